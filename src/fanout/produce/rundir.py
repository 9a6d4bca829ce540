"""The producer's side of the run directory: what it writes there, and what it removes
again when a start fails before its first window.

    lock = take_start_lock(root, db_path, takeover)  # RoleHeld: another producer starts here
    created = CreatedPaths.note(root, db_path, lock)  # under the lock, before creating anything
    check_producer_role(root, db_path, takeover)  # RoleHeld: a live producer holds the run
    coord = open_existing_run(root, contract, run_config, db_path, store, takeover)
    write_stream_info(root, info, fs)  # stream.json, atomically and durably
    coord = coord or create_run(root, contract, run_config, db_path, store)
    coord.register_producer(...)       # still under the lock; then lock.release()
    created.discard_if_unused(coord, created_db, owner)  # after a start that failed

Starts are serialised by the run dir's start lock (`producer.lock`, a
fanout.coord.pathlock.PathLock naming its holder): one producer at a time goes from
"what is here?" to "registered as the run's producer", and any other started then is
refused at once with the starting one's identity (with --takeover it waits for it).
So what a start finds missing under the lock, no other start can be creating, and a
start that fails (or is interrupted) before it publishes its first window removes
exactly what it created — no skeleton of a run that never produced anything is left
for trainers to find, and an existing run, or another producer's, is never touched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fanout.contract import CaptureContract
from fanout.coord.coordinator import DB_NAME, DB_POINTER, Coordinator, RunConfig
from fanout.coord.pathlock import PathLock
from fanout.data.draft_vocab import TOKEN_COUNTS
from fanout.errors import ConfigError, ContractMismatch, FanoutError, RoleHeld
from fanout.filesystem import FileSystem
from fanout.store.store import Store

log = logging.getLogger(__name__)

STREAM_INFO = "stream.json"
START_LOCK = "producer.lock"  # held from a producer's first look at the run dir to its registration

# What a producer may create in a run directory (fanout.store.store.RunDir's folders, the data
# cache, the coordinator's files, stream.json, token counts): the only names a producer
# that failed before its first window removes, and only those that were not there before.
RUN_DIR_NAMES = (
    "windows", "tmp", "quarantine", "telemetry", "logs", "cache", "contract.json",
    STREAM_INFO, TOKEN_COUNTS, DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm", DB_POINTER,
)  # fmt: skip


def take_start_lock(root: Path, db_path: str | None, takeover: bool) -> PathLock:
    """The run dir's start lock (made with the run dir if missing). RoleHeld while
    another producer holds it, naming the run's live producer if it has one (the
    lock's holder may be a second one, only checking), else the producer that is
    starting there now; with `takeover`, wait for the lock instead."""
    root = root.absolute()
    lock = PathLock(
        root / START_LOCK,
        f"the producer of {root}",
        role="a producer starting up",
        label=f"--run-dir {root}",
        hint="It is released once that producer has registered (it then holds the run) or "
        "its start failed; a crashed one's at once. With --takeover this one waits for it",
    )
    try:
        lock.acquire(wait=takeover)
    except RoleHeld as starting:
        _refuse_if_held(root, db_path)  # the run's own holder first: it is the one to name
        raise starting
    return lock


def _refuse_if_held(root: Path, db_path: str | None) -> None:
    """RoleHeld if the run exists and a live producer holds it; else nothing (a run not
    created yet, or any error reading it: the caller refuses anyway). Opens the run
    read-only: never Coordinator.exists here, which clears what looks like an
    interrupted create and, without the start lock, may be the starting producer's."""
    try:
        coord = Coordinator.open_if_created(root, db_path=db_path)
    except FanoutError:
        return
    if coord is None:
        return
    with coord:
        try:
            coord.check_producer_role(False)
        except RoleHeld:
            raise
        except FanoutError:
            return


def check_producer_role(root: Path, db_path: str | None, takeover: bool) -> None:
    """RoleHeld now, before minutes of data preparation and verifier loading, if the run
    exists and a live producer holds it (and not `takeover`)."""
    if takeover or not Coordinator.exists(root, db_path):
        return
    with Coordinator.open(root, db_path=db_path) as coord:
        coord.check_producer_role(takeover)


def open_existing_run(
    root: Path,
    contract: CaptureContract,
    run_config: RunConfig,
    db_path: str | None,
    store: Store,
    takeover: bool,
) -> Coordinator | None:
    """The run's coordinator if the run exists, None if it is new. Refused before anything
    is written: another contract (ContractMismatch, naming the fields), or a live
    producer holding the role without `takeover` (RoleHeld). Stored run settings win
    over the flags (logged)."""
    if not Coordinator.exists(root, db_path):
        return None
    coord = Coordinator.open(root, db_path=db_path, store=store)
    if coord.contract != contract:  # refuse before touching stream.json
        coord.close()
        raise ContractMismatch(coord.contract.diff(contract), where="producer")
    try:
        coord.check_producer_role(takeover)  # RoleHeld: refused before any write
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
) -> Coordinator:
    """Create the run's coordinator database (and contract.json); ConfigError naming
    --db-path when its directory cannot be made."""
    try:
        return Coordinator.create(root, contract, run_config, db_path=db_path, store=store)
    except OSError as e:
        raise ConfigError(
            f"--db-path {db_path}: cannot create the coordinator database: "
            f"{e.strerror or e} ({e.filename})"
        ) from None


