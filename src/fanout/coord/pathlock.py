"""A lock file that names its holder: one live process at a time per run-dir start or --save-path.

    from fanout.coord.pathlock import PathLock
    lock = PathLock(Path("drafts/b8/trainer.lock"), "--save-path drafts/b8")
    lock.acquire()     # RoleHeld naming the holder (host, pid, since when) while it lives
    ...                # only this process writes there now
    lock.release()

Exclusivity is flock(2) on the file: the kernel releases it when its holder exits,
kill -9 included, so a dead holder's lock is simply free again and there is no
stale lock to break. The holder then writes who it is into the file (host, pid,
`proc`: fanout.coord.liveness's process identity, and its wall-clock start), so a
refused process names the holder truthfully. Why not the `filelock` package: it
records nothing about its holder, and writing the record through the very
descriptor that holds the flock (then clearing it on release) is what keeps the
record and the lock in step.

Three guards on top of flock:
- The file may be unlinked while locked (a producer start that fails removes the run
  dir it made): a process that got the lock on an unlinked inode tries again on the
  file now at the path, so two processes never hold "the same path" on two inodes.
- A record naming a process that is still live on this host, found by a process that
  just got the lock, means flock is not honoured there (some network filesystems):
  refused as well. A holder clears its record on release.
- A forked child (the data stage's worker pool) closes its copy of every held lock's
  descriptor: a worker that outlived a killed parent would otherwise keep the lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fanout.coord.liveness import is_same_process, process_gone, this_process
from fanout.errors import ConfigError, RoleHeld

log = logging.getLogger(__name__)

# How long a refused process waits for the new holder to write its record, so that it
# can name it (the holder writes it right after flock returns: microseconds, unless
# the machine is very loaded). A bound, not a timing assumption: the refusal happens
# either way, naming "a process that has not recorded itself yet" at worst.
RECORD_WAIT_S = 30.0

DEFAULT_HINT = "It is released when that process exits (a crashed holder's lock is free at once)"

_HELD: weakref.WeakSet[PathLock] = weakref.WeakSet()


def _forget_in_child() -> None:
    """A forked child (the data stage's worker pool) must not keep its parent's locks:
    a worker outliving a killed parent would hold the lock of a dead process."""
    for lock in list(_HELD):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)  # the parent's descriptor (and its flock) stays


os.register_at_fork(after_in_child=_forget_in_child)


@dataclass(frozen=True, slots=True)
class LockRecord:
    """Who holds a lock file, as its holder wrote it."""

    host: str
    pid: int
    proc: str
    since: float  # wall clock when it took the lock: display only
    role: str  # what the holder is (e.g. "trainer of consumer c0"), for people

    def __str__(self) -> str:
        return f"{self.host} pid {self.pid}"

    def gone(self) -> bool | None:
        """Has the recorded process exited (True/False on this host; None: cannot tell)?"""
        return process_gone(self.proc, self.pid)

    def is_me(self) -> bool:
        return is_same_process(self.host, self.pid, self.proc, this_process())

    @classmethod
    def parse(cls, text: str) -> LockRecord | None:
        try:
            d = json.loads(text)
            return cls(str(d["host"]), int(d["pid"]), str(d["proc"]), float(d["since"]),
                       str(d.get("role", "")))  # fmt: skip
        except (ValueError, KeyError, TypeError):
            return None  # empty (not written yet, or cleared on release) or foreign


class PathLock:
    """An exclusive, holder-naming lock on `path` (a file; its parent is made if missing).

    Args:
        path: the lock file.
        what: what it guards, as messages name it ("the producer of runs/r1").
        role: what the holder is, recorded for whoever is refused.
        label: what an error creating the file names (a flag and its value); default `what`.
        hint: said after a refusal: when it is released, what to do instead.
    """

    def __init__(
        self, path: Path, what: str, role: str = "", label: str = "", hint: str = ""
    ) -> None:
        self.path, self.what, self.role = path.absolute(), what, role
        self.label, self.hint = label or what, hint
        self._fd: int | None = None
        self.made_parent = False  # acquire() created the lock's directory (os.mkdir)
        self.made_file = False  # ... and the lock file (O_EXCL)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, wait: bool = False) -> None:
        """Take the lock; RoleHeld naming the holder while a live process holds it
        (`wait`: block until it is released instead). ConfigError when the directory
        cannot be made or the file cannot be opened."""
        assert self._fd is None, "acquire() twice"
        told = False
        while True:
            fd = self._open()
            try:
                got = _try_flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if not got and wait:
                    if not told:
                        told = True
                        log.warning("%s: waiting for %s to release %s", self.what,
                                    self._holder_text(fd), self.path)  # fmt: skip
                    got = _try_flock(fd, fcntl.LOCK_EX)
                if not got and (refusal := self._refusal(fd)) is not None:
                    raise refusal
                if not self._same_file(fd):
                    os.close(fd)  # unlinked (or replaced) while we waited: try the new one
                    continue
                stale = self._read(fd)
                if stale is not None and stale.gone() is False and not stale.is_me():
                    raise RoleHeld(self.held_message(stale) + " (its lock file says so, "
                                   "though this filesystem let us lock it too)")  # fmt: skip
                self._write_record(fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
            self._fd = fd
            _HELD.add(self)
            return

    def release(self, unlink: bool = False) -> None:
        """Clear the record and let go (`unlink`: remove the file first, while still
        holding it, e.g. with the directory it lives in). Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _HELD.discard(self)
        try:
            if unlink:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
            else:
                os.ftruncate(fd, 0)
        except OSError as e:
            log.warning("%s: could not clear %s: %s", self.what, self.path, e)
        finally:
            # releases the flock even when it fails: a network filesystem's close may
            # report an I/O error (sshfs: EIO), which must not replace the error a
            # caller is handling, nor turn an exit into a traceback
            try:
                os.close(fd)
            except OSError as e:
                log.warning("%s: closing %s: %s", self.what, self.path, e)

    def __enter__(self) -> PathLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # a holder dropped without release(): let go anyway
        with contextlib.suppress(Exception):
            self.release()

    def holder(self) -> LockRecord | None:
        """The recorded holder, if any (it may have exited: check `gone()`)."""
        try:
            return LockRecord.parse(self.path.read_text())
        except OSError:
            return None

    def held_message(self, holder: LockRecord | None) -> str:
        if holder is None:
            who = "a process that has not recorded itself yet"
        else:
            age = time.time() - holder.since
            role = f"{holder.role}, " if holder.role else ""
            who = f"{holder} ({role}holding it since {age:.1f} s ago)"
        return (
            f"{self.what} is held by {who}: it holds {self.path}; refusing to start a second "
            f"one. {self.hint or DEFAULT_HINT}"
        )

    # ---- internals -----------------------------------------------------------------

    def _open(self) -> int:
        """Open (making, if missing) the lock file and its directory. Retried while a
        holder removes them (a failed producer start removing the run dir it made)."""
        parent = self.path.parent
        excl = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            while True:
                parent.parent.mkdir(parents=True, exist_ok=True)
                try:
                    parent.mkdir()
                    self.made_parent = True
                except OSError:  # there already (sshfs: EPERM for a mkdir another host won)
                    if not parent.is_dir():
                        raise
                try:  # O_EXCL: whether this process made the file is known, not guessed
                    fd = os.open(self.path, excl, 0o644)
                    self.made_file = True
                    return fd
                except FileExistsError:
                    pass
                except FileNotFoundError:
                    continue  # the directory went meanwhile: make it again
                except PermissionError:
                    # sshfs reports an O_EXCL create that lost to another host's as
                    # EPERM (SFTP's generic failure), not EEXIST: lost if the file is there
                    if not self.path.exists():
                        raise
                with contextlib.suppress(FileNotFoundError):
                    return os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise ConfigError(
                f"{self.label}: cannot create the lock file {self.path}: {e.strerror or e}"
            ) from None

    def _same_file(self, fd: int) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    @staticmethod
    def _read(fd: int) -> LockRecord | None:
        return LockRecord.parse(os.pread(fd, 4096, 0).decode(errors="replace"))

    def _write_record(self, fd: int) -> None:
        me = this_process()
        rec: dict[str, Any] = {"host": me.host, "pid": me.pid, "proc": me.proc,
                               "since": time.time(), "role": self.role}  # fmt: skip
        data = (json.dumps(rec) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)

    def _refusal(self, fd: int) -> RoleHeld | None:
        """RoleHeld naming the live holder; None if the lock came free meanwhile (it is
        then ours). A record naming a process that is gone is the previous holder's,
        not yet overwritten by the one that holds the lock now: wait for that one's."""
        deadline = time.monotonic() + RECORD_WAIT_S
        while True:
            rec = self._read(fd)
            if rec is not None and rec.gone() is not True:
                return RoleHeld(self.held_message(rec))
            if _try_flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB):
                return None
            if time.monotonic() > deadline:
                return RoleHeld(self.held_message(None))
            time.sleep(0.01)

    def _holder_text(self, fd: int) -> str:
        rec = self._read(fd)
        return "the process that holds it" if rec is None else str(rec)


def _try_flock(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
