"""The coordinator: windows, consumers, leases, cursors, eviction, backpressure, fencing.

    from fanout.coord.coordinator import Coordinator, RunConfig
    coord = Coordinator.create("runs/demo", contract, RunConfig(max_live_windows=4))
    p = coord.register_producer(contract)                       # producer side
    while coord.wait_for_capacity(p, timeout_s=60) and (c := coord.claim(p)):
        coord.publish_ready(c, store.publish(tensors, meta))
    reg = Coordinator.open("runs/demo").register_consumer("draft-b8", dp_rank=0)
    lease = coord.acquire(reg, timeout_s=600); ...; coord.ack(lease)   # consumer side

One database shared by one producer and N consumers, each holding its own
`Coordinator` (one connection, one thread): SQLite beside the run (fanout.coord.sqlitedb,
the default; one host) or PostgreSQL (fanout.coord.postgresdb, when `db_path` is a
`postgresql://` URL; several hosts). Both hold the tables of fanout.coord.schema and
run the same statements. Every state change is one short serialised write
transaction fenced by a token: a consumer's epoch token, a lease token, the
producer's token or its claim token. Tokens come from one
counter and are never reused, so a process that was reclaimed, detached or
superseded ("zombie") gets StaleLease/RoleTaken/Detached on its next write and
changes nothing. Roles are exclusive: while a live process holds the producer role
or a consumer id, a second one is refused with RoleHeld unless it takes over
(`takeover=True`, the `--takeover` flag; see `_take_role`). The producer's calls
live in fanout.coord.claims (a mixin of this class), the eviction and lag rules in
fanout.coord.retention (with RunConfig), liveness and role holders in fanout.coord.liveness,
the tokens' value types in fanout.coord.leases; the file side of eviction and
quarantine goes through fanout.store.store (imported lazily: no torch for `status`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from fanout.contract import CaptureContract
from fanout.coord import postgresdb, retention, schema, sqlitedb
from fanout.coord.claims import ProducerSide
from fanout.coord.leases import ConsumerReg, Lease, ProducerReg, WindowFiles
from fanout.coord.liveness import (
    HOLDER_COLUMNS,
    Holder,
    ProcessInfo,
    Reclaimer,
    RoleWatch,
    this_process,
)
from fanout.coord.retention import RunConfig
from fanout.errors import (
    AcquireCancelled,
    AcquireTimeout,
    ConfigError,
    Detached,
    NoCoordinator,
    RoleHeld,
    RoleTaken,
    StaleLease,
    WindowGone,
)

log = logging.getLogger(__name__)

DB_NAME = "coordinator.sqlite3"
DB_POINTER = "coordinator.dbpath"  # written when --db-path puts the database elsewhere

Location = Path | str  # a SQLite file, or a postgresql:// URL (without its password)
T = TypeVar("T")


def _root(run_dir: Any) -> Path:
    """A run directory given as a path or as a fanout.store.store.RunDir."""
    return Path(run_dir if isinstance(run_dir, (str, os.PathLike)) else run_dir.root).absolute()


def _now() -> float:
    return time.time()  # wall clock: display (heartbeat age) only, never for decisions


class Coordinator(ProducerSide):
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
        self._blocked_since: float | None = None  # producer's own clock, for `detach`
        self._role_watch: dict[str, RoleWatch] = {}  # what _take_role saw, per role

    # ---- opening -----------------------------------------------------------------

    @staticmethod
    def resolve_db_path(root: Path, db_path: str | os.PathLike[str] | None) -> Location:
        """--db-path if given (a path, sqlite:///path or a postgresql:// URL), else what
        create() recorded in the run dir, else root/coordinator.sqlite3."""
        if db_path is None and (root / DB_POINTER).is_file():
            db_path = (root / DB_POINTER).read_text().strip()
        if db_path is None:
            return root / DB_NAME
        if postgresdb.is_url(db_path):
            return str(db_path)
        path = str(db_path)
        if path.startswith("sqlite:///"):  # DESIGN's URL form of a SQLite file
            path = path[len("sqlite://") :]
        return Path(path).absolute()

    @classmethod
    def exists(cls, run_dir: str | os.PathLike[str], db_path: str | None = None) -> bool:
        """Has a producer created this run's database? (Clears an interrupted SQLite create.)"""
        where = cls.resolve_db_path(_root(run_dir), db_path)
        if isinstance(where, Path):
            return sqlitedb.exists(where)
        return postgresdb.exists(where)

    @classmethod
    def create(
        cls,
        run_dir: str | os.PathLike[str],
        contract: CaptureContract,
        config: RunConfig | None = None,
        *,
        db_path: str | os.PathLike[str] | None = None,
        allow_network_fs: bool = False,
        mountinfo: str | None = None,
        store: WindowFiles | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> Coordinator:
        """Create the database of a new run (refused if one exists) and write contract.json."""
        config = config or RunConfig()
        root = _root(run_dir)
        root.mkdir(parents=True, exist_ok=True)
        where = cls.resolve_db_path(root, db_path)
        conn: schema.Database
        if isinstance(where, Path):
            if where.exists():
                raise ConfigError(f"{where}: a coordinator database already exists; use open()")
            where.parent.mkdir(parents=True, exist_ok=True)
            if not allow_network_fs:
                sqlitedb.check_local_filesystem(where, mountinfo)
            conn = sqlitedb.SqliteDatabase(where, busy_timeout_s=config.busy_timeout_s)
        else:
            conn = postgresdb.PostgresDatabase(where)
            where = conn.where  # never write a password into the run dir
            conn.create_namespace()
            if conn.has_tables():
                conn.close()
                raise ConfigError(
                    f"{where}: a coordinator database already exists there; use open(), "
                    "or give this run its own ?schema=NAME"
                )
        if where != root / DB_NAME:
            (root / DB_POINTER).write_text(f"{where}\n")
        contract.save(root / "contract.json")
        schema.create_schema(
            conn,
            {
                "config": config.model_dump_json(),
                "contract": contract.model_dump_json(),
                "stream_id": contract.stream_id,
            },
        )
        log.info("created coordinator %s (stream %s, %s)", where, contract.stream_id, config)
        return cls(conn, root, where, store=store, clock=clock)

    @classmethod
    def open(
        cls,
        run_dir: str | os.PathLike[str],
        *,
        db_path: str | os.PathLike[str] | None = None,
        allow_network_fs: bool = False,
        mountinfo: str | None = None,
        store: WindowFiles | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> Coordinator:
        """Open an existing run's database (SchemaVersionError if it is not one we know)."""
        root = _root(run_dir)
        where = cls.resolve_db_path(root, db_path)
        conn: schema.Database
        if isinstance(where, Path):
            if not allow_network_fs:
                sqlitedb.check_local_filesystem(where, mountinfo)
            if not where.is_file():
                raise NoCoordinator(
                    f"{where}: no coordinator database (has a producer created the run?)"
                )
            conn = sqlitedb.SqliteDatabase(where)
        else:
            conn = postgresdb.PostgresDatabase(where)
            where = conn.where
        return cls(conn, root, where, store=store, clock=clock)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Coordinator:
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

    # ---- consumer side -----------------------------------------------------------

    def register_consumer(
        self,
        name: str,
        dp_rank: int = 0,
        expect: dict[str, Any] | None = None,
        cursor: int | None = None,
        *,
        takeover: bool = False,
    ) -> ConsumerReg:
        """Join (or rejoin) as `name:dp<rank>`; `cursor` resumes from a checkpoint.

        A rejoin keeps the stored cursor unless `cursor` is given (which may move it
        back: that window is then recaptured), fences the previous incarnation and
        drops its leases. RoleHeld while another live process holds this id (see
        `_take_role`), unless `takeover`. ContractMismatch names every expected field
        that differs.
        """
        if not name or ":" in name:
            raise ConfigError(f"consumer name {name!r}: must be non-empty without ':'")
        cid = f"{name}:dp{dp_rank}"
        self.contract.require(expect or {}, where=f"consumer {cid}")
        expect_json = json.dumps(expect or {}, sort_keys=True)

        def register(cur: schema.Sql, me: ProcessInfo) -> ConsumerReg:
            token = self._bump(cur, "next_token")
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
                (cid, expect_json, start, _now(), token, me.host, me.pid, me.proc),
            )
            return ConsumerReg(cid, token, start)

        reg = self._take_role(
            f"consumer {cid}",
            (f"SELECT {HOLDER_COLUMNS} FROM consumers WHERE id=?", (cid,)),
            takeover,
            register,
        )
        self._reclaimer.own(cid)
        log.info("consumer %s registered at cursor %d (token %d)", cid, reg.cursor, reg.token)
        return reg

    def resume(self, reg: ConsumerReg, cursor: int) -> ConsumerReg:
        """Re-register `reg`'s consumer at `cursor` (its checkpoint's)."""
        name, _, rank = reg.consumer_id.rpartition(":dp")
        return self.register_consumer(name, int(rank), cursor=cursor)

    def _check_consumer(self, cur: schema.Sql, cid: str, token: int) -> int:
        """Return the consumer's cursor; raise Detached / StaleLease if fenced off."""
        row = cur.execute(
            f"SELECT cursor, note, {HOLDER_COLUMNS} FROM consumers WHERE id=?", (cid,)
        ).fetchone()
        if row is None:
            raise StaleLease(f"consumer {cid} is not registered")
        cursor, note, holder = row[0], row[1], Holder(*row[2:])
        if holder.state == "detached" and (holder.pid is None or holder.is_process(this_process())):
            raise Detached(f"consumer {cid} was detached by the lag policy ({note})")
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

    def heartbeat(self, reg: ConsumerReg | ProducerReg) -> None:
        """Prove liveness (increments the heartbeat counter). Fenced."""
        with self._write() as cur:
            if isinstance(reg, ProducerReg):
                self._check_producer(cur, reg.token)
                cur.execute("UPDATE producer SET hb_seq=hb_seq+1, hb_wall=?", (_now(),))
            else:
                self._check_consumer(cur, reg.consumer_id, reg.token)
                cur.execute(
                    "UPDATE consumers SET hb_seq=hb_seq+1, hb_wall=? WHERE id=?",
                    (_now(), reg.consumer_id),
                )

    def acquire(
        self,
        reg: ConsumerReg,
        timeout_s: float | None = None,
        window: int | None = None,
        cancel: threading.Event | None = None,
    ) -> Lease | None:
        """Lease the window at the cursor (or `window` ≥ cursor), waiting until it is ready.

        Returns None at the end of a finite stream. An evicted window is put on
        demand and captured again (new generation); a failed one raises WindowGone.
        Raises AcquireTimeout after `timeout_s` (None waits forever), AcquireCancelled
        within ~50 ms of `cancel` being set (a prefetch thread at shutdown).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if cancel is not None and cancel.is_set():
                raise AcquireCancelled(f"{reg.consumer_id}: acquire cancelled")
            with self._write() as cur:
                cursor = self._check_consumer(cur, reg.consumer_id, reg.token)
                w = cursor if window is None else window
                if w < cursor:
                    raise ConfigError(f"{reg.consumer_id}: window {w} is behind cursor {cursor}")
                total = self.config.total_windows
                if total is not None and w >= total:
                    return None
                lease, state = self._try_lease(cur, reg, w)
            if lease is not None:
                return lease
            self.reclaim_lost()
            if deadline is not None and time.monotonic() >= deadline:
                raise AcquireTimeout(
                    f"{reg.consumer_id}: window {w} not ready after {timeout_s} s (state {state})"
                )
            self._wait_change(deadline)

    def _try_lease(self, cur: schema.Sql, reg: ConsumerReg, w: int) -> tuple[Lease | None, str]:
        cid = reg.consumer_id
        row = cur.execute(
            "SELECT state, generation, name, path, last_error FROM windows WHERE window=?", (w,)
        ).fetchone()
        if row is None:
            if w >= int(self._meta_cur(cur, "next_window")):
                return None, "not yet produced"
            # An evicted row that compaction deleted: same as evicted.
            cur.execute(
                "INSERT INTO windows(window, state, demand, updated_at) VALUES (?, 'queued', 1, ?)",
                (w, _now()),
            )
            return None, "evicted; queued for recapture"
        state, gen, name, path, err = row
        if state == "ready":
            held = cur.execute(
                "SELECT token FROM leases WHERE consumer=? AND window=?", (cid, w)
            ).fetchone()
            if held is not None:
                token = int(held[0])
            else:
                token = self._bump(cur, "next_token")
                cur.execute(
                    "INSERT INTO leases(token, consumer, window, generation, epoch, acquired_wall) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (token, cid, w, gen, reg.token, _now()),
                )
            return Lease(cid, w, gen, name, path, token, reg.token, self._rows(w)), state
        if state in ("evicted", "evicting"):
            cur.execute(
                "UPDATE windows SET state='queued', demand=1, attempts=0, name=NULL, path=NULL, "
                "updated_at=? WHERE window=?",
                (_now(), w),
            )
            log.info("window %d wanted by %s after eviction: queued for recapture", w, cid)
            return None, "evicted; queued for recapture"
        if state == "queued":
            cur.execute("UPDATE windows SET demand=1 WHERE window=? AND demand=0", (w,))
            return None, "queued for recapture"
        if state == "failed":
            raise WindowGone(f"window {w} failed {self.config.max_attempts} captures: {err}")
        return None, state

    @staticmethod
    def _meta_cur(cur: schema.Sql, key: str) -> Any:
        if key in schema.COUNTERS:
            return int(cur.execute("SELECT value FROM counters WHERE key=?", (key,)).fetchone()[0])
        row = cur.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else row[0]

    def _held_lease(self, cur: schema.Sql, lease: Lease) -> None:
        self._check_consumer(cur, lease.consumer_id, lease.epoch)
        held = cur.execute(
            "SELECT 1 FROM leases WHERE token=? AND consumer=?", (lease.token, lease.consumer_id)
        ).fetchone()
        if held is None:
            raise StaleLease(
                f"{lease.consumer_id}: lease {lease.token} on window {lease.window} is not held"
            )

    def ack(self, lease: Lease) -> None:
        """The window was consumed: drop the lease, advance the cursor (never backwards)."""
        with self._write() as cur:
            self._held_lease(cur, lease)
            cur.execute("DELETE FROM leases WHERE token=?", (lease.token,))
            nxt = lease.window + 1
            cur.execute(
                "UPDATE consumers SET cursor = CASE WHEN cursor < ? THEN ? ELSE cursor END "
                "WHERE id=?",
                (nxt, nxt, lease.consumer_id),
            )
            doomed = retention.mark_evictable(cur, self.config.expected_consumers)
        self._finish_evictions(doomed)

    def release(self, lease: Lease) -> bool:
        """Give a lease back without consuming it (cursor unchanged). False if not held."""
        with self._write() as cur:
            n = cur.execute(
                "DELETE FROM leases WHERE token=? AND consumer=?", (lease.token, lease.consumer_id)
            ).rowcount
        return n > 0

    def finish(self, reg: ConsumerReg) -> None:
        """The consumer is done for good: its cursor stops holding windows back."""
        with self._write() as cur:
            self._check_consumer(cur, reg.consumer_id, reg.token)
            cur.execute("DELETE FROM leases WHERE consumer=?", (reg.consumer_id,))
            cur.execute(
                "UPDATE consumers SET state='finished', hb_wall=? WHERE id=?",
                (_now(), reg.consumer_id),
            )
            doomed = retention.mark_evictable(cur, self.config.expected_consumers)
        self._finish_evictions(doomed)

    def stop(self, reg: ConsumerReg) -> None:
        """The consumer exits cleanly before the end of its stream (--max-steps, a
        signal): state 'stopped', leases dropped. Its cursor still holds windows back,
        as a lost one's does: a restart (--resume) continues there."""
        with self._write() as cur:
            self._check_consumer(cur, reg.consumer_id, reg.token)
            cur.execute("DELETE FROM leases WHERE consumer=?", (reg.consumer_id,))
            cur.execute(
                "UPDATE consumers SET state='stopped', hb_wall=? WHERE id=?",
                (_now(), reg.consumer_id),
            )

    def report_corrupt(self, lease: Lease, reason: str) -> None:
        """Quarantine the leased file and queue the window for recapture (new generation)."""
        with self._write() as cur:
            self._held_lease(cur, lease)
        self.store.quarantine(lease.name)  # a file already gone is fine (another reporter)
        with self._write() as cur:
            cur.execute("DELETE FROM leases WHERE token=?", (lease.token,))
            n = cur.execute(
                "UPDATE windows SET state='queued', demand=1, name=NULL, path=NULL, nbytes=0, "
                "last_error=?, updated_at=? WHERE window=? AND generation=? AND state='ready'",
                (f"corrupt: {reason}", _now(), lease.window, lease.generation),
            ).rowcount
            if n:
                self._bump(cur, "corrupt")
        log.warning(
            "window %d g%d corrupt (%s): quarantined", lease.window, lease.generation, reason
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
                        self._release_claims(cur)
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
