"""The producer's side of the run directory: what it writes there, and what it removes
again when a start fails before its first window.

    lock, rank = take_start_lock(root, db_path, takeover, rank, replicas)  # RoleHeld: taken
    created = CreatedPaths.note(root, db_path, lock, rank, replicas)  # under it, before creating
    check_producer_role(root, db_path, takeover, rank, replicas)  # RoleHeld: held live
    with join_lock(root):                     # replicas of one run create or join it in turn
        coord = open_existing_run(root, contract, run_config, db_path, store, takeover, rank)
        StreamInfo(...).write(RunDir(root), fs)  # stream.json, atomically and durably
        coord, created_db = (coord, False) if coord else create_run(root, contract, ...)
        coord.register_producer(..., rank=rank, plan=plan)  # still under the start lock
    lock.release()
    created.discard_if_unused(coord, created_db, owner)  # after a start that failed

    with StartNotice() as notice:             # a start says what it waits for, every 5 s
        notice.stage("loading the verifier")  # "starting (not registered yet, 10 s): ..."

Starts are serialised per replica rank by the rank's start lock
(`RunDir.start_lock(rank)`: `producer.lock` for rank 0, the run's only producer, a
fanout.coord.pathlock.PathLock naming its holder): one process at a time goes from
"what is here?" to "registered as that rank", and any other started for the rank
then is refused at once with the starting one's identity (with --takeover it waits
for it); one asking for any rank takes the first whose lock and role are free. The
replicas of a run start side by side; the short `join_lock` orders their "create the
run, or join it", so exactly one creates it; on several hosts sharing the run dir
(where a lock file is no lock) the database decides: a create that loses joins. A start that fails (or is interrupted)
before it publishes its first window removes exactly what it created, under the join
lock and only while no other replica is starting — no skeleton of a run that never
produced anything is left for trainers to find, and an existing run, or another
producer's, is never touched. On a network filesystem it removes nothing: another
host's replica may be starting there, unordered by any lock file.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fanout.contract import CaptureContract
from fanout.coord.coordinator import Coordinator, RunConfig
from fanout.coord.grants import ProducerPlan
from fanout.coord.pathlock import PathLock
from fanout.errors import ConfigError, ContractMismatch, FanoutError, RoleHeld
from fanout.filesystem import FileSystem
from fanout.netfs import on_network_filesystem
from fanout.store.rundir import RunDir
from fanout.store.store import Store
from fanout.ticker import Ticker

log = logging.getLogger(__name__)

START_NOTICE_EVERY_S = 5.0  # a starting producer says what it waits for this often


class StartNotice:
    """Says on the log what a starting producer is doing or waiting for, until it has
    registered: a restart that loads a verifier, counts tokens or waits for a lock is
    not silent for a minute. The first line comes once the start is `every_s` old, then
    one every `every_s`, e.g.

        starting (not registered yet, 15 s): loading the verifier (10 s)

    `stage(what)` names the next step; `tick()` logs a line when one is due (the thread
    that `__enter__` starts calls it). `clock` and `say` are seams for tests."""

    def __init__(
        self,
        every_s: float = START_NOTICE_EVERY_S,
        *,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] = log.info,
    ) -> None:
        self.every_s, self.clock, self.say = every_s, clock, say
        self._lock = threading.Lock()
        self._t0 = self._since = clock()
        self._due = self._t0 + every_s
        self._what = "starting"
        self._ticker = Ticker(self.tick, min(1.0, every_s), name="start-notice")

    def stage(self, what: str) -> None:
        with self._lock:
            self._what, self._since = what, self.clock()

    def tick(self) -> str | None:
        with self._lock:
            now = self.clock()
            if now < self._due:
                return None
            self._due = now + self.every_s
            line = (
                f"starting (not registered yet, {now - self._t0:.0f} s): {self._what} "
                f"({now - self._since:.0f} s)"
            )
        self.say(line)
        return line

    def __enter__(self) -> StartNotice:
        self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ticker.stop()


def start_lock(root: Path, rank: int, replicas: int) -> PathLock:
    """Replica `rank`'s start lock (RunDir.start_lock), made with the run dir if missing."""
    root = root.absolute()
    what = f"the producer of {root}" if replicas == 1 else f"producer replica {rank} of {root}"
    return PathLock(
        RunDir(root).start_lock(rank),
        what,
        role="a producer starting up",
        label=f"--run-dir {root}",
        hint="It is released once that producer has registered (it then holds the run) or "
        "its start failed; a crashed one's at once. With --takeover this one waits for it",
    )


