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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from fanout.coord import schema, states, waits
from fanout.coord.core import RunDb
from fanout.coord.database import wall
from fanout.coord.eviction import Eviction
from fanout.coord.grants import ConsumerReg, Lease
from fanout.coord.roles import Roles
from fanout.coord.states import RoleState, W
from fanout.errors import AcquireCancelled, AcquireTimeout, ConfigError, StaleLease, WindowGone

log = logging.getLogger("fanout.coord.coordinator")


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
        waited, last = 0.0, time.monotonic()
        while True:
            if cancel is not None and cancel.is_set():
                raise AcquireCancelled(f"{reg.consumer_id}: acquire cancelled")
            with self.run.write() as cur:
                cursor = self.roles.check_consumer(cur, reg.consumer_id, reg.token)
                w = cursor if window is None else window
                if w < cursor:
                    raise ConfigError(f"{reg.consumer_id}: window {w} is behind cursor {cursor}")
                total = self.run.config.total_windows
                end = waits.stream_end(cur)
                if (total is not None and w >= total) or (end is not None and w >= end):
                    return None
                lease, state = self._try_lease(cur, reg, w)
                if lease is not None:
                    return lease
                why = waits.consumer_wait(cur, self.run.config, reg.consumer_id, w)
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
            self.run.wait_change(left)

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
        it back; a registration at an older cursor does, fanout.coord.roles)."""
        with self.run.write() as cur:
            self._held_lease(cur, lease)
            cur.execute("DELETE FROM leases WHERE token=?", (lease.token,))
            nxt = lease.window + 1
            cur.execute(
                "UPDATE consumers SET cursor = CASE WHEN cursor < ? THEN ? ELSE cursor END "
                "WHERE id=?",
                (nxt, nxt, lease.consumer_id),
            )
            doomed = self.eviction.mark(cur)
        self.eviction.finish(doomed)

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
