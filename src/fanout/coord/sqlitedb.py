"""The coordinator on SQLite: the embedded default, for a producer and trainers on one host.

    from fanout.coord.sqlitedb import SqliteDatabase, check_local_filesystem
    check_local_filesystem(path)               # refuses NFS/CIFS/Lustre/...
    db = SqliteDatabase(path)                   # WAL, autocommit, busy timeout
    with db.write() as cur: cur.execute(...)    # BEGIN IMMEDIATE ... COMMIT

Every connection is stdlib `sqlite3` in autocommit mode (`isolation_level=None`)
so that this module, not the driver, decides where transactions begin: every
writing transaction is `BEGIN IMMEDIATE` (takes the write lock up front, so two
writers never deadlock upgrading a read lock) and short. `write()` wraps the
transient "database is locked" in bounded retries; a caller only ever sees
`CoordinatorBusy` after `max_wait_s` of continuous contention.

Errors are classified by SQLite's result code (`sqlite_errorcode`), never by reading
messages: BUSY/LOCKED → `CoordinatorBusy`, FULL → `CoordinatorFull`,
NOTADB/CORRUPT → `NotACoordinatorDatabase`, CANTOPEN/READONLY/PERM/IOERR →
`CoordinatorUnavailable` (`typed_error`).

The WAL stays bounded while readers overlap (`SqliteDatabase.bound_wal`, #52): a
connection that commits with the `-wal` file past WAL_STARVED_PAGES empties it with
`PRAGMA wal_checkpoint(TRUNCATE)`, tried for at most CHECKPOINT_WAIT_S while readers
are in it; tests/test_follow_wal.py shows the growth it stops.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fanout.coord.database import Rows, Statement, T
from fanout.errors import (
    CoordinatorBusy,
    CoordinatorFull,
    CoordinatorUnavailable,
    FanoutError,
    NotACoordinatorDatabase,
    UnsupportedFilesystem,
)
from fanout.netfs import filesystem_type, is_network_filesystem

log = logging.getLogger("fanout.coord.coordinator")

# Checkpoints (WAL -> database file) are the only fsyncs left in WAL with synchronous=
# NORMAL; one per 4000 pages (16 MiB of WAL) instead of SQLite's 1000 amortizes them
# over ~1000 lease cycles.
AUTOCHECKPOINT_PAGES = 4000
# Checkpoint starvation (#52: a followed run goes on for hours). The automatic
# checkpoint (PASSIVE, by the connection whose commit took the WAL past
# AUTOCHECKPOINT_PAGES) copies frames only up to the oldest open reader's snapshot, and
# the WAL restarts from its start only when no reader uses it. Readers whose short
# transactions overlap (trainers polling, `fanout status` scrapes) can leave one in it at
# every checkpoint; the WAL then grows by every commit for the run's life (~115 KB a
# window; tests/test_follow_wal.py: 110 MiB over 1000 windows). journal_size_limit does
# not help: it truncates only a WAL that restarted. A WAL that restarts never passes
# much over AUTOCHECKPOINT_PAGES, so one twice that big is starved: the connection that
# commits then checkpoints with TRUNCATE, tried again every CHECKPOINT_RETRY_S for up to
# CHECKPOINT_WAIT_S, each try without waiting. One try with SQLite's busy handler waits
# instead, but on the read-lock slot of a reader older than the WAL's end, which a newer
# reader can take over and hold: with the readers of tests/test_follow_wal.py it waited
# the whole second and failed, where a new try sees that slot's newer mark.
# Each try copies what no older reader still reads; once all is copied, new readers read
# the database file, and the next try after the WAL's last readers ended empties it.
# Writers go on between tries. A reader that stays longer (a transaction left open)
# cannot be waited out: the next attempt comes WAL_RETRY_PAGES later, with a warning.
WAL_STARVED_PAGES = 2 * AUTOCHECKPOINT_PAGES
WAL_RETRY_PAGES = AUTOCHECKPOINT_PAGES
CHECKPOINT_WAIT_S, CHECKPOINT_RETRY_S = 1.0, 0.002


def check_local_filesystem(db_path: Path, mountinfo: str | None = None) -> None:
    """Raise UnsupportedFilesystem if the database's directory is on a network filesystem
    (fanout.netfs says which are). SQLite WAL is unsafe there: it coordinates
    writers through a shared-memory file (`-shm`) that every process must map on ONE
    host, and POSIX locks on these are per host, emulated, or lied about."""
    fstype, point = filesystem_type(db_path.parent, mountinfo)
    if is_network_filesystem(fstype):
        raise UnsupportedFilesystem(
            f"coordinator database {db_path} would live on {fstype} (mounted at {point}); "
            "SQLite WAL needs shared memory and locks on one host, so it must be on a "
            "local disk of the producer's host. Keep the artifacts on the shared "
            "filesystem and put the database elsewhere with --db-path /local/disk/run.sqlite3, "
            "use a PostgreSQL coordinator (--db-path postgresql://host/db) for trainers on "
            "other hosts, or pass allow_network_fs=True / --allow-network-fs if you know it is safe."
        )


# SQLite's primary result codes (sqlite3.h), as the stdlib names them.
SQLITE_PERM, SQLITE_BUSY, SQLITE_LOCKED = (
    sqlite3.SQLITE_PERM,
    sqlite3.SQLITE_BUSY,
    sqlite3.SQLITE_LOCKED,
)
SQLITE_READONLY, SQLITE_IOERR = sqlite3.SQLITE_READONLY, sqlite3.SQLITE_IOERR
SQLITE_CORRUPT, SQLITE_FULL = sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_FULL
SQLITE_CANTOPEN, SQLITE_NOTADB = sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_NOTADB


def error_code(e: sqlite3.Error) -> int | None:
    """SQLite's primary result code of `e` (extended codes folded: BUSY_SNAPSHOT → BUSY)."""
    code = getattr(e, "sqlite_errorcode", None)  # None: not raised by SQLite itself
    return None if code is None else int(code) & 0xFF


