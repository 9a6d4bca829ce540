"""One live trainer per --save-path and per consumer id, and a used --save-path resumed
or refused, decided before a trainer builds anything.

    lock = hold_save_path(cfg, cfg.save_path, rank=0, is_main=True, expect={...},
                          resume=cfg.resume)
    ...                      # train, checkpoint into cfg.save_path
    lock.release()           # (never held on ranks other than 0: they never save)

Two trainers on one --save-path would overwrite and prune each other's checkpoints
(and remove each other's temp checkpoint directories), so rank 0 holds
`<save-path>/trainer.lock` (a fanout.coord.pathlock.PathLock: flock, released by the
kernel when the holder exits, kill -9 included; the file names host, pid, process
start and consumer id). A second trainer is refused at start (RoleHeld, exit 1)
naming the holder: first by the coordinator if a live process holds its consumer id
(as a second producer is), then by the lock if a live trainer holds the save path.
With --takeover, a live trainer of the same consumer id is fenced off first (it
exits at its next coordinator call) and its lock waited for; a save path held for
another consumer id is never taken over.

A save path that holds committed checkpoints is refused without --resume (ConfigError,
one line naming both ways out: --resume, or another --save-path). A trainer that started
there from step 0 would write checkpoints of lower steps than those already there: a
resume would pick the old newest, and pruning (it keeps the highest steps) deleted each
new one as it was written, while the run looked healthy. --resume where no checkpoint is
yet starts fresh, so a launcher may always pass it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fanout.checkpoints.layout import latest_checkpoint
from fanout.coord.coordinator import Coordinator
from fanout.coord.pathlock import PathLock
from fanout.errors import ConfigError, RoleHeld
from fanout.train.consumer import ConsumerOptions

LOCK_NAME = "trainer.lock"


def hold_save_path(
    cfg: ConsumerOptions,
    save_path: str,
    rank: int,
    is_main: bool,
    expect: dict[str, Any],
    agree: Callable[[bool], bool] = bool,
    resume: bool = False,
) -> PathLock:
    """Refuse now (RoleHeld naming the holder) if a live process holds this rank's
    consumer id or (rank 0) the save path; else return the save-path lock, held on
    rank 0 (other ranks only check their consumer id: theirs is never held, and its
    release() does nothing). Rank 0 then refuses a save path holding checkpoints unless
    `resume` (ConfigError). Under torchrun every rank stops when one is refused
    (`agree`: fanout.train.distributed.DataParallel's), each with one line, instead
    of the others dying in their next collective.

    Args:
        cfg: the trainer's ConsumerOptions (run dir, database, consumer id, takeover).
        save_path: --save-path.
        rank, is_main: this process's data-parallel rank; only rank 0 saves.
        expect: the contract fields the consumer will register with (for --takeover).
        agree: True on every rank if True on any.
        resume: --resume (continue from the newest checkpoint there).
    """
    lock = PathLock(
        Path(save_path) / LOCK_NAME,
        f"--save-path {save_path}",
        role=f"the trainer of consumer {cfg.consumer_id}:dp{rank}",
        hint="Two trainers on one --save-path would overwrite each other's checkpoints: "
        "give this one its own --save-path, or stop that trainer (its lock goes when it "
        "exits, a crashed one's at once)",
    )
    refused: RoleHeld | ConfigError | None = None
    try:
        _hold(lock, cfg, rank, is_main, expect)
        if is_main and not resume:
            refuse_used(save_path)
    except (RoleHeld, ConfigError) as e:
        refused = e
    if agree(refused is not None):
        lock.release()
        raise refused or RoleHeld(
            f"consumer {cfg.consumer_id}:dp{rank}: another rank of this trainer was refused "
            "at start (its line says why); this rank stops too"
        )
    return lock


def refuse_used(save_path: str) -> None:
    """ConfigError if `save_path` holds a committed checkpoint (a start without --resume)."""
    newest = latest_checkpoint(save_path)
    if newest is not None:
        raise ConfigError(
            f"--save-path {save_path} holds checkpoints (the newest: {newest.name}) and "
            "--resume was not given: continue from it with --resume, or train from step 0 "
            "into another --save-path"
        )


def _hold(
    lock: PathLock, cfg: ConsumerOptions, rank: int, is_main: bool, expect: dict[str, Any]
) -> None:
    with Coordinator.open(cfg.run_dir, db_path=cfg.db_path) as coord:
        coord.check_consumer_role(cfg.consumer_id, rank, cfg.takeover)
    if not is_main:
        return
    try:
        lock.acquire()
    except RoleHeld:
        holder = lock.holder()
        if not cfg.takeover or holder is None or holder.role != lock.role:
            raise
        # Fence the holder off first (it exits at its next coordinator call), then wait
        # for it to let go: the two never write the save path at the same time.
        with Coordinator.open(cfg.run_dir, db_path=cfg.db_path) as coord:
            coord.register_consumer(cfg.consumer_id, rank, expect=expect, takeover=True)
        lock.acquire(wait=True)