def take_start_lock(
    root: Path, db_path: str | None, takeover: bool, rank: int | None = 0, replicas: int = 1
) -> tuple[PathLock, int]:
    """The start lock of replica `rank` (None: of the first rank whose lock is free and
    whose role no live process holds, in the coordinator's order: a crashed or lost
    holder's rank before a finished one's, so a restart leaves no rank `active` behind
    a dead process) and that rank. RoleHeld while another process
    holds it, naming the run's live producer of that rank if it has one (the lock's
    holder may be a second one, only checking), else the one starting there now
    (for None: every rank's); with `takeover`, wait for the lock instead."""
    root = root.absolute()
    if rank is not None:
        lock = start_lock(root, rank, replicas)
        try:
            lock.acquire(wait=takeover)
        except RoleHeld as starting:
            _refuse_if_held(root, db_path, rank, replicas)  # the run's own holder first
            raise starting
        return lock, rank
    refusals: list[str] = []
    for r in _rank_order(root, db_path, replicas):
        lock = start_lock(root, r, replicas)
        try:
            lock.acquire()
        except RoleHeld as starting:
            refusals.append(_holder_first(root, db_path, r, replicas, starting))
            continue
        try:
            check_producer_role(root, db_path, False, r, replicas)
        except RoleHeld as held:
            lock.release(unlink=lock.made_file)
            refusals.append(str(held))
            continue
        except BaseException:
            lock.release(unlink=lock.made_file)
            raise
        return lock, r
    raise RoleHeld(f"every producer replica rank of {root} (--replicas {replicas}) is taken: "
                   + " | ".join(refusals))  # fmt: skip


def _rank_order(root: Path, db_path: str | None, replicas: int) -> list[int]:
    """Coordinator.free_rank_order for an existing run; 0 .. replicas-1 for a new one
    (or one whose create is in flight: no rank is held there yet)."""
    coord = Coordinator.open_if_created(root, db_path=db_path)
    if coord is None:
        return list(range(replicas))
    with coord:
        return coord.free_rank_order(replicas)


@contextlib.contextmanager
def join_lock(root: Path) -> Iterator[PathLock]:
    """Held while a replica creates the run or joins it, up to its registration (and
    while a failed start removes what it made): replicas started together find one run."""
    lock = PathLock(
        RunDir(root).join_lock,
        f"creating or joining the run {root}",
        role="a producer replica creating or joining the run",
        label=f"--run-dir {root}",
    )
    lock.acquire(wait=True)
    try:
        yield lock
    finally:
        lock.release()


def _holder_first(
    root: Path, db_path: str | None, rank: int, replicas: int, starting: RoleHeld
) -> str:
    """The refusal to give for a rank whose start lock is held: the run's live holder of
    that rank if it has one (it is the one to name), else the process starting it."""
    try:
        _refuse_if_held(root, db_path, rank, replicas)
    except RoleHeld as held:
        return str(held)
    return str(starting)


def _refuse_if_held(root: Path, db_path: str | None, rank: int, replicas: int) -> None:
    """RoleHeld if the run exists and a live producer holds replica `rank`; else nothing
    (a run not created yet, or any error reading it: the caller refuses anyway). Opens
    the run read-only: never Coordinator.exists here, which clears what looks like an
    interrupted create and, without the start lock, may be the starting producer's."""
    try:
        coord = Coordinator.open_if_created(root, db_path=db_path)
    except FanoutError:
        return
    if coord is None:
        return
    with coord:
        try:
            coord.check_producer_role(False, rank, replicas)
        except RoleHeld:
            raise
        except FanoutError:
            return


def check_producer_role(
    root: Path, db_path: str | None, takeover: bool, rank: int = 0, replicas: int = 1
) -> None:
    """RoleHeld now, before minutes of data preparation and verifier loading, if the run
    exists and a live producer holds replica `rank` (and not `takeover`). Reads the run
    without clearing what looks like an interrupted create (never Coordinator.exists
    here): the caller holds only its own rank's start lock, and another replica may be
    creating the database under the join lock this very moment (seen under load: its
    half-made file removed, its registration lost)."""
    if takeover:
        return
    coord = Coordinator.open_if_created(root, db_path=db_path)
    if coord is None:
        return
    with coord:
        coord.check_producer_role(takeover, rank, replicas)


def check_plan(root: Path, db_path: str | None, rank: int, plan: ProducerPlan) -> None:
    """PlanMismatch now, before data preparation and verifier loading, if live replicas
    of the run present another data plan (--replicas, --epochs, --max-windows)."""
    if Coordinator.open_if_created(root, db_path=db_path) is None:
        return
    with Coordinator.open(root, db_path=db_path) as coord:
        coord.check_plan(rank, plan)


