"""The PostgreSQL coordinator backend's own parts: URLs, statement translation, errors.

    .venv/bin/pytest tests/test_postgresdb.py -x -q

The coordinator's behaviour on PostgreSQL is tested by the same tests as on SQLite
(the `db` fixture in conftest.py runs them on both): test_coordinator.py,
test_coordinator_model.py, test_coordinator_procs.py and the producer's
backpressure and recapture tests with real consumer processes.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import PostgresControl
from fanout.coord.coordinator import Coordinator, RunConfig
from fanout.coord.heartbeat import Heartbeat
from fanout.coord.postgresdb import PostgresDatabase, _translate, parse_url, redact
from fanout.coord.replay import ReadsChanged
from fanout.errors import ConfigError, CoordinatorBusy, CoordinatorFull, CoordinatorUnavailable
from fanout.store.store import Published, RunDir
from test_coordinator import make_contract


def test_url_schema_parameter_is_ours_and_the_password_never_leaves() -> None:
    url = "postgresql://fan:s3cret@db.example:5433/runs?sslmode=require&schema=run_7"
    conninfo, schema, shown = parse_url(url)
    assert conninfo == "postgresql://fan:s3cret@db.example:5433/runs?sslmode=require"
    assert schema == "run_7"
    assert shown == "postgresql://fan@db.example:5433/runs?sslmode=require&schema=run_7"
    assert parse_url("postgresql:///x?host=/tmp/s")[:2] == ("postgresql:///x?host=/tmp/s", "fanout")
    assert redact("postgres://h/db") == "postgres://h/db"
    assert (
        redact("postgresql://h/db?password=x&sslmode=require")
        == "postgresql://h/db?sslmode=require"
    )
    assert redact("postgresql://h/db?password=x") == "postgresql://h/db"
    with pytest.raises(ConfigError, match="schema 'run-7'"):
        parse_url("postgresql://h/db?schema=run-7")


def test_statements_are_translated_for_psycopg() -> None:
    sql = "SELECT window FROM windows w WHERE w.window < ? AND name LIKE 'a%' AND x=?"
    assert _translate(sql) == (
        'SELECT "window" FROM windows w WHERE w."window" < %s AND name LIKE \'a%%\' AND x=%s'
    )
    # table and index names that merely contain the word are left alone
    assert _translate("CREATE INDEX leases_by_window ON windows(window)") == (
        'CREATE INDEX leases_by_window ON windows("window")'
    )


def test_unreachable_server_is_a_clear_error(tmp_path: Path) -> None:
    pytest.importorskip("psycopg")
    url = f"postgresql:///fanout?host={tmp_path}/nowhere&connect_timeout=2&schema=r"
    with pytest.raises(CoordinatorUnavailable, match=r"cannot connect.*nowhere"):
        Coordinator.open(tmp_path, db_path=url)


def test_run_dir_records_the_url_without_password(pg_url: str, tmp_path: Path) -> None:
    """Trust auth accepts any password, so a URL with one connects; the run dir and
    every message name the URL without it."""
    url = pg_url.replace("postgresql://postgres@", "postgresql://postgres:hunter2@", 1)
    assert "hunter2" in url
    rd = RunDir(tmp_path / "run").create()
    co = Coordinator.create(rd.root, make_contract(), RunConfig(), db_path=url)
    pointer = rd.db_pointer.read_text()
    assert "hunter2" not in pointer and "hunter2" not in str(co.db_path)
    assert pointer.strip() == str(co.db_path)
    assert not (rd.root / "coordinator.sqlite3").exists()
    with Coordinator.open(rd.root) as again:  # found through the run dir
        assert again.contract == co.contract
    with pytest.raises(ConfigError, match="already exists"):
        Coordinator.create(tmp_path / "other", make_contract(), RunConfig(), db_path=url)
    assert Coordinator.exists(rd.root)
    assert not Coordinator.exists(tmp_path / "x", db_path=pg_url + "_other")
    co.close()


def test_driver_errors_become_typed_errors(pg_url: str, postgres_control: PostgresControl) -> None:
    import psycopg

    db = PostgresDatabase(pg_url, lock_timeout_s=0.05)
    try:
        assert isinstance(db._typed(psycopg.errors.DiskFull("no space")), CoordinatorFull)
        assert isinstance(db._typed(psycopg.errors.LockNotAvailable("x")), CoordinatorBusy)
        second = PostgresDatabase(pg_url, lock_timeout_s=0.05)
        with pytest.raises(CoordinatorBusy, match="stayed locked"), db.write(), second.write():
            pass  # a second writer on the same run waits for the first
        postgres_control.stop()  # the server goes away for longer than reconnect_s
        try:
            db._reconnect_s = 0.5
            with pytest.raises(CoordinatorUnavailable, match="unreachable for 0 s"):
                db.execute("SELECT 1")
        finally:
            postgres_control.start()
    finally:
        db.close()


def _terminate(url: str, pid: int) -> None:
    """Drop one connection from the server side (as a failover or a cut link does), and
    return once its backend has ended (PostgreSQL 14+ waits for it, up to 60 s): the
    connection's next statement then meets a dead socket, never the live backend."""
    other = PostgresDatabase(url)
    try:
        assert other.execute("SELECT pg_terminate_backend(?, 60000)", (pid,)).fetchone() == (True,)
    finally:
        other.close()


