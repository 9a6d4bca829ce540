"""Coordinator under real processes: contention, SIGKILL mid-transaction, publish
crash points, a killed lease holder, a SIGSTOPped zombie.

    .venv/bin/pytest tests/test_coordinator_procs.py -x -q
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from coord_children import crashing_producer, cycler, die_in_txn, lease_holder, zombie
from fanout.coord.coordinator import Coordinator, RunConfig
from fanout.coord.postgresdb import PostgresDatabase
from fanout.errors import CoordinatorBusy
from fanout.store.store import Published, RunDir, Store, WindowMeta, parse_window_name, window_name
from test_coordinator import make_contract
from window_files import window_names

# spawned children run the bodies in coord_children.py: it imports the coordinator only,
# not this module's torch and test helpers (seconds per child)
CTX = mp.get_context("spawn")


def fake_publish(co: Coordinator, p: Any, n: int) -> None:
    """Metadata-only windows (no files): eviction's unlink is a harmless no-op."""
    for _ in range(n):
        cl = co.claim(p)
        assert cl is not None
        name = window_name(cl.window, cl.generation)
        co.publish_ready(cl, Published(name, co.root / "windows" / name, 10, "xxh3_128:0"))


def _signal(p: Any, sig: int) -> None:
    assert p.pid is not None, "process not started"
    os.kill(p.pid, sig)


def wait_for(pred: Any, timeout: float = 30.0, what: str = "") -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# ---- 8 processes × 500 acquire/ack cycles --------------------------------------------


def test_eight_processes_no_lock_errors_no_double_grants(db: str | None, tmp_path: Path) -> None:
    procs, cycles = 8, 500 if db is None else 60  # PostgreSQL: a round trip per statement
    rd = RunDir(tmp_path / "run").create()
    cfg = RunConfig(max_live_windows=cycles + 2, expected_consumers=procs)
    co = Coordinator.create(rd.root, make_contract(), cfg, db_path=db)
    fake_publish(co, co.register_producer(make_contract()), cycles)
    q = CTX.Queue()
    ps = [CTX.Process(target=cycler, args=(str(rd.root), r, cycles, q)) for r in range(procs)]
    for p in ps:
        p.start()
    results = [q.get(timeout=240) for _ in ps]
    for p in ps:
        p.join(timeout=30)
    tokens: set[int] = set()
    for rank, grants, errors in results:
        assert errors == [], f"rank {rank}: {errors[:3]}"
        assert [w for w, _ in grants] == list(range(cycles))  # in order, no gaps
        tokens.update(t for _, t in grants)
    assert len(tokens) == procs * cycles  # no lease token granted twice
    cursors = [c for (c,) in co.conn.execute("SELECT cursor FROM consumers")]
    assert cursors == [cycles] * procs  # acks == grants
    assert co.meta("evictions") == cycles
    assert co.conn.execute("SELECT COUNT(*) FROM leases").fetchone()[0] == 0


# ---- SIGKILL inside a write transaction -------------------------------------------------


def test_sigkill_inside_write_transaction(db: str | None, tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "run").create()
    co = Coordinator.create(rd.root, make_contract(), RunConfig(), db_path=db)
    reg = co.register_consumer("a")
    ready = CTX.Event()
    p = CTX.Process(target=die_in_txn, args=(str(rd.root), ready))
    p.start()
    assert ready.wait(60)
    if db is None:
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            other = sqlite3.connect(co.db_path, timeout=0.05, isolation_level=None)
            other.execute("BEGIN IMMEDIATE")
    else:  # the advisory lock is held: another writer waits, then gets CoordinatorBusy
        other_db = PostgresDatabase(db, lock_timeout_s=0.05)
        with pytest.raises(CoordinatorBusy, match="stayed locked"), other_db.write():
            pass
    _signal(p, signal.SIGKILL)
    p.join(10)
    t0 = time.monotonic()
    co.heartbeat(reg)  # a write: needs the lock the dead process held
    assert time.monotonic() - t0 < co.config.busy_timeout_s + 1
    assert co.conn.execute("SELECT cursor FROM consumers").fetchone()[0] == 0
    assert co.meta("evictions") == 0
    if db is None:
        assert co.conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


# ---- publish crash points -----------------------------------------------------------


CRASH_POINTS = [
    ("mid-write", "write", 3, False),
    ("after fsync", "close", 2, False),  # second window: first one committed
    ("after link, before temp unlink", "unlink", 1, False),
    ("before dir fsync", "fsync_dir", 2, False),
    ("after dir fsync, before commit", "never", 0, True),
]


