"""The coordinator's SQLite database: where it may live, how it is opened, its schema.

    from fanout.schema import connect, check_local_filesystem
    conn = connect(Path("runs/demo/coordinator.sqlite3"))   # refuses NFS/CIFS/...

Every connection is stdlib `sqlite3` in autocommit mode (`isolation_level=None`)
so that this module, not the driver, decides where transactions begin: every
writing transaction is `BEGIN IMMEDIATE` (takes the write lock up front, so two
writers never deadlock upgrading a read lock) and short. `write()` wraps the
transient "database is locked" in bounded retries; a caller only ever sees
`CoordinatorBusy` after `max_wait_s` of continuous contention.

The schema is versioned (`meta.schema_version`); an unknown version is refused
with `SchemaVersionError` instead of being guessed at.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fanout.errors import (
    CoordinatorBusy,
    CoordinatorFull,
    SchemaVersionError,
    UnsupportedFilesystem,
)

SCHEMA_VERSION = 1

# Filesystems on which SQLite WAL is unsafe: WAL coordinates writers through a
# shared-memory file (`-shm`) that must be mmapped by every process on ONE host,
# and POSIX locks on these are either per-host, emulated, or lied about.
NETWORK_FS_TYPES = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb", "smb3", "smbfs", "fuse.sshfs", "sshfs",
        "lustre", "gpfs", "ceph", "fuse.ceph", "fuse.cephfs", "glusterfs",
        "fuse.glusterfs", "beegfs", "fuse.beegfs", "panfs", "afs", "ocfs2", "gfs2",
        "orangefs", "pvfs2", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone", "fuse.juicefs",
        "wekafs", "9p", "fuse.weka",
    }
)  # fmt: skip

# Integer counters in `meta`: id sources (never reused) and what `fanout status` reports.
COUNTERS = (
    "next_window", "next_generation", "next_token", "recaptures", "evictions",
    "corrupt", "detaches", "reclaims", "hw_windows", "hw_bytes",
)  # fmt: skip

DDL = """
CREATE TABLE meta(key TEXT PRIMARY KEY, value) WITHOUT ROWID;
CREATE TABLE windows(
  window     INTEGER PRIMARY KEY,
  state      TEXT NOT NULL CHECK (state IN
               ('queued','capturing','ready','evicting','evicted','failed')),
  generation INTEGER NOT NULL DEFAULT 0,   -- of the current/last capture (fencing)
  demand     INTEGER NOT NULL DEFAULT 0,   -- 1: a consumer waits for it (recapture)
  claim_token INTEGER,                     -- producer's claim while capturing
  name       TEXT, path TEXT, nbytes INTEGER NOT NULL DEFAULT 0, checksum TEXT,
  captures   INTEGER NOT NULL DEFAULT 0,   -- completed captures (>1 = recaptured)
  attempts   INTEGER NOT NULL DEFAULT 0,   -- failed attempts since last success
  last_error TEXT,
  updated_at REAL NOT NULL                 -- wall clock, display only
);
CREATE INDEX windows_by_state ON windows(state, window);
CREATE TABLE consumers(
  id         TEXT PRIMARY KEY,             -- name:dp<rank>
  expect     TEXT NOT NULL,                -- JSON of the contract fields it asked for
  cursor     INTEGER NOT NULL,             -- next window it needs
  hb_seq     INTEGER NOT NULL DEFAULT 0,   -- heartbeat counter (liveness)
  hb_wall    REAL NOT NULL,                -- wall clock of last heartbeat, display only
  state      TEXT NOT NULL CHECK (state IN ('active','lost','finished','detached')),
  token      INTEGER NOT NULL,             -- epoch token (fencing)
  note       TEXT
) WITHOUT ROWID;
CREATE TABLE leases(
  token      INTEGER PRIMARY KEY,          -- fencing token of this lease
  consumer   TEXT NOT NULL,
  window     INTEGER NOT NULL,
  generation INTEGER NOT NULL,
  epoch      INTEGER NOT NULL,             -- consumer token when granted
  acquired_wall REAL NOT NULL
);
CREATE UNIQUE INDEX leases_by_consumer ON leases(consumer, window);
CREATE INDEX leases_by_window ON leases(window);
CREATE TABLE producer(
  id      INTEGER PRIMARY KEY CHECK (id = 1),
  token   INTEGER NOT NULL,
  hb_seq  INTEGER NOT NULL DEFAULT 0,
  hb_wall REAL NOT NULL,
  state   TEXT NOT NULL CHECK (state IN ('active','lost','finished')),
  owner   TEXT NOT NULL
);
"""


def parse_mountinfo(text: str) -> list[tuple[str, str]]:
    """(mount point, fs type) per line of /proc/self/mountinfo (octal escapes decoded).

    Format (proc(5)): `id parent major:minor root MOUNTPOINT opts [optional...] - FSTYPE src sopts`.
    """
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        point = fields[4].encode().decode("unicode_escape")  # "\040" -> " "
        out.append((point, right.split()[0]))
    return out


def filesystem_type(path: Path, mountinfo: str | None = None) -> tuple[str, str]:
    """(fs type, mount point) of the filesystem holding `path` (longest mount prefix)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return ("unknown", "/")
    target = os.path.realpath(path)
    best = ("unknown", "/")
    best_len = -1
    for point, fstype in parse_mountinfo(mountinfo):
        p = point.rstrip("/") or "/"
        inside = target == p or p == "/" or target.startswith(p + "/")
        # ">=" so that a later mount stacked on the same point wins, as the kernel does.
        if inside and len(p) >= best_len:
            best, best_len = (fstype, p), len(p)
    return best


