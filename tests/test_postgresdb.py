"""The PostgreSQL coordinator backend's own parts: URLs, statement translation, errors.

    .venv/bin/pytest tests/test_postgresdb.py -x -q

The coordinator's behaviour on PostgreSQL is tested by the same tests as on SQLite
(the `db` fixture in conftest.py runs them on both): test_coordinator.py,
test_coordinator_model.py, test_coordinator_procs.py and the producer's
backpressure and recapture tests with real consumer processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fanout.coordinator import DB_POINTER, Coordinator, RunConfig
from fanout.errors import ConfigError, CoordinatorBusy, CoordinatorFull, CoordinatorUnavailable
from fanout.postgresdb import PostgresDatabase, _translate, parse_url, redact
from fanout.store import RunDir
from test_coordinator import make_contract


def test_url_schema_parameter_is_ours_and_the_password_never_leaves() -> None:
    url = "postgresql://fan:s3cret@db.example:5433/runs?sslmode=require&schema=run_7"
    conninfo, schema, shown = parse_url(url)
    assert conninfo == "postgresql://fan:s3cret@db.example:5433/runs?sslmode=require"
    assert schema == "run_7"
    assert shown == "postgresql://fan@db.example:5433/runs?sslmode=require&schema=run_7"
    assert parse_url("postgresql:///x?host=/tmp/s")[:2] == ("postgresql:///x?host=/tmp/s", "fanout")
    assert redact("postgres://h/db") == "postgres://h/db"
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
    url = pg_url.replace("postgresql://", "postgresql://postgres:hunter2@", 1)
    rd = RunDir(tmp_path / "run").create()
    co = Coordinator.create(rd.root, make_contract(), RunConfig(), db_path=url)
    pointer = (rd.root / DB_POINTER).read_text()
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


def test_driver_errors_become_typed_errors(pg_url: str) -> None:
    import psycopg

    db = PostgresDatabase(pg_url, lock_timeout_s=0.05)
    try:
        assert isinstance(db._typed(psycopg.errors.DiskFull("no space")), CoordinatorFull)
        assert isinstance(db._typed(psycopg.errors.LockNotAvailable("x")), CoordinatorBusy)
        second = PostgresDatabase(pg_url, lock_timeout_s=0.05)
        with pytest.raises(CoordinatorBusy, match="stayed locked"), db.write(), second.write():
            pass  # a second writer on the same run waits for the first
        db.raw.close()  # the server went away
        with pytest.raises(CoordinatorUnavailable, match=pg_url.split("?")[0]):
            db.execute("SELECT 1")
    finally:
        db.close()
