"""What a wait waits for: who holds the producer back, what a trainer's window waits on.

    from fanout.coord.waits import consumer_wait, producer_block, stream_end
    with db.write() as cur:
        why = consumer_wait(cur, config, "b8:dp0", window=14)
        why.text     # "the producer is blocked at K=4 by short:dp0 (stopped 40 s ago, ...)"
        why.counts   # False: another consumer holds it, not counted toward the timeout

Pure reads over the coordinator's tables (fanout.coord.schema), run inside the
caller's transaction; fanout.coord.coordinator asks them while a consumer waits
(`acquire`) and while the producer is blocked at K (`blocked_by`), and `fanout
status` shows the same words. One rule for "who holds the producer": the counted
consumers (fanout.coord.retention.COUNTED_STATES) whose cursor has not passed the
oldest window still on disk, plus the expected consumers that have not joined.

A wait *counts* toward a trainer's --acquire-timeout-s only when nothing but the
producer can end it (the producer is gone, stopped, lost, or slow): a wait for
another consumer (one that holds the producer at K, or has not joined yet) does
not, so one trainer never exits because of another (issue #27); nor does a wait
for the trainer itself (its prefetch waits while the window it trains on holds the
producer at K: its own ack ends it, issue #47).
"""

from __future__ import annotations

from dataclasses import dataclass

from fanout.coord import retention, states
from fanout.coord.database import Statement, wall
from fanout.coord.retention import RunConfig
from fanout.coord.schema import Sql
from fanout.coord.states import RoleState, W

STREAM_END = "stream_end"  # meta key: windows [0, N) are the stream (recorded once, complete)
BLOCKED_SINCE = "blocked_since"  # meta key: wall clock since the producer is blocked at K
# The kind of change an ack's commit announces (Database.write's `notify`): a trainer
# waiting for its window and a producer waiting for room skip it (what an ack frees is
# announced by the eviction's own commit), else every ack would wake every waiter.
ACK = "ack"


@dataclass(frozen=True, slots=True)
class Holding:
    """A consumer that holds the producer back: it still needs the oldest live window."""

    consumer_id: str
    state: str  # active, lost or stopped
    cursor: int
    since_wall: float  # its last heartbeat (a stopped one's: when it stopped)

    def describe(self, now: float) -> str:
        age = max(0.0, now - self.since_wall)
        when = {
            RoleState.ACTIVE: "heartbeat",
            RoleState.STOPPED: "stopped",
            RoleState.LOST: "last heartbeat",
        }.get(RoleState(self.state), self.state)
        return f"{self.consumer_id} ({self.state}, cursor {self.cursor}, {when} {age:.0f} s ago)"


@dataclass(frozen=True, slots=True)
class WaitState:
    """Why a consumer's window is not ready: words for people, and whether the wait
    counts toward its --acquire-timeout-s."""

    text: str
    counts: bool


def stream_end(cur: Sql) -> int | None:
    """Windows in the stream, once its end is recorded (`end_if_complete`: every window
    before it published, by whichever replica); None while the stream is open."""
    end = cur.execute("SELECT value FROM meta WHERE key=?", (STREAM_END,)).fetchone()
    return None if end is None or end[0] in (None, "") else int(end[0])


def end_if_complete(cur: Sql, end: int) -> bool:
    """Record that the stream ends at `end` windows (its length, --max-windows, or any
    budget: what a producer replica that ends it by design knows) once every window
    before it has been published, unless an end is recorded already: so the end is
    recorded once, by the replica that publishes the last window (or finishes after
    it). True if this call recorded it."""
    if stream_end(cur) is not None:
        return False
    frontier = int(cur.execute("SELECT value FROM counters WHERE key='next_window'").fetchone()[0])
    if frontier < end:
        return False
    never = cur.execute(  # claimed or queued but never published (failed ones never will be)
        "SELECT 1 FROM windows WHERE window < ? AND captures = 0 AND state <> ? LIMIT 1",
        (end, W.FAILED.value),
    ).fetchone()
    if never is not None:
        return False
    cur.execute("INSERT INTO meta(key, value) VALUES (?, ?)", (STREAM_END, str(end)))
    return True