def check_local_filesystem(db_path: Path, mountinfo: str | None = None) -> None:
    """Raise UnsupportedFilesystem if the database's directory is on a network filesystem."""
    fstype, point = filesystem_type(db_path.parent, mountinfo)
    if fstype in NETWORK_FS_TYPES or fstype.startswith(("nfs", "fuse.ceph")):
        raise UnsupportedFilesystem(
            f"coordinator database {db_path} would live on {fstype} (mounted at {point}); "
            "SQLite WAL needs shared memory and locks on one host, so it must be on a "
            "local disk of the producer's host. Keep the artifacts on the shared "
            "filesystem and put the database elsewhere with --db-path /local/disk/run.sqlite3 "
            "(or pass allow_network_fs=True / --allow-network-fs if you know it is safe)."
        )


def connect(db_path: Path, *, busy_timeout_s: float = 5.0) -> sqlite3.Connection:
    """Open a connection with the pragmas every coordinator connection uses."""
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
    # Checkpoints (WAL -> database file) are the only fsyncs left; one per 4000 pages
    # (16 MiB of WAL) instead of SQLite's 1000 amortizes them over ~1000 lease cycles.
    # journal_size_limit truncates the WAL back afterwards, so disk use stays flat.
    conn.execute("PRAGMA wal_autocheckpoint=4000")
    conn.execute("PRAGMA journal_size_limit=67108864")
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


def _is_busy(e: sqlite3.OperationalError) -> bool:
    msg = str(e).lower()
    return "locked" in msg or "busy" in msg