def typed_error(e: sqlite3.Error, where: str) -> FanoutError | None:
    """The fanout error for a driver error a caller can act on; None for the rest
    (those are bugs, and propagate as they are)."""
    code = error_code(e)
    if code in (SQLITE_BUSY, SQLITE_LOCKED):
        return CoordinatorBusy(f"coordinator database {where} is locked by another process: {e}")
    if code == SQLITE_FULL:
        return CoordinatorFull(
            f"coordinator database {where}: disk full ({e}); the transaction rolled back "
            "and nothing changed. Free space on that filesystem (or move the database with "
            "--db-path) and start the process again."
        )
    if code in (SQLITE_NOTADB, SQLITE_CORRUPT):
        return NotACoordinatorDatabase(
            f"{where}: not a fanout coordinator database ({e}); check --run-dir / --db-path, "
            "or move the file away and start the run again"
        )
    if code in (SQLITE_CANTOPEN, SQLITE_READONLY, SQLITE_PERM, SQLITE_IOERR):
        return CoordinatorUnavailable(
            f"coordinator database {where}: cannot open or write it ({e}); check that its "
            "directory exists and is writable by this user on a read-write filesystem"
        )
    return None


def connect(db_path: Path, *, busy_timeout_s: float = 5.0) -> sqlite3.Connection:
    """Open a connection with the pragmas every coordinator connection uses (typed errors)."""
    try:
        return _connect(db_path, busy_timeout_s)
    except sqlite3.Error as e:
        typed = typed_error(e, str(db_path))
        if typed is None:
            raise
        raise typed from None


