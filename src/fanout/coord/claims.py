"""The producer's side of the coordinator: register, claim, publish, fail, backpressure.

    p = coord.register_producer(contract)            # RoleHeld if a live producer runs
    while coord.wait_for_capacity(p, timeout_s=60):  # blocks at K live windows
        claim = coord.claim(p)                       # demand (recaptures) first
        if claim is None:
            break                                    # finite stream fully produced
        coord.publish_ready(claim, store.publish(tensors, meta))
    coord.finish_producer(p)                         # a clean exit: state 'finished'

A layer of fanout.coord.coordinator.Coordinator (one class for callers, a file per
side for readers) on fanout.coord.base.CoordinatorBase, whose connection, tokens
(`_bump`), role taking (`_take_role`, `_fenced`) and eviction it uses. Every call
is one serialised write transaction fenced by the producer's token and, for a
claim, the claim's token: a producer that was taken over (RoleTaken) or declared
lost gets StaleLease and changes nothing.
"""

from __future__ import annotations

import logging
import os
import time

from fanout.contract import CaptureContract
from fanout.coord import reads, retention, schema, waits
from fanout.coord.base import CoordinatorBase, release_claims
from fanout.coord.leases import Claim, ProducerReg, PublishedLike
from fanout.coord.liveness import HOLDER_COLUMNS, Holder, ProcessInfo
from fanout.errors import ContractMismatch, StaleLease

log = logging.getLogger("fanout.coord.coordinator")


def _now() -> float:
    return time.time()  # wall clock: display only