@contextmanager
def write(
    conn: sqlite3.Connection, *, max_wait_s: float = 60.0, busy_ms: int | None = None
) -> Iterator[sqlite3.Cursor]:
    """`BEGIN IMMEDIATE` ... `COMMIT`, retrying a busy database for up to `max_wait_s`.

    The body must be short and must not have side effects outside the database:
    on a busy error at BEGIN we simply retry; errors inside the body roll back.
    `busy_ms` is the connection's busy timeout, restored after BEGIN (read if None).
    """
    deadline = time.monotonic() + max_wait_s
    delay = 0.0001
    # Waiting for the write lock is done here, not by SQLite's busy handler: it sleeps
    # 1, 2, 5, 10, ... 100 ms between tries, which under 8 contending processes turns
    # sub-millisecond transactions into tens of milliseconds of idling.
    if busy_ms is None:
        busy_ms = int(conn.execute("PRAGMA busy_timeout").fetchone()[0])
    conn.execute("PRAGMA busy_timeout=0")
    try:
        while True:
            try:
                conn.execute("BEGIN IMMEDIATE")
                break
            except sqlite3.OperationalError as e:
                if not _is_busy(e):
                    raise
                if time.monotonic() > deadline:
                    raise CoordinatorBusy(
                        f"coordinator database stayed locked for {max_wait_s:.0f} s: {e}"
                    ) from None
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 1.5, 0.002)
    finally:
        conn.execute(f"PRAGMA busy_timeout={int(busy_ms)}")
    cur = conn.cursor()
    try:
        yield cur
    except sqlite3.OperationalError as e:
        _rollback(conn)
        if _is_full(e):
            raise _full_error(conn, e) from None
        raise
    except BaseException:
        _rollback(conn)
        raise
    # COMMIT in WAL mode can itself be busy only while a checkpoint holds the lock.
    while True:
        try:
            conn.execute("COMMIT")
            return
        except sqlite3.OperationalError as e:
            if _is_full(e):
                _rollback(conn)
                raise _full_error(conn, e) from None
            if not _is_busy(e) or time.monotonic() > deadline:
                _rollback(conn)
                raise CoordinatorBusy(f"commit failed on a locked database: {e}") from None
            time.sleep(0.002)


def _rollback(conn: sqlite3.Connection) -> None:
    # After some errors (SQLITE_FULL among them) SQLite has already rolled back,
    # and ROLLBACK would fail with "no transaction is active".
    if conn.in_transaction:
        conn.execute("ROLLBACK")


def _is_full(e: sqlite3.OperationalError) -> bool:
    return getattr(e, "sqlite_errorname", "") == "SQLITE_FULL" or "is full" in str(e)


def _full_error(conn: sqlite3.Connection, e: sqlite3.OperationalError) -> CoordinatorFull:
    rows = conn.execute("PRAGMA database_list").fetchall()
    path = next((str(r[2]) for r in rows if r[1] == "main"), "?")
    return CoordinatorFull(
        f"coordinator database {path}: disk full ({e}); the transaction rolled back and "
        "nothing changed. Free space on that filesystem (or move the database with "
        "--db-path) and start the process again."
    )


def create_schema(conn: sqlite3.Connection, meta: dict[str, object]) -> None:
    """Create the tables and seed `meta` in one transaction (fails if they exist)."""
    with write(conn) as cur:
        for stmt in DDL.split(";"):
            if stmt.strip():
                cur.execute(stmt)
        cur.executemany(
            "INSERT INTO meta(key, value) VALUES (?, ?)",
            [("schema_version", SCHEMA_VERSION), *meta.items()] + [(k, 0) for k in COUNTERS],
        )


def check_schema(conn: sqlite3.Connection, db_path: Path) -> None:
    """Raise SchemaVersionError unless the database has exactly SCHEMA_VERSION."""
    try:
        row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    except sqlite3.OperationalError as e:
        raise SchemaVersionError(f"{db_path}: not a fanout coordinator database ({e})") from None
    version = None if row is None else row[0]
    if version != SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{db_path}: coordinator schema version {version!r}, this fanout knows "
            f"{SCHEMA_VERSION}; use the fanout version that created the run, or start a new run dir"
        )


def open_existing(db_path: Path) -> sqlite3.Connection:
    """Connect to an existing database with the busy timeout its run was created with."""
    probe = sqlite3.connect(db_path, timeout=5.0, isolation_level=None)
    try:
        raw = probe.execute("SELECT value FROM meta WHERE key='config'").fetchone()
        busy = float(json.loads(raw[0])["busy_timeout_s"]) if raw else 5.0
    except (sqlite3.Error, ValueError, KeyError):
        busy = 5.0  # check_schema (run by the caller) explains what is wrong
    finally:
        probe.close()
    return connect(db_path, busy_timeout_s=busy)