def _connect(db_path: Path, busy_timeout_s: float) -> sqlite3.Connection:
    conn = sqlite3.connect(
        db_path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=True
    )
    conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
    mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        raise UnsupportedFilesystem(f"{db_path}: SQLite refused WAL mode (got {mode!r})")
    # NORMAL in WAL: a commit is durable across a *process* crash (the WAL is in the
    # page cache the kernel owns); only a power loss can drop the last commits, and
    # the publish protocol already fsyncs every window file before its row commits,
    # so a lost row only means a window is captured again. FULL would fsync per
    # lease/ack and cap the coordinator at the disk's fsync rate.
    conn.execute("PRAGMA synchronous=NORMAL")
    # AUTOCHECKPOINT_PAGES says why 4000. journal_size_limit truncates a WAL that
    # restarted back to 64 MiB; one that cannot restart is SqliteDatabase.bound_wal's.
    conn.execute(f"PRAGMA wal_autocheckpoint={AUTOCHECKPOINT_PAGES}")
    conn.execute("PRAGMA journal_size_limit=67108864")
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


def _is_busy(e: sqlite3.Error) -> bool:
    return error_code(e) in (SQLITE_BUSY, SQLITE_LOCKED)


def _begin_pauses() -> Iterator[float]:
    """The pauses between BEGIN tries: from 0.1 ms, ×1.5 a try up to 2 ms, each jittered
    (× 0.5 to 1.5) so that contending processes do not retry in step."""
    delay = 0.0001
    while True:
        yield delay * (0.5 + random.random())
        delay = min(delay * 1.5, 0.002)


def _busy_timeout_of_run(db_path: Path) -> float:
    """The busy timeout the run was created with (RunConfig.busy_timeout_s), else 5 s."""
    probe = sqlite3.connect(db_path, timeout=5.0, isolation_level=None)
    try:
        raw = probe.execute("SELECT value FROM meta WHERE key='config'").fetchone()
        return float(json.loads(raw[0])["busy_timeout_s"]) if raw else 5.0
    except (sqlite3.Error, ValueError, KeyError):
        return 5.0  # schema.check_schema (run by the caller) explains what is wrong
    finally:
        probe.close()


def exists(db_path: Path) -> bool:
    """Is there a coordinator database at `db_path`? Removes the empty file that a
    process killed inside create (before its schema committed) leaves: nothing was
    ever stored in it, and no later open could use it."""
    if not db_path.exists():
        return False
    try:
        conn = sqlite3.connect(db_path)
        try:
            empty = int(conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0]) == 0
        finally:
            conn.close()
    except sqlite3.Error as e:
        typed = typed_error(e, str(db_path))
        if typed is None:
            raise
        raise typed from None
    if empty:
        log.warning("%s has no tables (interrupted create); creating it again", db_path)
        for p in (db_path, Path(f"{db_path}-wal"), Path(f"{db_path}-shm")):
            p.unlink(missing_ok=True)
    return not empty


