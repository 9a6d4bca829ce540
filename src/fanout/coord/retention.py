"""Retention: which window files may exist, and which must go (RunConfig, eviction, lag policy).

    from fanout.coord.retention import mark_evictable, has_capacity
    with db.write() as cur:
        doomed = mark_evictable(cur, expected_consumers=2)   # [(window, file name)]

Pure rules over the coordinator's tables, each run inside the caller's write
transaction; fanout.coord.eviction decides when to apply them and does the file
side (unlink first, then mark the row evicted). Window states and their moves are
fanout.coord.states'.

Rules:
- a ready window is evictable when at least `expected_consumers` consumers have
  registered, every *counted* consumer (states.COUNTED: active, lost or stopped; not
  finished or detached) has a cursor past it, and no lease holds it;
- capacity: at most K windows are live (states.LIVE), whatever claims them (every
  producer replica together). The last of the K slots is reserved for the slowest
  counted consumer's next *needed* window: the first window at or after its cursor
  that is not live (new, queued again on demand after an eviction, or a released
  claim). The others may fill only K − 1, else K windows that the slowest does not
  need yet could deadlock it; and the slot goes to the window after the one it is
  reading, so a trainer that prefetches overlaps with capture even at K = 2 (issue
  #47: a slot kept for the cursor window it already held stayed empty, and the
  producer waited for the trainer that waited for it). With a step spanning at most K
  windows (fanout.store.streaminfo.windows_per_step) the slowest consumer always
  gets its step's windows, K = 1 included (capture and training then take turns).
  When its cursor moves back (a restart from an older checkpoint, a late joiner) while
  K windows it needs later are live, the highest of them is evicted to give the slot
  back (`yield_reserved`; captured again when wanted);
- `recapture`: when blocked, an unleased ready window that the leading consumer
  has passed (so only consumers behind it need it) is evicted to make room: the
  one whose next reader is furthest behind it, never a window some consumer reads
  next while the leader has its own next window (see `recapture_victim`);
- `detach`: when blocked long enough, the counted consumer with the lowest cursor
  behind the leader is detached (fenced, leases dropped).
"""

from __future__ import annotations

import bisect
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fanout.coord import states
from fanout.coord.database import Statement
from fanout.coord.schema import Sql
from fanout.coord.states import RoleState, W
from fanout.flags import limit_flag

# consumers whose cursors hold windows back (states.COUNTED), as an SQL list
COUNTED_STATES = states.sql_in(states.COUNTED)
EVICTED_ROWS_KEPT = 64  # older evicted rows are deleted, so metadata stays flat forever
_FAR = 1 << 62


