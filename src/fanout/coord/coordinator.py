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
(`takeover=True`, the `--takeover` flag; see `_take_role`). The class is built in
layers, each its own module: fanout.coord.base (the connection, tokens, role taking,
reclaiming lost processes, eviction's file side and the named reads of
fanout.coord.reads), fanout.coord.claims (the producer's calls) and this module
(opening a run, the consumers' calls). The eviction and lag rules live in
fanout.coord.retention (with RunConfig), liveness and role holders in
fanout.coord.liveness, the heartbeat thread in fanout.coord.heartbeat, the tokens'
value types in fanout.coord.leases; the file side of eviction and quarantine goes
through fanout.store.store (imported lazily: no torch for `status`). Only
fanout.coord speaks SQL: everything else calls named methods.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fanout.contract import CaptureContract
from fanout.coord import postgresdb, retention, schema, sqlitedb, waits
from fanout.coord.base import Location
from fanout.coord.claims import ProducerSide
from fanout.coord.leases import ConsumerReg, Lease, ProducerReg, WindowFiles
from fanout.coord.liveness import (
    HOLDER_COLUMNS,
    Holder,
    ProcessInfo,
    process_gone,
    this_process,
)
from fanout.coord.retention import RunConfig
from fanout.errors import (
    AcquireCancelled,
    AcquireTimeout,
    ConfigError,
    CoordinatorBusy,
    Detached,
    NoCoordinator,
    StaleLease,
    WindowGone,
)
from fanout.filesystem import FileSystem

log = logging.getLogger(__name__)

DB_NAME = "coordinator.sqlite3"
DB_POINTER = "coordinator.dbpath"  # written when --db-path puts the database elsewhere

__all__ = ["DB_NAME", "DB_POINTER", "Coordinator", "Location", "RunConfig"]


def _root(run_dir: Any) -> Path:
    """A run directory given as a path or as a fanout.store.store.RunDir."""
    return Path(run_dir if isinstance(run_dir, (str, os.PathLike)) else run_dir.root).absolute()


def _now() -> float:
    return time.time()  # wall clock: display (heartbeat age) only, never for decisions


class Coordinator(ProducerSide):
    """One connection to a run's coordinator database. Not thread-safe: one per thread.

    Opening (create, open) and the consumers' calls are here; the producer's in
    fanout.coord.claims, what both share in fanout.coord.base.
    """

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
        made_namespace = False  # a PostgreSQL schema this create made
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
            made_namespace = conn.create_namespace()
            if conn.has_tables():
                conn.close()
                raise ConfigError(
                    f"{where}: a coordinator database already exists there; use open(), "
                    "or give this run its own ?schema=NAME"
                )
        if where != root / DB_NAME:
            # atomic: a torn pointer would send trainers to a database that is not there
            FileSystem().write_atomic(root / DB_POINTER, f"{where}\n".encode())
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
        coord = cls(conn, root, where, store=store, clock=clock)
        coord.created_namespace = made_namespace
        return coord

    def discard_run(self) -> None:
        """Drop this run's tables and close: for a producer start that failed before
        anything used the run (fanout.produce.rundir). On PostgreSQL the schema goes
        too when `create` made it, so a retry with the same URL starts clean; a SQLite
        file is the caller's to remove with the run dir."""
        schema.drop_tables(self.conn)
        if self.created_namespace and isinstance(self.conn, postgresdb.PostgresDatabase):
            self.conn.drop_namespace()
        self.close()

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

    @classmethod
    def open_if_created(
        cls, run_dir: str | os.PathLike[str], *, db_path: str | os.PathLike[str] | None = None
    ) -> Coordinator | None:
        """open(), or None while no producer has created the run yet (no database,
        its tables not committed, or the create holding it locked). For watchers
        (bench probes, reports, the chaos sampler) on either database: the run dir
        records where the database is (DB_POINTER)."""
        try:
            return cls.open(run_dir, db_path=db_path)
        except (NoCoordinator, CoordinatorBusy):
            return None

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

    def check_consumer_role(self, name: str, dp_rank: int = 0, takeover: bool = False) -> None:
        """Raise RoleHeld now if a live process holds consumer `name:dp<rank>` (and not
        `takeover`): a second trainer learns it before it builds anything or takes its
        --save-path (fanout.train.savepath)."""
        if takeover:
            return
        cid = f"{name}:dp{dp_rank}"
        self._take_role(
            f"consumer {cid}",
            (f"SELECT {HOLDER_COLUMNS} FROM consumers WHERE id=?", (cid,)),
            False,
            lambda cur, me: None,
        )

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
            raise Detached(f"consumer {cid} was detached ({note})")
        if holder.token != token or holder.state != "active":
            raise self._fenced(f"consumer {cid}", token, holder)
        return int(cursor)

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
            with self._write() as cur:
                cursor = self._check_consumer(cur, reg.consumer_id, reg.token)
                w = cursor if window is None else window
                if w < cursor:
                    raise ConfigError(f"{reg.consumer_id}: window {w} is behind cursor {cursor}")
                total = self.config.total_windows
                end = waits.stream_end(cur)
                if (total is not None and w >= total) or (end is not None and w >= end):
                    return None
                lease, state = self._try_lease(cur, reg, w)
                if lease is not None:
                    return lease
                why = waits.consumer_wait(cur, self.config, reg.consumer_id, w)
            if on_wait is not None:
                on_wait(why)
            self.reclaim_lost()
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
            self._wait_change(left)

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
        """The consumer reached its own end (the stream's, --max-steps, --epochs): state
        'finished', leases dropped; its cursor stops holding windows back under every
        lag policy. A later --resume registers it again, as a late joiner."""
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
        """The consumer exits before its end (a signal, a timeout, a failed window):
        state 'stopped', leases dropped. Its cursor still holds windows back, as a lost
        one's does: a restart (--resume) continues there, `fanout detach` releases it."""
        with self._write() as cur:
            self._check_consumer(cur, reg.consumer_id, reg.token)
            cur.execute("DELETE FROM leases WHERE consumer=?", (reg.consumer_id,))
            cur.execute(
                "UPDATE consumers SET state='stopped', hb_wall=? WHERE id=?",
                (_now(), reg.consumer_id),
            )

    def detach_consumer(self, consumer_id: str, *, force: bool = False) -> list[str]:
        """`fanout detach`: release a stopped or lost consumer (`name:dp<rank>`, or a
        name: every rank of it) so it no longer holds windows back. Refuses an active
        one (ConfigError naming it) unless `force` (it is fenced off: Detached on its
        next call). Recorded (state 'detached', a note, the `detaches` counter); the
        consumer may register again later. Returns one line per consumer."""
        done: list[str] = []
        with self._write() as cur:
            rows = cur.execute(
                f"SELECT id, cursor, {HOLDER_COLUMNS} FROM consumers ORDER BY id"
            ).fetchall()
            known = [str(r[0]) for r in rows]
            mine = [r for r in rows if consumer_id in (r[0], str(r[0]).rpartition(":dp")[0])]
            if not mine:
                raise ConfigError(
                    f"no consumer {consumer_id!r} in {self.root} (registered: "
                    f"{', '.join(known) or 'none'})"
                )
            for row in mine:
                cid, cursor, holder = str(row[0]), int(row[1]), Holder(*row[2:])
                if holder.state in ("detached", "finished"):
                    done.append(f"{cid}: already {holder.state}; it holds nothing back")
                    continue
                live = holder.state == "active" and not process_gone(holder.proc, holder.pid)
                if live and not force:
                    raise ConfigError(
                        f"consumer {cid} of {self.root} is active ({holder}, last heartbeat "
                        f"{_now() - holder.hb_wall:.1f} s ago): stop it first (SIGINT or "
                        "SIGTERM: it saves a checkpoint and exits), or pass --force to detach "
                        "it anyway (it is fenced off and exits 3)"
                    )
                was = "active" if live else ("lost" if holder.state == "active" else holder.state)
                when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
                note = f"by `fanout detach` at {when}; was {was} at cursor {cursor}"
                cur.execute("DELETE FROM leases WHERE consumer=?", (cid,))
                cur.execute(
                    "UPDATE consumers SET state='detached', token=?, note=? WHERE id=?",
                    (self._bump(cur, "next_token"), note, cid),
                )
                self._bump(cur, "detaches")
                done.append(f"{cid}: detached ({note})")
            doomed = retention.mark_evictable(cur, self.config.expected_consumers)
        self._finish_evictions(doomed)
        for line in done:
            log.warning("%s", line)
        return done

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