@pytest.mark.parametrize(("label", "op", "n", "before_commit"), CRASH_POINTS)
def test_publish_crash_points(
    tmp_path: Path, label: str, op: str, n: int, before_commit: bool
) -> None:
    c = make_contract()
    rd = RunDir(tmp_path / "run").create()
    # K = 4: the three windows of the stream, and the slowest consumer's slot
    co = Coordinator.create(rd.root, c, RunConfig(max_live_windows=4, total_windows=3))
    p = CTX.Process(target=crashing_producer, args=(str(rd.root), c, op, n, before_commit))
    p.start()
    p.join(120)
    assert p.exitcode == -signal.SIGKILL, f"{label}: producer was not killed ({p.exitcode})"
    # Restart: a new producer fences the dead one (its claim is released), then the
    # sweeper removes its debris.
    pr = co.register_producer(c)
    co.sweep()
    assert list(rd.tmp.iterdir()) == []
    store = Store(rd)
    for name in window_names(store):  # every final-named file is complete and committed
        w, g = parse_window_name(name) or (-1, -1)
        assert co.wants_file(w, g), f"{label}: orphan {name} survived the sweep"
        row = co.conn.execute(
            "SELECT state, checksum FROM windows WHERE window=? AND generation=?", (w, g)
        ).fetchone()
        with store.open(name, expect_contract=c.stream_id) as r:
            assert r.meta.checksum == row[1]
    while co.wait_for_capacity(pr, 1) and (cl := co.claim(pr)) is not None:
        t = torch.full((2, 64), cl.window, dtype=torch.int32)
        meta = WindowMeta(c.stream_id, cl.window, cl.generation, 0, *cl.rows)
        co.publish_ready(cl, store.publish({"x": t}, meta))
    co.sweep()
    names = window_names(store)
    assert [parse_window_name(x)[0] for x in names] == [0, 1, 2], names  # type: ignore[index]
    ready = co.conn.execute("SELECT window FROM windows WHERE state='ready' ORDER BY 1").fetchall()
    assert ready == [(0,), (1,), (2,)]
    for name in names:
        with store.open(name, expect_contract=c.stream_id) as r:
            assert int(r.get("x")[0, 0]) == r.meta.window
    assert list(rd.tmp.iterdir()) == []


# ---- a consumer killed while holding a lease ----------------------------------------


def test_killed_consumer_reclaimed_between_ttl_and_twice_ttl(
    db: str | None, tmp_path: Path
) -> None:
    ttl = 1.0
    rd = RunDir(tmp_path / "run").create()
    cfg = RunConfig(ttl_s=ttl, max_live_windows=2)
    co = Coordinator.create(rd.root, make_contract(), cfg, db_path=db)
    fake_publish(co, co.register_producer(make_contract()), 1)
    ready = CTX.Event()
    p = CTX.Process(target=lease_holder, args=(str(rd.root), "a", ready))
    p.start()
    assert ready.wait(60)
    _signal(p, signal.SIGKILL)
    p.join(10)
    t0 = time.monotonic()
    lost: list[str] = []
    while not lost:
        lost = co.reclaim_lost()
        co.evict()
        held = co.conn.execute("SELECT state FROM windows WHERE window=0").fetchone()[0]
        assert held == "ready"  # never evicted under the lease (or, later, the lost cursor)
        time.sleep(0.02)
        assert time.monotonic() - t0 < 2 * ttl + 0.5, "not reclaimed within 2·ttl"
    assert time.monotonic() - t0 >= ttl
    assert lost == ["a:dp0"]
    assert co.conn.execute("SELECT COUNT(*) FROM leases").fetchone()[0] == 0
    # A restarted consumer resumes at its cursor.
    reg = co.register_consumer("a")
    lease = co.acquire(reg, timeout_s=1)
    assert reg.cursor == 0 and lease is not None and lease.window == 0
    co.ack(lease)
    assert co.conn.execute("SELECT state FROM windows WHERE window=0").fetchone()[0] == "evicted"


# ---- SIGSTOPped zombie ------------------------------------------------------------------


def test_zombie_ack_is_refused_and_cursor_never_moves_back(db: str | None, tmp_path: Path) -> None:
    ttl = 0.5
    rd = RunDir(tmp_path / "run").create()
    cfg = RunConfig(ttl_s=ttl, max_live_windows=8)
    co = Coordinator.create(rd.root, make_contract(), cfg, db_path=db)
    fake_publish(co, co.register_producer(make_contract()), 5)
    ready, go, out = CTX.Event(), CTX.Event(), CTX.Queue()
    p = CTX.Process(target=zombie, args=(str(rd.root), ready, go, out))
    p.start()
    assert ready.wait(60)
    _signal(p, signal.SIGSTOP)
    try:
        wait_for(lambda: co.reclaim_lost() == ["z:dp0"], 10, "zombie reclaimed")
        reg = co.register_consumer("z")  # the restarted incarnation moves on
        assert reg.cursor == 1
        for _ in range(2):
            lease = co.acquire(reg, timeout_s=1)
            assert lease is not None
            co.ack(lease)
    finally:
        _signal(p, signal.SIGCONT)
    go.set()
    assert str(out.get(timeout=60)).startswith("stale")
    p.join(30)
    assert co.conn.execute("SELECT cursor, token FROM consumers").fetchone() == (3, reg.token)
