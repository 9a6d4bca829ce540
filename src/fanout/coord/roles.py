"""Who may act on a run: registering the producer and the consumers, fencing, heartbeats,
reclaiming the lost, detaching.

    roles = Roles(run, eviction)             # a part of fanout.coord.coordinator.Coordinator
    reg = roles.register_consumer("b8", dp_rank=0)
    with run.write() as cur:
        cursor = roles.check_consumer(cur, reg.consumer_id, reg.token)   # fenced

Roles are exclusive: the producer, and each consumer id `name:dp<rank>`, is held by
one process at a time (fanout.coord.liveness decides who is live). A newcomer is
refused with RoleHeld while a live process holds the role, unless it takes over;
every registration takes a new token from one counter that never repeats, and every
later call is checked against it (`check_producer`, `check_consumer`), so a process
that was replaced, reclaimed as lost or detached gets StaleLease / RoleTaken /
Detached and changes nothing.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from fanout.contract import CaptureContract
from fanout.coord import schema
from fanout.coord.core import RunDb
from fanout.coord.eviction import Eviction
from fanout.coord.leases import ConsumerReg, ProducerReg
from fanout.coord.liveness import (
    HOLDER_COLUMNS,
    Holder,
    ProcessInfo,
    Reclaimer,
    RoleWatch,
    process_gone,
    this_process,
    wall,
)
from fanout.coord.states import release_claims
from fanout.errors import ConfigError, ContractMismatch, Detached, RoleHeld, RoleTaken, StaleLease

log = logging.getLogger("fanout.coord.coordinator")
T = TypeVar("T")

_PRODUCER = (f"SELECT {HOLDER_COLUMNS} FROM producer", ())


def _consumer_row(cid: str) -> tuple[str, tuple[object, ...]]:
    return (f"SELECT {HOLDER_COLUMNS} FROM consumers WHERE id=?", (cid,))


class Roles:
    """Registration, fencing and liveness for the producer and every consumer."""

    def __init__(self, run: RunDb, eviction: Eviction) -> None:
        self.run, self.eviction = run, eviction
        self.reclaimer = Reclaimer(run.config.ttl_s, run.clock)
        self._watch: dict[str, RoleWatch] = {}  # what take_role saw, per role

    @property
    def producer_role(self) -> str:
        return f"the producer of {self.run.root}"

    # ---- registering -------------------------------------------------------------

    def register_producer(
        self, contract: CaptureContract, owner: str = "", *, takeover: bool = False
    ) -> ProducerReg:
        """Become the run's producer: fences the previous one and releases its claims."""
        if contract != self.run.contract:
            raise ContractMismatch(self.run.contract.diff(contract), where="producer")
        owner = owner or f"pid {os.getpid()}"

        def register(cur: schema.Sql, me: ProcessInfo) -> int:
            token = self.run.bump(cur, "next_token")
            cur.execute(
                "INSERT INTO producer(id, token, hb_wall, state, owner, host, pid, proc) "
                "VALUES (1, ?, ?, 'active', ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
                "token=excluded.token, hb_wall=excluded.hb_wall, state='active', "
                "owner=excluded.owner, host=excluded.host, pid=excluded.pid, proc=excluded.proc",
                (token, wall(), owner, me.host, me.pid, me.proc),
            )
            release_claims(cur)
            return token

        token = self.take_role(self.producer_role, _PRODUCER, takeover, register)
        self.reclaimer.own("producer")
        log.info("producer %s registered (token %d)", owner, token)
        return ProducerReg(token, owner)

    def register_consumer(
        self,
        name: str,
        dp_rank: int = 0,
        expect: dict[str, Any] | None = None,
        cursor: int | None = None,
        *,
        takeover: bool = False,
    ) -> ConsumerReg:
        """Join (or rejoin) as `name:dp<rank>` at `cursor` (default: the stored one)."""
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
                "VALUES (?, ?, ?, ?, 'active', ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
                "expect=excluded.expect, cursor=excluded.cursor, hb_wall=excluded.hb_wall, "
                "state='active', token=excluded.token, note=NULL, host=excluded.host, "
                "pid=excluded.pid, proc=excluded.proc",
                (cid, expect_json, start, wall(), token, me.host, me.pid, me.proc),
            )
            return ConsumerReg(cid, token, start)

        reg = self.take_role(f"consumer {cid}", _consumer_row(cid), takeover, register)
        self.reclaimer.own(cid)
        log.info("consumer %s registered at cursor %d (token %d)", cid, reg.cursor, reg.token)
        return reg

    def check_free(self, role: str, select: tuple[str, tuple[object, ...]]) -> None:
        """Raise RoleHeld now if a live process holds `role` (registers nothing)."""
        self.take_role(role, select, False, lambda cur, me: None)

    def check_producer_role(self) -> None:
        self.check_free(self.producer_role, _PRODUCER)

    def check_consumer_role(self, cid: str) -> None:
        self.check_free(f"consumer {cid}", _consumer_row(cid))

    def take_role(
        self,
        role: str,
        select: tuple[str, tuple[object, ...]],
        takeover: bool,
        register: Callable[[schema.Sql, ProcessInfo], T],
    ) -> T:
        """Run `register` in the write transaction that finds `role` free (RoleWatch).

        Raises RoleHeld while another live process holds it, unless `takeover`. A
        holder that exited on this host is replaced at once; one on another host once
        its heartbeat counter stood still for ttl_s while we watched (no wall clocks).
        """
        me = this_process()
        # Kept per role: a check before a registration (check_producer_role) counts
        # toward the registration's own watch.
        watch = self._watch.setdefault(role, RoleWatch(self.run.config.ttl_s))
        waiting = False
        while True:
            with self.run.write() as cur:
                row = cur.execute(*select).fetchone()
                holder = None if row is None else Holder(*row)
                verdict = watch.verdict(holder, me)
                if verdict == "free" or takeover:
                    if verdict != "free":
                        log.warning("%s: taking over from %s (--takeover)", role, holder)
                    elif holder is not None and holder.state == "active":
                        log.info("%s: replacing %s: %s", role, holder, watch.reason)
                    return register(cur, me)
                if verdict == "held":
                    assert holder is not None
                    del self._watch[role]  # a later try watches afresh
                    raise RoleHeld(self._held_message(role, holder, watch.reason))
            if not waiting:
                waiting = True
                log.warning(
                    "%s is registered to %s (on another host, or not heartbeating): waiting "
                    "up to %g s (ttl_s) to see whether its heartbeat moves",
                    role, holder, self.run.config.ttl_s,
                )  # fmt: skip
            self.run.wait_change(None, max_s=0.2)

    def _held_message(self, role: str, holder: Holder, reason: str) -> str:
        ttl = self.run.config.ttl_s
        return (
            f"{role} is held by {holder} (last heartbeat {wall() - holder.hb_wall:.1f} s ago; "
            f"{reason}); refusing to start a second one. To replace it, stop that process, or "
            "start this one with --takeover (the other is then fenced off and exits). A "
            "holder that stopped or crashed is replaced without --takeover: at once when it "
            f"ran on this host, else once its heartbeat has not moved for ttl_s = {ttl:g} s"
        )

    # ---- fencing -----------------------------------------------------------------

    def check_producer(self, cur: schema.Sql, token: int) -> None:
        """Raise StaleLease / RoleTaken unless `token` is the active producer's."""
        row = cur.execute(*_PRODUCER).fetchone()
        if row is None:
            raise StaleLease(f"producer token {token}: no producer is registered")
        holder = Holder(*row)
        if holder.token != token or holder.state != "active":
            raise self._fenced(self.producer_role, token, holder)

    def check_consumer(self, cur: schema.Sql, cid: str, token: int) -> int:
        """Return the consumer's cursor; raise Detached / StaleLease if fenced off."""
        row = cur.execute(
            f"SELECT cursor, note, {HOLDER_COLUMNS} FROM consumers WHERE id=?", (cid,)
        ).fetchone()
        if row is None:
            raise StaleLease(f"consumer {cid} is not registered")
        cursor, note, holder = row[0], row[1], Holder(*row[2:])
        if holder.state == "detached" and (holder.pid is None or holder.is_process(this_process())):
            raise Detached(f"consumer {cid} was detached ({note})")
        if holder.token != token or holder.state != "active":
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
        if not mine and not (holder.state == "lost" and holder.pid is None):
            now = {"active": "holds it now"}.get(holder.state, f"is now {holder.state}")
            return RoleTaken(
                f"{role}: another process took this role: {holder} registered it after this "
                f"process and {now} (token {token} is stale, the role's is {holder.token}). "
                "This process is fenced off and stops here; nothing it does changes the run"
            )
        if holder.state != "lost":
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
        """Prove liveness (increments the heartbeat counter). Fenced."""
        with self.run.write() as cur:
            if isinstance(reg, ProducerReg):
                self.check_producer(cur, reg.token)
                cur.execute("UPDATE producer SET hb_seq=hb_seq+1, hb_wall=?", (wall(),))
            else:
                self.check_consumer(cur, reg.consumer_id, reg.token)
                cur.execute(
                    "UPDATE consumers SET hb_seq=hb_seq+1, hb_wall=? WHERE id=?",
                    (wall(), reg.consumer_id),
                )

    def reclaim_lost(self, exclude: Iterable[str] = ()) -> list[str]:
        """Declare lost every process whose heartbeat counter stood still for ttl_s
        on this process's own clock; release its leases/claims and fence it."""
        rows = self.run.conn.execute(
            "SELECT id, token, hb_seq FROM consumers WHERE state='active' UNION ALL "
            "SELECT 'producer', token, hb_seq FROM producer WHERE state='active'"
        ).fetchall()
        lost = self.reclaimer.observe([(r[0], r[1], r[2]) for r in rows], exclude)
        done = []
        for pid, token, seq in lost:
            with self.run.write() as cur:
                new = self.run.bump(cur, "next_token")
                if pid == "producer":
                    n = cur.execute(
                        "UPDATE producer SET state='lost', token=? WHERE token=? AND hb_seq=? "
                        "AND state='active'",
                        (new, token, seq),
                    ).rowcount
                    if n:
                        release_claims(cur)
                else:
                    n = cur.execute(
                        "UPDATE consumers SET state='lost', token=? WHERE id=? AND token=? AND "
                        "hb_seq=? AND state='active'",
                        (new, pid, token, seq),
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
                if holder.state in ("detached", "finished"):
                    done.append(f"{cid}: already {holder.state}; it holds nothing back")
                    continue
                live = holder.state == "active" and not process_gone(holder.proc, holder.pid)
                if live and not force:
                    raise ConfigError(
                        f"consumer {cid} of {self.run.root} is active ({holder}, last heartbeat "
                        f"{wall() - holder.hb_wall:.1f} s ago): stop it first (SIGINT or "
                        "SIGTERM: it saves a checkpoint and exits), or pass --force to detach "
                        "it anyway (it is fenced off and exits 3)"
                    )
                was = "active" if live else ("lost" if holder.state == "active" else holder.state)
                when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
                note = f"by `fanout detach` at {when}; was {was} at cursor {cursor}"
                cur.execute("DELETE FROM leases WHERE consumer=?", (cid,))
                cur.execute(
                    "UPDATE consumers SET state='detached', token=?, note=? WHERE id=?",
                    (self.run.bump(cur, "next_token"), note, cid),
                )
                self.run.bump(cur, "detaches")
                done.append(f"{cid}: detached ({note})")
            doomed = self.eviction.mark(cur)
        self.eviction.finish(doomed)
        return done  # not logged too: `fanout detach` prints them, once, on stdout