def open_existing_run(
    root: Path,
    contract: CaptureContract,
    run_config: RunConfig,
    db_path: str | None,
    store: Store,
    takeover: bool,
    rank: int = 0,
    replicas: int = 1,
) -> Coordinator | None:
    """The run's coordinator if the run exists, None if it is new. Refused before anything
    is written: another contract (ContractMismatch, naming the fields), or a live
    producer holding replica `rank` without `takeover` (RoleHeld). Stored run settings
    win over the flags (logged)."""
    if not Coordinator.exists(root, db_path):
        return None
    coord = Coordinator.open(root, db_path=db_path, store=store)
    if coord.contract != contract:  # refuse before touching stream.json
        coord.close()
        raise ContractMismatch(coord.contract.diff(contract), where="producer")
    try:
        coord.check_producer_role(takeover, rank, replicas)  # RoleHeld: refused before any write
    except BaseException:
        coord.close()
        raise
    if coord.config != run_config:
        log.warning("run settings stored in %s win over flags: %s", coord.db_path, coord.config)
    return coord


def create_run(
    root: Path,
    contract: CaptureContract,
    run_config: RunConfig,
    db_path: str | None,
    store: Store,
    takeover: bool = False,
    rank: int = 0,
    replicas: int = 1,
) -> tuple[Coordinator, bool]:
    """Create the run's coordinator database (and contract.json), or join the run another
    replica created first: (coordinator, whether this call created it). The join lock
    orders replicas on one host; on several hosts sharing the run dir (a lock file there
    is not a lock across hosts) two may both find no run and both create: the database
    lets one win, and the other joins it as open_existing_run does (ContractMismatch,
    RoleHeld). ConfigError naming --db-path when its directory cannot be made."""
    try:
        return Coordinator.create(root, contract, run_config, db_path=db_path, store=store), True
    except OSError as e:
        raise ConfigError(
            f"--db-path {db_path}: cannot create the coordinator database: "
            f"{e.strerror or e} ({e.filename})"
        ) from None
    except FanoutError:
        joined = open_existing_run(
            root, contract, run_config, db_path, store, takeover, rank, replicas
        )
        if joined is None:  # not a lost race: the create failed on its own
            raise
        log.info("%s: another replica created the run first; joining it", root)
        return joined, False


def check_disk_budget(root: Path, fs: FileSystem, max_live_windows: int, window_bytes: int) -> None:
    """Warn at start when the run dir cannot hold K windows (every replica's together,
    the slowest consumer's reserved slot among them). Not an error: evictions, an
    operator or another job may free space, and a full disk is waited out, not fatal."""
    need = max_live_windows * window_bytes
    free = fs.free_bytes(root)
    gib = 2**30
    msg = (
        f"{root}: up to {max_live_windows} windows of "
        f"{window_bytes / gib:.2f} GiB need {need / gib:.1f} GiB"
    )
    if free < need:
        log.warning(
            "%s but only %.1f GiB are free: the producer will wait on a full disk. Lower "
            "--max-live-windows or --window-rows, or use --storage-dtype float8_e4m3fn",
            msg,
            free / gib,
        )
    else:
        log.info("%s (%.1f GiB free)", msg, free / gib)


