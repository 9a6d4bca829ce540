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
  registered, every *counted* consumer (active, lost or stopped; not finished or
  detached) has a cursor past it, and no lease holds it;
- capacity: at most K windows are live (states.LIVE); one more
  only for the window the slowest counted consumer waits on, else K ready
  windows that it also needs would deadlock it;
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
from fanout.coord.schema import Sql
from fanout.coord.states import W

# consumers whose cursors hold windows back: running, lost, or stopped cleanly mid-stream
COUNTED_STATES = "('active','lost','stopped')"
EVICTED_ROWS_KEPT = 64  # older evicted rows are deleted, so metadata stays flat forever
_FAR = 1 << 62


class RunOptions(BaseModel):
    """How a run shares its windows, as a producer's flags set it (`fanout produce`
    inherits these fields). RunConfig adds what the producer works out itself."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_live_windows: int = Field(
        4,
        ge=2,
        description="K: most window files that exist at once (ready, capturing or evicting).",
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

    total_windows: int | None = Field(
        None, ge=1, description="Windows in the run; None = endless stream."
    )


Doomed = list[tuple[int, "str | None"]]  # (window, file name) marked 'evicting'


def _mark(cur: Sql, sql: str, args: tuple[object, ...]) -> Doomed:
    rows = [(int(w), n) for w, n in cur.execute(sql, args).fetchall()]
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


def mark_evictable(cur: Sql, expected_consumers: int, recover: bool = False) -> Doomed:
    """Mark every evictable ready window 'evicting'; with `recover`, also return rows a
    crashed process left 'evicting' (their files may still exist)."""
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
    )


def finish_evicted(cur: Sql, windows: list[int]) -> int:
    """Mark 'evicting' rows evicted (their files are gone) and compact old evicted rows."""
    n = states.move_windows(cur, W.EVICTING, W.EVICTED, windows, also="path=NULL")
    if windows:
        states.compact_evicted(cur, max(windows) - EVICTED_ROWS_KEPT)
    cur.execute("UPDATE counters SET value=value+? WHERE key='evictions'", (n,))
    return n


def has_capacity(cur: Sql, max_live_windows: int, extra: bool = True) -> bool:
    """May the producer claim one more window now? `extra`: count the K+1st slot that
    only the window the slowest consumer waits for may use."""
    live = cur.execute(
        f"SELECT COUNT(*) FROM windows WHERE state IN {states.sql_in(states.LIVE)}"
    ).fetchone()[0]
    if live != max_live_windows or not extra:
        return bool(live < max_live_windows)
    low, _ = cursor_bounds(cur)
    wanted = cur.execute(
        "SELECT 1 FROM windows WHERE state=? AND demand=1 AND window=?", (W.QUEUED.value, low)
    ).fetchone()
    return wanted is not None


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
    row = cur.execute(
        f"SELECT 1 FROM windows WHERE window=? AND state IN {states.sql_in(states.WANTED_FILE)}",
        (lead,),
    ).fetchone()
    return row is not None


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
    cur.execute("DELETE FROM leases WHERE consumer=?", (cid,))
    cur.execute(
        "UPDATE consumers SET state='detached', token=?, note=? WHERE id=?",
        (new_token, f"by the detach lag policy at cursor {cursor} (leader at {lead})", cid),
    )
    cur.execute("UPDATE counters SET value=value+1 WHERE key='detaches'")
    return cid, cursor, int(lead)
