"""The coordinator's hot calls hold the run's write lock only where they must (issue #55).

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_coord_throughput.py

On PostgreSQL every write transaction is serialised by one advisory lock per run
(fanout.coord.postgresdb); with the database on another host, a lock held across round
trips caps the whole run at a few dozen writes a second (benchmarks/hosts.py). So a
heartbeat, a renew and an acquire whose window is not ready take no run lock at all:
each completes while another connection holds it (before, each waited for it and failed
CoordinatorBusy). An ack and a lease grant are one batch of statements that check their
own preconditions in SQL: a fenced ack or a grant whose window changed writes nothing,
on either database.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from fanout.coord.coordinator import Coordinator, RunConfig
from fanout.coord.postgresdb import PostgresDatabase, _lock_key
from fanout.errors import AcquireTimeout, StaleLease
from fanout.store.store import Published, RunDir
from test_coordinator import make_contract


@contextmanager
def run_lock_held(pg_url: str) -> Iterator[None]:
    """Another connection holds the run's write lock (as a writer stuck mid-transaction)."""
    import psycopg

    schema = PostgresDatabase(pg_url).schema
    base = pg_url.partition("&schema=")[0]
    with psycopg.connect(base, autocommit=True) as other:
        other.execute("BEGIN")
        other.execute("SELECT pg_advisory_xact_lock(%s::bigint)", (_lock_key(schema),))
        yield
        other.execute("ROLLBACK")


def _publish(co: Coordinator, rd: RunDir, preg: Any) -> None:
    claim = co.claim(preg)
    assert claim is not None
    name = f"w{claim.window}"
    co.publish_ready(claim, Published(name, rd.windows / name, 1, "xxh3_128:0"))


def test_heartbeats_renew_and_a_wait_take_no_run_lock(pg_url: str, tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "run").create()
    c = make_contract()
    co = Coordinator.create(rd.root, c, RunConfig(max_live_windows=2), db_path=pg_url)
    reg, preg = co.register_consumer("a"), co.register_producer(c)
    claim = co.claim(preg)  # window 0: capturing
    assert claim is not None
    # a call that waited for the lock fails in 2 s instead of after the default 60 s
    co.conn.execute("SET lock_timeout = 2000")
    seq = co.conn.execute("SELECT hb_seq FROM consumers").fetchone()[0]
    with run_lock_held(pg_url):
        co.heartbeat(reg)
        co.heartbeat(preg)
        co.renew(claim)
        with pytest.raises(AcquireTimeout, match="capturing window 0"):
            co.acquire(reg, timeout_s=0.2)  # not ready: read, waited, timed out
    assert co.conn.execute("SELECT hb_seq FROM consumers").fetchone()[0] == seq + 1
    co.close()


def test_a_fenced_ack_or_heartbeat_changes_nothing(db: str | None, tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "run").create()
    c = make_contract()
    co = Coordinator.create(rd.root, c, RunConfig(max_live_windows=2), db_path=db)
    old, preg = co.register_consumer("a"), co.register_producer(c)
    _publish(co, rd, preg)
    lease = co.acquire(old, timeout_s=5)
    assert lease is not None and lease.window == 0
    new = co.register_consumer("a")  # registered again: the old token is fenced off
    with pytest.raises(StaleLease):
        co.ack(lease)
    with pytest.raises(StaleLease):
        co.heartbeat(old)
    row = co.conn.execute("SELECT cursor, hb_seq FROM consumers").fetchone()
    assert int(row[0]) == 0  # the cursor did not move
    assert co.conn.execute("SELECT state FROM windows WHERE window=0").fetchone()[0] == "ready"
    co.heartbeat(new)
    assert co.conn.execute("SELECT hb_seq FROM consumers").fetchone()[0] == row[1] + 1
    again = co.acquire(new, timeout_s=5)  # the same window, under the new token
    assert again is not None and again.window == 0 and again.epoch == new.token
    co.ack(again)
    assert co.conn.execute("SELECT cursor FROM consumers").fetchone()[0] == 1
    co.close()
