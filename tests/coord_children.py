"""The bodies of the child processes the coordinator process tests start (spawn).

    .venv/bin/pytest tests/test_coordinator_procs.py tests/test_replicas.py -q

A spawned child imports the module its target lives in. These targets lived in the test
modules, whose imports (torch, fanout.cli, the other tests' helpers) took a child ~2.5 s
of CPU before its first statement: 27 children in test_coordinator_procs.py alone, eight
of them at once on 2 cores. Here a child imports the coordinator only (~0.3 s), and torch
only where it writes tensors. What each child does is unchanged; the contract it
registers with comes from the parent (test_coordinator.make_contract).
"""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

from fanout.contract import CaptureContract
from fanout.coord.coordinator import Coordinator
from fanout.coord.grants import ProducerPlan
from fanout.coord.heartbeat import Heartbeat
from fanout.errors import FanoutError, StaleLease
from fanout.filesystem import FileSystem

# ---- test_coordinator_procs.py ------------------------------------------------------


def cycler(root: str, rank: int, cycles: int, out: Any) -> None:
    """Consumer `stress` rank `rank`: `cycles` acquire/ack cycles; puts (rank, grants,
    errors) on `out` (errors: any FanoutError or SQLite error, which must never happen)."""
    co = Coordinator.open(root)
    reg = co.register_consumer("stress", dp_rank=rank)
    grants: list[tuple[int, int]] = []
    errors: list[str] = []
    for _ in range(cycles):
        try:
            lease = co.acquire(reg, timeout_s=60)
            assert lease is not None
            grants.append((lease.window, lease.token))
            co.ack(lease)
        except (FanoutError, sqlite3.OperationalError) as e:  # must never happen
            errors.append(repr(e))
    out.put((rank, grants, errors))


def die_in_txn(root: str, ready: Any) -> None:
    """Inside a write transaction that changed rows, sets `ready` and sleeps (to be
    SIGKILLed there, holding the write lock)."""
    co = Coordinator.open(root)
    with co.conn.write() as cur:
        cur.execute("UPDATE consumers SET cursor=999")
        cur.execute("UPDATE counters SET value=123456 WHERE key='evictions'")
        ready.set()
        time.sleep(600)  # SIGKILLed here, holding the write lock


class KillAt(FileSystem):
    """SIGKILL this process right before the n-th call of `op` (a crash, not an error)."""

    def __init__(self, op: str, n: int) -> None:
        self.op, self.n, self.seen = op, n, 0

    def _before(self, op: str, arg: object) -> None:
        if op == self.op:
            self.seen += 1
            if self.seen == self.n:
                os.kill(os.getpid(), signal.SIGKILL)


def crashing_producer(
    root: str, contract: CaptureContract, op: str, n: int, before_commit: bool
) -> None:
    """A producer of 512 B windows whose file system SIGKILLs it before the n-th `op`
    (`before_commit`: after window 1's file is published, before its commit)."""
    import torch

    from fanout.store.store import RunDir, Store, WindowMeta

    co = Coordinator.open(root)
    store = Store(RunDir(Path(root)), KillAt(op, n), chunk_bytes=64)
    p = co.register_producer(contract)
    while co.wait_for_capacity(p, 10) and (cl := co.claim(p)) is not None:
        t = torch.full((2, 64), cl.window, dtype=torch.int32)  # 512 B: several 64 B chunks
        pub = store.publish(
            {"x": t}, WindowMeta(contract.stream_id, cl.window, cl.generation, 0, *cl.rows)
        )
        if before_commit and cl.window == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        co.publish_ready(cl, pub)


def lease_holder(root: str, name: str, ready: Any) -> None:
    """Consumer `name` holding a lease on its first window; sets `ready`, sleeps."""
    co = Coordinator.open(root)
    reg = co.register_consumer(name)
    assert co.acquire(reg, timeout_s=30) is not None
    ready.set()
    time.sleep(600)


def zombie(root: str, ready: Any, go: Any, out: Any) -> None:
    """Consumer `z`: acks window 0, holds window 1 heartbeating, sets `ready`, waits for
    `go` (SIGSTOPped meanwhile), then acks window 1: puts "acked" or "stale: …" on `out`."""
    co = Coordinator.open(root)
    reg = co.register_consumer("z")
    first = co.acquire(reg, timeout_s=30)
    assert first is not None
    co.ack(first)
    lease = co.acquire(reg, timeout_s=30)
    assert lease is not None and lease.window == 1
    with Heartbeat(root, reg, interval_s=0.05):
        ready.set()
        go.wait(120)  # SIGSTOPped in here, past ttl, then SIGCONTed
        try:
            co.ack(lease)
            out.put("acked")
        except StaleLease as e:
            out.put(f"stale: {e}")


# ---- test_replicas.py ---------------------------------------------------------------------


def register_and_die(root: str, db: str | None, contract: CaptureContract, rank: int) -> None:
    """A process that becomes replica `rank` of 2 and dies without finishing (a crash)."""
    co = Coordinator.open(root, db_path=db)
    co.register_producer(contract, rank=rank, plan=ProducerPlan(2))
    os._exit(0)


def hold(
    root: str, db: str | None, contract: CaptureContract, rank: int, ready: Any, go: Any
) -> None:
    """A process holding replica `rank` of 2, heartbeating until `go`."""
    co = Coordinator.open(root, db_path=db)
    reg = co.register_producer(contract, rank=rank, plan=ProducerPlan(2))
    with Heartbeat(root, reg, interval_s=0.05, open_kwargs={"db_path": db}):
        ready.put(os.getpid())
        go.wait(120)
