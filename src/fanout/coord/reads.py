"""Read-only questions about a run, asked of the coordinator's tables.

    from fanout.coord.reads import ready_windows
    n, nbytes = ready_windows(coord.conn)          # or coord.ready_windows()

The SQL that producers, trainers, `fanout status` (fanout.status), bench reports and
the chaos harness ask of a run lives here, behind names, so that only fanout.coord
speaks SQL. Each function takes a connection or a cursor inside a transaction; the
Coordinator's methods of the same names call them on its own connection.

This module is the coordinator's read API for code outside fanout.coord: the reads
that live beside the writes they mirror (a wait's words in waits, the K count in
retention, the status records in records) are named here too, so a reader imports
this module, the Coordinator and the state names (fanout.coord.states), nothing
else of coord/ (pyproject.toml's import-linter contract holds fanout.status to it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from fanout.coord import states
from fanout.coord.database import wall as wall  # the clock every *_wall stamp is in
from fanout.coord.liveness import process_gone as process_gone  # for people, not liveness
from fanout.coord.records import consumer_starts as consumer_starts
from fanout.coord.records import producer_exits as producer_exits
from fanout.coord.retention import live_windows as live_windows  # what K bounds
from fanout.coord.schema import Database, Sql
from fanout.coord.states import RoleState, W, sql_in
from fanout.coord.waits import block_text as block_text
from fanout.coord.waits import blocked_since as blocked_since
from fanout.coord.waits import consumer_wait as consumer_wait
from fanout.coord.waits import holders as holders
from fanout.coord.waits import is_blocked as is_blocked
from fanout.coord.waits import missing_consumers as missing_consumers
from fanout.coord.waits import stream_end as stream_end
from fanout.coord.waits import ways_out as ways_out


@contextmanager
def one_instant(db: Database) -> Iterator[None]:
    """Every read inside it in one read-only transaction: its numbers are of one instant
    (totals are the sum of the rows beside them, a window counted as made is published
    by some replica or still claimed), not of a moving run read in several autocommitted
    statements. PostgreSQL: REPEATABLE READ (one snapshot for the whole transaction);
    SQLite (WAL): a deferred transaction reads one snapshot from its first read.
    Neither blocks a writer."""
    begin = (
        "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY" if db.dialect == "postgres" else "BEGIN"
    )
    db.execute(begin)
    try:
        yield
    finally:
        db.execute("COMMIT")  # nothing was written: the end of the snapshot


def windows_by_state(cur: Sql) -> dict[str, int]:
    """{state: window rows in it} for every state (0 where none); evicted rows are
    compacted away, so `evicted` here is not the files evicted (counters: evictions)."""
    counts = dict(cur.execute("SELECT state, COUNT(*) FROM windows GROUP BY state").fetchall())
    return {s.value: int(counts.get(s.value, 0)) for s in W}


def window_state(cur: Sql, window: int) -> str | None:
    """The state of window `window`'s row, None when it has none (not handed out yet)."""
    row = cur.execute("SELECT state FROM windows WHERE window=?", (window,)).fetchone()
    return None if row is None else str(row[0])


def consumer_rows(cur: Sql) -> list[dict[str, Any]]:
    """One dict per consumer that joined, by id: id, state, cursor, heartbeats, hb_wall,
    note, host, pid, proc and expect (its registration's expectations, JSON)."""
    keys = ("id", "state", "cursor", "heartbeats", "hb_wall", "note", "host", "pid", "proc",
            "expect")  # fmt: skip
    rows = cur.execute(
        "SELECT id, state, cursor, hb_seq, hb_wall, note, host, pid, proc, expect "
        "FROM consumers ORDER BY id"
    ).fetchall()
    return [dict(zip(keys, row, strict=True)) for row in rows]


