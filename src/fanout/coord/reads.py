"""Read-only questions about a run, asked of the coordinator's tables.

    from fanout.coord.reads import ready_windows
    n, nbytes = ready_windows(coord.conn)          # or coord.ready_windows()

The SQL that producers, trainers, `fanout status`, bench reports and the chaos
harness ask of a run lives here, behind names, so that only fanout.coord speaks
SQL. Each function takes a connection or a cursor inside a transaction; the
Coordinator's methods of the same names call them on its own connection.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fanout.coord import states
from fanout.coord.schema import Database, Sql
from fanout.coord.states import RoleState, W, sql_in


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
