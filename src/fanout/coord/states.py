"""A window's life (its states, the moves between them, the named sets) and the roles' states.

    from fanout.coord import states
    from fanout.coord.states import W
    with db.write() as cur:
        states.move(cur, W.CAPTURING, W.READY, "window=?", (7,))   # publish window 7
        states.move(cur, W.READY, W.CAPTURING, "window=?", (7,))   # IllegalTransition

Every change of `windows.state` in fanout goes through `move` (and a new row
through `insert_queued`, a deleted one through `compact_evicted`); tests check that
no other statement writes the column. `move` refuses a move that is not in
TRANSITIONS before it touches the database, on either database. The SQL CHECK of
fanout.coord.schema, `fanout status`, the chaos checks and bench read the states
and the named sets from here.

    new ─► queued ─► capturing ─► ready ─► evicting ─► evicted ─► (row deleted)
             ▲          │    └─► failed   │         │          │
             └──────────┴─────────────────┴─────────┴──────────┘
               a retry; a corrupt file; wanted again after eviction (recapture)

A window that failed `max_attempts` captures stays failed: the consumers that
need it get WindowGone.

The processes that hold roles (consumers, producer replicas) have states too
(`RoleState`): one enum, with the named sets each table allows and the consumers
whose cursors hold windows back (`COUNTED`). Their writes carry these values as
parameters; no module spells a role state as a literal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from enum import StrEnum
from typing import Concatenate, ParamSpec

from fanout.coord.database import Sql, Statement, wall
from fanout.errors import IllegalTransition

P = ParamSpec("P")


class W(StrEnum):
    """The state of one window, as `windows.state` stores it."""

    QUEUED = "queued"  # to be captured: new, wanted again, or a retry
    CAPTURING = "capturing"  # claimed by the producer (claim_token); its file is being written
    READY = "ready"  # published: its file is final, consumers may lease it
    EVICTING = "evicting"  # every reader passed it; its file is being removed
    EVICTED = "evicted"  # its file is gone; wanting it again queues a recapture
    FAILED = "failed"  # max_attempts captures failed; never served


# (from, to): why the coordinator makes that move. The one list of legal moves.
TRANSITIONS: dict[tuple[W, W], str] = {
    (W.QUEUED, W.CAPTURING): "the producer claims it (new generation, claim token)",
    (W.CAPTURING, W.READY): "the producer publishes its final-named file",
    (W.CAPTURING, W.QUEUED): "a capture failed with attempts left, or its producer is gone",
    (W.CAPTURING, W.FAILED): "its max_attempts-th capture failed",
    (W.READY, W.EVICTING): "every counted consumer passed it, or the recapture policy chose it",
    (W.READY, W.QUEUED): "a consumer found its file corrupt (quarantined, recaptured)",
    (W.EVICTING, W.EVICTED): "its file was removed",
    (W.EVICTING, W.QUEUED): "a consumer wants it before its file is gone (recapture)",
    (W.EVICTED, W.QUEUED): "a consumer wants it again (recapture on demand)",
}

# The named sets. Each says what it is for; nothing else spells a set of states.
LIVE = (W.READY, W.CAPTURING, W.EVICTING)  # a file may exist: counts toward K (max_live_windows)
READABLE = (W.READY,)  # a consumer may lease it
EVICTABLE = (W.READY,)  # eviction may start here (retention decides whether it does)
WANTED_FILE = (W.READY, W.CAPTURING)  # its file (of its generation) is kept: the sweeper's rule
ON_DISK = (W.READY, W.EVICTING)  # published and its file not yet removed
PENDING = (W.QUEUED, W.CAPTURING)  # still to be captured
PUBLISHED = (W.READY, W.EVICTING, W.EVICTED)  # published once (the run was used)
TERMINAL = (W.FAILED,)  # no move leaves it

assert all(s in EVICTABLE for s, d in TRANSITIONS if d == W.EVICTING)
assert not any(s in TERMINAL for s, _ in TRANSITIONS)


class RoleState(StrEnum):
    """The state of a role's holder, as `consumers.state` and `producers.state` store it."""

    ACTIVE = "active"  # registered and heartbeating: it holds the role
    LOST = "lost"  # its heartbeat counter stood still for ttl_s: fenced off, role free
    FINISHED = "finished"  # a clean exit at its own end (a producer: any clean exit)
    STOPPED = "stopped"  # a consumer that exited cleanly before its end
    DETACHED = "detached"  # a consumer released by the detach lag policy or `fanout detach`