def lease_rows(cur: Sql) -> list[dict[str, Any]]:
    """One dict per lease held, by window: consumer, window, generation, token and
    acquired_wall."""
    keys = ("consumer", "window", "generation", "token", "acquired_wall")
    rows = cur.execute(
        "SELECT consumer, window, generation, token, acquired_wall FROM leases ORDER BY window"
    ).fetchall()
    return [dict(zip(keys, row, strict=True)) for row in rows]


def ready_windows(cur: Sql) -> tuple[int, int]:
    """(count, bytes) of the readable windows: what is on disk for trainers now."""
    n, nbytes = cur.execute(
        f"SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM windows WHERE state IN "
        f"{sql_in(states.READABLE)}"
    ).fetchone()
    return int(n), int(nbytes)


def ready_stamps(cur: Sql) -> list[float]:
    """Wall-clock stamps (for people and benchmarks) of when each readable window was
    published, oldest first."""
    q = f"SELECT updated_at FROM windows WHERE state IN {sql_in(states.READABLE)}"
    return sorted(float(t) for (t,) in cur.execute(q).fetchall())


def oldest_unread(cur: Sql) -> tuple[int, float, list[str]] | None:
    """The oldest readable window some counted consumer has not read past yet, when it
    was published (wall clock) and who is at or below it — what `fanout status` calls
    stalled once it waited too long (#52: nothing trained). With no consumer registered
    at all every readable window is unread; None when none is (or every consumer ended)."""
    counted = sql_in(states.COUNTED)
    (n,) = cur.execute("SELECT COUNT(*) FROM consumers").fetchone()
    (low,) = cur.execute(f"SELECT MIN(cursor) FROM consumers WHERE state IN {counted}").fetchone()
    if low is None and n:
        return None
    row = cur.execute(
        f"SELECT window, updated_at FROM windows WHERE state IN {sql_in(states.READABLE)} "
        "AND window >= ? ORDER BY window LIMIT 1",
        (low or 0,),
    ).fetchone()
    if row is None:
        return None
    who = cur.execute(
        f"SELECT id FROM consumers WHERE state IN {counted} AND cursor <= ? ORDER BY id",
        (int(row[0]),),
    ).fetchall()
    return int(row[0]), float(row[1]), [str(x) for (x,) in who]


def pending_windows(cur: Sql) -> int:
    """Windows still to be captured: queued (new, on demand, or retried) or capturing."""
    q = f"SELECT COUNT(*) FROM windows WHERE state IN {sql_in(states.PENDING)}"
    return int(cur.execute(q).fetchone()[0])


def active_consumers_before(cur: Sql, cursor: int) -> int:
    """Active consumers whose cursor is below `cursor` (they may still demand windows)."""
    q = "SELECT COUNT(*) FROM consumers WHERE state=? AND cursor < ?"
    return int(cur.execute(q, (RoleState.ACTIVE.value, cursor)).fetchone()[0])


def consumers_registered(cur: Sql) -> int:
    """Consumers that ever joined the run, in any state."""
    return int(cur.execute("SELECT COUNT(*) FROM consumers").fetchone()[0])


def run_was_used(cur: Sql, owner: str) -> bool:
    """Did anything use this run beyond producer `owner` creating it: a window published
    (or evicted since), a trainer joined, or another producer (a replica, or one that
    took the run over) registered?"""
    published = cur.execute(
        f"SELECT COUNT(*) FROM windows WHERE state IN {sql_in(states.PUBLISHED)}"
    ).fetchone()[0]
    evictions = cur.execute("SELECT value FROM counters WHERE key='evictions'").fetchone()[0]
    others = cur.execute("SELECT COUNT(*) FROM producers WHERE owner <> ?", (owner,)).fetchone()[0]
    return bool(published + int(evictions) + consumers_registered(cur) + others)