def end_if_complete_statement(
    end: int, window: int, guard: str, guard_params: tuple[object, ...]
) -> Statement:
    """`end_if_complete` as one statement of a batch that publishes `window` after it
    (so `window` counts as published), applied only where SQL condition `guard` holds;
    its row count says whether it recorded the end."""
    return (
        "INSERT INTO meta(key, value) SELECT ?, ? WHERE NOT EXISTS (SELECT 1 FROM meta "
        "WHERE key=? AND COALESCE(value, '') <> '') AND (SELECT value FROM counters WHERE "
        "key='next_window') >= ? AND NOT EXISTS (SELECT 1 FROM windows WHERE window < ? "
        f"AND captures = 0 AND state <> ? AND window <> ?) AND ({guard})",
        (STREAM_END, str(end), STREAM_END, end, end, W.FAILED.value, window, *guard_params),
    )


def reopen_stream(cur: Sql) -> None:
    """A producer starts a new session on the run (no other replica is active): the
    recorded end is forgotten, so a restart with a larger budget continues the stream."""
    cur.execute("DELETE FROM meta WHERE key IN (?, ?)", (STREAM_END, BLOCKED_SINCE))


def producer_state(cur: Sql) -> tuple[RoleState | None, float, int]:
    """The producer side as one state: active if any replica is, else lost if any is,
    else finished (None: no replica ever registered); the newest heartbeat among the
    replicas in that state; how many replicas are registered."""
    rows = [
        (RoleState(s), float(h)) for s, h in cur.execute("SELECT state, hb_wall FROM producers")
    ]
    for state in (RoleState.ACTIVE, RoleState.LOST, RoleState.FINISHED):
        walls = [h for s, h in rows if s == state]
        if walls:
            return state, max(walls), len(rows)
    return None, 0.0, len(rows)


def clear_blocked_unless_others(cur: Sql, rank: int) -> None:
    """At replica `rank`'s exit: forget the blocked-at-K stamp unless another replica is
    active (it is still the one blocked, or not)."""
    others = cur.execute(
        "SELECT COUNT(*) FROM producers WHERE state=? AND rank<>?", (RoleState.ACTIVE.value, rank)
    ).fetchone()[0]
    if not others:
        record_blocked(cur, False)


def record_blocked(cur: Sql, blocked: bool) -> None:
    """The producer's blocked-at-K stamp (`fanout status` shows since when)."""
    for statement in record_blocked_statements(blocked):
        cur.execute(*statement)


def record_blocked_statements(blocked: bool) -> list[Statement]:
    """`record_blocked`'s statements, for a batch."""
    clear: Statement = ("DELETE FROM meta WHERE key=?", (BLOCKED_SINCE,))
    if not blocked:
        return [clear]
    return [clear, ("INSERT INTO meta(key, value) VALUES (?, ?)", (BLOCKED_SINCE, repr(wall())))]


def blocked_since(cur: Sql) -> float | None:
    row = cur.execute("SELECT value FROM meta WHERE key=?", (BLOCKED_SINCE,)).fetchone()
    return None if row is None else float(row[0])


def holders(cur: Sql, exclude: str | None = None) -> list[Holding]:
    """Counted consumers (other than `exclude`) that still need the oldest window on
    disk: while they do, it cannot be evicted, and the producer stays at K."""
    oldest = cur.execute(
        f"SELECT MIN(window) FROM windows WHERE state IN {states.sql_in(states.ON_DISK)}"
    ).fetchone()[0]
    if oldest is None:
        return []
    rows = cur.execute(
        f"SELECT id, state, cursor, hb_wall FROM consumers WHERE state IN "
        f"{retention.COUNTED_STATES} AND cursor <= ? ORDER BY cursor, id",
        (int(oldest),),
    ).fetchall()
    return [Holding(str(i), str(s), int(c), float(h)) for i, s, c, h in rows if i != exclude]


def missing_consumers(cur: Sql, expected: int) -> int:
    """Expected consumers (--expected-consumers) that have not registered yet."""
    n = int(cur.execute("SELECT COUNT(*) FROM consumers").fetchone()[0])
    return max(0, expected - n)


