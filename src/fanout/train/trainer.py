"""The trainer: one consumer of a run, training one draft of any family (--draft-family).

    python scripts/train.py --run-dir runs/r1 --consumer-id draft-b8 \
        --verifier-name-or-path VERIFIER_DIR --block-size 8 --max-anchors 64 \
        --lr 3e-4 --rows-per-step 2 --max-steps 200 --save-path runs/r1/drafts/b8
    torchrun --nproc-per-node 4 scripts/train.py ...   # data parallel (fanout.train.distributed)

Reads rows from fanout.train.consumer (lease → train → ack after the optimizer step),
trains the draft of its family (fanout.families: the registry builds it) with the fused
linear CE and fused AdamW + LR schedule
(fanout.train.optim; its total from the stream, fanout.train.plan), logs JSONL (loss,
per-slot accuracy, EAL, the family's own metrics, step ms split fetch/fwd/bwd/opt,
tokens/s, window wait;
fanout.train.progress; train_log.jsonl: fanout.train.trainlog) and saves
speculators-format checkpoints that carry the consumer stream's position, so `--resume`
continues at the exact next row (how: fanout.checkpoints and fanout.train.consumer).
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import logging
import math
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fanout.checkpoints.resume import load_checkpoint
from fanout.checkpoints.save import save_checkpoint
from fanout.contract import CaptureContract
from fanout.errors import ConfigError, Detached, FanoutError, NonFiniteLoss, NoSupervisedTokens
from fanout.flags import (
    CommandFlags,
    FlagParser,
    add_log_level_flag,
    configure_logging,
    set_log_role,
)
from fanout.ops.fp8 import dequantize
from fanout.rows import HIDDEN_STATES, HIDDEN_STATES_SCALE
from fanout.tracking import WandbRun, group_for
from fanout.train.config import TrainConfig
from fanout.train.consumer import Batch, ConsumerStream
from fanout.train.distributed import DataParallel
from fanout.train.dplaunch import failed
from fanout.train.ema import WeightEMA
from fanout.train.ending import Ending, summary
from fanout.train.evaluation import PeriodicEval
from fanout.train.optim import LRCurve, build_optimizer
from fanout.train.plan import Plan, StreamPlanner
from fanout.train.progress import (
    ProgressBar,
    StartupClock,
    WaitNotice,
    wait_for_run,
)
from fanout.train.savepath import hold_save_path
from fanout.train.schedule import follow_plan, log_schedule, reconcile_schedule
from fanout.train.setup import build_draft, check_resume, check_run
from fanout.train.trainlog import MetricsLog, train_log_path
from fanout.train.verifier_versions import VersionFollower, live_version

log = logging.getLogger(__name__)

EXIT_DETACHED = 3
# steps averaged into a checkpoint's train_eal
RECENT_EAL_STEPS = 50
# Consecutive steps without a supervised token that end the trainer (the first one is a
# warning): a few happen on odd rows, this many say the draft cannot train on this run.
NO_TOKEN_STEPS = 20


class Trainer:
    """One consumer of a run training one draft: `Trainer(cfg).run()` → summary dict.

    Built in stages (`__init__`): wait for the run and check it (`setup.check_run`), build
    the draft (`setup.build_draft`), AdamW + LR schedule (`fanout.train.optim`), resume
    (`_resume`). `run()` registers as a consumer (`_open_stream`), then per batch: one
    optimizer step and the ack (`_step`), then reporting, eval and checkpoints
    (`_after_step`); `fanout.train.progress` holds what it says along the way.
    """

    def __init__(self, cfg: TrainConfig) -> None:
        self.startup = StartupClock()  # logged with the first step (docs/operations.md)
        # a versioned --verifier-name-or-path (produce --follow-verifier): the draft is
        # built from its live version, then follows each batch's (.verifier_versions)
        start, root = live_version(cfg.verifier_name_or_path), cfg.verifier_name_or_path
        if start is not None:
            cfg = cfg.model_copy(update={"verifier_name_or_path": str(start.path)})
        self.versions = None if start is None else VersionFollower(root, start, cfg)
        self._lag = 0  # versions the batch in hand is behind the newest
        self.cfg = cfg
        self.dp = DataParallel.from_env(cfg.device, cfg.dp_timeout_s)
        self.rank = self.dp.rank if self.dp.enabled else cfg.dp_rank
        torch.manual_seed(cfg.seed)
        self.device = self.dp.device(cfg.device)
        # the verifier directory is read only after the run appears: refuse a wrong one now,
        # not after --acquire-timeout-s of waiting for a producer
        from fanout.model.verifier import check_verifier_dir

        try:
            check_verifier_dir(cfg.verifier_name_or_path)
        except ConfigError as e:
            raise ConfigError(f"--verifier-name-or-path: {e}") from None
        contract = wait_for_run(Path(cfg.run_dir), cfg.db_path, cfg.acquire_timeout_s)
        self.startup.mark("run")
        layers = check_run(cfg, contract, self.dp.world)
        self.expect = {"target_layer_ids": layers}
        # Refused now, naming the holder, while a live process has this consumer id or
        # (rank 0) a live trainer holds --save-path; without --resume, while it holds
        # checkpoints (fanout.train.savepath).
        self.save_lock = hold_save_path(
            cfg, cfg.save_path, self.rank, self.dp.is_main, self.expect,
            agree=self.dp.agree, resume=cfg.resume,
        )  # fmt: skip
        try:
            # --resume: refused now if these flags would not continue the checkpoint's run
            self.resume_from = check_resume(cfg)
            self._build(contract, layers)
        except BaseException:
            self.save_lock.release()
            raise

    def _build(self, contract: CaptureContract, layers: list[int]) -> None:
        """Everything after the checks: draft, optimizer, resume, metrics log."""
        cfg = self.cfg
        self.draft = build_draft(self.cfg, contract, layers, self.device)
        self.gen = torch.Generator().manual_seed(self._anchor_seed())
        self.planner = StreamPlanner(
            Path(cfg.run_dir),
            rows_per_step=cfg.rows_per_step,
            world=self.dp.world,
            epochs=cfg.epochs,
            max_steps=cfg.max_steps,
        )
        self.plan = self._read_plan()
        self.max_windows = self.plan.max_windows
        # registered at its cursor by run(); _resume restores that position first
        self.stream = ConsumerStream(
            cfg.consumer_config(
                dp_rank=self.rank, dp_world_size=self.dp.world, max_windows=self.max_windows
            ),
            self.expect,
            about={
                "family": cfg.draft_family,
                "rows_per_step": cfg.rows_per_step,
                "metrics_log": str(train_log_path(cfg.save_path, self.dp.rank).resolve()),
            },
        )
        self.opt, self.backend, self.sched = build_optimizer(
            self.draft.parameters(),
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            backend=cfg.adamw_backend,
            max_grad_norm=cfg.max_grad_norm,
            warmup_ratio=cfg.warmup_ratio,
            scheduler_type=cfg.scheduler_type,
            total_steps=self.plan.total_steps,
            settled=self.plan.settled,
        )
        # --ema-decay: the average checkpoints serve (resumed with them, fanout.train.ema)
        self.ema = WeightEMA(self.draft, cfg.ema_decay) if cfg.ema_decay else None
        self._saved_at = time.monotonic()  # --checkpoint-every-s counts from here
        self.state = self._resume()
        log_schedule(self)
        self.dp.broadcast_parameters(self.draft)  # identical start on every rank
        self.metrics = MetricsLog(cfg.save_path, self.dp.rank, cfg.logger, self._tracker())
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if self.device.type == "cuda" and cfg.dtype == "bfloat16"
            else torch.autocast("cpu", enabled=False)
        )
        # EAL of the last logged steps: the train-time estimate a checkpoint records
        self.recent_eal: collections.deque[float] = collections.deque(maxlen=RECENT_EAL_STEPS)
        self.evaluator = PeriodicEval(cfg, self.device, self.versions)  # --eval-every
        self.seq_len = contract.seq_len
        # steps of this process with a supervised token (on any rank), and the run of
        # steps without one that is going on (NO_TOKEN_STEPS of them end the trainer)
        self.supervised_steps = self.no_token_streak = 0
        self.nonfinite_steps = self.nonfinite_streak = 0  # skipped: loss NaN or inf
        self._warned_no_tokens = False
        self._waiting = False  # for the next batch: the one time a signal stops at once
        self._stop_requested = False
        self.interrupted = False
        self.startup.mark("ready")

    # ---- building -------------------------------------------------------------------

    def _read_plan(self) -> Plan:
        """The stream's length (fanout.train.plan): every rank reads it (a bad
        stream.json fails on each), every rank follows rank 0's numbers."""
        mine = self.planner.read()
        got = Plan.from_ints(self.dp.from_main(mine.ints()))
        return mine if self.dp.is_main else got

    @property
    def curve(self) -> LRCurve:
        """The LR schedule's curve (its total, warm-up, decay; fanout.train.optim)."""
        f = self.sched.factor
        assert isinstance(f, LRCurve)
        return f

    def _resume(self) -> dict[str, Any]:
        """The training state: from the newest checkpoint with --resume (weights,
        optimizer, the stream's position, schedule and anchor generator restored in
        place: fanout.checkpoints.resume), else fresh."""
        ckpt = self.resume_from  # setup.check_resume: checked against these flags
        if ckpt is None:
            # from the start, not "wherever the coordinator has it": a draft without a
            # checkpoint has seen nothing, even if an earlier incarnation acked windows
            self.stream.load_state_dict({"cursor": 0, "rows_done": 0})
            return {"step": 0}
        planned = copy.copy(self.curve)
        state = load_checkpoint(
            ckpt,
            self.draft,
            self.opt,
            states={"stream": self.stream, "scheduler": self.sched},
            generators={"anchors": self.gen},
            ema=self.ema,
        )
        reconcile_schedule(self, planned)
        if self.dp.rank:  # the checkpoint holds rank 0's generator: derive our own
            self.gen.manual_seed(self._anchor_seed(state["step"]))
        log.info("resumed from %s at step %d, stream at %s", ckpt, state["step"],
                 self.stream.state_dict())  # fmt: skip
        return {"step": state["step"]}

    def _anchor_seed(self, step: int = 0) -> int:
        """Ranks draw anchors from their own streams (seed, rank) over their own rows."""
        return self.cfg.seed + 1_000_003 * self.dp.rank + step

    def request_stop(self, signum: int, _frame: Any) -> None:
        """SIGINT/SIGTERM handler: finish the step in progress (ack, log), save, stop.

        While waiting for a window nothing is half-done: stop at once. Anywhere else (a
        step, a save, the summary after the stream ended) the flag is all it sets: raising
        there would cut a save short or end a finished trainer with a traceback.
        """
        if self._waiting:
            log.warning("signal %d: stopping (waiting for a window) and saving", signum)
            raise KeyboardInterrupt
        log.warning("signal %d: stopping after the current step and saving", signum)
        self._stop_requested = True

    # ---- training -------------------------------------------------------------------

    def _tracker(self) -> WandbRun | None:
        """--logger wandb: rank 0's W&B run, in the run dir's group (fanout.tracking)."""
        cfg = self.cfg
        if cfg.logger != "wandb" or self.dp.rank != 0:
            return None
        return WandbRun.start(
            cfg,
            name=cfg.consumer_id,
            group=group_for(cfg.run_dir, cfg.wandb_group),
            job_type="train",
            config=cfg.model_dump(mode="json"),
            dir=cfg.save_path,
        )

    def run(self) -> dict[str, Any]:
        """Train until the stream ends, --max-steps, or a stop signal; save; summarise.
        What state each end leaves, and which keep a checkpoint: fanout.train.ending."""
        cfg = self.cfg
        stream = self._open_stream()
        first = last = None
        bar = self._progress_bar()
        waits = WaitNotice(cfg.acquire_timeout_s).start()
        batches = stream.batches(cfg.rows_per_step)
        end = Ending(cfg.consumer_id)
        try:
            try:
                t_fetch = time.perf_counter()
                while (batch := self._next_batch(stream, batches, waits)) is not None:
                    if self._too_old(stream, batch):  # acked untrained (--max-verifier-lag)
                        continue
                    rec = self._step(stream, batch, t_fetch)
                    if first is None:
                        first = rec
                        log.info("%s", self.startup.line(cfg.consumer_id))
                    last = rec
                    bar.update(rec, batch, stream.state_dict()["cursor"])
                    self._after_step(rec)
                    self._check_supervised(rec["step"])
                    follow_plan(self, stream, bar)
                    if self.dp.agree(self._stop_requested):  # every rank stops after this step
                        self.interrupted = True
                        break
                    if cfg.max_steps and rec["step"] >= cfg.max_steps:
                        end.reached = True  # its own end: finished, holds nothing back
                        break
                    t_fetch = time.perf_counter()
            except KeyboardInterrupt:
                self.interrupted = True  # while waiting for a window: nothing half-done
            except FanoutError as e:
                end.failed(e)  # fenced: nothing more is written; else saved, then raised
            if isinstance(end.failure, NoSupervisedTokens) and not self.supervised_steps:
                end.unsaved = (
                    "no step of this run had a supervised token, so it saved no checkpoint"
                )
            elif self.state["step"] and not end.fenced:
                end.saved = self.save()
        finally:
            waits.stop()
            bar.close()
            end.close(stream)
            self.metrics.close()
            self.save_lock.release()  # the next trainer may have --save-path now
        end.raise_failure(self.state["step"], stream)
        # the last log line and the summary (stdout's last line) both name the checkpoint
        log.info("%s", end.last_line(self.state["step"], stream))
        checkpoint = None if end.saved is None else str(end.saved)
        return self._summary(stream, first, last) | {
            "state": end.state(stream),
            "checkpoint": checkpoint,
        }

    def _open_stream(self) -> ConsumerStream:
        """Register as the run's consumer, reading on from this trainer's cursor."""
        try:
            stream = self.stream.open()
        except BaseException:  # RoleHeld, ContractMismatch: this trainer never started
            self.save_lock.release()
            raise
        self.startup.mark("registered")
        log.info(
            "%s: draft %d params, AdamW %s, from cursor %d",
            stream.reg.consumer_id,
            sum(p.numel() for p in self.draft.parameters() if p.requires_grad),
            self.backend,
            stream.reg.cursor,
        )
        return stream

    def _next_batch(
        self, stream: ConsumerStream, batches: Iterator[Batch], waits: WaitNotice
    ) -> Batch | None:
        """The next batch (None at the end); if that takes a while, `waits` says on stderr
        which window it waits for."""

        def what() -> str:
            w, why = stream.waiting_for, stream.wait_state
            if why is not None:  # what the producer is doing, as the coordinator sees it
                return f"window {w}: {why.text}"
            return "the next window" if w is None else f"window {w} from the producer"

        def counts() -> bool:
            return stream.wait_state is None or stream.wait_state.counts

        waits.begin(what, after_s=waits.every_s, counts=counts)
        self._waiting = True
        try:
            if self._stop_requested:  # signalled between steps (a skipped batch): stop now
                raise KeyboardInterrupt
            batch = next(batches, None)
        finally:
            self._waiting = False
            waits.end()
        self.startup.mark("first_batch")
        return batch

    def _to_device(self, batch: Batch) -> dict[str, torch.Tensor]:
        moved = {k: v.to(self.device, non_blocking=True) for k, v in batch.tensors.items()}
        scale = moved.pop(HIDDEN_STATES_SCALE, None)
        if scale is not None:  # fp8 windows: dequantise on the device (half the copy)
            moved[HIDDEN_STATES] = dequantize(moved[HIDDEN_STATES], scale)
        return {k: v.float() if v.is_floating_point() else v.long() for k, v in moved.items()}

    def _step(self, stream: ConsumerStream, batch: Batch, t_fetch: float) -> dict[str, Any]:
        """One optimizer step on `batch`, then the ack of its rows (only then: the step
        that consumed them is done); returns the step's log record."""
        t0 = time.perf_counter()
        # its verifier version's frozen tensors first, and its age's loss weight
        w = self.versions.prepare(self.draft, batch, self._lag) if self.versions else 1.0
        inputs = self._to_device(batch)
        with self.autocast:
            out = self.draft.loss(inputs, self.gen)
        t1 = time.perf_counter()
        (out.loss * w if w != 1.0 else out.loss).backward()
        self.dp.average_gradients(self.draft)
        t2 = time.perf_counter()
        lr = self.sched.get_last_lr()[0]  # this step's (step() sets the next one's)
        # A loss that is not finite (on any rank) would put NaN into every weight: the
        # update is skipped (the schedule moves on, the rows are acked), counted, and
        # --max-nonfinite-steps in a row stop the trainer. Read from the ranks' mean
        # loss the step logs anyway (non-finite on one rank: non-finite mean), so the
        # check costs no extra read of the loss nor collective; after backward, so the
        # GPU queue is not drained one more time per step.
        loss, eal, tokens = self.dp.mean([float(out.loss.detach()), float(out.eal), out.n_tokens])
        finite = math.isfinite(loss)
        if finite:
            self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        stream.ack(batch)
        self.state["step"] += 1
        self._count_finite(finite)
        if tokens > 0:  # on any rank: every rank counts the same
            self.supervised_steps += 1
            self.no_token_streak = 0
        else:
            self.no_token_streak += 1
        self.recent_eal.append(eal)
        return {
            "step": self.state["step"],
            "loss": round(loss, 6),  # NaN / inf where skipped
            **({} if finite else {"skipped": "non-finite loss"}),
            **({"nonfinite_steps": self.nonfinite_steps} if self.nonfinite_steps else {}),
            "eal": round(eal, 4),
            "acc": [round(float(a), 4) for a in out.per_slot_acc],
            "lr": lr,
            "tokens": out.n_tokens,
            "fetch_ms": round((t0 - t_fetch) * 1e3, 2),
            "fwd_ms": round((t1 - t0) * 1e3, 2),
            "bwd_ms": round((t2 - t1) * 1e3, 2),
            "opt_ms": round((t3 - t2) * 1e3, 2),
            "tokens_per_s": round(out.n_tokens / max(t3 - t_fetch, 1e-9), 1),
            "window_wait_ms": round(batch.wait_s * 1e3, 2),
            "windows": sorted({w for w, _ in batch.rows}),
            "acked": [ow.window for ow in batch.completes],
            "time": time.time(),
            **({} if self.versions is None else self.versions.record(self._lag)),
            # the family's own metrics (rank 0's; e.g. DFlash2's selector loss)
            **{k: round(float(v), 6) for k, v in out.extra.items()},
        }

    def _too_old(self, stream: ConsumerStream, batch: Batch) -> bool:
        """--max-verifier-lag: True for a batch acked untrained, too many verifier versions
        old; notes its lag for --verifier-age-decay (fanout.train.verifier_versions)."""
        self._lag, skip = self.versions.check(stream, batch, self.dp) if self.versions else (0, 0)
        return bool(skip)

    def _count_finite(self, finite: bool) -> None:
        """Count a step skipped for a non-finite loss (a warning each); raise
        NonFiniteLoss after --max-nonfinite-steps of them in a row."""
        if finite:
            self.nonfinite_streak = 0
            return
        self.nonfinite_steps += 1
        self.nonfinite_streak += 1
        step, bound = self.state["step"], self.cfg.max_nonfinite_steps
        log.warning(
            "%s: step %d: loss is not finite; skipped (no update; %d in a row, %d in all)",
            self.cfg.consumer_id, step, self.nonfinite_streak, self.nonfinite_steps,
        )  # fmt: skip
        if self.nonfinite_streak >= bound:
            raise NonFiniteLoss(
                f"{bound} steps in a row ({step - bound + 1}-{step}) had a loss that is not "
                "finite (--max-nonfinite-steps): check the run's windows (the producer's "
                "capture check), --lr, and the verifier's dtype"
            )

    def _after_step(self, rec: dict[str, Any]) -> None:
        """The weight average moves (--ema-decay); every --eval-every steps an eval (its
        numbers join `rec`), every --log-every the metrics record, every
        --checkpoint-every steps (or --checkpoint-every-s seconds) a checkpoint."""
        cfg, step = self.cfg, rec["step"]
        if self.ema is not None:
            self.ema.update(self.draft)  # after this step's optimizer update
        if cfg.eval_every and step % cfg.eval_every == 0 and self.dp.is_main:
            rec |= self.evaluator(self.draft)
        if step % cfg.log_every == 0:
            self.metrics.write(rec)
        due = step % cfg.checkpoint_every == 0 or (
            cfg.checkpoint_every_s is not None
            and time.monotonic() - self._saved_at >= cfg.checkpoint_every_s
        )
        if due and self.supervised_steps:
            self.save()  # not while this process has learned nothing (no supervised token)

    def _check_supervised(self, step: int) -> None:
        """A step without a supervised token (no anchor fit its rows) is a warning the
        first time; NO_TOKEN_STEPS in a row end the trainer (NoSupervisedTokens)."""
        if not self.no_token_streak:
            return
        why = (
            f"no anchor fit its rows: an anchor needs a supervised token followed by "
            f"another before position T - block size (T = {self.seq_len}, --block-size "
            f"{self.draft.cfg.block_size})"
        )
        if not self._warned_no_tokens:
            self._warned_no_tokens = True
            log.warning("%s: step %d had no supervised token: %s", self.cfg.consumer_id, step, why)
        if self.no_token_streak >= NO_TOKEN_STEPS:
            raise NoSupervisedTokens(
                f"{NO_TOKEN_STEPS} steps in a row ({step - NO_TOKEN_STEPS + 1}-{step}) had no "
                f"supervised token: {why}; use a smaller --block-size, or data with longer "
                "supervised (assistant) spans"
            )

    def _progress_bar(self) -> ProgressBar:
        """On stderr, rank 0 only (--progress; default: when stderr is a terminal)."""
        show = self.cfg.progress if self.cfg.progress is not None else sys.stderr.isatty()
        return ProgressBar(
            total=self.curve.total,
            initial=self.state["step"],
            desc=self.cfg.consumer_id,
            show=show and self.dp.is_main,
        )

    def _summary(
        self, stream: ConsumerStream, first: dict[str, Any] | None, last: dict[str, Any] | None
    ) -> dict[str, Any]:
        return summary(self, stream, first, last)

    # ---- checkpoints and eval -------------------------------------------------------

    def save(self) -> Path | None:
        """Write a checkpoint (rank 0 only: every rank holds the same weights)."""
        if not self.dp.is_main:
            return None
        self._saved_at = time.monotonic()
        return save_checkpoint(
            self.cfg.save_path,
            self.draft,
            self.opt,
            dict(self.state, adamw_backend=self.backend),
            states={"stream": self.stream, "scheduler": self.sched},
            generators={"anchors": self.gen},
            verifier_name_or_path=str(
                self.versions.path if self.versions else self.cfg.verifier_name_or_path
            ),
            verifier_serving_name=self.cfg.checkpoint_verifier_name,
            config_extra=self._checkpoint_extra(),
            keep=self.cfg.keep_checkpoints,
            ema=self.ema,
            training_config=self.cfg.recorded(),
        )

    def _checkpoint_extra(self) -> dict[str, Any]:
        """Train-time numbers a checkpoint carries next to the draft (`fanout eval`
        prints `train_eal` beside the measured acceptance length)."""
        recent = list(self.recent_eal)
        extra: dict[str, Any] = {"step": self.state["step"]}
        if self.versions is not None:  # the verifier version its tensors are from
            extra["verifier_version"] = self.versions.loaded
        if recent:
            extra["train_eal"] = round(sum(recent) / len(recent), 4)
            extra["train_eal_steps"] = len(recent)
        return extra


