"""The coordinator's tables, in one schema for both databases that can hold them.

    from fanout.coord import schema, sqlitedb
    db = sqlitedb.SqliteDatabase(Path("runs/demo/coordinator.sqlite3"))   # or postgresdb
    schema.create_schema(db, {"config": ..., "contract": ..., "stream_id": ...})
    schema.check_schema(db)                      # SchemaVersionError if unknown

Two backends hold the same tables with the same statements: fanout.coord.sqlitedb (the
embedded default, one host) and fanout.coord.postgresdb (several hosts). Both are a
`Database`: `execute` for reads, `write()` for one serialised write transaction,
`wait_change` to sleep until another process commits. The statements are
written once, in the subset both dialects share (`?` placeholders, `RETURNING`,
`ON CONFLICT`, `CASE` instead of SQLite's two-argument `MAX`); the PostgreSQL
backend translates placeholders and quotes the column `window`, a reserved word
there. Only the DDL's types differ (`DDL.format(**DIALECTS[...])`).

The schema is versioned (`meta.schema_version`); versions 1 (counters kept in
`meta`), 2 (no role holders, no 'stopped' consumers) and 3 (one producer row, no
replicas), 4 (no follow_chunks, fanout.coord.follow_log) and 5 (no verifier versions:
`windows.verifier_version`, `consumers.lag_skipped`) are migrated in place,
one step at a time, each in one transaction;
anything else unknown is refused with `SchemaVersionError` instead of being
guessed at.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from fanout.coord import states
from fanout.coord.database import Database as Database  # the seam, named here too
from fanout.coord.database import Sql as Sql
from fanout.errors import ConfigError, NoCoordinator, NotACoordinatorDatabase, SchemaVersionError

SCHEMA_VERSION = 6

# Integer counters (table `counters`): id sources (never reused) and what `fanout status` reports.
# `reclaims`: processes declared lost; `claims_reclaimed`: windows a producer replica had
# claimed and lost (it died, was declared lost or was replaced), captured again by another.
COUNTERS = (
    "next_window", "next_generation", "next_token", "recaptures", "evictions",
    "corrupt", "detaches", "reclaims", "hw_windows", "hw_bytes", "claims_reclaimed",
    "capture_failures",
)  # fmt: skip
# counters added after a schema version shipped: a run created before has no row for
# them, read as 0 and made on their first bump (fanout.coord.core.RunDb.bump / meta)
LATE_COUNTERS = frozenset({"capture_failures"})

# Types per dialect. PostgreSQL's INTEGER is 32-bit and its REAL 32-bit float: byte
# counts and wall-clock seconds need BIGINT and DOUBLE PRECISION there. SQLite's
# WITHOUT ROWID saves a b-tree for tables keyed by text.
DIALECTS = {
    "sqlite": {"int": "INTEGER", "real": "REAL", "no_rowid": "WITHOUT ROWID"},
    "postgres": {"int": "BIGINT", "real": "DOUBLE PRECISION", "no_rowid": ""},
}

DDL = """
CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT) {no_rowid};
CREATE TABLE counters(key TEXT PRIMARY KEY, value {int} NOT NULL) {no_rowid};
CREATE TABLE windows(
  window     {int} PRIMARY KEY,
  state      TEXT NOT NULL CHECK (state IN {window_states}), -- fanout.coord.states.W
  generation {int} NOT NULL DEFAULT 0,     -- of the current/last capture (fencing)
  demand     {int} NOT NULL DEFAULT 0,     -- 1: a consumer waits for it (recapture)
  claim_token {int},                       -- producer's claim while capturing
  claim_rank {int},                        -- the replica that holds that claim (schema 4)
  name       TEXT, path TEXT, nbytes {int} NOT NULL DEFAULT 0, checksum TEXT,
  captures   {int} NOT NULL DEFAULT 0,     -- completed captures (>1 = recaptured)
  attempts   {int} NOT NULL DEFAULT 0,     -- failed attempts since last success
  last_error TEXT,
  verifier_version {int},                  -- captured with (--follow-verifier, schema 6)
  updated_at {real} NOT NULL               -- wall clock, display only
);
CREATE INDEX windows_by_state ON windows(state, window);
CREATE TABLE consumers(
  id         TEXT PRIMARY KEY,             -- name:dp<rank>
  expect     TEXT NOT NULL,                -- JSON of the contract fields it asked for
  cursor     {int} NOT NULL,               -- next window it needs
  hb_seq     {int} NOT NULL DEFAULT 0,     -- heartbeat counter (liveness)
  hb_wall    {real} NOT NULL,              -- wall clock of last heartbeat, display only
  state      TEXT NOT NULL CHECK (state IN {consumer_states}), -- states.RoleState
  token      {int} NOT NULL,               -- epoch token (fencing)
  note       TEXT,
  host       TEXT,                         -- who holds the role (schema 3)
  pid        {int},                        -- its process id there
  lag_skipped {int} NOT NULL DEFAULT 0,    -- windows acked untrained: --max-verifier-lag (schema 6)
  proc       TEXT                          -- boot id/pid namespace/start time (fanout.coord.liveness)
) {no_rowid};
CREATE TABLE leases(
  token      {int} PRIMARY KEY,            -- fencing token of this lease
  consumer   TEXT NOT NULL,
  window     {int} NOT NULL,
  generation {int} NOT NULL,
  epoch      {int} NOT NULL,               -- consumer token when granted
  acquired_wall {real} NOT NULL
);
CREATE UNIQUE INDEX leases_by_consumer ON leases(consumer, window);
CREATE INDEX leases_by_window ON leases(window);
CREATE TABLE producers(
  rank    {int} PRIMARY KEY,               -- replica rank 0 .. replicas-1 (schema 4)
  token   {int} NOT NULL,
  hb_seq  {int} NOT NULL DEFAULT 0,
  hb_wall {real} NOT NULL,
  state   TEXT NOT NULL CHECK (state IN {producer_states}), -- states.RoleState
  owner   TEXT NOT NULL,
  host    TEXT,                            -- who holds the role, as in consumers
  pid     {int},
  proc    TEXT,
  made    {int} NOT NULL DEFAULT 0,        -- windows this rank published, every incarnation
  since_wall {real} NOT NULL,              -- when this incarnation registered (display)
  made_since {int} NOT NULL DEFAULT 0      -- windows it published since then (its rate)
);
CREATE TABLE follow_chunks(                -- a followed source's commits (schema 5)
  stream  TEXT NOT NULL,                   -- the run's stream id
  chunk   {int} NOT NULL,                  -- RUN_DIR/follow/chunk-<chunk>-<digest>.jsonl
  records {int} NOT NULL,                  -- its lines
  digest  TEXT NOT NULL,                   -- of its bytes
  positions TEXT NOT NULL,                 -- JSON: bytes read per file (dev:ino) after it
  counts  TEXT NOT NULL,                   -- JSON: records, heldout, skipped so far
  committed_wall {real} NOT NULL,          -- display only
  PRIMARY KEY (stream, chunk)
) {no_rowid};
"""


# The run's tables, in creation order (dropped in reverse).
TABLES = tuple(re.findall(r"CREATE TABLE (\w+)\(", DDL))


def drop_tables(db: Database, keep_if: Callable[[Sql], bool] | None = None) -> bool:
    """Drop the run's tables in one transaction: what `create_schema` made, nothing else
    (for a run whose producer failed before anything used it). `keep_if` is asked in
    that same transaction, so nothing can use the run between the check and the drop;
    True from it keeps the tables. Returns whether they were dropped."""
    with db.write() as cur:
        if keep_if is not None and keep_if(cur):
            return False
        for name in reversed(TABLES):
            cur.execute(f"DROP TABLE IF EXISTS {name}")
    return True


def statements(dialect: str) -> list[str]:
    ddl = DDL.format(
        **DIALECTS[dialect],
        window_states=states.sql_in(states.W),
        consumer_states=states.sql_in(states.CONSUMER_STATES),
        producer_states=states.sql_in(states.PRODUCER_STATES),
    )
    return [s for s in ddl.split(";") if s.strip()]


def _statement(dialect: str, table: str) -> str:
    """The CREATE TABLE statement of `table` (for migrations)."""
    return next(st for st in statements(dialect) if f"TABLE {table}(" in st)


# does this run's namespace hold fanout's first table? (asked under the write lock)
_HAS_META = {
    "sqlite": "SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'",
    "postgres": "SELECT 1 FROM information_schema.tables "
    "WHERE table_schema=current_schema() AND table_name='meta'",
}


def create_schema(db: Database, meta: dict[str, object]) -> None:
    """Create the tables and seed `meta` and the counters in one transaction. ConfigError
    if they exist by then: two hosts that both saw no run race here, and the write lock
    lets one create while the other waits, then finds the tables (a DuplicateTable from
    the server was a traceback instead of the loser joining the run)."""
    with db.write() as cur:
        if cur.execute(_HAS_META[db.dialect]).fetchone() is not None:
            raise ConfigError("a coordinator database was created there first; use open()")
        for stmt in statements(db.dialect):
            cur.execute(stmt)
        cur.executemany(
            "INSERT INTO meta(key, value) VALUES (?, ?)",
            [("schema_version", str(SCHEMA_VERSION))] + [(k, str(v)) for k, v in meta.items()],
        )
        cur.executemany("INSERT INTO counters(key, value) VALUES (?, 0)", [(k,) for k in COUNTERS])


def _migrate_v1(cur: Sql, dialect: str) -> None:
    """Version 1 kept the counters in `meta` (an untyped SQLite column); move them out."""
    keys = ",".join("?" * len(COUNTERS))
    cur.execute(statements(dialect)[1])  # CREATE TABLE counters
    cur.execute(
        f"INSERT INTO counters(key, value) SELECT key, value FROM meta WHERE key IN ({keys})",
        COUNTERS,
    )
    cur.execute(f"DELETE FROM meta WHERE key IN ({keys})", COUNTERS)


_V2_CONSUMER_COLUMNS = "id, expect, cursor, hb_seq, hb_wall, state, token, note"


def _migrate_v2(cur: Sql, dialect: str) -> None:
    """Version 3 records who holds each role (host, pid, proc) and lets a consumer be
    'stopped' (exited cleanly before the end of its stream). Adding a value to a CHECK
    needs a new table on SQLite, so `consumers` is copied into one (same statements on
    PostgreSQL); `producer` gets the columns in place."""
    create = _statement(dialect, "consumers")
    cur.execute(create.replace("TABLE consumers(", "TABLE consumers_v3("))
    cols = _V2_CONSUMER_COLUMNS
    cur.execute(f"INSERT INTO consumers_v3({cols}) SELECT {cols} FROM consumers")
    cur.execute("DROP TABLE consumers")
    cur.execute("ALTER TABLE consumers_v3 RENAME TO consumers")
    int_type = DIALECTS[dialect]["int"]
    for col, tp in (("host", "TEXT"), ("pid", int_type), ("proc", "TEXT")):
        cur.execute(f"ALTER TABLE producer ADD COLUMN {col} {tp}")


_V3_PRODUCER_COLUMNS = "token, hb_seq, hb_wall, state, owner, host, pid, proc"


def _migrate_v3(cur: Sql, dialect: str) -> None:
    """Version 4 runs producer replicas: `producer` (one row, id 1) becomes `producers`
    (one row per replica rank; the old row is rank 0's), every claim records its
    replica (`windows.claim_rank`: rank 0's for a claim in flight), and the counter
    `claims_reclaimed` is added."""
    cur.execute(_statement(dialect, "producers"))
    cols = _V3_PRODUCER_COLUMNS
    cur.execute(
        f"INSERT INTO producers(rank, {cols}, since_wall) SELECT 0, {cols}, hb_wall FROM producer"
    )
    cur.execute("DROP TABLE producer")
    cur.execute(f"ALTER TABLE windows ADD COLUMN claim_rank {DIALECTS[dialect]['int']}")
    cur.execute("UPDATE windows SET claim_rank=0 WHERE claim_token IS NOT NULL")
    cur.execute("INSERT INTO counters(key, value) VALUES ('claims_reclaimed', 0)")


def _migrate_v4(cur: Sql, dialect: str) -> None:
    """Version 5 records a followed source's chunks (`follow_chunks`,
    fanout.coord.follow_log): a new, empty table."""
    cur.execute(_statement(dialect, "follow_chunks"))


def _migrate_v5(cur: Sql, dialect: str) -> None:
    """Version 6 records the verifier version each window was captured with
    (`windows.verifier_version`, null: a fixed verifier) and how many windows each
    consumer acked without training for being too many versions old
    (`consumers.lag_skipped`): two columns added in place."""
    int_type = DIALECTS[dialect]["int"]
    for table, column in (("windows", "verifier_version {int}"),
                          ("consumers", "lag_skipped {int} NOT NULL DEFAULT 0")):  # fmt: skip
        # a run migrated from version 2 got today's `consumers` table (_migrate_v2)
        if column.split()[0] not in _columns(cur, dialect, table):
            cur.execute(f"ALTER TABLE {table} ADD COLUMN {column.format(int=int_type)}")


# Each step migrates the version it is named for to the next. Version 1 was SQLite's
# only (before PostgreSQL); on PostgreSQL it is unknown.
_MIGRATIONS: dict[str, Callable[[Sql, str], None]] = {
    "1": _migrate_v1, "2": _migrate_v2, "3": _migrate_v3, "4": _migrate_v4, "5": _migrate_v5
}  # fmt: skip


def _migrate(db: Database, version: str) -> None:
    """Run the step from `version` to the next in one write transaction that reads the
    version again first (another process may have migrated it meanwhile: then nothing)
    and records the next one last."""
    with db.write() as cur:
        row = cur.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if str(row[0]) != version:
            return  # another process migrated it first
        _MIGRATIONS[version](cur, db.dialect)
        cur.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(int(version) + 1),))


def _columns(cur: Sql, dialect: str, table: str) -> set[str]:
    """The column names of `table` (in the current schema on PostgreSQL)."""
    if dialect == "sqlite":
        rows = cur.execute(f"SELECT name FROM pragma_table_info('{table}')").fetchall()
    else:
        rows = cur.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name=? "
            "AND table_schema=current_schema()",
            (table,),
        ).fetchall()
    return {str(r[0]) for r in rows}


def check_schema(db: Database) -> None:
    """Raise unless the database has SCHEMA_VERSION (after migrating 1 to 5): NoCoordinator
    when it has no tables yet (being created), NotACoordinatorDatabase when its tables
    are not fanout's, SchemaVersionError for a version this code does not know."""
    tables = db.table_names()
    if not tables:
        raise NoCoordinator(
            f"{db.where}: no coordinator tables yet (a producer is creating the run, or was "
            "stopped while it did; a restarted producer creates them)"
        )
    if "meta" not in tables:
        raise NotACoordinatorDatabase(
            f"{db.where}: not a fanout coordinator database (its tables: "
            f"{', '.join(sorted(tables)[:5])}); check --run-dir / --db-path"
        )
    row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    version = None if row is None else str(row[0])
    while version in _MIGRATIONS and (version != "1" or db.dialect == "sqlite"):
        _migrate(db, version)
        version = str(int(version) + 1)
    if version != str(SCHEMA_VERSION):
        raise SchemaVersionError(
            f"{db.where}: coordinator schema version {version or 'missing'}, this fanout knows "
            f"{SCHEMA_VERSION}; use the fanout version that created the run, or start a new run dir"
        )
