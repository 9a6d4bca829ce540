"""What the producer's and the consumers' calls share: one connection, tokens, roles, liveness.

    class ProducerSide(CoordinatorBase): ...        # fanout.coord.claims
    class Coordinator(ProducerSide): ...            # fanout.coord.coordinator (opening, consumers)

`CoordinatorBase` holds a run's connection, its RunConfig and CaptureContract, and
the machinery both sides of fanout.coord.coordinator.Coordinator use: the counters
that hand out tokens (`_bump`), role taking and the fencing errors (`_take_role`,
`_fenced`), eviction's file side (`_finish_evictions`), reclaiming lost processes
(`reclaim_lost`, fanout.coord.liveness decides who is lost), the sweeper's
`is_live`, and the named reads of fanout.coord.reads. Callers use the Coordinator;
this class is never built on its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Self, TypeVar

from fanout.contract import CaptureContract
from fanout.coord import reads, retention, schema
from fanout.coord.leases import WindowFiles
from fanout.coord.liveness import Holder, ProcessInfo, Reclaimer, RoleWatch, this_process
from fanout.coord.retention import RunConfig
from fanout.errors import RoleHeld, RoleTaken, StaleLease

log = logging.getLogger("fanout.coord.coordinator")

Location = Path | str  # a SQLite file, or a postgresql:// URL (without its password)
T = TypeVar("T")


def _now() -> float:
    return time.time()  # wall clock: display (heartbeat age) only, never for decisions


def release_claims(cur: schema.Sql) -> None:
    """Requeue every window being captured, with demand: it is captured again first,
    under a new generation (the producer that claimed it is gone or was replaced)."""
    cur.execute(
        "UPDATE windows SET state='queued', demand=1, claim_token=NULL WHERE state='capturing'"
    )


class CoordinatorBase:
    """One connection to a run's coordinator database. Not thread-safe: one per thread."""

    def __init__(
        self,
        conn: schema.Database,
        root: Path,
        db_path: Location,
        *,
        store: WindowFiles | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.conn, self.root, self.db_path, self.clock = conn, root, db_path, clock
        try:
            schema.check_schema(conn)
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        except BaseException:
            conn.close()
            raise
        self.config = RunConfig.model_validate_json(meta["config"])
        self.contract = CaptureContract.model_validate_json(meta["contract"])
        self._store = store
        self._reclaimer = Reclaimer(self.config.ttl_s, clock)
        self._role_watch: dict[str, RoleWatch] = {}  # what _take_role saw, per role
        self.created_namespace = False  # create() made the PostgreSQL schema

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def store(self) -> WindowFiles:
        if self._store is None:
            # Imported lazily: `fanout status` must not pay for torch.
            from fanout.filesystem import FileSystem
            from fanout.store.store import RunDir, Store

            self._store = Store(RunDir(self.root), FileSystem())
        return self._store

    # ---- small helpers -----------------------------------------------------------

    def meta(self, key: str) -> Any:
        """A counter (schema.COUNTERS, an int) or a stored run setting (text)."""
        return self._meta_cur(self.conn, key)

    @staticmethod
    def _bump(cur: schema.Sql, key: str, n: int = 1) -> int:
        row = cur.execute(
            "UPDATE counters SET value = value + ? WHERE key=? RETURNING value", (n, key)
        ).fetchone()
        return int(row[0])

    def _rows(self, window: int) -> tuple[int, int]:
        r = self.contract.window_rows
        return (window * r, (window + 1) * r)

    def _write(self) -> Any:
        return self.conn.write()

    def _wait_change(self, deadline: float | None, max_s: float = 0.05) -> None:
        """Sleep until another connection commits or max_s passes."""
        self.conn.wait_change(deadline, max_s)

    @staticmethod
    def _meta_cur(cur: schema.Sql, key: str) -> Any:
        if key in schema.COUNTERS:
            return int(cur.execute("SELECT value FROM counters WHERE key=?", (key,)).fetchone()[0])
        row = cur.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else row[0]

    # ---- roles and fencing -------------------------------------------------------

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
            f"did not move for ttl_s = {self.config.ttl_s:g} s: paused, stalled, or cut off "
            "from the coordinator) and fenced off; it stops here. Nothing holds the role now: "
            "restarting this process (trainers: with --resume) rejoins"
        )

    def _take_role(
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
        watch = self._role_watch.setdefault(role, RoleWatch(self.config.ttl_s))
        waiting = False
        while True:
            with self._write() as cur:
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
                    del self._role_watch[role]  # a later try watches afresh
                    raise RoleHeld(self._held_message(role, holder, watch.reason))
            if not waiting:
                waiting = True
                log.warning(
                    "%s is registered to %s (on another host, or not heartbeating): waiting "
                    "up to %g s (ttl_s) to see whether its heartbeat moves",
                    role, holder, self.config.ttl_s,
                )  # fmt: skip
            self._wait_change(None, max_s=0.2)

    def _held_message(self, role: str, holder: Holder, reason: str) -> str:
        age = _now() - holder.hb_wall
        return (
            f"{role} is held by {holder} (last heartbeat {age:.1f} s ago; {reason}); "
            "refusing to start a second one. To replace it, stop that process, or start "
            "this one with --takeover (the other is then fenced off and exits). A holder "
            "that stopped or crashed is replaced without --takeover: at once when it ran "
            f"on this host, else once its heartbeat has not moved for ttl_s = "
            f"{self.config.ttl_s:g} s"
        )

    # ---- eviction ----------------------------------------------------------------

    def _finish_evictions(self, doomed: retention.Doomed) -> None:
        """File first (unlink), then row (evicted): a row never names a missing ready file."""
        if not doomed:
            return
        for _, name in doomed:
            if name:
                self.store.remove(name)
        with self._write() as cur:
            retention.finish_evicted(cur, [w for w, _ in doomed])

    def evict(self) -> int:
        """Evict every evictable window now (also done by ack and the producer's wait)."""
        with self._write() as cur:
            doomed = retention.mark_evictable(cur, self.config.expected_consumers, recover=True)
        self._finish_evictions(doomed)
        return len(doomed)

    # ---- liveness and sweeping ---------------------------------------------------

    def reclaim_lost(self, exclude: Iterable[str] = ()) -> list[str]:
        """Declare lost every process whose heartbeat counter stood still for ttl_s
        on this process's own clock; release its leases/claims and fence it."""
        rows = self.conn.execute(
            "SELECT id, token, hb_seq FROM consumers WHERE state='active' UNION ALL "
            "SELECT 'producer', token, hb_seq FROM producer WHERE state='active'"
        ).fetchall()
        lost = self._reclaimer.observe([(r[0], r[1], r[2]) for r in rows], exclude)
        done = []
        for pid, token, seq in lost:
            with self._write() as cur:
                new = self._bump(cur, "next_token")
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
                    self._bump(cur, "reclaims")
                    done.append(pid)
        for pid in done:
            log.warning(
                "%s lost: no heartbeat for %.1f s; leases/claims released", pid, self.config.ttl_s
            )
        return done

    def is_live(self, window: int, generation: int) -> bool:
        """For the sweeper: is window `window` generation `generation` ready or being captured?"""
        row = self.conn.execute(
            "SELECT 1 FROM windows WHERE window=? AND generation=? AND state IN ('ready','capturing')",
            (window, generation),
        ).fetchone()
        return row is not None

    def sweep(self) -> Any:
        """Finish interrupted evictions, then let the store remove debris and orphans."""
        self.evict()
        return self.store.sweep(self.is_live)

    # ---- reads (fanout.coord.reads) ----------------------------------------------

    def live_windows(self) -> tuple[int, int]:
        """(count, bytes) of the ready windows: what is on disk for trainers now."""
        return reads.live_windows(self.conn)

    def pending_windows(self) -> int:
        """Windows still to be captured (queued or capturing)."""
        return reads.pending_windows(self.conn)

    def active_consumers_before(self, cursor: int) -> int:
        """Active consumers whose cursor is below `cursor`."""
        return reads.active_consumers_before(self.conn, cursor)

    def run_was_used(self, owner: str) -> bool:
        """Did anything use this run beyond producer `owner` creating it: a window
        published, a trainer joined, or another producer took the run over?"""
        return reads.run_was_used(self.conn, owner)

    def consumers_registered(self) -> int:
        """Consumers that ever joined the run, in any state."""
        return reads.consumers_registered(self.conn)

    def audit(self) -> dict[str, Any]:
        """The database's integrity check and the run's end-state invariants, on
        either database (fanout.coord.reads.audit): what the chaos harness checks."""
        return reads.audit(self.conn)
