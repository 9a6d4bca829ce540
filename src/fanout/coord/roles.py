"""Who may act on a run: registering the producer replicas and the consumers, fencing,
heartbeats, reclaiming the lost, detaching.

    roles = Roles(run, eviction)             # a part of fanout.coord.coordinator.Coordinator
    reg = roles.register_consumer("b8", dp_rank=0)
    p = roles.register_producer(contract, rank=None, plan=ProducerPlan(replicas=3))
    with run.write() as cur:
        cursor = roles.check_consumer(cur, reg.consumer_id, reg.token)   # fenced

Roles are exclusive: each producer replica rank (0 .. replicas-1; a run's only producer
is rank 0), and each consumer id `name:dp<rank>`, is held by one process at a time
(fanout.coord.liveness decides who is live). A newcomer is refused with RoleHeld while
a live process holds the role, unless it takes over; a producer asking for any rank
(`rank=None`) takes a free one (a crashed or lost holder's first, a finished one's
last) and is refused only when every rank is held.
Every registration takes a new token from one counter that never repeats, and every
later call is checked against it (`check_producer`, `check_consumer`), so a process
that was replaced, reclaimed as lost or detached gets StaleLease / RoleTaken /
Detached and changes nothing. A replica that joins live replicas must present their
data plan (PlanMismatch naming the flag); the first of a session records it and
reopens a stream whose end was recorded (fanout.coord.waits).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from fanout.contract import CaptureContract
from fanout.coord import records, retention, schema, states, waits
from fanout.coord.core import RunDb
from fanout.coord.database import wall
from fanout.coord.eviction import Eviction
from fanout.coord.grants import ConsumerReg, ProducerPlan, ProducerReg, producer_id
from fanout.coord.liveness import (
    HOLDER_COLUMNS,
    Holder,
    ProcessInfo,
    Reclaimer,
    RoleWatch,
    process_gone,
    this_process,
)
from fanout.coord.states import RoleState, release_claims
from fanout.errors import (
    ConfigError,
    ContractMismatch,
    Detached,
    PlanMismatch,
    RoleHeld,
    RoleTaken,
    StaleLease,
)

log = logging.getLogger("fanout.coord.coordinator")
# (role, holder's fencing token) this process has said it replaces: a start looks at a
# role two or three times (its early check, then its registration) and says it once
_SAID_REPLACING: set[tuple[str, int]] = set()
T = TypeVar("T")
Select = tuple[str, tuple[object, ...]]  # the statement that reads a role's holder
PLAN = "plan"  # meta key: the data plan of the run's producer replicas (ProducerPlan)
ACTIVE = RoleState.ACTIVE.value
CONSUMER_CHECK = f"cursor, note, {HOLDER_COLUMNS}"  # what check_consumer reads of its row


def _producer_row(rank: int) -> Select:
    return (f"SELECT {HOLDER_COLUMNS} FROM producers WHERE rank=?", (rank,))


def _consumer_row(cid: str) -> Select:
    return (f"SELECT {HOLDER_COLUMNS} FROM consumers WHERE id=?", (cid,))


class Roles:
    """Registration, fencing and liveness for the producer and every consumer."""

    def __init__(self, run: RunDb, eviction: Eviction) -> None:
        self.run, self.eviction = run, eviction
        self.reclaimer = Reclaimer(run.config.ttl_s, run.clock)
        self._watch: dict[str, RoleWatch] = {}  # what take_role saw, per role

    def producer_role(self, rank: int, replicas: int = 1) -> str:
        """What a refusal calls replica `rank`'s role."""
        if replicas == 1 and rank == 0:
            return f"the producer of {self.run.root}"
        return f"producer replica {rank} of {self.run.root}"

    # ---- registering -------------------------------------------------------------

    def register_producer(
        self,
        contract: CaptureContract,
        owner: str = "",
        *,
        takeover: bool = False,
        rank: int | None = 0,
        plan: ProducerPlan | None = None,
    ) -> ProducerReg:
        """Become the run's producer, or producer replica `rank` of `plan.replicas` (None:
        a free rank, a crashed holder's first, in free_rank_order): fences that rank's
        previous holder and releases its claims (counted in `claims_reclaimed`: another
        replica, or this one, captures them again). RoleHeld while a live process holds
        it (every rank, for None), unless `takeover`; a crashed or finished one is
        replaced without asking. PlanMismatch when live replicas run with another data
        plan (`plan`)."""
        if contract != self.run.contract:
            raise ContractMismatch(self.run.contract.diff(contract), where="producer")
        plan = plan or ProducerPlan()
        if rank is not None and not 0 <= rank < plan.replicas:
            raise ConfigError(
                f"--replica-rank {rank}: must be below --replicas {plan.replicas} (0 .. "
                f"{plan.replicas - 1})"
            )
        owner = owner or f"pid {os.getpid()}"

        def register(cur: schema.Sql, me: ProcessInfo, r: int) -> int:
            self._join_plan(cur, r, plan)
            token = self.run.bump(cur, "next_token")
            now = wall()
            cur.execute(
                "INSERT INTO producers(rank, token, hb_wall, state, owner, host, pid, proc, "
                "since_wall) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(rank) DO UPDATE SET "
                "token=excluded.token, hb_wall=excluded.hb_wall, state=excluded.state, "
                "owner=excluded.owner, host=excluded.host, pid=excluded.pid, proc=excluded.proc, "
                "since_wall=excluded.since_wall, made_since=0",
                (r, token, now, ACTIVE, owner, me.host, me.pid, me.proc, now),
            )
            self.release_claims_of(cur, r)
            return token

        ranks = [rank] if rank is not None else self.free_rank_order(plan.replicas)
        roles = [(self.producer_role(r, plan.replicas), _producer_row(r)) for r in ranks]
        token, i = self.take_role(roles, takeover, register, labels=ranks)
        got = ranks[i]
        self.reclaimer.own(producer_id(got))
        log.info("%s: %s registered (token %d)", roles[i][0], owner, token)
        return ProducerReg(token, owner, got)

    def free_rank_order(self, replicas: int) -> list[int]:
        """The ranks a replica started without `--replica-rank` tries, in order: a rank
        whose holder crashed or was lost first (a restarted replica takes its place, so
        no row is left `active` behind a dead process), then one never taken, then a
        finished one. Only an order: `take_role` decides, in its transaction, which
        rank is free. fanout.produce.run_start.take_start_lock tries the start locks in
        this order too: it settles the rank before the registration does."""
        rows = dict(
            self.run.conn.execute(
                "SELECT rank, state FROM producers WHERE rank < ?", (replicas,)
            ).fetchall()
        )
        order = {ACTIVE: 0, RoleState.LOST.value: 0, None: 1, RoleState.FINISHED.value: 2}
        return sorted(range(replicas), key=lambda r: (order.get(rows.get(r), 1), r))

    def _join_plan(self, cur: schema.Sql, rank: int, plan: ProducerPlan) -> None:
        """PlanMismatch if other replicas are active with another data plan; the first
        replica of a session (none other active) records its plan and reopens the
        stream (fanout.coord.waits.reopen_stream)."""
        live = self._plan_check(cur, rank, plan)
        cur.execute("DELETE FROM meta WHERE key=?", (PLAN,))
        cur.execute(
            "INSERT INTO meta(key, value) VALUES (?, ?)", (PLAN, json.dumps(plan.as_dict()))
        )
        if not live:
            waits.reopen_stream(cur)

    def check_plan(self, rank: int, plan: ProducerPlan) -> None:
        """PlanMismatch now if live producer replicas (other than `rank`) run with another
        data plan: a replica learns it before it loads anything."""
        self._plan_check(self.run.conn, rank, plan)

    def _plan_check(self, cur: schema.Sql, rank: int, plan: ProducerPlan) -> bool:
        """PlanMismatch naming each differing flag when other replicas are active (a
        process this host sees gone does not count) and recorded another plan; returns
        whether any other replica is active."""
        others = [
            Holder(*row)
            for row in cur.execute(
                f"SELECT {HOLDER_COLUMNS} FROM producers WHERE rank<>? AND state=?", (rank, ACTIVE)
            ).fetchall()
        ]
        live = [h for h in others if process_gone(h.proc, h.pid) is not True]
        row = cur.execute("SELECT value FROM meta WHERE key=?", (PLAN,)).fetchone()
        if not live or row is None:
            return bool(live)
        mine, theirs = plan.as_dict(), json.loads(row[0])
        diff = {k: (theirs.get(k), mine.get(k)) for k in sorted(theirs.keys() | mine.keys())
                if theirs.get(k) != mine.get(k)}  # fmt: skip
        if diff:
            raise PlanMismatch(
                diff, where=f"producer replica {rank}, joining live replicas ({live[0]}, ...)"
            )
        return True

    def release_claims_of(self, cur: schema.Sql, rank: int) -> int:
        """Release replica `rank`'s claims (its process is gone, lost or replaced),
        counted in `claims_reclaimed`."""
        n = release_claims(cur, rank)
        if n:
            self.run.bump(cur, "claims_reclaimed", n)
            log.warning("released %d claim(s) of %s for recapture", n, producer_id(rank))
        return n

    def register_consumer(
        self,
        name: str,
        dp_rank: int = 0,
        expect: dict[str, Any] | None = None,
        cursor: int | None = None,
        *,
        takeover: bool = False,
        about: dict[str, Any] | None = None,
    ) -> ConsumerReg:
        """Join (or rejoin) as `name:dp<rank>`; `cursor` resumes from a checkpoint;
        `about` (family, data-parallel world, ...) is what `fanout status` shows of it
        (fanout.coord.records).

        A rejoin keeps the stored cursor unless `cursor` is given (which may move it
        back: that window is then recaptured), fences the previous incarnation and
        drops its leases. RoleHeld while another live process holds this id, unless
        `takeover`. ContractMismatch names every expected field that differs.
        """
        if not name or ":" in name:
            raise ConfigError(f"consumer name {name!r}: must be non-empty without ':'")
        cid = f"{name}:dp{dp_rank}"
        self.run.contract.require(expect or {}, where=f"consumer {cid}")
        expect_json = json.dumps(expect or {}, sort_keys=True)

        def register(cur: schema.Sql, me: ProcessInfo) -> ConsumerReg:
            token = self.run.bump(cur, "next_token")
            row = cur.execute("SELECT cursor FROM consumers WHERE id=?", (cid,)).fetchone()
            start = cursor if cursor is not None else (row[0] if row else 0)
            if start < 0:
                raise ConfigError(f"consumer {cid}: cursor must be >= 0, got {start}")
            cur.execute("DELETE FROM leases WHERE consumer=?", (cid,))
            cur.execute(
                "INSERT INTO consumers(id, expect, cursor, hb_wall, state, token, host, pid, proc) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
                "expect=excluded.expect, cursor=excluded.cursor, hb_wall=excluded.hb_wall, "
                "state=excluded.state, token=excluded.token, note=NULL, host=excluded.host, "
                "pid=excluded.pid, proc=excluded.proc",
                (cid, expect_json, start, wall(), ACTIVE, token, me.host, me.pid, me.proc),
            )
            records.record_consumer_start(cur, cid, start, about)
            return ConsumerReg(cid, token, start)

        reg, _ = self.take_role(
            [(f"consumer {cid}", _consumer_row(cid))], takeover, lambda c, m, _i: register(c, m)
        )
        self.reclaimer.own(cid)
        log.info("consumer %s registered at cursor %d (token %d)", cid, reg.cursor, reg.token)
        return reg

    def check_free(self, roles: list[tuple[str, Select]]) -> None:
        """Raise RoleHeld now if live processes hold every role of `roles` (registers
        nothing)."""
        self.take_role(roles, False, lambda cur, me, i: None)

    def check_producer_role(self, rank: int | None = 0, replicas: int = 1) -> None:
        ranks = [rank] if rank is not None else list(range(replicas))
        self.check_free([(self.producer_role(r, replicas), _producer_row(r)) for r in ranks])

    def check_consumer_role(self, cid: str) -> None:
        self.check_free([(f"consumer {cid}", _consumer_row(cid))])

    def take_role(
        self,
        roles: list[tuple[str, Select]],
        takeover: bool,
        register: Callable[[schema.Sql, ProcessInfo, int], T],
        labels: list[int] | None = None,
    ) -> tuple[T, int]:
        """Run `register(cur, me, label)` in the write transaction that finds one of
        `roles` (named, with the statement that reads its holder) free (RoleWatch): the
        first free one, in order. Returns its result and that role's index.

        Raises RoleHeld while live processes hold every one, unless `takeover` (which
        takes the first). A holder that exited on this host is replaced at once; one on
        another host once its heartbeat counter stood still for ttl_s while we watched
        (no wall clocks).
        """
        me = this_process()
        # Kept per role: a check before a registration (check_producer_role) counts
        # toward the registration's own watch.
        watches = [self._watch.setdefault(r, RoleWatch(self.run.config.ttl_s)) for r, _ in roles]
        labels = labels if labels is not None else list(range(len(roles)))
        waiting = False
        while True:
            with self.run.write() as cur:
                holders: list[Holder | None] = []
                verdicts = []
                for (_role, select), watch in zip(roles, watches, strict=True):
                    row = cur.execute(*select).fetchone()
                    holders.append(None if row is None else Holder(*row))
                    verdicts.append(watch.verdict(holders[-1], me))
                pick = next((i for i, v in enumerate(verdicts) if v == "free"), None)
                if pick is None and takeover:
                    pick = 0
                    log.warning("%s: taking over from %s (--takeover)", roles[0][0], holders[0])
                if pick is not None:
                    holder = holders[pick]
                    if verdicts[pick] == "free" and holder is not None and holder.state == ACTIVE:
                        said = (roles[pick][0], holder.token)
                        if said not in _SAID_REPLACING:  # the start's check, then its register
                            _SAID_REPLACING.add(said)
                            log.info("%s: replacing %s: %s",
                                     roles[pick][0], holder, watches[pick].reason)  # fmt: skip
                    return register(cur, me, labels[pick]), pick
                if all(v == "held" for v in verdicts):
                    for role, _ in roles:
                        del self._watch[role]  # a later try watches afresh
                    raise RoleHeld(
                        "; ".join(
                            self._held_message(role, h, w.reason, last=i == len(roles) - 1)
                            for i, ((role, _), h, w) in enumerate(
                                zip(roles, holders, watches, strict=True)
                            )
                            if h is not None
                        )
                    )
            if not waiting:
                waiting = True
                watched = [(r, h) for (r, _), h, v in zip(roles, holders, verdicts, strict=True)
                           if v == "watch"]  # fmt: skip
                log.warning(
                    "%s is registered to %s (on another host, or not heartbeating): waiting "
                    "up to %g s (ttl_s) to see whether its heartbeat moves",
                    watched[0][0], watched[0][1], self.run.config.ttl_s,
                )  # fmt: skip
            self.run.wait_change(None, max_s=0.2)

    def _held_message(self, role: str, holder: Holder, reason: str, last: bool = True) -> str:
        ttl = self.run.config.ttl_s
        held = (
            f"{role} is held by {holder} (last heartbeat {wall() - holder.hb_wall:.1f} s ago; "
            f"{reason})"
        )
        if not last:
            return held
        return (
            f"{held}; refusing to start a second one. To replace it, stop that process, or "
            "start this one with --takeover (the other is then fenced off and exits). A "
            "holder that stopped or crashed is replaced without --takeover: at once when it "
            f"ran on this host, else once its heartbeat has not moved for ttl_s = {ttl:g} s"
        )

    # ---- fencing -----------------------------------------------------------------

    def check_producer(self, cur: schema.Sql, token: int, rank: int = 0) -> None:
        """Raise StaleLease / RoleTaken unless `token` is replica `rank`'s, active."""
        self.producer_holds(token, rank, cur.execute(*_producer_row(rank)).fetchone())

    def producer_holds(self, token: int, rank: int, row: tuple[Any, ...] | None) -> None:
        """check_producer on a row of HOLDER_COLUMNS read already (None: no such rank)."""
        if row is None:
            raise StaleLease(f"producer token {token}: no producer replica {rank} is registered")
        holder = Holder(*row)
        if holder.token != token or holder.state != ACTIVE:
            raise self._fenced(self.producer_role(rank), token, holder)

    def check_consumer(self, cur: schema.Sql, cid: str, token: int) -> int:
        """Return the consumer's cursor; raise Detached / StaleLease if fenced off."""
        row = cur.execute(f"SELECT {CONSUMER_CHECK} FROM consumers WHERE id=?", (cid,)).fetchone()
        return self.consumer_cursor(cid, token, row)

    def consumer_cursor(self, cid: str, token: int, row: tuple[Any, ...] | None) -> int:
        """check_consumer on a row of CONSUMER_CHECK's columns read already (None: no
        such consumer)."""
        if row is None:
            raise StaleLease(f"consumer {cid} is not registered")
        cursor, note, holder = row[0], row[1], Holder(*row[2:])
        if holder.state == RoleState.DETACHED and (
            holder.pid is None or holder.is_process(this_process())
        ):
            raise Detached(f"consumer {cid} was detached ({note})")
        if holder.token != token or holder.state != ACTIVE:
            raise self._fenced(f"consumer {cid}", token, holder)
        return int(cursor)

    def _fenced(self, role: str, token: int, holder: Holder) -> StaleLease:
        """The error for a call whose token is no longer the role's: who has the role now.

        Never advises registering again: the role is someone else's (RoleTaken), or
        this process was declared lost, or it already ended its registration.
        """
        if holder.token == token:
            return StaleLease(
                f"{role}: this process already ended its registration (state {holder.state}); "
                "no further calls are accepted"
            )
        mine = holder.is_process(this_process())
        if not mine and not (holder.state == RoleState.LOST and holder.pid is None):
            now = "holds it now" if holder.state == ACTIVE else f"is now {holder.state}"
            return RoleTaken(
                f"{role}: another process took this role: {holder} registered it after this "
                f"process and {now} (token {token} is stale, the role's is {holder.token}). "
                "This process is fenced off and stops here; nothing it does changes the run"
            )
        if holder.state != RoleState.LOST:
            return StaleLease(
                f"{role}: token {token} is stale: this same process registered the role again "
                f"(token {holder.token}); the older registration is fenced off"
            )
        return StaleLease(
            f"{role}: token {token} is stale: this process was declared lost (its heartbeat "
            f"did not move for ttl_s = {self.run.config.ttl_s:g} s: paused, stalled, or cut "
            "off from the coordinator) and fenced off; it stops here. Nothing holds the role "
            "now: restarting this process (trainers: with --resume) rejoins"
        )

    # ---- liveness ----------------------------------------------------------------

    def heartbeat(self, reg: ConsumerReg | ProducerReg) -> None:
        """Prove liveness (increments the heartbeat counter). Fenced: one statement moves
        the counter only while the role is active under this token, else the check
        says why (a token never comes back, so a miss stays a miss).

        It takes no run-wide lock (Database.write_row): the counter is all it changes,
        and what decides on the counter (a reclaim's `hb_seq=?`) or changes the row's
        token or state (a registration, a reclaim, a detach) is ordered against it by
        the row's lock, and sees it (PostgreSQL re-reads a row it waited for)."""
        conn = self.run.conn
        ident: int | str  # the role's row: its key
        says_why: Callable[[], object]  # raises the error that names why a beat missed
        if isinstance(reg, ProducerReg):
            table, column, ident, role = "producers", "rank", reg.rank, reg.role_id
            says_why = functools.partial(self.check_producer, conn, reg.token, reg.rank)
        else:
            table, column, ident = "consumers", "id", reg.consumer_id
            role = f"consumer {reg.consumer_id}"
            says_why = functools.partial(self.check_consumer, conn, reg.consumer_id, reg.token)
        if not conn.write_row(
            f"UPDATE {table} SET hb_seq=hb_seq+1, hb_wall=? WHERE {column}=? AND token=? "
            "AND state=?",
            (wall(), ident, reg.token, ACTIVE),
        ):
            says_why()
            raise StaleLease(f"{role}: token {reg.token} is stale")  # not reached

    def reclaim_lost(self, exclude: Iterable[str] = ()) -> list[str]:
        """Declare lost every process whose heartbeat counter stood still for ttl_s
        on this process's own clock; release its leases/claims and fence it. Returns
        their ids: producer replicas are `producer:r<rank>` here (grants.producer_id)."""
        consumers = self.run.conn.execute(
            "SELECT id, token, hb_seq FROM consumers WHERE state=?", (ACTIVE,)
        ).fetchall()
        producers = self.run.conn.execute(
            "SELECT rank, token, hb_seq FROM producers WHERE state=?", (ACTIVE,)
        ).fetchall()
        ranks = {producer_id(int(r)): int(r) for r, _, _ in producers}
        rows = [(str(c), int(t), int(q)) for c, t, q in consumers]
        rows += [(producer_id(int(r)), int(t), int(q)) for r, t, q in producers]
        lost = self.reclaimer.observe(rows, exclude)
        done = []
        for pid, token, seq in lost:
            with self.run.write() as cur:
                new = self.run.bump(cur, "next_token")
                if pid in ranks:
                    n = cur.execute(
                        "UPDATE producers SET state=?, token=? WHERE rank=? AND token=? AND "
                        "hb_seq=? AND state=?",
                        (RoleState.LOST.value, new, ranks[pid], token, seq, ACTIVE),
                    ).rowcount
                    if n:
                        self.release_claims_of(cur, ranks[pid])
                else:
                    n = cur.execute(
                        "UPDATE consumers SET state=?, token=? WHERE id=? AND token=? AND "
                        "hb_seq=? AND state=?",
                        (RoleState.LOST.value, new, pid, token, seq, ACTIVE),
                    ).rowcount
                    if n:
                        cur.execute("DELETE FROM leases WHERE consumer=?", (pid,))
                if n:
                    self.run.bump(cur, "reclaims")
                    done.append(pid)
        for pid in done:
            log.warning(
                "%s lost: no heartbeat for %.1f s; leases/claims released",
                pid, self.run.config.ttl_s,
            )  # fmt: skip
        return done

    # ---- detaching ---------------------------------------------------------------

    def detach_consumer(self, consumer_id: str, *, force: bool = False) -> list[str]:
        """`fanout detach`: release a stopped or lost consumer (`name:dp<rank>`, or a
        name: every rank of it) so it no longer holds windows back. Refuses an active
        one (ConfigError naming it) unless `force` (it is fenced off: Detached on its
        next call). Recorded (state 'detached', a note, the `detaches` counter); the
        consumer may register again later. Returns one line per consumer."""
        done: list[str] = []
        with self.run.write() as cur:
            rows = cur.execute(
                f"SELECT id, cursor, {HOLDER_COLUMNS} FROM consumers ORDER BY id"
            ).fetchall()
            mine = [r for r in rows if consumer_id in (r[0], str(r[0]).rpartition(":dp")[0])]
            if not mine:
                known = ", ".join(str(r[0]) for r in rows) or "none"
                raise ConfigError(
                    f"no consumer {consumer_id!r} in {self.run.root} (registered: {known})"
                )
            for row in mine:
                cid, cursor, holder = str(row[0]), int(row[1]), Holder(*row[2:])
                if holder.state in states.RELEASED:
                    done.append(f"{cid}: already {holder.state}; it holds nothing back")
                    continue
                live = holder.state == ACTIVE and not process_gone(holder.proc, holder.pid)
                if live and not force:
                    raise ConfigError(
                        f"consumer {cid} of {self.run.root} is active ({holder}, last heartbeat "
                        f"{wall() - holder.hb_wall:.1f} s ago): stop it first (SIGINT or "
                        "SIGTERM: it saves a checkpoint and exits), or pass --force to detach "
                        "it anyway (it is fenced off and exits 3)"
                    )
                was = (
                    ACTIVE
                    if live
                    else (RoleState.LOST.value if holder.state == ACTIVE else holder.state)
                )
                when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
                note = f"by `fanout detach` at {when}; was {was} at cursor {cursor}"
                retention.detach(cur, cid, self.run.bump(cur, "next_token"), note)
                done.append(f"{cid}: detached ({note})")
            doomed = self.eviction.mark(cur)
        self.eviction.finish(doomed)
        return done  # not logged too: `fanout detach` prints them, once, on stdout
