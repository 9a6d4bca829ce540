"""The LR schedule of a trainer as the stream's length becomes known: said at start,
reconciled with a resumed checkpoint's, retargeted as the producer's stream.json changes.

    log_schedule(trainer)                    # one line at start (a warning without a total)
    reconcile_schedule(trainer, planned)     # after a resume: whose curve continues
    follow_plan(trainer, stream, bar)        # each step, until the stream's length is settled

Functions of the Trainer (`t`: fanout.train.trainer's; typed Any, as fanout.train.ending
does, so this module does not import the trainer), kept apart from its step loop; the
curve itself is fanout.train.optim's LRCurve, the stream's length fanout.train.plan's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fanout.train.optim import LRCurve
from fanout.train.plan import Plan

if TYPE_CHECKING:
    from fanout.train.consumer import ConsumerStream
    from fanout.train.progress import ProgressBar

log = logging.getLogger("fanout.train.trainer")


def log_schedule(t: Any) -> None:
    """One line at start: the schedule's kind, warm-up and total (and a warning
    when nothing says the total yet)."""
    cid, curve = t.cfg.consumer_id, t.curve
    if not t.dp.is_main:
        return
    if curve.total is None and curve.kind != "constant":
        log.warning(
            "%s: the %s lr schedule has no total steps yet (%s): it warms up over %d "
            "steps, holds --lr and decays once the stream's end is recorded; pass "
            "--max-steps (or --epochs) to plan the decay from the start",
            cid, curve.kind, t.plan.why, curve.warmup,
        )  # fmt: skip
    log.info("%s: lr schedule: %s (%s)", cid, curve.describe(), t.plan.why)


def reconcile_schedule(t: Any, planned: LRCurve) -> None:
    """After a resume: the checkpoint's curve continues, retargeted where it had no
    final total and one is known now; the flags' curve where they plan another (a
    new --max-steps, --epochs or --scheduler-type)."""
    cur, step = t.curve, t.sched.last_epoch
    if vars(cur) == vars(planned):  # the same, or a checkpoint from before LRCurve
        return
    if cur.kind != planned.kind or (cur.settled and planned.settled and cur.total != planned.total):
        log.info(
            "%s: lr schedule planned anew at step %d (the checkpoint's: %s)",
            t.cfg.consumer_id, step, cur.describe(),
        )  # fmt: skip
        t.sched.set_factor(planned)
    elif not cur.settled and planned.total is not None and planned.total != cur.total:
        cur.retarget(planned.total, step, settled=planned.settled)


def follow_plan(t: Any, stream: ConsumerStream, bar: ProgressBar) -> None:
    """Until the stream's length is settled: rank 0 re-reads stream.json when it
    changes (one stat() a step), and every rank follows what it says now: the LR
    schedule's new total, continuous (LRCurve.retarget), and --epochs' windows."""
    if t.plan.settled:
        return
    new = t.planner.reread_if_changed() if t.dp.is_main else None
    got = t.dp.from_main([1, *new.ints()] if new is not None else [0, 0, 0, 0])
    if not got[0]:
        return
    plan = new if new is not None else Plan.from_ints(got[1:])
    cid, step, curve = t.cfg.consumer_id, t.sched.last_epoch, t.curve
    if plan.max_windows is not None and t.max_windows is None:
        stream.stop_at(plan.max_windows)
        t.max_windows = plan.max_windows
        log.info("%s: --epochs: reading windows [0, %d) (%s)", cid, plan.max_windows, plan.why)
    if plan.total_steps is not None and (
        plan.total_steps != curve.total or plan.settled != curve.settled
    ):
        curve.retarget(plan.total_steps, step, settled=plan.settled)
        bar.set_total(plan.total_steps)
        log.info("%s: lr schedule from step %d: %s (%s)", cid, step, curve.describe(), plan.why)
    t.plan = plan
