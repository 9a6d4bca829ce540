"""SQLite errors become typed fanout errors by result code, never by message text.

.venv/bin/pytest tests/test_sqlitedb.py -q
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from fanout.coord import sqlitedb
from fanout.coord.schema import check_schema
from fanout.errors import (
    CoordinatorBusy,
    CoordinatorFull,
    CoordinatorUnavailable,
    NoCoordinator,
    NotACoordinatorDatabase,
)


def _driver_error(make: str) -> sqlite3.Error:
    """A real error from the driver (it carries sqlite_errorcode on Python >= 3.11)."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.execute(make)
    except sqlite3.Error as e:
        return e
    raise AssertionError(f"{make!r} did not fail")


def test_garbage_file_is_not_a_coordinator_database(tmp_path: Path) -> None:
    db = tmp_path / "coordinator.sqlite3"
    db.write_bytes(b"not a database at all" * 200)
    with pytest.raises(NotACoordinatorDatabase, match=re.escape(str(db))):
        sqlitedb.SqliteDatabase(db)
    with pytest.raises(NotACoordinatorDatabase):
        sqlitedb.exists(db)  # the producer's check, not only the open


def test_empty_database_is_no_coordinator_yet(tmp_path: Path) -> None:
    """What a producer killed inside create leaves (or one still creating): waitable."""
    db = sqlitedb.SqliteDatabase(tmp_path / "coordinator.sqlite3")
    with pytest.raises(NoCoordinator, match="no coordinator tables yet"):
        check_schema(db)
    db.execute("CREATE TABLE other(a)")
    with pytest.raises(NotACoordinatorDatabase, match="other"):
        check_schema(db)
    db.close()


def test_unopenable_path_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(CoordinatorUnavailable, match="cannot open or write"):
        sqlitedb.SqliteDatabase(tmp_path / "file" / "coordinator.sqlite3")


@pytest.mark.parametrize(
    ("code", "want"),
    [
        (sqlitedb.SQLITE_BUSY, CoordinatorBusy),
        (sqlitedb.SQLITE_BUSY | (2 << 8), CoordinatorBusy),  # SQLITE_BUSY_SNAPSHOT
        (sqlitedb.SQLITE_LOCKED, CoordinatorBusy),
        (sqlitedb.SQLITE_FULL, CoordinatorFull),
        (sqlitedb.SQLITE_NOTADB, NotACoordinatorDatabase),
        (sqlitedb.SQLITE_CORRUPT, NotACoordinatorDatabase),
        (sqlitedb.SQLITE_CANTOPEN, CoordinatorUnavailable),
        (sqlitedb.SQLITE_READONLY, CoordinatorUnavailable),
        (sqlitedb.SQLITE_IOERR | (10 << 8), CoordinatorUnavailable),  # SQLITE_IOERR_DELETE
    ],
)
def test_classified_by_code_whatever_the_message(code: int, want: type[Exception]) -> None:
    e = sqlite3.OperationalError("some words that name nothing")
    e.sqlite_errorcode = code
    assert isinstance(sqlitedb.typed_error(e, "db"), want)


def test_driver_errors_keep_their_code() -> None:
    e = _driver_error("SELECT * FROM no_such_table")
    assert sqlitedb.error_code(e) == 1  # SQLITE_ERROR: a bug, not classified
    assert sqlitedb.typed_error(e, "db") is None


def test_full_database_inside_a_write_is_coordinator_full(tmp_path: Path) -> None:
    db = sqlitedb.SqliteDatabase(tmp_path / "c.sqlite3")
    with db.write() as cur:
        cur.execute("CREATE TABLE t(a)")
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count={pages}")
    with pytest.raises(CoordinatorFull, match=r"c\.sqlite3"), db.write() as cur:
        cur.executemany("INSERT INTO t VALUES (?)", [("x" * 4000,)] * 50)
    assert db.execute("SELECT COUNT(*) FROM t").fetchone()[0] == 0  # rolled back
    db.close()


def test_begin_on_a_locked_database_gives_up_as_coordinator_busy(tmp_path: Path) -> None:
    holder = sqlitedb.SqliteDatabase(tmp_path / "c.sqlite3")
    other = sqlitedb.SqliteDatabase(tmp_path / "c.sqlite3")
    with holder.write() as cur:
        cur.execute("CREATE TABLE t(a)")
    busy = pytest.raises(CoordinatorBusy, match="stayed locked for 0 s")
    with holder.write(), busy, other.write(0.0):  # holder holds the write lock
        raise AssertionError("BEGIN succeeded under another writer's lock")
    with other.write() as cur:  # its busy_timeout is back and the lock free: it writes
        cur.execute("INSERT INTO t VALUES (1)")
    assert holder.execute("SELECT COUNT(*) FROM t").fetchone()[0] == 1
    holder.close()
    other.close()


class _BusyCommits:
    """A sqlite3 connection whose first `n` COMMITs fail as SQLITE_BUSY (a checkpoint
    holding the lock, which a test cannot time)."""

    def __init__(self, conn: sqlite3.Connection, n: int) -> None:
        self._conn, self.left, self.commits = conn, n, 0

    def execute(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Cursor:
        if sql == "COMMIT":
            self.commits += 1
            if self.left > 0:
                self.left -= 1
                e = sqlite3.OperationalError("database is locked")
                e.sqlite_errorcode = sqlitedb.SQLITE_BUSY
                raise e
        return self._conn.execute(sql, params)

    def __getattr__(self, name: str) -> object:
        return getattr(self._conn, name)


def test_busy_commit_is_retried_then_rolled_back_past_the_deadline(tmp_path: Path) -> None:
    db = sqlitedb.SqliteDatabase(tmp_path / "c.sqlite3")
    with db.write() as cur:
        cur.execute("CREATE TABLE t(a)")
    real = db.raw
    db.raw = busy = _BusyCommits(real, 2)  # type: ignore[assignment]
    with db.write() as cur:
        cur.execute("INSERT INTO t VALUES (1)")
    assert busy.commits == 3  # two busy tries, then committed
    db.raw = busy = _BusyCommits(real, 10**9)  # type: ignore[assignment]
    locked = pytest.raises(CoordinatorBusy, match="commit failed on a locked database")
    with locked, db.write(0.0) as cur:
        cur.execute("INSERT INTO t VALUES (2)")
    assert not real.in_transaction  # rolled back, not left open
    db.raw = real
    assert [r[0] for r in db.execute("SELECT a FROM t").fetchall()] == [1]
    db.close()