def producer_replicas(cur: Sql) -> list[dict[str, Any]]:
    """One dict per producer replica rank that ever registered, by rank: rank, state,
    owner, host, pid, proc, heartbeats, hb_wall, made (windows published by that rank),
    since_wall and made_since (its current incarnation's start and windows)."""
    keys = ("rank", "state", "owner", "host", "pid", "proc", "heartbeats", "hb_wall", "made",
            "since_wall", "made_since")  # fmt: skip
    rows = cur.execute(
        "SELECT rank, state, owner, host, pid, proc, hb_seq, hb_wall, made, since_wall, "
        "made_since FROM producers ORDER BY rank"
    ).fetchall()
    return [dict(zip(keys, row, strict=True)) for row in rows]


def consumer_states(cur: Sql) -> dict[str, str]:
    """{consumer id: state} of every consumer that joined."""
    return {str(k): str(v) for k, v in cur.execute("SELECT id, state FROM consumers").fetchall()}


def counters(cur: Sql, keys: Iterable[str] | None = None) -> dict[str, int]:
    """The run's counters (schema.COUNTERS), all or those named."""
    rows = cur.execute("SELECT key, value FROM counters").fetchall()
    wanted = None if keys is None else set(keys)
    return {str(k): int(v) for k, v in rows if wanted is None or k in wanted}


AUDIT_COUNTERS = (
    "recaptures", "evictions", "corrupt", "detaches", "reclaims", "next_window", "hw_windows",
    "claims_reclaimed",
)  # fmt: skip


def audit(db: Database) -> dict[str, Any]:
    """What a run that stopped must satisfy, on either database (the chaos harness's
    final check): `integrity_check` is the database's own check ("ok" on PostgreSQL,
    which keeps its files consistent), then that every lease names a ready window of
    its generation (what a torn write would break); leases left, failed windows,
    consumer states, and the counters that say what happened."""
    integrity = db.integrity_check()
    torn = db.execute(
        "SELECT COUNT(*) FROM leases l LEFT JOIN windows w ON w.window=l.window "
        f"AND w.generation=l.generation AND w.state IN {sql_in(states.READABLE)} "
        "WHERE w.window IS NULL"
    ).fetchone()[0]
    if integrity == "ok" and torn:
        integrity = f"{torn} leases name no ready window"
    q = "SELECT COUNT(*) FROM windows WHERE state=?"
    failed = db.execute(q, (W.FAILED.value,)).fetchone()[0]
    return {
        "integrity_check": integrity,
        "leases_left": int(db.execute("SELECT COUNT(*) FROM leases").fetchone()[0]),
        "consumers": consumer_states(db),
        "failed_windows": int(failed),
        "counters": counters(db, AUDIT_COUNTERS),
    }


# ---- verifier versions (`produce --follow-verifier`; fanout.checkpoints.versions) ----


def verifier_versions(cur: Sql) -> dict[int, int]:
    """{verifier version: readable windows captured with it}: the versions live on disk
    ({} for a run whose verifier does not change)."""
    rows = cur.execute(
        f"SELECT verifier_version, COUNT(*) FROM windows WHERE verifier_version IS NOT NULL "
        f"AND state IN {sql_in(states.READABLE)} GROUP BY verifier_version"
    ).fetchall()
    return {int(v): int(n) for v, n in rows}


def newest_verifier_version(cur: Sql) -> int | None:
    """The verifier version the run captures with now: the one the furthest window that
    records a version was captured with (None: none records one). The furthest window,
    not the largest number: a producer follows `current` back too, after a rollback."""
    row = cur.execute(
        "SELECT verifier_version FROM windows WHERE verifier_version IS NOT NULL "
        "ORDER BY window DESC LIMIT 1"
    ).fetchone()
    return None if row is None else int(row[0])


def window_verifier_version(cur: Sql, window: int) -> int | None:
    """The verifier version window `window` was captured with (None: none recorded, or
    no row)."""
    row = cur.execute("SELECT verifier_version FROM windows WHERE window=?", (window,)).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def lag_skipped(cur: Sql) -> dict[str, int]:
    """{consumer id: windows it acked without training, too many versions old}."""
    rows = cur.execute("SELECT id, lag_skipped FROM consumers").fetchall()
    return {str(c): int(n) for c, n in rows}