CONSUMER_STATES = tuple(RoleState)  # what `consumers.state` may hold
PRODUCER_STATES = (RoleState.ACTIVE, RoleState.LOST, RoleState.FINISHED)  # `producers.state`
# consumers whose cursors hold windows back: running, lost, or stopped cleanly mid-stream
COUNTED = (RoleState.ACTIVE, RoleState.LOST, RoleState.STOPPED)
RELEASED = (RoleState.FINISHED, RoleState.DETACHED)  # a consumer that holds nothing back
assert set(COUNTED) | set(RELEASED) == set(CONSUMER_STATES)


def sql_in(states: Iterable[W | RoleState]) -> str:
    """`('ready','capturing')`: a set of states as an SQL list (enum values, never input)."""
    return "(" + ",".join(f"'{s.value}'" for s in states) + ")"


def check(src: W | Iterable[W], dst: W) -> tuple[W, ...]:
    """The source states of a move to `dst`; IllegalTransition if any is not in TRANSITIONS."""
    srcs = (src,) if isinstance(src, W) else tuple(src)
    bad = [s for s in srcs if (s, dst) not in TRANSITIONS]
    if bad or not srcs:
        allowed = sorted(s.value for s, d in TRANSITIONS if d == dst)
        raise IllegalTransition(
            f"window move {'/'.join(s.value for s in bad) or '(nothing)'} → {dst.value} is not "
            f"in fanout.coord.states.TRANSITIONS (moves to {dst.value} come from: "
            f"{', '.join(allowed) or 'none'}); this is a bug in fanout"
        )
    return srcs


def _run(statement: Callable[P, Statement]) -> Callable[Concatenate[Sql, P], int]:
    """The call that runs a `statement` builder's statement on `cur` and returns how
    many rows it changed: `move(cur, ...)` is `move_statement(...)` run now. The
    builders are for a batch of statements sent at once
    (fanout.coord.database.Database.batch); one signature and one check serve both."""

    def run(cur: Sql, /, *args: P.args, **kwargs: P.kwargs) -> int:
        return int(cur.execute(*statement(*args, **kwargs)).rowcount)

    run.__doc__ = f"`{statement.__name__}` (its docstring) run on `cur` now: rows changed."
    return run


def move_statement(
    src: W | Iterable[W],
    dst: W,
    where: str,
    params: Sequence[object] = (),
    *,
    also: str = "",
    also_params: Sequence[object] = (),
    returning: str = "",
) -> Statement:
    """Move the windows in state `src` that match `where` to `dst` (`move` returns how
    many moved; this builds its statement, for a batch).

    `also`: more `col=?` assignments made in the same statement (with `also_params`).
    Rows in another state are left alone, so a move that lost a race changes nothing.
    `returning`: the columns of each moved row the statement returns (in a batch).
    """
    srcs = check(src, dst)
    sets = "state=?, updated_at=?" + (f", {also}" if also else "")
    sql = f"UPDATE windows SET {sets} WHERE state IN {sql_in(srcs)} AND ({where})"
    if returning:
        sql += f" RETURNING {returning}"
    return sql, (dst.value, wall(), *also_params, *params)


move = _run(move_statement)


def move_windows(
    cur: Sql, src: W | Iterable[W], dst: W, windows: Sequence[int], *, also: str = ""
) -> int:
    """`move` for the windows numbered in `windows` (none: nothing moves, no statement)."""
    if not windows:
        return 0
    return move(cur, src, dst, f"window IN ({','.join('?' * len(windows))})", windows, also=also)


def release_claims(cur: Sql, rank: int) -> int:
    """Requeue every window producer replica `rank` is capturing, with demand: it is
    captured again first, under a new generation (that replica is gone, finished or
    replaced). Returns how many were released."""
    return move(
        cur, W.CAPTURING, W.QUEUED, "claim_rank=?", (rank,),
        also="demand=1, claim_token=NULL, claim_rank=NULL",
    )  # fmt: skip


def insert_queued_statement(window: int, demand: bool) -> Statement:
    """A window's row is born queued: a new window (`demand` False) or one whose evicted
    row was compacted away and that a consumer wants again (`demand` True). That one was
    published before, so its row starts at `captures` 1 (how many more is forgotten with
    the row): its next publish is counted as the recapture it is (fanout.coord.claims).
    `insert_queued` runs it now."""
    return (
        "INSERT INTO windows(window, state, demand, captures, updated_at) VALUES (?, ?, ?, ?, ?)",
        (window, W.QUEUED.value, int(demand), int(demand), wall()),
    )


def compact_statement(below: int) -> Statement:
    """Delete evicted rows below `below`: a missing row below next_window reads as
    evicted (fanout.coord.leasing), so metadata stays flat however long the stream.
    `compact_evicted` runs it now."""
    return f"DELETE FROM windows WHERE state IN {sql_in([W.EVICTED])} AND window < ?", (below,)


insert_queued = _run(insert_queued_statement)
compact_evicted = _run(compact_statement)
