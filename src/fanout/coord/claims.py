"""The producer replicas' work: claim, publish, fail, wait for room at K, end the stream.

    p = coord.register_producer(contract)            # RoleHeld if a live producer runs
    while coord.wait_for_capacity(p, timeout_s=60):  # blocks at K live windows
        claim = coord.claim(p, end=total)            # demand (recaptures) first
        if claim is None:
            break                                    # finite stream fully produced
        coord.publish_ready(claim, store.publish(tensors, meta))
    coord.finish_producer(p, stream_end=total)       # a clean exit: state 'finished'

`Claims` is a part of fanout.coord.coordinator.Coordinator: it holds the run
(fanout.coord.core.RunDb), the roles (fanout.coord.roles: who each replica is, and
the fencing check every call makes) and eviction (what goes when blocked).
Every call is one serialised write transaction fenced by the replica's token and,
for a claim, the claim's token: a replica that was taken over (RoleTaken) or
declared lost gets StaleLease and changes nothing. The window moves it makes
(queued → capturing → ready, or back to queued, or failed) are fanout.coord.states'.

Replicas (several producers of one run, `fanout produce --replicas M`) share this
one queue: a claim is a window no other replica holds, so each window is made once
(a lost replica's claims are released and made again, counted in
`claims_reclaimed`), K counts every replica's windows together, and the stream's end
is recorded once, by the replica that publishes its last window
(fanout.coord.waits.end_if_complete).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from fanout.coord import retention, schema, states, waits
from fanout.coord.core import RunDb
from fanout.coord.database import Statement, wall
from fanout.coord.eviction import Eviction
from fanout.coord.grants import Claim, ProducerReg, producer_id
from fanout.coord.liveness import HOLDER_COLUMNS
from fanout.coord.roles import ACTIVE, Roles
from fanout.coord.states import RoleState, W
from fanout.errors import StaleLease

if TYPE_CHECKING:  # the type only: fanout.store.store imports torch, `fanout status` none
    from fanout.store.store import Published

log = logging.getLogger("fanout.coord.coordinator")
# A claim's reads, in one statement: the replica's row (fencing), then how many windows
# are live (what K bounds), the frontier, and the first queued window (demand first).
_CLAIM_READ = (
    f"SELECT {HOLDER_COLUMNS}, (SELECT COUNT(*) FROM windows WHERE state IN "
    f"{states.sql_in(states.LIVE)}), (SELECT value FROM counters WHERE key='next_window'), "
    "(SELECT window FROM windows WHERE state=? ORDER BY demand DESC, window LIMIT 1) "
    "FROM producers WHERE rank=?"
)
WAIT_S = 0.25  # longest armed wait for room: an ack that frees the reserved slot is not heard


class Claims:
    """The producer's calls: claims on windows, publishing, backpressure, its end."""

    def __init__(self, run: RunDb, roles: Roles, eviction: Eviction) -> None:
        self.run, self.roles, self.eviction = run, roles, eviction
        self._blocked_since: float | None = None  # claims first found no room (run.clock)
        self._block_recorded = False  # meta blocked_since is set ("blocked … since")

    def finish_producer(self, preg: ProducerReg, stream_end: int | None = None) -> None:
        """A clean exit of one replica: state 'finished', its claims released; `fanout
        status` shows it finished, and nobody reclaims it as lost. `stream_end`: it ended
        the stream by design (the run's last window, --max-windows, any budget) after
        that many windows; the end is recorded now if every window before it is
        published (else by the replica that publishes the last one), and every trainer
        finishes at it. None (a signal): the stream stays open for a restarted
        producer, and trainers wait for one."""
        with self.run.write() as cur:
            self.roles.check_producer(cur, preg.token, preg.rank)
            self.roles.release_claims_of(cur, preg.rank)
            cur.execute(
                "UPDATE producers SET state=?, hb_wall=? WHERE rank=?",
                (RoleState.FINISHED.value, wall(), preg.rank),
            )
            waits.clear_blocked_unless_others(cur, preg.rank)
            ended = stream_end is not None and waits.end_if_complete(cur, stream_end)
        self._block_recorded = False
        if ended:
            log.info("the stream ends at window %s (recorded by %s)", stream_end, preg.role_id)

    def blocked_by(self) -> str:
        """While blocked at K: who holds the producer back and the ways out, in words."""
        return waits.producer_block(self.run.conn, self.run.config, str(self.run.root))

    def claim(
        self, preg: ProducerReg, end: int | None = None, upto: int | None = None
    ) -> Claim | None:
        """Claim the next window to capture: demand first, then the next in order.
        `end`: the stream's end, no new window at or past it (an open-ended run whose
        producer knows its length, --max-windows; the claim carries it, to record the
        end when its last window is published); the run's total_windows when None.
        `upto`: no new window at or past it for now (an on-policy stream whose later
        rows are not regenerated yet); not an end.

        None when there is nothing to claim now: at capacity (call wait_for_capacity
        first; the last of the K slots only takes the slowest consumer's next needed
        window, fanout.coord.retention.reserved_window), every
        window is claimed by some replica, or the finite stream is fully produced and
        nothing is on demand.
        """
        run = self.run
        total = run.config.total_windows if end is None else end
        k = run.config.max_live_windows

        def decide(cur: schema.Sql) -> tuple[int | None, list[Statement]]:
            # what the decision reads, in one statement (one round trip under the lock)
            row = cur.execute(_CLAIM_READ, (W.QUEUED.value, preg.rank)).fetchone()
            self.roles.producer_holds(preg.token, preg.rank, None if row is None else row[:-3])
            assert row is not None
            live, frontier, queued = int(row[-3]), int(row[-2]), row[-1]
            # retention.claimable, on the count read above
            if live < k - 1:
                w = frontier if queued is None else int(queued)
            elif live < k and (reserved := retention.reserved_window(cur)) is not None:
                w = reserved  # the slowest consumer's next needed window only
            else:
                return None, []
            # a recapture is counted when it is published, not here
            writes: list[Statement] = []
            if w == frontier:  # a new window: within the stream?
                if (total is not None and w >= total) or (upto is not None and w >= upto):
                    return None, []
                writes += [
                    ("UPDATE counters SET value = value + 1 WHERE key='next_window'", ()),
                    states.insert_queued_statement(w, demand=False),
                ]
            counter = "(SELECT value FROM counters WHERE key='{}')"
            writes += [
                ("UPDATE counters SET value = value + 1 WHERE key='next_generation' "
                 "RETURNING value", ()),
                ("UPDATE counters SET value = value + 1 WHERE key='next_token' RETURNING value",
                 ()),
                states.move_statement(
                    W.QUEUED, W.CAPTURING, "window=?", (w,),
                    also=f"generation={counter.format('next_generation')}, "
                    f"claim_token={counter.format('next_token')}, claim_rank=?",
                    also_params=(preg.rank,),
                ),
            ]  # fmt: skip
            return w, writes

        # a read first: at K (or fenced) there is nothing to claim, and no lock to take
        # (a replica that lost the race for a freed slot finds it here)
        row = run.conn.execute(_CLAIM_READ, (W.QUEUED.value, preg.rank)).fetchone()
        self.roles.producer_holds(preg.token, preg.rank, None if row is None else row[:-3])
        if row is not None and int(row[-3]) >= k:
            return None
        w, got = run.conn.decide(decide)
        if w is None:
            return None
        gen, token = int(got[-3].rows[0][0]), int(got[-2].rows[0][0])
        assert got[-1].rowcount == 1
        return Claim(w, gen, token, preg.token, run.rows(w), preg.rank, total)

    def _check_claim(self, cur: schema.Sql, claim: Claim) -> None:
        self.roles.check_producer(cur, claim.producer_token, claim.rank)
        row = cur.execute(
            "SELECT 1 FROM windows WHERE window=? AND state=? AND claim_token=?",
            (claim.window, W.CAPTURING.value, claim.token),
        ).fetchone()
        if row is None:
            raise StaleLease(f"claim {claim.token} on window {claim.window} is no longer held")

    def _claim_held(self, claim: Claim) -> tuple[str, tuple[object, ...]]:
        """`_check_claim` as an SQL condition (with its parameters), for statements
        that apply only while the claim is held."""
        return (
            "EXISTS (SELECT 1 FROM producers WHERE rank=? AND token=? AND state=?) AND EXISTS "
            f"(SELECT 1 FROM windows WHERE window=? AND state IN {states.sql_in([W.CAPTURING])} "
            "AND claim_token=?)",
            (claim.rank, claim.producer_token, ACTIVE, claim.window, claim.token),
        )

    def _stale(self, claim: Claim) -> StaleLease:
        """A guarded statement found the claim not held: `_check_claim` says why."""
        self._check_claim(self.run.conn, claim)
        return StaleLease(f"claim {claim.token} on window {claim.window} is no longer held")

    def renew(self, claim: Claim) -> None:
        """Heartbeat while capturing one long window; StaleLease if the claim was lost.
        One statement applied only while the claim is held, outside the run's lock, as
        a heartbeat is (fanout.coord.roles.Roles.heartbeat)."""
        held, params = self._claim_held(claim)
        if not self.run.conn.write_row(
            f"UPDATE producers SET hb_seq=hb_seq+1, hb_wall=? WHERE rank=? AND {held}",
            (wall(), claim.rank, *params),
        ):
            raise self._stale(claim)

    def publish_ready(self, claim: Claim, published: Published) -> None:
        """Record a durable, final-named window file (Store.publish's result) as ready.

        A window published before (evicted, compacted or quarantined, then wanted
        again) is a recapture: counted and logged here, once per publish, so that
        `recaptures` = files published − windows published. A claim that was retried
        or reclaimed before it was ever published is not one (nothing was published).
        The replica's count of windows made goes up; a claim that knew the stream's end
        records it when this was its last window (waits.end_if_complete).
        """
        # One batch (Database.batch), every statement applied only while the claim is
        # held (`held`, true for all of them or none: nothing else writes between them),
        # the move last: before it, this window is not yet readable (the high-water
        # marks add it) nor published (the stream's end check skips it).
        held, hp = self._claim_held(claim)
        ready = f"FROM windows WHERE state IN {states.sql_in(states.READABLE)}"
        high = "UPDATE counters SET value = CASE WHEN value < ({0}) THEN ({0}) ELSE value END "
        w, nbytes = claim.window, int(published.nbytes)
        batch: list[Statement] = [
            (
                "UPDATE counters SET value=value+1 WHERE key='recaptures' AND (SELECT captures "
                f"FROM windows WHERE window=?) > 0 AND {held} RETURNING value",
                (w, *hp),
            ),
            (
                high.format(f"SELECT COUNT(*) + 1 {ready}") + f"WHERE key='hw_windows' AND {held}",
                hp,
            ),
            (
                high.format(f"SELECT COALESCE(SUM(nbytes), 0) + ? {ready}")
                + f"WHERE key='hw_bytes' AND {held}",
                (nbytes, nbytes, *hp),
            ),
            (
                "UPDATE producers SET made=made+1, made_since=made_since+1 WHERE rank=? AND "
                f"{held}",
                (claim.rank, *hp),
            ),
        ]
        if claim.end is not None:
            batch.append(waits.end_if_complete_statement(claim.end, w, held, hp))
        batch.append(
            states.move_statement(
                W.CAPTURING,
                W.READY,
                "window=? AND claim_token=? AND EXISTS (SELECT 1 FROM "
                "producers WHERE rank=? AND token=? AND state=?)",
                (w, claim.token, claim.rank, claim.producer_token, ACTIVE),
                also="name=?, path=?, nbytes=?, checksum=?, captures=captures+1, demand=0, "
                "attempts=0, claim_token=NULL, claim_rank=NULL, last_error=NULL, "
                "verifier_version=?",
                also_params=(
                    published.name,
                    str(published.path),
                    nbytes,
                    str(published.checksum),
                    published.verifier_version,
                ),
            )
        )
        got = self.run.batch(batch)
        if not got[-1].rowcount:
            raise self._stale(claim)
        nth = int(got[0].rows[0][0]) if got[0].rows else 0
        ended = claim.end is not None and got[-2].rowcount > 0
        if ended:
            log.info(
                "the stream ends at window %d (recorded by %s)", claim.end, producer_id(claim.rank)
            )
        if nth:  # after the commit: a line for each recapture that counts, and only those
            log.info(
                "window %d recaptured as generation %d (recapture %d of the run)",
                claim.window, claim.generation, nth,
            )  # fmt: skip

    def fail(self, claim: Claim, reason: str) -> None:
        """A capture failed: requeue the window (retried first) or, after max_attempts, fail it."""
        with self.run.write() as cur:
            self._check_claim(cur, claim)
            attempts = int(
                cur.execute(
                    "UPDATE windows SET attempts=attempts+1 WHERE window=? RETURNING attempts",
                    (claim.window,),
                ).fetchone()[0]
            )
            self.run.bump(cur, "capture_failures")  # status and /metrics count them
            state = W.FAILED if attempts >= self.run.config.max_attempts else W.QUEUED
            states.move(
                cur, W.CAPTURING, state, "window=?", (claim.window,),
                also="last_error=?, claim_token=NULL, claim_rank=NULL, demand=1",
                also_params=(reason,),
            )  # fmt: skip
        log.warning(
            "window %d capture failed (%s); attempt %d → %s",
            claim.window, reason, attempts, state.value,
        )  # fmt: skip

    def wait_for_capacity(self, preg: ProducerReg, timeout_s: float) -> bool:
        """Block while there is no room (K windows live, or K − 1 and the slowest
        consumer's next needed window cannot be claimed: fanout.coord.retention
        .reserved_window); apply the lag policy. False on timeout.

        While blocked, the run records since when (fanout.coord.waits.BLOCKED_SINCE),
        so `fanout status` can say "producer blocked at K by … since …"."""
        try:
            return self._wait_for_capacity(preg, timeout_s)
        finally:
            self.run.conn.disarm()  # UNLISTEN rides on this process's next commit

    def _wait_for_capacity(self, preg: ProducerReg, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        cfg = self.run.config
        armed = False
        while True:
            self.roles.reclaim_lost()
            if armed:
                self.run.conn.arm()  # what was heard before this read is in the read
            room = self._room_read(preg)
            if room:
                self._blocked_since = None
                return True
            if room is False:
                if not armed:
                    self.run.conn.arm()
                    armed = True
                    continue  # read again, armed: a commit from now on wakes the wait
                if time.monotonic() >= deadline:
                    return False
                self.run.wait_change(deadline, WAIT_S, (waits.ACK,))
                continue
            with self.run.write() as cur:
                self.roles.check_producer(cur, preg.token, preg.rank)
                doomed = self.eviction.mark(cur, recover=True)
                if not doomed:
                    room = retention.has_capacity(cur, cfg.max_live_windows, reserved=False)
                    if not room:
                        # The slowest consumer's cursor window gets the last slot back
                        # (a restart from an older checkpoint); else the lag policy may
                        # make room before the reserved slot is used.
                        doomed = retention.yield_reserved(
                            cur, cfg.max_live_windows
                        ) or self._apply_lag_policy(cur)
                        room = not doomed and retention.has_capacity(cur, cfg.max_live_windows)
                    if room or not doomed:
                        self._record_block(cur, blocked=not room)
                    if room:
                        self._blocked_since = None
                        return True
            if doomed:
                self.eviction.finish(doomed)
                continue
            if time.monotonic() >= deadline:
                return False
            if armed:
                self.run.wait_change(deadline, WAIT_S, (waits.ACK,))
            else:
                self.run.wait_change(deadline)

    def _room_read(self, preg: ProducerReg) -> bool | None:
        """The write path's answer where it would change no window, from reads alone
        (under the `hold` policy): True (room), False (no room), the blocked-at-K stamp
        set or cleared to match (one batch; `fanout status` shows it); None where the
        write path must decide (a window to evict or to yield, another lag policy).
        Fenced like the write path."""
        cfg, conn = self.run.config, self.run.conn
        if cfg.lag_policy != "hold":
            return None
        self.roles.check_producer(conn, preg.token, preg.rank)
        if retention.mark_evictable(conn, cfg.expected_consumers, recover=True, dry=True):
            return None
        room = retention.has_capacity(conn, cfg.max_live_windows, reserved=False)
        if not room:
            if retention.yield_reserved(conn, cfg.max_live_windows, dry=True):
                return None
            room = retention.has_capacity(conn, cfg.max_live_windows)
        if (not room) != self._block_recorded:  # the stamp alone changes: no decision rests on it
            self.run.batch(waits.record_blocked_statements(not room), notify=None)
            self._block_recorded = not room
        return room

    def _record_block(self, cur: schema.Sql, blocked: bool) -> None:
        if blocked != self._block_recorded:  # a write only when it changes
            waits.record_blocked(cur, blocked)
            self._block_recorded = blocked

    def _apply_lag_policy(self, cur: schema.Sql) -> retention.Doomed:
        cfg = self.run.config
        if cfg.lag_policy == "hold" or not retention.enough_registered(cur, cfg.expected_consumers):
            return []
        if cfg.lag_policy == "recapture":
            return retention.recapture_victim(cur)
        now = self.run.clock()  # detach: blocked for detach_after on the producer's own clock
        if self._blocked_since is None:
            self._blocked_since = now
        if now - self._blocked_since < cfg.detach_after:
            return []
        gone = retention.detach_laggard(cur, self.run.bump(cur, "next_token"))
        if gone is None:
            return []
        log.warning("detached laggard %s at cursor %d (leader at %d)", *gone)
        self._blocked_since = now
        return self.eviction.mark(cur)