_FLAGS = CommandFlags(TrainConfig)  # `fanout train`'s flags: TrainConfig's fields
add_arguments, config_from_args = _FLAGS.add_arguments, _FLAGS.config_from_args


def run(args: argparse.Namespace, name: str = "train") -> int:
    cfg = config_from_args(args)
    trainer: Trainer | None = None
    try:
        trainer = Trainer(cfg)
        dp = trainer.dp  # log lines name the draft and its DP rank: [train b16:dp1]
        set_log_role("train", f"{cfg.consumer_id}:dp{dp.rank}" if dp.enabled else cfg.consumer_id)
        signal.signal(signal.SIGINT, trainer.request_stop)
        signal.signal(signal.SIGTERM, trainer.request_stop)
        summary = trainer.run()
    except Detached as e:
        print(
            f"{cfg.consumer_id}: {e}. Restart with --resume to rejoin (what it needs again "
            "is recaptured), or give it its own run.",
            file=sys.stderr,
        )
        return EXIT_DETACHED
    finally:
        if trainer is not None:
            trainer.dp.close()
    # One write() per line: torchrun's ranks share this pipe, unbuffered, and print()
    # writes the text and its newline separately, so two summaries could interleave.
    sys.stdout.write(json.dumps(summary) + "\n")
    sys.stdout.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    """scripts/train.py: `fanout train` with its own parser (torchrun starts this one)."""
    # `fanout train`'s name, so its errors read as the docs (and `fanout train`) print them
    p = FlagParser(prog="fanout train", description=__doc__.split("\n")[0])
    add_log_level_flag(p, "info")
    add_arguments(p)
    try:
        args = p.parse_args(argv)  # a refused flag: FlagError, one line as any other
        configure_logging(args, role="train")
        return run(args)
    except FanoutError as e:
        return failed(p.prog, e)  # also for fanout.train.dplaunch's line