class RunOptions(BaseModel):
    """How a run shares its windows, as a producer's flags set it (`fanout produce`
    inherits these fields). RunConfig adds what the producer works out itself."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_live_windows: int = Field(
        4,
        ge=1,
        description="K: most window files that exist at once (ready, capturing or evicting), "
        "across every producer replica; the last of the K is kept for the slowest "
        "consumer's next needed window. K >= 2 overlaps capture with training; K = 1 "
        "works, capture and training taking turns. A trainer whose step spans more "
        "windows than K is refused at start.",
    )
    lag_policy: Literal["hold", "recapture", "detach"] = Field(
        "hold",
        description="What to do about a consumer that holds the producer at K: hold "
        "(producer waits), recapture (evict what only laggards need; recapture it on "
        "demand), detach (after detach_after_s, drop the slowest consumer).",
    )
    expected_consumers: int = Field(
        1, ge=1, description="Nothing is evicted until this many consumers have registered."
    )
    ttl_s: float = Field(
        30.0, gt=0, description="Seconds without a heartbeat before a process is lost."
    )
    detach_after_s: float | None = Field(
        None, gt=0, description="Seconds the producer may be blocked before detach; None = ttl_s."
    )
    max_attempts: int = Field(
        3, ge=1, description="Failed captures of one window before it is marked failed."
    )
    busy_timeout_s: float = Field(
        5.0, ge=5.0, description="SQLite busy timeout per statement (seconds)."
    )

    @property
    def detach_after(self) -> float:
        return self.ttl_s if self.detach_after_s is None else self.detach_after_s


class RunConfig(RunOptions):
    """How a run shares its windows. Stored in the database at create time."""

    total_windows: int | None = limit_flag("Windows in the run; None = endless stream.")


Doomed = list[tuple[int, "str | None"]]  # (window, file name) marked 'evicting'


def _mark(cur: Sql, sql: str, args: tuple[object, ...], dry: bool = False) -> Doomed:
    """Mark the windows `sql` selects 'evicting'; `dry`: only say which (a read)."""
    rows = [(int(w), n) for w, n in cur.execute(sql, args).fetchall()]
    if not dry:
        states.move_windows(cur, states.EVICTABLE, W.EVICTING, [w for w, _ in rows])
    return rows


def enough_registered(cur: Sql, expected_consumers: int) -> bool:
    n = cur.execute("SELECT COUNT(*) FROM consumers").fetchone()[0]
    return bool(n >= expected_consumers)


def cursor_bounds(cur: Sql) -> tuple[int | None, int | None]:
    """(lowest, highest) cursor among counted consumers; (None, None) if there are none."""
    lo, hi = cur.execute(
        f"SELECT MIN(cursor), MAX(cursor) FROM consumers WHERE state IN {COUNTED_STATES}"
    ).fetchone()
    return lo, hi


def mark_evictable(
    cur: Sql, expected_consumers: int, recover: bool = False, dry: bool = False
) -> Doomed:
    """Mark every evictable ready window 'evicting'; with `recover`, also return rows a
    crashed process left 'evicting' (their files may still exist). `dry`: mark
    nothing, only return what would be (a read: a waiting producer asks it first)."""
    stale: Doomed = []
    if recover:
        rows = cur.execute(
            "SELECT window, name FROM windows WHERE state=?", (W.EVICTING.value,)
        ).fetchall()
        stale = [(int(w), n) for w, n in rows]
    # One query for both conditions: this runs on every ack.
    n, low = cur.execute(
        f"SELECT COUNT(*), MIN(CASE WHEN state IN {COUNTED_STATES} THEN cursor END) FROM consumers"
    ).fetchone()
    if n < expected_consumers:
        return stale
    return stale + _mark(
        cur,
        f"SELECT window, name FROM windows w WHERE state IN {states.sql_in(states.EVICTABLE)} "
        "AND window < ? AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.window=w.window) "
        "ORDER BY window",
        (_FAR if low is None else low,),
        dry,
    )


def mark_evictable_statement(
    expected_consumers: int, lease: int, guard: str, guard_params: tuple[object, ...]
) -> Statement:
    """`mark_evictable` (without `recover`) as one statement of a batch
    (fanout.coord.database.Database.batch) that also drops lease `lease`: the same
    rule, with that lease counted as gone, applied only where SQL condition `guard`
    holds (the batch's own check: the lease is held). It returns (window, name) of
    each window it marked, in no particular order."""
    where = (
        "window < COALESCE((SELECT MIN(cursor) FROM consumers WHERE state IN "
        f"{COUNTED_STATES}), ?) AND (SELECT COUNT(*) FROM consumers) >= ? AND NOT EXISTS "
        "(SELECT 1 FROM leases l WHERE l.window=windows.window AND l.token<>?) "
        f"AND ({guard})"
    )
    return states.move_statement(
        states.EVICTABLE, W.EVICTING, where, (_FAR, expected_consumers, lease, *guard_params),
        returning="window, name",
    )  # fmt: skip


def acked_by_all(cur: Sql, expected_consumers: int) -> int:
    """Every window below the returned one is acknowledged by every counted consumer (its
    cursor is past it): what a followed source's chunks below it may go by
    (fanout.produce.follow). Unlike eviction it never counts a window that `recapture`
    evicted for a laggard as done; 0 until `expected_consumers` registered, and while
    no consumer is counted (a later one may still need everything)."""
    n, low = cur.execute(
        f"SELECT COUNT(*), MIN(CASE WHEN state IN {COUNTED_STATES} THEN cursor END) FROM consumers"
    ).fetchone()
    return 0 if n < expected_consumers or low is None else int(low)


def finish_evicted_statements(windows: list[int]) -> list[Statement]:
    """`finish_evicted` as statements for one batch (none needs another's result): the
    counter first, by the rows about to move, then the move, then compaction."""
    if not windows:
        return []
    marks = ",".join("?" * len(windows))
    count = (
        f"SELECT COUNT(*) FROM windows WHERE state IN {states.sql_in([W.EVICTING])} "
        f"AND window IN ({marks})"
    )
    return [
        (f"UPDATE counters SET value=value+({count}) WHERE key='evictions'", tuple(windows)),
        states.move_statement(
            W.EVICTING, W.EVICTED, f"window IN ({marks})", windows, also="path=NULL"
        ),
        states.compact_statement(max(windows) - EVICTED_ROWS_KEPT),
    ]


def finish_evicted(cur: Sql, windows: list[int]) -> int:
    """Mark 'evicting' rows evicted (their files are gone) and compact old evicted rows."""
    n = states.move_windows(cur, W.EVICTING, W.EVICTED, windows, also="path=NULL")
    if windows:
        states.compact_evicted(cur, max(windows) - EVICTED_ROWS_KEPT)
    cur.execute("UPDATE counters SET value=value+? WHERE key='evictions'", (n,))
    return n


def live_windows(cur: Sql) -> int:
    """Windows whose file may exist (states.LIVE): what K bounds."""
    q = f"SELECT COUNT(*) FROM windows WHERE state IN {states.sql_in(states.LIVE)}"
    return int(cur.execute(q).fetchone()[0])


def reserved_window(cur: Sql) -> int | None:
    """The window the last of the K slots is for: the slowest counted consumer's next
    needed window, i.e. the first window at or after its cursor that is not live, when
    a producer may claim it now — queued (on demand after an eviction, or a released
    claim) or the next new window (`next_window`; the claim checks the stream's end).
    None when there is no counted consumer, or that window is evicted and not yet
    wanted again (the consumer demands it when it gets there), or failed."""
    low, _ = cursor_bounds(cur)
    if low is None:
        return None
    live = {s.value for s in states.LIVE}
    w = int(low)
    # Rows at or after the cursor: the live ones (at most K), then what the consumers
    # passed to queue on demand or the recapture policy evicted (compaction bounds it).
    rows = cur.execute(
        "SELECT window, state FROM windows WHERE window >= ? ORDER BY window", (w,)
    ).fetchall()
    for window, state in rows:
        if int(window) != w:  # no row: an evicted row compaction deleted (not wanted yet)
            return None
        if state not in live:
            return w if state == W.QUEUED else None
        w += 1
    frontier = int(cur.execute("SELECT value FROM counters WHERE key='next_window'").fetchone()[0])
    return w if w == frontier else None


def claimable(cur: Sql, max_live_windows: int) -> Literal["any", "reserved", "none"]:
    """What a producer replica may claim now: any window while fewer than K − 1 are
    live; with K − 1 live (at K = 1: none), only the reserved one (`reserved_window`);
    nothing at K."""
    live = live_windows(cur)
    if live < max_live_windows - 1:
        return "any"
    if live < max_live_windows and reserved_window(cur) is not None:
        return "reserved"
    return "none"


def yield_reserved(cur: Sql, max_live_windows: int, dry: bool = False) -> Doomed:
    """At K, give the last slot back to the slowest consumer's cursor window: when that
    window is queued (it asked for it: a consumer restarted from an older checkpoint,
    a late joiner, a window evicted before it read it) and not live while K windows
    are, mark the highest unleased ready window above its cursor for eviction (it is
    captured again when wanted, counted as a recapture); [] otherwise. Why: the last
    slot takes the slowest consumer's next needed window (`reserved_window`), so K
    windows it needs *later* can be live when its cursor moves back; without this, the
    window it needs now would wait for a slot nothing frees. `dry`: mark nothing."""
    if live_windows(cur) < max_live_windows:
        return []
    low, _ = cursor_bounds(cur)
    if low is None:
        return []
    row = cur.execute("SELECT state FROM windows WHERE window=?", (low,)).fetchone()
    if row is None or row[0] != W.QUEUED:
        return []
    return _mark(
        cur,
        f"SELECT window, name FROM windows w WHERE state IN {states.sql_in(states.EVICTABLE)} "
        "AND window > ? AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.window=w.window) "
        "ORDER BY window DESC LIMIT 1",
        (low,),
        dry,
    )


def has_capacity(cur: Sql, max_live_windows: int, reserved: bool = True) -> bool:
    """May a producer replica claim a window now? `reserved`: the reserved slot counts
    too (only for the slowest consumer's window)."""
    room = claimable(cur, max_live_windows)
    return room == "any" or (reserved and room == "reserved")


def recapture_victim(cur: Sql) -> Doomed:
    """Mark one unleased ready window the leader has passed, for recapture; [] if none.

    Which one: the window whose next reader is furthest from it, i.e. the largest
    `w − (highest counted cursor ≤ w)`; ties go to the oldest window, so a
    near-leader's next windows outlast a laggard's. Consumers move at similar speeds,
    so this approximates Belady's rule (evict what is needed furthest in the future).

    A window at some consumer's cursor (distance 0) is what that consumer reads
    next, typically a window just recaptured for a catching-up laggard that has not
    leased it yet. Evicting it makes the laggard demand it again, and that churn
    (one chaos run: 257 recaptures for ~50 windows) is what the rule avoids: such a
    window goes only when nothing else can and the leader has no window of its own
    to read (its cursor's window is not ready or being captured), so a paused
    laggard can never hold the leader at K, and a live one never loses its next
    window to the producer merely running ahead.
    """
    _, lead = cursor_bounds(cur)
    if lead is None:
        return []
    windows = [
        int(w)
        for (w,) in cur.execute(
            f"SELECT window FROM windows w WHERE state IN {states.sql_in(states.EVICTABLE)} "
            "AND window < ? AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.window=w.window)",
            (lead,),
        )
    ]
    if not windows:
        return []
    cursors = sorted(
        int(c)
        for (c,) in cur.execute(f"SELECT cursor FROM consumers WHERE state IN {COUNTED_STATES}")
    )

    def distance(w: int) -> int:
        behind = bisect.bisect_right(cursors, w)  # cursors[:behind] are <= w
        return w - cursors[behind - 1] if behind else _FAR

    victim = max(windows, key=lambda w: (distance(w), -w))
    if distance(victim) == 0 and _leader_has_work(cur, lead):
        return []
    return _mark(cur, "SELECT window, name FROM windows WHERE window=?", (victim,))


def _leader_has_work(cur: Sql, lead: int) -> bool:
    """Is the leading consumer's next window ready or being captured?"""
    return file_wanted(cur, lead)


def file_wanted(cur: Sql, window: int, generation: int | None = None) -> bool:
    """Is window `window`'s file (of `generation`, or of its current one) wanted: ready
    or being captured (states.WANTED_FILE)? The sweeper keeps a file only then, and the
    recapture policy asks it of the leader's next window."""
    gen = "" if generation is None else " AND generation=?"
    row = cur.execute(
        f"SELECT 1 FROM windows WHERE window=?{gen} AND state IN "
        f"{states.sql_in(states.WANTED_FILE)}",
        (window,) if generation is None else (window, generation),
    ).fetchone()
    return row is not None


def detach(cur: Sql, consumer_id: str, new_token: int, note: str) -> None:
    """Detach a consumer: its leases dropped, state 'detached' under a new token (it is
    fenced off: Detached on its next call), the note saying why, the `detaches`
    counter. Its cursor no longer holds windows back. The one way any detach is made
    (the detach lag policy, `fanout detach`)."""
    cur.execute("DELETE FROM leases WHERE consumer=?", (consumer_id,))
    cur.execute(
        "UPDATE consumers SET state=?, token=?, note=? WHERE id=?",
        (RoleState.DETACHED.value, new_token, note, consumer_id),
    )
    cur.execute("UPDATE counters SET value=value+1 WHERE key='detaches'")


def detach_laggard(cur: Sql, new_token: int) -> tuple[str, int, int] | None:
    """Detach the counted consumer with the lowest cursor behind the leader.

    Returns (consumer id, its cursor, leader's cursor), or None when every counted
    consumer is at the same cursor (then nobody is holding the others back).
    """
    _, lead = cursor_bounds(cur)
    if lead is None:
        return None
    row = cur.execute(
        f"SELECT id, cursor FROM consumers WHERE state IN {COUNTED_STATES} AND cursor < ? "
        "ORDER BY cursor, id LIMIT 1",
        (lead,),
    ).fetchone()
    if row is None:
        return None
    cid, cursor = str(row[0]), int(row[1])
    detach(cur, cid, new_token, f"by the detach lag policy at cursor {cursor} (leader at {lead})")
    return cid, cursor, int(lead)