class ProducerSide(CoordinatorBase):
    """The producer's calls of fanout.coord.coordinator.Coordinator (which adds opening
    and the consumers' calls); what both share is fanout.coord.base's."""

    _blocked_since: float | None = None  # when claims first found no room, on self.clock
    _block_recorded = False  # meta blocked_since is set (fanout status: "blocked … since")

    def register_producer(
        self, contract: CaptureContract, owner: str = "", *, takeover: bool = False
    ) -> ProducerReg:
        """Become the run's producer: fences the previous one and releases its claims.

        RoleHeld while another live producer holds the run (Coordinator._take_role),
        unless `takeover`; a crashed or finished one is replaced without asking.
        """
        if contract != self.contract:
            raise ContractMismatch(self.contract.diff(contract), where="producer")
        owner = owner or f"pid {os.getpid()}"

        def register(cur: schema.Sql, me: ProcessInfo) -> int:
            token = self._bump(cur, "next_token")
            cur.execute(
                "INSERT INTO producer(id, token, hb_wall, state, owner, host, pid, proc) "
                "VALUES (1, ?, ?, 'active', ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
                "token=excluded.token, hb_wall=excluded.hb_wall, state='active', "
                "owner=excluded.owner, host=excluded.host, pid=excluded.pid, proc=excluded.proc",
                (token, _now(), owner, me.host, me.pid, me.proc),
            )
            release_claims(cur)
            return token

        token = self._take_role(
            f"the producer of {self.root}",
            (f"SELECT {HOLDER_COLUMNS} FROM producer", ()),
            takeover,
            register,
        )
        self._reclaimer.own("producer")
        log.info("producer %s registered (token %d)", owner, token)
        return ProducerReg(token, owner)

    def check_producer_role(self, takeover: bool = False) -> None:
        """Raise RoleHeld now if a live producer holds the run (and not `takeover`): a
        second producer learns it before it writes anything to the run dir."""
        if not takeover:
            self._take_role(
                f"the producer of {self.root}",
                (f"SELECT {HOLDER_COLUMNS} FROM producer", ()),
                False,
                lambda cur, me: None,
            )

    def finish_producer(self, preg: ProducerReg, stream_end: int | None = None) -> None:
        """A clean exit: state 'finished', claims released; `fanout status` shows it
        finished, and nobody reclaims it as lost. `stream_end`: the producer ended the
        stream by design (the run's last window, --max-windows, any budget) after that
        many windows, and every trainer finishes at it; None (a signal): the stream
        stays open for a restarted producer, and trainers wait for one."""
        with self._write() as cur:
            self._check_producer(cur, preg.token)
            release_claims(cur)
            cur.execute("UPDATE producer SET state='finished', hb_wall=?", (_now(),))
            waits.record_stream_end(cur, stream_end)
        self._block_recorded = False

    def blocked_by(self) -> str:
        """While blocked at K: who holds the producer back and the ways out, in words."""
        return waits.producer_block(self.conn, self.config, str(self.root))

    def _check_producer(self, cur: schema.Sql, token: int) -> None:
        row = cur.execute(f"SELECT {HOLDER_COLUMNS} FROM producer").fetchone()
        if row is None:
            raise StaleLease(f"producer token {token}: no producer is registered")
        holder = Holder(*row)
        if holder.token != token or holder.state != "active":
            raise self._fenced(f"the producer of {self.root}", token, holder)

    def claim(self, preg: ProducerReg, end: int | None = None) -> Claim | None:
        """Claim the next window to capture: demand first, then the next in order.
        `end`: no new window at or past it (an open-ended run whose producer knows its
        length, fanout.produce.onpolicy); the run's total_windows when that is set.

        None when there is nothing to claim now: at capacity (call wait_for_capacity
        first) or the finite stream is fully produced and nothing is on demand.
        """
        with self._write() as cur:
            self._check_producer(cur, preg.token)
            if not retention.has_capacity(cur, self.config.max_live_windows):
                return None
            row = cur.execute(
                "SELECT window, captures FROM windows WHERE state='queued' "
                "ORDER BY demand DESC, window LIMIT 1"
            ).fetchone()
            if row is not None:
                w, captures = int(row[0]), int(row[1])
                if captures:
                    self._bump(cur, "recaptures")
            else:
                w, captures = int(self._meta_cur(cur, "next_window")), 0
                total = self.config.total_windows if end is None else end
                if total is not None and w >= total:
                    return None
                self._bump(cur, "next_window")
                cur.execute(
                    "INSERT INTO windows(window, state, updated_at) VALUES (?, 'queued', ?)",
                    (w, _now()),
                )
            gen = self._bump(cur, "next_generation")
            token = self._bump(cur, "next_token")
            cur.execute(
                "UPDATE windows SET state='capturing', generation=?, claim_token=?, updated_at=? "
                "WHERE window=?",
                (gen, token, _now(), w),
            )
        return Claim(w, gen, token, preg.token, self._rows(w))

    def _check_claim(self, cur: schema.Sql, claim: Claim) -> None:
        self._check_producer(cur, claim.producer_token)
        row = cur.execute(
            "SELECT 1 FROM windows WHERE window=? AND state='capturing' AND claim_token=?",
            (claim.window, claim.token),
        ).fetchone()
        if row is None:
            raise StaleLease(f"claim {claim.token} on window {claim.window} is no longer held")

    def renew(self, claim: Claim) -> None:
        """Heartbeat while capturing one long window; StaleLease if the claim was lost."""
        with self._write() as cur:
            self._check_claim(cur, claim)
            cur.execute("UPDATE producer SET hb_seq=hb_seq+1, hb_wall=?", (_now(),))

    def publish_ready(self, claim: Claim, published: PublishedLike) -> None:
        """Record a durable, final-named window file (Store.publish's result) as ready."""
        with self._write() as cur:
            self._check_claim(cur, claim)
            cur.execute(
                "UPDATE windows SET state='ready', name=?, path=?, nbytes=?, checksum=?, "
                "captures=captures+1, demand=0, attempts=0, claim_token=NULL, last_error=NULL, "
                "updated_at=? WHERE window=?",
                (
                    published.name,
                    str(published.path),
                    int(published.nbytes),
                    str(published.checksum),
                    _now(),
                    claim.window,
                ),
            )
            n, nbytes = reads.live_windows(cur)
            high = (
                "UPDATE counters SET value = CASE WHEN value < ? THEN ? ELSE value END WHERE key=?"
            )
            cur.execute(high, (n, n, "hw_windows"))
            cur.execute(high, (int(nbytes), int(nbytes), "hw_bytes"))

    def fail(self, claim: Claim, reason: str) -> None:
        """A capture failed: requeue the window (retried first) or, after max_attempts, fail it."""
        with self._write() as cur:
            self._check_claim(cur, claim)
            attempts = cur.execute(
                "UPDATE windows SET attempts=attempts+1, last_error=?, claim_token=NULL, "
                "demand=1, updated_at=? WHERE window=? RETURNING attempts",
                (reason, _now(), claim.window),
            ).fetchone()[0]
            state = "failed" if attempts >= self.config.max_attempts else "queued"
            cur.execute("UPDATE windows SET state=? WHERE window=?", (state, claim.window))
        log.warning(
            "window %d capture failed (%s); attempt %d → %s", claim.window, reason, attempts, state
        )

    def wait_for_capacity(self, preg: ProducerReg, timeout_s: float) -> bool:
        """Block while K windows are live; apply the lag policy. False on timeout.

        While blocked, the run records since when (fanout.coord.waits.BLOCKED_SINCE),
        so `fanout status` can say "producer blocked at K by … since …"."""
        deadline = time.monotonic() + timeout_s
        cfg = self.config
        while True:
            self.reclaim_lost()
            with self._write() as cur:
                self._check_producer(cur, preg.token)
                doomed = retention.mark_evictable(cur, cfg.expected_consumers, recover=True)
                if not doomed:
                    room = retention.has_capacity(cur, cfg.max_live_windows, extra=False)
                    if not room:
                        # The lag policy may make room below K before the extra slot is used.
                        doomed = self._apply_lag_policy(cur)
                        room = not doomed and retention.has_capacity(cur, cfg.max_live_windows)
                    if room or not doomed:
                        self._record_block(cur, blocked=not room)
                    if room:
                        self._blocked_since = None
                        return True
            if doomed:
                self._finish_evictions(doomed)
                continue
            if time.monotonic() >= deadline:
                return False
            self._wait_change(deadline)

    def _record_block(self, cur: schema.Sql, blocked: bool) -> None:
        if blocked != self._block_recorded:  # a write only when it changes
            waits.record_blocked(cur, blocked)
            self._block_recorded = blocked

    def _apply_lag_policy(self, cur: schema.Sql) -> retention.Doomed:
        cfg = self.config
        if cfg.lag_policy == "hold" or not retention.enough_registered(cur, cfg.expected_consumers):
            return []
        if cfg.lag_policy == "recapture":
            return retention.recapture_victim(cur)
        now = self.clock()  # detach: blocked for detach_after on the producer's own clock
        if self._blocked_since is None:
            self._blocked_since = now
        if now - self._blocked_since < cfg.detach_after:
            return []
        gone = retention.detach_laggard(cur, self._bump(cur, "next_token"))
        if gone is None:
            return []
        log.warning("detached laggard %s at cursor %d (leader at %d)", *gone)
        self._blocked_since = now
        return retention.mark_evictable(cur, cfg.expected_consumers)