@dataclass
class CreatedPaths:
    """What a producer start created, noted under its start lock before it creates
    anything, so that a start that fails before the first window leaves no run-dir
    skeleton behind. Under the lock no other start of this rank creates anything here,
    and a removal happens only while no other replica is starting or joining, so
    "missing when noted" and "removed" are this start's."""

    root: Path
    lock: PathLock  # the start lock; held whenever anything is removed
    rank: int  # the replica rank it starts (its lock)
    replicas: int
    root_is_new: bool  # this start made the run dir (os.mkdir succeeded)
    run_existed: bool  # a coordinator database (or a pointer to one) was there: never remove
    new_names: list[str]
    new_db: Path | None  # a SQLite database elsewhere (--db-path) that did not exist
    join_is_new: bool  # the join lock's file was not there
    db_path: str | None = None  # --db-path
    # the run dir is on a network filesystem: another host may be starting in it now,
    # and no lock file orders starts across hosts, so nothing here is surely this start's
    shared_across_hosts: bool = False

    @classmethod
    def note(
        cls, root: Path, db_path: str | None, lock: PathLock, rank: int = 0, replicas: int = 1
    ) -> CreatedPaths:
        assert lock.held, "note what exists under the start lock"
        rd = RunDir(root.absolute())
        where = Coordinator.resolve_db_path(rd.root, db_path)
        new_db = where if isinstance(where, Path) and not where.exists() else None
        if new_db is not None and new_db.parent == rd.root:
            new_db = None  # one of RunDir.producer_names()
        return cls(
            root=rd.root,
            lock=lock,
            rank=rank,
            replicas=replicas,
            root_is_new=lock.made_parent,
            run_existed=rd.database.exists()
            or rd.db_pointer.exists()
            or (isinstance(where, Path) and where.exists()),
            new_names=[n for n in rd.producer_names() if not (rd.root / n).exists()],
            new_db=new_db,
            join_is_new=not rd.join_lock.exists(),
            db_path=db_path,
            shared_across_hosts=on_network_filesystem(rd.root),
        )

    def discard_if_unused(self, coord: Coordinator | None, created_db: bool, owner: str) -> bool:
        """After a start that failed or was interrupted: if this producer created the run
        (no coordinator database was there), no window was ever published, no trainer
        has joined and no other replica registered, remove what it created (folders,
        database, contract.json, stream.json, token counts, data cache, the lock files
        it made) and the run dir itself if it made it and it is now empty. Never touches
        an existing run, and runs only holding its start lock (taken again if the start
        had released it), every other replica's start lock and the join lock: if another
        producer is starting or joining now, everything is left to it. True if it
        removed something.

        Args:
            coord: the run's coordinator if the start got that far (closed here when
                the run goes), else None.
            created_db: this process created the coordinator database.
            owner: the producer's owner id (`host:pid`), as run() registers it.
        """
        if self.run_existed:
            return False
        if self.shared_across_hosts:
            # What was missing when noted may be another host's replica's by now (it made
            # tmp/ and windows/, and is loading its verifier before it creates the run):
            # removing it broke that replica's first window. The skeleton stays; a start
            # again reuses it.
            log.info(
                "%s: stopped before publishing a window; left the run dir as it is (on a "
                "network filesystem a replica on another host may be starting in it, and "
                "a lock file orders nothing across hosts)",
                self.root,
            )
            return False
        mine = [] if self.lock.held else [self.lock]  # taken again if the start released it
        others = [start_lock(self.root, r, self.replicas) for r in range(self.replicas)
                  if r != self.rank]  # fmt: skip
        join = PathLock(RunDir(self.root).join_lock, f"creating or joining the run {self.root}")
        held: list[PathLock] = []
        removed: list[str] = []
        try:
            for lock in [*mine, *others, join]:
                lock.acquire()
                held.append(lock)
            removed = self._discard(coord, created_db, owner)
        except RoleHeld as e:
            log.info("%s: not removing what this start created: %s", self.root, e)
        finally:
            for lock in reversed(held):  # a lock file made just now goes; so does the join
                if lock is not self.lock:  # lock's, made by this start, with the run
                    lock.release(
                        unlink=lock.made_file
                        or (lock is join and bool(removed) and self.join_is_new)
                    )
            if removed and self.lock.made_file:
                self.lock.release(unlink=True)  # held by the start, or taken again here
            elif mine:
                self.lock.release()
        if removed and self.root_is_new:
            with contextlib.suppress(OSError):  # not empty: someone else's files stay
                self.root.rmdir()
                removed.append(str(self.root))
        if removed:
            log.info(
                "%s: stopped before publishing a window; removed what this start created: %s",
                self.root,
                ", ".join(removed),
            )
        return bool(removed)

    def _discard(self, coord: Coordinator | None, created_db: bool, owner: str) -> list[str]:
        if coord is None:
            other = Coordinator.open_if_created(self.root, db_path=self.db_path)
            if other is not None:
                # a run exists now that this start did not make: another replica's,
                # perhaps on another host, whose start the lock files here did not
                # order (a lock file is no lock across hosts). What "was missing when
                # noted" is its.
                other.close()
                return []
        if coord is not None:
            if not created_db:
                return []
            try:
                # unless a window was published, a trainer joined, or another producer
                # registered: checked and dropped in one transaction (Coordinator.discard_run)
                dropped = coord.discard_run(owner)
            except Exception as e:  # the database itself failed: keep it for a post-mortem
                log.warning("%s: could not drop the unused run's tables: %s", self.root, e)
                coord.close()
                return []
            if not dropped:
                return []
        return self.remove()

    def remove(self) -> list[str]:
        """Remove what was created (best effort, never raises); returns what went. The
        start lock's file goes once the lock is released (discard_if_unused), while
        still held (a process waiting on it then tries the file at the path again:
        fanout.coord.pathlock)."""
        paths = [self.root / n for n in self.new_names]
        if self.new_db is not None:
            paths += [self.new_db, Path(f"{self.new_db}-wal"), Path(f"{self.new_db}-shm")]
        removed = []
        for path in paths:
            try:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                elif path.exists() or path.is_symlink():
                    path.unlink()
                else:
                    continue
            except OSError as e:
                log.warning("could not remove %s: %s", path, e)
                continue
            removed.append(path.name)
        if self.lock.made_file:
            removed.append(self.lock.path.name)
        return removed