def _run_with_a_consumer(pg_url: str, tmp_path: Path) -> tuple[Coordinator, PostgresDatabase, Any]:
    """A run on PostgreSQL, its connection and one registered consumer."""
    rd = RunDir(tmp_path / "run").create()
    co = Coordinator.create(rd.root, make_contract(), RunConfig(), db_path=pg_url)
    assert isinstance(co.conn, PostgresDatabase)
    return co, co.conn, co.register_consumer("a")


def test_a_lost_connection_is_replaced_where_nothing_had_run(pg_url: str, tmp_path: Path) -> None:
    co, db, reg = _run_with_a_consumer(pg_url, tmp_path)
    _terminate(pg_url, db.raw.info.backend_pid)
    assert co.meta("next_token") == 1  # a read: reconnected, then answered
    _terminate(pg_url, db.raw.info.backend_pid)
    co.heartbeat(reg)  # a write whose BEGIN met the dead connection: begun again
    assert db.reconnects == 2
    # Lost at a write's COMMIT (nothing after the body's last statement): the outcome
    # is the server's to know, and the caller is told; the next call works.
    with pytest.raises(CoordinatorUnavailable) as lost, db.write() as cur:
        cur.execute("UPDATE consumers SET cursor=99")
        _terminate(pg_url, db.raw.info.backend_pid)
    assert not isinstance(lost.value, ReadsChanged)
    assert co.conn.execute("SELECT cursor FROM consumers").fetchone()[0] == 0
    assert db.reconnects == 3
    co.close()


