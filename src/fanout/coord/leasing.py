"""The consumers' work: lease the window at the cursor, ack it, give it back, end.

    reg = coord.register_consumer("draft-b8", dp_rank=0)
    while (lease := coord.acquire(reg, timeout_s=600)) is not None:   # None: stream end
        train_on(lease.path); coord.ack(lease)                          # cursor += 1
    coord.finish(reg)                                  # its own end: holds nothing back

`Leasing` is a part of fanout.coord.coordinator.Coordinator: it holds the run
(fanout.coord.core.RunDb), the roles (fanout.coord.roles: the fencing check every
call makes) and eviction (an ack may let windows go). A lease is granted only on
a readable window (fanout.coord.states.READABLE) under the consumer's current
token; a window that was evicted is queued again (recaptured on demand) under every
lag policy, a failed one raises WindowGone.

The hot calls cost few round trips to a database on another host (issue #55): an
acquire first reads (`_peek`, one statement, no lock) and writes nothing while its
window is not ready, only waits (armed: no commit between its read and its wait is
missed, so it waits up to WAIT_S, woken by the commits that matter to it, not by
every trainer's ack); a ready window's lease and an ack are each one batch of
statements that check their own preconditions in SQL (Database.batch: on PostgreSQL
the run's write lock is held while the server runs them, not across round trips).
Where a batch's check fails, or the window needs a write to be wanted again, the
call takes the general path: one write transaction that reads and decides, as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from fanout.coord import retention, schema, states, waits
from fanout.coord.core import RunDb
from fanout.coord.database import wall
from fanout.coord.eviction import Eviction
from fanout.coord.grants import ConsumerReg, Lease
from fanout.coord.roles import ACTIVE, CONSUMER_CHECK, Roles
from fanout.coord.states import RoleState, W
from fanout.errors import AcquireCancelled, AcquireTimeout, ConfigError, StaleLease, WindowGone

log = logging.getLogger("fanout.coord.coordinator")
ACK = waits.ACK
WAIT_S = 1.0  # longest armed wait for a window between two reads (at most ttl_s / 4)
CANCEL_S = 0.05  # how often a wait looks at its `cancel` event
_END = "end of stream"
_CHECK = ", ".join(f"c.{col}" for col in CONSUMER_CHECK.split(", "))
_PEEK = (  # the consumer (fencing), the stream's end, the frontier, its window, its lease
    f"SELECT {_CHECK}, (SELECT value FROM meta WHERE key=?), "
    "(SELECT value FROM counters WHERE key='next_window'), w.state, w.generation, w.name, "
    "w.path, w.demand, (SELECT token FROM leases l WHERE l.consumer=c.id AND l.window=w.window) "
    "FROM consumers c LEFT JOIN windows w ON w.window = COALESCE(CAST(? AS BIGINT), c.cursor) "
    "WHERE c.id=?"
)
_N_CHECK = len(CONSUMER_CHECK.split(", "))


class Leasing:
    """A consumer's calls on windows: acquire, ack, release, report_corrupt, its end."""

    def __init__(self, run: RunDb, roles: Roles, eviction: Eviction) -> None:
        self.run, self.roles, self.eviction = run, roles, eviction

    def acquire(
        self,
        reg: ConsumerReg,
        timeout_s: float | None = None,
        window: int | None = None,
        cancel: threading.Event | None = None,
        on_wait: Callable[[waits.WaitState], None] | None = None,
    ) -> Lease | None:
        """Lease the window at the cursor (or `window` ≥ cursor), waiting until it is ready.

        Returns None at the end of the stream: the run's last window, or where a
        producer that finished by design ended it (fanout.coord.waits.stream_end). An
        evicted window is put on demand and captured again (new generation), under
        every lag policy (docs/operations.md, "Backpressure and lag policies"); a
        failed one raises WindowGone. While it waits, `on_wait` hears why
        (fanout.coord.waits.consumer_wait). AcquireTimeout once the waits that count
        (the producer is gone, stopped or slow; not: another consumer holds it at K or
        has not joined) add up to `timeout_s` (None waits forever); AcquireCancelled
        within ~50 ms of `cancel` being set (a prefetch thread at shutdown).
        """
        try:
            return self._acquire(reg, timeout_s, window, cancel, on_wait)
        finally:
            self.run.conn.disarm()  # UNLISTEN rides on this process's next commit

    def _acquire(
        self,
        reg: ConsumerReg,
        timeout_s: float | None,
        window: int | None,
        cancel: threading.Event | None,
        on_wait: Callable[[waits.WaitState], None] | None,
    ) -> Lease | None:
        waited, last = 0.0, time.monotonic()
        armed = False
        cfg = self.run.config
        wait_s = min(WAIT_S, cfg.ttl_s / 4)  # reclaim_lost below must watch within ttl_s / 2
        while True:
            if cancel is not None and cancel.is_set():
                raise AcquireCancelled(f"{reg.consumer_id}: acquire cancelled")
            if armed:
                self.run.conn.arm()  # what was heard before this read is in the read
            w, seen = self._peek(reg, window)
            if isinstance(seen, Lease):
                return seen
            if seen == _END:
                return None
            if seen is not None:  # not ready, and nothing to write: a read says why
                if not armed:
                    self.run.conn.arm()
                    armed = True
                    continue  # read again, armed: a publish from now on wakes the wait
                state = seen
                why = waits.consumer_wait(self.run.conn, cfg, reg.consumer_id, w)
            else:
                with self.run.write() as cur:
                    cursor = self.roles.check_consumer(cur, reg.consumer_id, reg.token)
                    w = cursor if window is None else window
                    if w < cursor:
                        raise ConfigError(
                            f"{reg.consumer_id}: window {w} is behind cursor {cursor}"
                        )
                    total = cfg.total_windows
                    end = waits.stream_end(cur)
                    if (total is not None and w >= total) or (end is not None and w >= end):
                        return None
                    lease, state = self._try_lease(cur, reg, w)
                    if lease is not None:
                        return lease
                    why = waits.consumer_wait(cur, cfg, reg.consumer_id, w)
            if on_wait is not None:
                on_wait(why)
            self.roles.reclaim_lost()
            now = time.monotonic()
            waited += now - last if why.counts else 0.0
            last = now
            if timeout_s is not None and waited >= timeout_s:
                raise AcquireTimeout(
                    f"{reg.consumer_id}: window {w} not ready after {timeout_s:g} s of "
                    f"waiting on the producer (--acquire-timeout-s; window state {state}): "
                    f"{why.text}"
                )
            left = None if timeout_s is None or not why.counts else now + timeout_s - waited
            if not armed:
                self.run.wait_change(left)
                continue
            end_s = now + wait_s if left is None else min(now + wait_s, left)
            while not self.run.wait_change(end_s, CANCEL_S if cancel else wait_s, (ACK,)):
                if time.monotonic() >= end_s or (cancel is not None and cancel.is_set()):
                    break

    def _peek(self, reg: ConsumerReg, window: int | None) -> tuple[int, Lease | str | None]:
        """One read: (window, what it found): the lease (granted by `_grant`), _END (the
        stream ends before it), the window's state when it is not ready and nothing need
        be written (capturing, not yet produced, queued with demand), or None: the write
        path decides (a lease held already, a window to want again, a failed one, a
        guard that failed). Fencing errors as check_consumer raises them."""
        cid = reg.consumer_id
        row = self.run.conn.execute(_PEEK, (waits.STREAM_END, window, cid)).fetchone()
        cursor = self.roles.consumer_cursor(cid, reg.token, None if row is None else row[:_N_CHECK])
        w = cursor if window is None else window
        if w < cursor:
            raise ConfigError(f"{cid}: window {w} is behind cursor {cursor}")
        end_value, frontier, state, gen, name, path, demand, held = row[_N_CHECK:]
        end = None if end_value in (None, "") else int(end_value)
        total = self.run.config.total_windows
        if (total is not None and w >= total) or (end is not None and w >= end):
            return w, _END
        if state is None:
            return w, ("not yet produced" if w >= int(frontier) else None)
        if state in states.READABLE and held is None:
            return w, self._grant(reg, cursor, w, int(gen), name, path, end_value)
        if state == W.QUEUED and demand:
            return w, "queued for recapture"
        if state == W.CAPTURING:
            return w, str(state)
        return w, None

    def _grant(
        self, reg: ConsumerReg, cursor: int, w: int, gen: int, name: str, path: str,
        end_value: str | None,
    ) -> Lease | None:  # fmt: skip
        """`_try_lease`'s grant of a readable window as one batch: a new lease token and
        the lease, each only while what `_peek` read still holds (the consumer active
        under its token at that cursor, the window readable in that generation, no lease
        of it yet, the stream's end unchanged). None when that no longer holds (nothing
        was written). Its commit tells nobody: a lease frees nothing a waiter waits for."""
        cid = reg.consumer_id
        guard = (
            "EXISTS (SELECT 1 FROM consumers WHERE id=? AND token=? AND state=? AND cursor=?) "
            "AND EXISTS (SELECT 1 FROM windows WHERE window=? AND generation=? AND state IN "
            f"{states.sql_in(states.READABLE)}) AND NOT EXISTS (SELECT 1 FROM leases WHERE "
            "consumer=? AND window=?) AND COALESCE((SELECT value FROM meta WHERE key=?), '') = ?"
        )
        gp = (cid, reg.token, ACTIVE, cursor, w, gen, cid, w, waits.STREAM_END, end_value or "")
        bump, _ = self.run.batch(
            [
                ("UPDATE counters SET value = value + 1 WHERE key='next_token' AND "
                 f"{guard} RETURNING value", gp),
                ("INSERT INTO leases(token, consumer, window, generation, epoch, acquired_wall) "
                 f"SELECT value, ?, ?, ?, ?, ? FROM counters WHERE key='next_token' AND {guard}",
                 (cid, w, gen, reg.token, wall(), *gp)),
            ],
            notify=None,
        )  # fmt: skip
        if not bump.rows:
            return None
        token = int(bump.rows[0][0])
        return Lease(cid, w, gen, name, path, token, reg.token, self.run.rows(w))

    def _try_lease(self, cur: schema.Sql, reg: ConsumerReg, w: int) -> tuple[Lease | None, str]:
        cid = reg.consumer_id
        row = cur.execute(
            "SELECT state, generation, name, path, last_error FROM windows WHERE window=?", (w,)
        ).fetchone()
        if row is None:
            if w >= int(self.run.meta(cur, "next_window")):
                return None, "not yet produced"
            states.insert_queued(cur, w, demand=True)  # an evicted row compaction deleted
            return self._wanted_again(w, cid)
        state, gen, name, path, err = row
        if state in states.READABLE:
            held = cur.execute(
                "SELECT token FROM leases WHERE consumer=? AND window=?", (cid, w)
            ).fetchone()
            if held is not None:
                token = int(held[0])
            else:
                token = self.run.bump(cur, "next_token")
                cur.execute(
                    "INSERT INTO leases(token, consumer, window, generation, epoch, acquired_wall) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (token, cid, w, gen, reg.token, wall()),
                )
            return Lease(cid, w, gen, name, path, token, reg.token, self.run.rows(w)), state
        if state in (W.EVICTED, W.EVICTING):
            states.move(
                cur, (W.EVICTED, W.EVICTING), W.QUEUED, "window=?", (w,),
                also="demand=1, attempts=0, name=NULL, path=NULL",
            )  # fmt: skip
            return self._wanted_again(w, cid)
        if state == W.QUEUED:
            cur.execute("UPDATE windows SET demand=1 WHERE window=? AND demand=0", (w,))
            return None, "queued for recapture"
        if state == W.FAILED:
            raise WindowGone(f"window {w} failed {self.run.config.max_attempts} captures: {err}")
        return None, state

    @staticmethod
    def _wanted_again(w: int, cid: str) -> tuple[None, str]:
        """An evicted window (its row kept or compacted away) was queued for recapture:
        one line per demand, the producer's log one per recapture (fanout.coord.claims)."""
        log.info("window %d wanted by %s after eviction: queued for recapture", w, cid)
        return None, "evicted; queued for recapture"

    def _held_lease(self, cur: schema.Sql, lease: Lease) -> None:
        self.roles.check_consumer(cur, lease.consumer_id, lease.epoch)
        held = cur.execute(
            "SELECT 1 FROM leases WHERE token=? AND consumer=?", (lease.token, lease.consumer_id)
        ).fetchone()
        if held is None:
            raise StaleLease(
                f"{lease.consumer_id}: lease {lease.token} on window {lease.window} is not held"
            )

    def ack(self, lease: Lease) -> None:
        """The window was consumed: drop the lease, advance the cursor (an ack never moves
        it back; a registration at an older cursor does, fanout.coord.roles), mark what
        is evictable now.

        One batch of three statements, each applied only while the lease is held (the
        consumer active under the lease's epoch, the lease there): cursor, eviction
        (fanout.coord.retention.mark_evictable_statement, counting this lease as gone),
        then the lease itself. Nothing else writes between them (the run's lock), so all
        three apply or none does; none did: `_held_lease` says why."""
        cid, nxt = lease.consumer_id, lease.window + 1
        held = (
            "EXISTS (SELECT 1 FROM consumers WHERE id=? AND token=? AND state=?) "
            "AND EXISTS (SELECT 1 FROM leases WHERE token=? AND consumer=?)"
        )
        hp = (cid, lease.epoch, ACTIVE, lease.token, cid)
        _, marked, dropped = self.run.batch(
            [
                ("UPDATE consumers SET cursor = CASE WHEN cursor < ? THEN ? ELSE cursor END "
                 f"WHERE id=? AND {held}", (nxt, nxt, cid, *hp)),
                retention.mark_evictable_statement(
                    self.run.config.expected_consumers, lease.token, held, hp
                ),
                ("DELETE FROM leases WHERE token=? AND consumer=? AND EXISTS (SELECT 1 FROM "
                 "consumers WHERE id=? AND token=? AND state=?)",
                 (lease.token, cid, cid, lease.epoch, ACTIVE)),
            ],
            notify=ACK,
        )  # fmt: skip
        if not dropped.rowcount:
            self._held_lease(self.run.conn, lease)  # raises what fenced it
            raise StaleLease(f"{cid}: lease {lease.token} on window {lease.window} is not held")
        self.eviction.finish(sorted((int(w), n) for w, n in marked.rows))

    def release(self, lease: Lease) -> bool:
        """Give a lease back without consuming it (cursor unchanged). False if not held."""
        with self.run.write() as cur:
            n = cur.execute(
                "DELETE FROM leases WHERE token=? AND consumer=?", (lease.token, lease.consumer_id)
            ).rowcount
        return n > 0

    def finish(self, reg: ConsumerReg) -> None:
        """The consumer reached its own end (the stream's, --max-steps, --epochs): state
        'finished', leases dropped; its cursor stops holding windows back under every
        lag policy. A later --resume registers it again, as a late joiner."""
        self._end(reg, RoleState.FINISHED)

    def stop(self, reg: ConsumerReg) -> None:
        """The consumer exits before its end (a signal, a timeout, a failed window):
        state 'stopped', leases dropped. Its cursor still holds windows back, as a lost
        one's does: a restart (--resume) continues there, `fanout detach` releases it."""
        self._end(reg, RoleState.STOPPED)

    def _end(self, reg: ConsumerReg, state: RoleState) -> None:
        with self.run.write() as cur:
            self.roles.check_consumer(cur, reg.consumer_id, reg.token)
            cur.execute("DELETE FROM leases WHERE consumer=?", (reg.consumer_id,))
            cur.execute(
                "UPDATE consumers SET state=?, hb_wall=? WHERE id=?",
                (state.value, wall(), reg.consumer_id),
            )
            # a finished cursor no longer counts (states.COUNTED): windows may go
            doomed = self.eviction.mark(cur) if state not in states.COUNTED else []
        self.eviction.finish(doomed)

    def report_corrupt(self, lease: Lease, reason: str) -> None:
        """Quarantine the leased file and queue the window for recapture (new generation)."""
        with self.run.write() as cur:
            self._held_lease(cur, lease)
        self.run.store.quarantine(lease.name)  # a file already gone is fine (another reporter)
        with self.run.write() as cur:
            cur.execute("DELETE FROM leases WHERE token=?", (lease.token,))
            n = states.move(
                cur, W.READY, W.QUEUED, "window=? AND generation=?",
                (lease.window, lease.generation),
                also="demand=1, name=NULL, path=NULL, nbytes=0, last_error=?",
                also_params=(f"corrupt: {reason}",),
            )  # fmt: skip
            if n:
                self.run.bump(cur, "corrupt")
        log.warning(
            "window %d g%d corrupt (%s): quarantined", lease.window, lease.generation, reason
        )
