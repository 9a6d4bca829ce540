"""The coordinator: one database that hands out windows to M producer replicas and N consumers.

    from fanout.coord.coordinator import Coordinator, RunConfig
    coord = Coordinator.create("runs/demo", contract, RunConfig(max_live_windows=4))
    p = coord.register_producer(contract)                       # producer side
    while coord.wait_for_capacity(p, timeout_s=60) and (c := coord.claim(p)):
        coord.publish_ready(c, store.publish(tensors, meta))
    reg = Coordinator.open("runs/demo").register_consumer("draft-b8", dp_rank=0)
    lease = coord.acquire(reg, timeout_s=600); ...; coord.ack(lease)   # consumer side

Each process holds its own `Coordinator` (one connection, one thread) on the run's
database: SQLite beside the run (fanout.coord.sqlitedb, the default; one host) or
PostgreSQL (fanout.coord.postgresdb, when `db_path` is a `postgresql://` URL;
several hosts), with the tables of fanout.coord.schema and the same statements.
Every state change is one short serialised write transaction fenced by a token
(a consumer's epoch token, a lease token, the producer's token or its claim
token; a heartbeat is one statement fenced the same way, ordered by its row's
lock); tokens come from one counter and are never reused, so a process that was
reclaimed, detached or superseded gets StaleLease / RoleTaken / Detached on its
next write and changes nothing.

This module opens runs (create, open) and is the one class callers use. Behind it,
one part per responsibility, each its own module, sharing only the run
(fanout.coord.core.RunDb: connection, settings, tokens):

    roles      registration, fencing, heartbeats, reclaiming the lost, detach
    claims     the producer's work: claim, publish, fail, backpressure at K, its end
    leasing    the consumers' work: acquire, ack, release, corrupt reports, their end
    retention  what may be evicted and when (rules, RunConfig)
    eviction   eviction's file side and the sweep (Eviction)
    reads      named read-only questions: the read API (status, bench, chaos)
    follow_log a followed source's committed chunks (`produce --follow`'s position)

Window states and their legal moves are fanout.coord.states'; liveness rules
fanout.coord.liveness'; the heartbeat thread fanout.coord.heartbeat's; what it grants
(registrations, claims, leases: plain values with their tokens) fanout.coord.grants'. The file side of eviction and quarantine goes
through fanout.store.store (imported lazily: no torch for `status`). Only
fanout.coord speaks SQL: everything else calls named methods.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from fanout.contract import CaptureContract
from fanout.coord import postgresdb, reads, records, retention, schema, sqlitedb
from fanout.coord.claims import Claims
from fanout.coord.core import Location, RunDb
from fanout.coord.eviction import Eviction
from fanout.coord.follow_log import FollowLog
from fanout.coord.grants import ConsumerReg, ProducerReg, WindowFiles
from fanout.coord.leasing import Leasing
from fanout.coord.retention import RunConfig
from fanout.coord.roles import Roles
from fanout.errors import ConfigError, CoordinatorBusy, NoCoordinator
from fanout.filesystem import FileSystem
from fanout.store.rundir import RunDir

log = logging.getLogger(__name__)

__all__ = ["Coordinator", "Location", "RunConfig"]

P = ParamSpec("P")
R = TypeVar("R")


def _root(run_dir: Any) -> Path:
    """A run directory given as a path or as a fanout.store.rundir.RunDir."""
    return Path(run_dir if isinstance(run_dir, (str, os.PathLike)) else run_dir.root).absolute()


def _forward(
    part: str, method: Callable[Concatenate[Any, P], R]
) -> Callable[Concatenate[Any, P], R]:
    """`method` of the part a Coordinator holds as attribute `part`, as a Coordinator
    method: one line into the part that owns the call, whose signature and docstring
    it is (mypy checks the arguments against the part's; help() shows its docstring)."""

    def call(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return method(getattr(self, part), *args, **kwargs)

    return functools.update_wrapper(call, method)


class Coordinator:
    """One connection to a run's coordinator database. Not thread-safe: one per thread.

    Opening (create, open) is here; every other call is one line into the part that
    owns it (the module docstring lists them).
    """

    def __init__(self, run: RunDb) -> None:
        """Compose the parts over `run` (create() and open() build it)."""
        self.run = run
        self.eviction = Eviction(self.run)
        self.roles = Roles(self.run, self.eviction)
        self.claims = Claims(self.run, self.roles, self.eviction)
        self.leasing = Leasing(self.run, self.roles, self.eviction)
        self.follow_log = FollowLog(self.run, self.roles)
        self.conn, self.root, self.db_path = run.conn, run.root, run.db_path
        self.config, self.contract = self.run.config, self.run.contract
        self.created_namespace = False  # create() made the PostgreSQL schema

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def meta(self, key: str) -> Any:
        """A counter (schema.COUNTERS, an int) or a stored run setting (text)."""
        return self.run.meta(self.conn, key)

    # ---- opening -----------------------------------------------------------------

    @staticmethod
    def resolve_db_path(root: Path, db_path: str | os.PathLike[str] | None) -> Location:
        """--db-path if given (a path, sqlite:///path or a postgresql:// URL), else what
        create() recorded in the run dir, else root/coordinator.sqlite3."""
        rd = RunDir(root)
        if db_path is None:
            with contextlib.suppress(FileNotFoundError, IsADirectoryError, NotADirectoryError):
                db_path = rd.db_pointer.read_text().strip() or None
        if db_path is None:
            return rd.database
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
        rd = RunDir(root)
        if where != rd.database:
            # atomic: a torn pointer would send trainers to a database that is not there
            FileSystem().write_atomic(rd.db_pointer, f"{where}\n".encode())
        contract.save(rd.contract)
        try:
            schema.create_schema(
                conn,
                {
                    "config": config.model_dump_json(),
                    "contract": contract.model_dump_json(),
                    "stream_id": contract.stream_id,
                },
            )
        except BaseException:  # another host created it first (ConfigError), or worse
            conn.close()
            raise
        log.info("created coordinator %s (stream %s, %s)", where, contract.stream_id, config)
        coord = cls(RunDb(conn, root, where, store=store, clock=clock))
        coord.created_namespace = made_namespace
        return coord

    def discard_run(self, owner: str) -> bool:
        """Drop this run's tables and close, unless something used it beyond producer
        `owner` creating it (reads.run_was_used, asked in the same write transaction as
        the drop: a trainer that joins meanwhile keeps the run). For a producer start
        that failed (fanout.produce.run_start). On PostgreSQL the schema goes too when
        `create` made it, so a retry with the same URL starts clean; a SQLite file is the
        caller's to remove with the run dir. Returns whether the run was dropped (the
        connection is closed only then)."""
        if not schema.drop_tables(self.conn, keep_if=lambda cur: reads.run_was_used(cur, owner)):
            return False
        if self.created_namespace and isinstance(self.conn, postgresdb.PostgresDatabase):
            self.conn.drop_namespace()
        self.close()
        return True

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
        pointer = RunDir(root).db_pointer
        where = cls.resolve_db_path(root, db_path)
        conn: schema.Database
        if isinstance(where, Path):
            if (
                not where.is_file()
                and db_path is None
                and (not pointer.is_file() or where == RunDir(root).database)
            ):
                # Nothing says where the database is: a PostgreSQL run's pointer is
                # written by the producer that creates it, so do not name a SQLite file,
                # nor refuse one on a shared run dir: the run is not made yet (waited on).
                # A pointer that appeared after resolve_db_path looked is that producer
                # creating it now: the next look reads it.
                raise NoCoordinator(
                    f"{root}: no coordinator database yet: no producer has created this "
                    f"run (neither {where.name} nor {pointer.name}, the pointer to a "
                    "--db-path database, is there); start the producer, or pass --db-path"
                )
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
        return cls(RunDb(conn, root, where, store=store, clock=clock))

    @classmethod
    def open_when_created(
        cls,
        run_dir: str | os.PathLike[str],
        timeout_s: float,
        *,
        db_path: str | os.PathLike[str] | None = None,
        allow_network_fs: bool = False,
        on_wait: Callable[[NoCoordinator | CoordinatorBusy], object] | None = None,
        poll_s: float = 0.2,
    ) -> Coordinator:
        """open(), waiting up to `timeout_s` while no producer has created the run yet
        (what open_if_created reads as None), calling `on_wait` with why after each
        try that found none; the last NoCoordinator / CoordinatorBusy once the time is
        up. The one wait for a run that trainers and monitors (`status --serve`) share;
        anything else that stops open() is raised at once (waiting would not fix it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return cls.open(run_dir, db_path=db_path, allow_network_fs=allow_network_fs)
            except (NoCoordinator, CoordinatorBusy) as e:
                if time.monotonic() > deadline:
                    raise
                if on_wait is not None:
                    on_wait(e)
            time.sleep(poll_s)

    @classmethod
    def open_if_created(
        cls, run_dir: str | os.PathLike[str], *, db_path: str | os.PathLike[str] | None = None
    ) -> Coordinator | None:
        """open(), or None while no producer has created the run yet (no database,
        its tables not committed, or the create holding it locked). For watchers
        (bench probes, reports, the chaos sampler) on either database: the run dir
        records where the database is (RunDir.db_pointer)."""
        try:
            return cls.open(run_dir, db_path=db_path)
        except (NoCoordinator, CoordinatorBusy):
            return None

    # ---- roles (fanout.coord.roles) ---------------------------------------------
    # A call that only passes a part's call through is that method (_forward): its
    # signature and docstring are written once, in the part.

    register_producer = _forward("roles", Roles.register_producer)
    free_rank_order = _forward("roles", Roles.free_rank_order)
    check_plan = _forward("roles", Roles.check_plan)
    register_consumer = _forward("roles", Roles.register_consumer)
    heartbeat = _forward("roles", Roles.heartbeat)
    reclaim_lost = _forward("roles", Roles.reclaim_lost)
    detach_consumer = _forward("roles", Roles.detach_consumer)

    def check_producer_role(
        self, takeover: bool = False, rank: int | None = 0, replicas: int = 1
    ) -> None:
        """Raise RoleHeld now if a live producer holds replica `rank` (None: every rank of
        `replicas`) and not `takeover`: a second producer learns it before it writes
        anything to the run dir."""
        if not takeover:
            self.roles.check_producer_role(rank, replicas)

    def check_consumer_role(self, name: str, dp_rank: int = 0, takeover: bool = False) -> None:
        """Raise RoleHeld now if a live process holds consumer `name:dp<rank>` (and not
        `takeover`): a second trainer learns it before it builds anything or takes its
        --save-path (fanout.train.savepath)."""
        if not takeover:
            self.roles.check_consumer_role(f"{name}:dp{dp_rank}")

    # ---- the producer's work (fanout.coord.claims) ------------------------------

    claim = _forward("claims", Claims.claim)
    renew = _forward("claims", Claims.renew)
    publish_ready = _forward("claims", Claims.publish_ready)
    fail = _forward("claims", Claims.fail)
    wait_for_capacity = _forward("claims", Claims.wait_for_capacity)
    blocked_by = _forward("claims", Claims.blocked_by)

    def finish_producer(self, preg: ProducerReg, stream_end: int | None = None) -> None:
        """A replica's clean exit: state 'finished', its claims released; `stream_end`
        (windows) ends the stream by design (recorded once every window before it is
        published), None (a signal) leaves it open for a restart. How it ended is
        recorded first (fanout.coord.records), so `fanout status` tells a replica stopped
        by a signal from one that finished."""
        with self.run.write() as cur:
            self.roles.check_producer(cur, preg.token, preg.rank)
            records.record_producer_exit(cur, preg.rank, stream_end)
        self.claims.finish_producer(preg, stream_end)

    # ---- a followed source (fanout.coord.follow_log) -----------------------------

    commit_follow_chunk = _forward("follow_log", FollowLog.commit)
    follow_chunks = _forward("follow_log", FollowLog.chunks)
    follow_position = _forward("follow_log", FollowLog.position)

    # ---- the consumers' work (fanout.coord.leasing) -----------------------------

    acquire = _forward("leasing", Leasing.acquire)
    ack = _forward("leasing", Leasing.ack)
    release = _forward("leasing", Leasing.release)
    report_corrupt = _forward("leasing", Leasing.report_corrupt)
    finish = _forward("leasing", Leasing.finish)
    stop = _forward("leasing", Leasing.stop)

    def count_lag_skipped(self, reg: ConsumerReg, n: int = 1) -> None:
        """`n` more windows this consumer acks without training: captured too many
        verifier versions before the newest (--max-verifier-lag; `fanout status`
        shows the count). Fenced by its token: a replaced consumer counts nothing."""
        with self.run.write() as cur:
            cur.execute(
                "UPDATE consumers SET lag_skipped = lag_skipped + ? WHERE id=? AND token=?",
                (int(n), reg.consumer_id, reg.token),
            )

    def newest_verifier_version(self) -> int | None:
        """The newest verifier version a window of the run was captured with (None: a
        verifier that does not change; fanout.coord.reads)."""
        return reads.newest_verifier_version(self.conn)

    # ---- eviction (fanout.coord.eviction) ---------------------------------------

    evict = _forward("eviction", Eviction.evict)
    wants_file = _forward("eviction", Eviction.wants_file)
    sweep = _forward("eviction", Eviction.sweep)

    def acked_by_all(self) -> int:
        """Every window below this one is acknowledged by every counted consumer
        (fanout.coord.retention.acked_by_all): a followed source's chunks retire by it."""
        return retention.acked_by_all(self.conn, self.run.config.expected_consumers)

    # ---- reads (fanout.coord.reads) ----------------------------------------------

    def ready_windows(self) -> tuple[int, int]:
        """(count, bytes) of the ready windows: what is on disk for trainers now."""
        return reads.ready_windows(self.conn)

    def ready_stamps(self) -> list[float]:
        """When each readable window was published (wall clock, oldest first)."""
        return reads.ready_stamps(self.conn)

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

    def producer_replicas(self) -> list[dict[str, Any]]:
        """Every producer replica rank that registered: state, holder, windows made."""
        return reads.producer_replicas(self.conn)

    def audit(self) -> dict[str, Any]:
        """The database's integrity check and the run's end-state invariants, on
        either database (fanout.coord.reads.audit): what the chaos harness checks."""
        return reads.audit(self.conn)
