"""The SQLite coordinator's WAL stays bounded while readers overlap (#52: a followed run lasts hours).

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_follow_wal.py

SQLite's automatic checkpoint copies the WAL into the database only up to the oldest
open reader's snapshot, and the WAL restarts from its start only when no reader uses it:
readers whose transactions overlap (trainers polling, `fanout status` scrapes) can leave
one in it at every checkpoint, and the `-wal` file then grows with every commit for as
long as the run lasts (checkpoint starvation). Here a producer and two trainers run
several hundred windows through the coordinator (metadata-only windows: the WAL is the
subject) while a reader thread keeps a read transaction open at every instant, each one
begun before the one before it ends. Before the bound (fanout.coord.sqlitedb,
WAL_STARVED_PAGES) the WAL grew by ~115 KB a window (about 115 MB over 1000 windows,
the same without the reader stays at ~16 MB); with it, it is emptied each time it
passes twice what the automatic checkpoint keeps. A reader that never ends cannot be
waited out: the writes go on, and a warning says why the WAL grows.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path

import pytest

from fanout.coord.coordinator import Coordinator, RunConfig
from fanout.store.store import Published, RunDir, window_name
from test_coordinator import make_contract

MIB = 1 << 20
# twice the automatic checkpoint's 4000 pages is where the bound starts (32 MiB); one
# failed attempt (the readers kept it busy for the whole second) defers the next by
# 16 MiB more
BOUND = 56 * MIB


def _run(tmp_path: Path) -> tuple[Coordinator, RunDir]:
    rd = RunDir(tmp_path / "run").create()
    return Coordinator.create(rd.root, make_contract(), RunConfig(max_live_windows=4)), rd


def _windows(co: Coordinator, rd: RunDir, n: int, wal: Path) -> list[int]:
    """`n` windows produced and acknowledged by two trainers; the WAL's size after each."""
    p = co.register_producer(make_contract())
    regs = [co.register_consumer(f"t{i}") for i in range(2)]
    sizes = []
    for _ in range(n):
        assert co.wait_for_capacity(p, 0.0)
        cl = co.claim(p)
        assert cl is not None
        name = window_name(cl.window, cl.generation)  # no file: eviction's unlink is a no-op
        co.publish_ready(cl, Published(name, rd.windows / name, 10, "xxh3_128:0"))
        for r in regs:
            lease = co.acquire(r, timeout_s=5)
            assert lease is not None
            co.ack(lease)
        sizes.append(wal.stat().st_size if wal.exists() else 0)
    return sizes


def _read(conn: sqlite3.Connection) -> None:
    """A read transaction as `fanout status` takes one (fanout.coord.reads.one_instant)."""
    conn.execute("BEGIN")
    conn.execute("SELECT COUNT(*) FROM windows").fetchone()


@contextmanager
def overlapping_readers(db: Path) -> Iterator[None]:
    """A thread that keeps a read transaction open at every instant: the next one begins
    before the last one ends (each lasts ~2 ms; the thread runs between the writer's
    SQLite calls, which release the GIL)."""
    stop = threading.Event()
    conns = [sqlite3.connect(db, isolation_level=None, check_same_thread=False) for _ in "ab"]

    def loop() -> None:
        k = 0
        _read(conns[0])
        while not stop.is_set():
            k += 1
            _read(conns[k % 2])
            stop.wait(0.002)
            conns[(k - 1) % 2].execute("COMMIT")
        conns[k % 2].execute("COMMIT")

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=30)
        for c in conns:
            c.close()


def test_the_wal_stays_bounded_while_readers_overlap(tmp_path: Path) -> None:
    co, rd = _run(tmp_path)
    wal = Path(f"{co.db_path}-wal")
    with overlapping_readers(Path(co.db_path)):
        sizes = _windows(co, rd, 1000, wal)
    co.close()
    top = max(sizes)
    # the old code: every window's frames stayed, ~115 MB at the end
    assert top <= BOUND, f"the WAL grew to {top / MIB:.1f} MiB (bound {BOUND / MIB:.0f})"
    assert any(b < a for a, b in pairwise(sizes)), "never emptied"


def test_a_reader_that_never_ends_is_named_and_writes_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    co, rd = _run(tmp_path)
    wal = Path(f"{co.db_path}-wal")
    pinned = sqlite3.connect(co.db_path, isolation_level=None)
    _read(pinned)  # left open: no checkpoint can pass its snapshot
    with caplog.at_level(logging.WARNING, logger="fanout.coord.coordinator"):
        sizes = _windows(co, rd, 320, wal)  # past 32 MiB: one try, which fails
    pinned.execute("COMMIT")
    pinned.close()
    said = [r.getMessage() for r in caplog.records if "read transaction" in r.getMessage()]
    assert sizes[-1] > 32 * MIB and len(said) == 1, (sizes[-1], said)
    assert "MiB" in said[0] and str(co.db_path) in said[0], said
    after = _windows(co, rd, 150, wal)  # the reader is gone: the WAL restarts, no longer grows
    assert max(after) <= sizes[-1] + MIB, (sizes[-1], max(after))
    co.close()


def test_operations_md_states_the_bound_the_code_has() -> None:
    from fanout.coord import sqlitedb

    text = " ".join((Path(__file__).parents[1] / "docs" / "operations.md").read_text().split())
    wait = f"every {sqlitedb.CHECKPOINT_RETRY_S * 1000:g} ms for up to {sqlitedb.CHECKPOINT_WAIT_S:g} s"
    assert sqlitedb.WAL_STARVED_PAGES == 2 * sqlitedb.AUTOCHECKPOINT_PAGES == 8000
    assert f"(every {sqlitedb.AUTOCHECKPOINT_PAGES} pages, 16 MiB)" in text and wait in text