def is_blocked(cur: Sql, cfg: RunConfig) -> bool:
    """Is the producer at K with no room for anything (not even the slowest's window)?"""
    return not retention.has_capacity(cur, cfg.max_live_windows)


def block_text(cur: Sql, cfg: RunConfig, exclude: str | None = None) -> tuple[str, bool]:
    """("by X (stopped 40 s ago), …", whether someone other than `exclude` holds it)."""
    now = wall()
    held = holders(cur, exclude)
    missing = missing_consumers(cur, cfg.expected_consumers)
    parts = [h.describe(now) for h in held]
    if missing:
        joined = cfg.expected_consumers - missing
        parts.append(
            f"waiting for {missing} of {cfg.expected_consumers} expected consumers "
            f"({joined} joined; nothing is evicted until --expected-consumers have registered)"
        )
    return ("by " + "; ".join(parts)) if parts else "", bool(parts)


def ways_out(held: list[Holding], run_dir: str) -> str:
    """What an operator can do about consumers that hold the producer back."""
    idle = [h.consumer_id for h in held if h.state != RoleState.ACTIVE]
    if not idle:
        return ""
    name = idle[0]
    return (
        f"ways out: resume it (fanout train ... --consumer-id {name.rpartition(':dp')[0]} "
        f"--resume), release it (fanout detach --run-dir {run_dir} --consumer-id {name}), "
        "or a lag policy that does not wait for it (--lag-policy recapture or detach)"
    )


def producer_block(cur: Sql, cfg: RunConfig, run_dir: str) -> str:
    """The producer's own line while blocked at K: who holds it and the ways out."""
    text, _ = block_text(cur, cfg)
    out = ways_out(holders(cur), run_dir)
    return (
        f"blocked at K={cfg.max_live_windows} live windows {text or '(no consumer holds it)'}"
        + (f"; {out}" if out else "")
    )


def consumer_wait(cur: Sql, cfg: RunConfig, consumer_id: str, window: int) -> WaitState:
    """Why `window` is not ready for `consumer_id`: what the producer (its replicas) is
    doing."""
    state, hb_wall, n = producer_state(cur)
    frontier = int(cur.execute("SELECT value FROM counters WHERE key='next_window'").fetchone()[0])
    if state is None:
        return WaitState("no producer has registered with the run yet", True)
    who = "the producer" if n == 1 else f"every producer replica ({n})"
    if state == RoleState.LOST:
        return WaitState(
            f"{who} is lost (no heartbeat for ttl_s = {cfg.ttl_s:g} s; killed or cut "
            "off): restart `fanout produce` with the same flags to continue the stream",
            True,
        )
    if state == RoleState.FINISHED:
        end = stream_end(cur)
        if end is not None:  # a window below the end: evicted and queued again
            return WaitState(
                f"the producer finished the stream at window {end}, but window {window} "
                "must be captured again: start `fanout produce` with the same flags",
                True,
            )
        ago = max(0.0, wall() - hb_wall)
        return WaitState(
            f"{who} was stopped (a signal, {ago:.0f} s ago) after {frontier} windows; "
            "the stream is open: restart `fanout produce` with the same flags to continue",
            True,
        )
    w = cur.execute("SELECT state FROM windows WHERE window=?", (window,)).fetchone()
    if w is not None and w[0] == W.CAPTURING:
        return WaitState(f"the producer is capturing window {window}", True)
    if is_blocked(cur, cfg):
        k = cfg.max_live_windows
        text, others = block_text(cur, cfg, exclude=consumer_id)
        if others:
            return WaitState(f"the producer is blocked at K={k} live windows {text}", False)
        mine = [h for h in holders(cur) if h.consumer_id == consumer_id]
        if mine:  # its own held window: it ends the wait itself when it acks (issue #47)
            return WaitState(
                f"the producer is blocked at K={k} live windows and waits for this trainer "
                f"to finish window {mine[0].cursor}",
                False,
            )
        return WaitState(f"the producer is blocked at K={k} live windows", True)
    ahead = "queued for capture" if w is None or w[0] == W.QUEUED else str(w[0])
    return WaitState(f"the producer is capturing (window {window} {ahead})", True)