def write_stream_info(root: Path, info: dict[str, Any], fs: FileSystem) -> Path:
    """stream.json: what consumers need to turn `--epochs` into windows (stream id, rows,
    window rows, epochs, total windows). Replaced whole or not at all, and durable
    (`FileSystem.write_atomic`: temp, fsync, rename, fsync the run dir)."""
    path = root / STREAM_INFO
    fs.write_atomic(path, (json.dumps(info, indent=2) + "\n").encode())
    return path


def check_disk_budget(root: Path, fs: FileSystem, max_live_windows: int, window_bytes: int) -> None:
    """Warn at start when the run dir cannot hold K + 1 windows (the K+1st: the extra
    slot for the slowest consumer's window). Not an error: evictions, an operator or
    another job may free space, and a full disk is waited out, not fatal."""
    need = (max_live_windows + 1) * window_bytes
    free = fs.free_bytes(root)
    gib = 2**30
    msg = (
        f"{root}: up to {max_live_windows} + 1 windows of "
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
    """What a producer start created, noted under the run dir's start lock before it
    creates anything, so that a start that fails before the first window leaves no
    run-dir skeleton behind. Under the lock no other start creates anything here, so
    "missing when noted" means "made by this start"."""

    root: Path
    lock: PathLock  # the start lock; held whenever anything is removed
    root_is_new: bool  # this start made the run dir (os.mkdir succeeded)
    run_existed: bool  # a coordinator database (or a pointer to one) was there: never remove
    new_names: list[str]
    new_db: Path | None  # a SQLite database elsewhere (--db-path) that did not exist

    @classmethod
    def note(cls, root: Path, db_path: str | None, lock: PathLock) -> CreatedPaths:
        assert lock.held, "note what exists under the start lock"
        root = root.absolute()
        where = Coordinator.resolve_db_path(root, db_path)
        new_db = where if isinstance(where, Path) and not where.exists() else None
        if new_db is not None and new_db.parent == root:
            new_db = None  # one of RUN_DIR_NAMES
        return cls(
            root=root,
            lock=lock,
            root_is_new=lock.made_parent,
            run_existed=(root / DB_NAME).exists()
            or (root / DB_POINTER).exists()
            or (isinstance(where, Path) and where.exists()),
            new_names=[n for n in RUN_DIR_NAMES if not (root / n).exists()],
            new_db=new_db,
        )

    def discard_if_unused(self, coord: Coordinator | None, created_db: bool, owner: str) -> bool:
        """After a start that failed or was interrupted: if this producer created the run
        (no coordinator database was there), no window was ever published and no trainer
        has joined, remove what it created (folders, database, contract.json,
        stream.json, token counts, data cache, the start lock if it made it) and the run
        dir itself if it made it and it is now empty. Never touches an existing run, and
        runs only holding the start lock (taken again if the start had released it; if
        another producer is starting now, everything is left to it). True if it removed
        something.

        Args:
            coord: the run's coordinator if the start got that far (closed here when
                the run goes), else None.
            created_db: this process created the coordinator database.
            owner: the producer's owner id (`host:pid`), as run() registers it.
        """
        if self.run_existed:
            return False
        relock = not self.lock.held
        if relock:
            try:
                self.lock.acquire()
            except RoleHeld as e:
                log.info("%s: not removing what this start created: %s", self.root, e)
                return False
        try:
            return self._discard(coord, created_db, owner)
        finally:
            if relock:
                self.lock.release()

    def _discard(self, coord: Coordinator | None, created_db: bool, owner: str) -> bool:
        if coord is not None:
            if not created_db:
                return False
            try:
                # unless a window was published, a trainer joined, or another producer
                # took over: checked and dropped in one transaction (Coordinator.discard_run)
                dropped = coord.discard_run(owner)
            except Exception as e:  # the database itself failed: keep it for a post-mortem
                log.warning("%s: could not drop the unused run's tables: %s", self.root, e)
                coord.close()
                return False
            if not dropped:
                return False
        removed = self.remove()
        if removed:
            log.info(
                "%s: stopped before publishing a window; removed what this start created: %s",
                self.root,
                ", ".join(removed),
            )
        return bool(removed)

    def remove(self) -> list[str]:
        """Remove what was created (best effort, never raises); returns what went. The
        start lock goes last, still held (a process waiting on it then tries the file
        at the path again: fanout.coord.pathlock)."""
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
        if self.lock.made_file and self.lock.held:
            self.lock.release(unlink=True)
            removed.append(START_LOCK)
        if self.root_is_new:
            with contextlib.suppress(OSError):  # not empty: someone else's files stay
                self.root.rmdir()
                removed.append(str(self.root))
        return removed