def test_a_write_whose_connection_went_inside_its_body_is_begun_again(
    pg_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Lost inside a write's body, before its COMMIT was sent: the server rolled the
    transaction back, so it is begun again on a new connection, the body's statements
    so far run again (each answering as before), and the body goes on: committed once,
    not twice, and the process does not stop (it used to: CoordinatorUnavailable)."""
    co, db, _ = _run_with_a_consumer(pg_url, tmp_path)
    token = co.meta("next_token")
    with db.write() as cur:
        (seen,) = cur.execute("SELECT cursor FROM consumers").fetchone()
        cur.execute("UPDATE consumers SET cursor=cursor+5")
        _terminate(pg_url, db.raw.info.backend_pid)
        cur.execute("UPDATE counters SET value=value+1 WHERE key='next_token'")
        (now,) = cur.execute("SELECT cursor FROM consumers").fetchone()
    assert (seen, now) == (0, 5) and db.reconnects == 1
    assert "begun again (2 statements run again" in caplog.text  # what the log says
    assert co.conn.execute("SELECT cursor FROM consumers").fetchall() == [(5,)]
    assert co.meta("next_token") == token + 1
    co.close()


def test_a_write_whose_reads_changed_before_its_replay_writes_nothing(
    pg_url: str, tmp_path: Path
) -> None:
    """Lost inside a write's body, and another process commits before the replay: what
    the body read is no longer true, so its decisions may not hold. The write raises
    ReadsChanged (one line: a CoordinatorUnavailable) and nothing of it is written;
    `decide`, whose body only reads, runs its whole call again instead."""
    co, db, _ = _run_with_a_consumer(pg_url, tmp_path)
    other = PostgresDatabase(pg_url)
    changed = r"lost inside a write .*nothing of it was written"
    with pytest.raises(ReadsChanged, match=changed), db.write() as cur:
        cur.execute("SELECT cursor FROM consumers")
        _terminate(pg_url, db.raw.info.backend_pid)
        other.execute("UPDATE consumers SET cursor=7")
        cur.execute("UPDATE counters SET value=value+1 WHERE key='corrupt'")
    assert co.meta("corrupt") == 0
    bodies: list[int] = []

    def body(cur: Any) -> tuple[int, list[Any]]:
        (seen,) = cur.execute("SELECT cursor FROM consumers").fetchone()
        bodies.append(seen)
        if len(bodies) == 1:  # the first time: lost, and the row moves meanwhile
            _terminate(pg_url, db.raw.info.backend_pid)
            other.execute("UPDATE consumers SET cursor=cursor+3")
            cur.execute("SELECT 1")
        return seen, [("UPDATE consumers SET cursor=?", (seen + 1,))]

    seen, _ = db.decide(body)
    assert bodies == [7, 10] and seen == 10
    assert co.conn.execute("SELECT cursor FROM consumers").fetchall() == [(11,)]
    other.close()
    co.close()


def test_a_dropped_socket_psycopg_has_not_marked_broken_is_replaced_too(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server can drop a connection between two statements so that the next one
    fails with a client-side "connection socket closed" (no SQLSTATE) before psycopg
    marks the connection broken (seen once in a full suite run). Nothing had run: the
    BEGIN is begun again on a new connection, as for a marked one."""
    co, db, reg = _run_with_a_consumer(pg_url, tmp_path)
    _terminate(pg_url, db.raw.info.backend_pid)
    # the connection as psycopg may still describe it: neither closed nor broken
    monkeypatch.setattr(type(db.raw), "broken", property(lambda self: False))
    monkeypatch.setattr(type(db.raw), "closed", property(lambda self: False))
    co.heartbeat(reg)  # a write whose BEGIN met the dead socket: begun again
    assert db.reconnects == 1
    monkeypatch.undo()
    co.close()


def test_trainer_side_calls_wait_out_a_server_restart(
    pg_url: str, tmp_path: Path, postgres_control: PostgresControl
) -> None:
    """A consumer waiting for a window, and its heartbeat thread, ride out a 2 s outage:
    the window published after it is acquired, and the heartbeat thread did not stop."""
    rd = RunDir(tmp_path / "run").create()
    c = make_contract()
    co = Coordinator.create(rd.root, c, RunConfig(max_live_windows=2), db_path=pg_url)
    reg = co.register_consumer("a")
    got: list[Any] = []

    def wait_for_window() -> None:
        try:
            got.append(Coordinator.open(rd.root).acquire(reg, timeout_s=60))
        except Exception as e:
            got.append(e)

    waiter = threading.Thread(target=wait_for_window)
    with Heartbeat(rd.root, reg, interval_s=0.1) as hb:
        waiter.start()
        time.sleep(0.3)
        postgres_control.restart(2.0)
        p = co.register_producer(c)
        cl = co.claim(p)
        assert cl is not None
        co.publish_ready(cl, Published("w0", rd.windows / "w0", 1, "xxh3_128:0"))
        waiter.join(30)
        beats, end = hb.beats, time.monotonic() + 15  # its reconnect backs off up to 5 s
        while hb.beats <= beats + 2 and time.monotonic() < end:
            time.sleep(0.05)
        hb.check()  # no error kept
        assert hb.beats > beats + 2  # still beating after the restart
    assert len(got) == 1 and getattr(got[0], "window", got) == 0
    co.close()


def test_every_connection_has_tcp_timeouts_a_url_may_override(pg_url: str) -> None:
    """A partition (no RST) must end a call in about half a minute, not TCP's ~15
    minutes: every connection carries keepalives and tcp_user_timeout (#55), and a
    URL that sets one keeps its own value."""
    from fanout.coord.postgresdb import TCP_DEFAULTS, PostgresDatabase

    db = PostgresDatabase(pg_url)
    got = db.raw.info.get_parameters()
    assert {k: got.get(k) for k in TCP_DEFAULTS} == TCP_DEFAULTS, got
    db.raw.close()
    own = PostgresDatabase(pg_url + "&keepalives_idle=60&tcp_user_timeout=5000")
    got = own.raw.info.get_parameters()
    assert (got.get("keepalives_idle"), got.get("tcp_user_timeout")) == ("60", "5000")
    assert got.get("keepalives_count") == TCP_DEFAULTS["keepalives_count"]
    own.raw.close()