class SqliteDatabase:
    """A `schema.Database` on one SQLite file (WAL). `raw` is the sqlite3 connection."""

    dialect = "sqlite"

    def __init__(self, path: Path, *, busy_timeout_s: float | None = None) -> None:
        self.path = path
        self.where = str(path)
        if busy_timeout_s is None:
            busy_timeout_s = _busy_timeout_of_run(path) if path.is_file() else 5.0
        self.raw = connect(path, busy_timeout_s=busy_timeout_s)
        self._busy_ms = int(busy_timeout_s * 1000)
        self._armed: int | None = None  # data_version when arm() was called
        # bound_wal: a WAL frame is a page and its 24-byte header
        frame = int(self.execute("PRAGMA page_size").fetchone()[0]) + 24
        self.wal = Path(f"{path}-wal")
        self._starved_bytes = WAL_STARVED_PAGES * frame
        self._retry_bytes = WAL_RETRY_PAGES * frame
        self._checkpoint_at = self._starved_bytes  # the WAL size of the next try

    def execute(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Cursor:
        try:
            return self.raw.execute(sql, params)
        except sqlite3.Error as e:
            raise self._typed(e) from None

    def table_names(self) -> set[str]:
        """Names of the tables in the database (empty while a create is in flight)."""
        rows = self.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall()
        return {str(r[0]) for r in rows}

    def integrity_check(self) -> str:
        """`PRAGMA integrity_check`: "ok", or the first problem SQLite found in the file."""
        return str(self.execute("PRAGMA integrity_check").fetchone()[0])

    def _typed(self, e: sqlite3.Error) -> Exception:
        return typed_error(e, self.where) or e

    def executemany(self, sql: str, seq: Iterable[Sequence[Any]]) -> sqlite3.Cursor:
        return self.raw.executemany(sql, seq)

    def close(self) -> None:
        self.raw.close()

    @contextmanager
    def write(self, max_wait_s: float = 60.0, notify: str | None = "") -> Iterator[sqlite3.Cursor]:
        """`BEGIN IMMEDIATE` ... `COMMIT`, retrying a busy database for up to `max_wait_s`.

        The body must be short and must not have side effects outside the database:
        on a busy error at BEGIN we simply retry; errors inside the body roll back.
        `notify` is PostgreSQL's (here every commit changes `data_version`).
        """
        conn = self.raw
        deadline = time.monotonic() + max_wait_s
        # Waiting for the write lock is done here, not by SQLite's busy handler: it sleeps
        # 1, 2, 5, 10, ... 100 ms between tries, which under 8 contending processes turns
        # sub-millisecond transactions into tens of milliseconds of idling.
        conn.execute("PRAGMA busy_timeout=0")
        try:
            locked = f"coordinator database stayed locked for {max_wait_s:.0f} s"
            self._while_busy("BEGIN IMMEDIATE", deadline, _begin_pauses(), locked)
        finally:
            conn.execute(f"PRAGMA busy_timeout={self._busy_ms}")
        cur = conn.cursor()
        try:
            yield cur
        except sqlite3.Error as e:
            self._rollback()
            raise self._typed(e) from None
        except BaseException:
            self._rollback()
            raise
        # COMMIT in WAL mode can itself be busy only while a checkpoint holds the lock.
        locked = "commit failed on a locked database"
        self._while_busy("COMMIT", deadline, itertools.repeat(0.002), locked)
        self.bound_wal()  # committed: what it does (or fails to do) is not the caller's

    def _while_busy(self, sql: str, deadline: float, pauses: Iterator[float], locked: str) -> None:
        """Execute `sql` (BEGIN or COMMIT), again after the next of `pauses` while the
        database is busy (SQLITE_BUSY / SQLITE_LOCKED), until `deadline`: then
        CoordinatorBusy(`locked: <error>`); any other error typed (`_typed`). Raises with
        no transaction open: a COMMIT that failed is rolled back (a failed BEGIN has none)."""
        while True:
            try:
                self.raw.execute(sql)
                return
            except sqlite3.Error as e:
                busy = _is_busy(e)
                if busy and time.monotonic() <= deadline:
                    time.sleep(next(pauses))
                    continue
                self._rollback()
                raise (CoordinatorBusy(f"{locked}: {e}") if busy else self._typed(e)) from None

    def bound_wal(self) -> bool:
        """After a commit: empty a starved WAL (AUTOCHECKPOINT_PAGES and WAL_STARVED_PAGES
        say why). One stat per commit; True when this call emptied it."""
        try:
            size = os.stat(self.wal).st_size
        except OSError:  # no WAL yet, or another connection's TRUNCATE just won
            return False
        if size < self._starved_bytes:  # it restarts, or another connection emptied it
            self._checkpoint_at = self._starved_bytes
        if size < self._checkpoint_at:
            return False
        deadline = time.monotonic() + CHECKPOINT_WAIT_S
        self.raw.execute("PRAGMA busy_timeout=0")  # tries, not one wait (WAL_STARVED_PAGES)
        try:
            while True:
                failed = None
                try:
                    busy = int(self.raw.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0])
                except sqlite3.Error as e:  # the commit stands: not the caller's error
                    busy, failed = 1, None if _is_busy(e) else e  # busy: another checkpoints
                if not busy or failed or time.monotonic() >= deadline:
                    break
                time.sleep(CHECKPOINT_RETRY_S)
        finally:
            self.raw.execute(f"PRAGMA busy_timeout={self._busy_ms}")
        if busy:
            self._checkpoint_at = size + self._retry_bytes
            why = (
                f"checkpointing it failed ({failed})" if failed else
                f"readers kept it in use for {CHECKPOINT_WAIT_S:g} s of tries (a read "
                "transaction left open, a process stopped mid-read?)"
            )  # fmt: skip
            log.warning("%s: the WAL is %.0f MiB and %s; it grows until it can be emptied "
                        "(tried again at %.0f MiB)", self.wal, size / (1 << 20), why,
                        self._checkpoint_at / (1 << 20))  # fmt: skip
            return False
        self._checkpoint_at = self._starved_bytes
        log.info("%s: the WAL was %.0f MiB, starved by overlapping readers; emptied",
                 self.wal, size / (1 << 20))  # fmt: skip
        return True

    def batch(self, statements: Sequence[Statement], notify: str | None = "") -> list[Rows]:
        """The statements one after another in one `write` (one host: no round trips to
        save), each one's rows fetched before the next runs."""
        _, out = self.decide(lambda cur: (None, statements))
        return out

    def decide(
        self, body: Callable[[Any], tuple[T, Sequence[Statement]]], notify: str | None = ""
    ) -> tuple[T, list[Rows]]:
        """`body`, then its statements, in one `write`."""
        out = []
        with self.write() as cur:
            value, statements = body(cur)
            for sql, params in statements:
                c = cur.execute(sql, params)
                if c.description is None:
                    out.append(Rows([], int(c.rowcount)))
                else:
                    rows = [tuple(r) for r in c.fetchall()]
                    out.append(Rows(rows, len(rows)))
        return value, out

    def write_row(self, sql: str, params: Sequence[Any] = ()) -> int:
        """One statement in its own `write` (SQLite has one writer at a time anyway)."""
        with self.write() as cur:
            return int(cur.execute(sql, params).rowcount)

    def arm(self) -> None:
        """Commits of other connections from now on wake the next `wait_change`."""
        self._armed = self.raw.execute("PRAGMA data_version").fetchone()[0]

    def disarm(self) -> None:
        self._armed = None

    def writable(self, timeout_s: float) -> bool:
        try:
            with self.write(max_wait_s=timeout_s):
                return True  # an empty transaction: commits nothing
        except CoordinatorBusy:
            return False

    def _rollback(self) -> None:
        # After some errors (SQLITE_FULL among them) SQLite has already rolled back,
        # and ROLLBACK would fail with "no transaction is active".
        if self.raw.in_transaction:
            self.raw.execute("ROLLBACK")

    def wait_change(
        self, deadline: float | None, max_s: float = 0.05, ignore: tuple[str, ...] = ()
    ) -> bool:
        """Poll `PRAGMA data_version` (changes when another connection commits; since
        `arm()` when armed). `ignore` is PostgreSQL's: every commit wakes it here."""
        end = time.monotonic() + max_s
        if deadline is not None:
            end = min(end, deadline)
        v0 = self._armed
        if v0 is None:
            v0 = self.raw.execute("PRAGMA data_version").fetchone()[0]
        elif self.raw.execute("PRAGMA data_version").fetchone()[0] != v0:
            return True
        pause = 0.0005
        while time.monotonic() < end:
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
            if self.raw.execute("PRAGMA data_version").fetchone()[0] != v0:
                return True
        return False
