"""The filesystem seam: every write-side call of the store passes through one object.

    from fanout.filesystem import FileSystem, FaultyFileSystem
    fs = FaultyFileSystem(fail_at=3, errno_=errno.EIO)   # the 3rd call raises EIO
    Store(RunDir(root).create(), fs=fs).publish(tensors, meta)

`FileSystem` makes the real calls (open with O_EXCL and mode 0644, write loops
on short writes, fsync, hard link that never overwrites, rename, unlink, fsync
of a directory, mkdir -p). Reads are not part of the seam: they cannot leave
debris behind, and the reader validates everything it maps anyway.

`FaultyFileSystem` counts calls (all of them, or only the op names in `ops`)
and raises `OSError(errno_)` at call number `fail_at` (1-based) — once, or on
every counted call from then on when `persistent` is set. Tests and chaos runs
inject EIO/ENOSPC with it instead of monkeypatching `os`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

StrPath = str | os.PathLike[str]
# What write() accepts: anything exposing the buffer protocol, passed as a memoryview
# when it is not bytes (numpy arrays, mmap slices) so no copy is made.
Buffer = bytes | bytearray | memoryview

# Op names, as counted by FaultyFileSystem and accepted in its `ops` filter.
OPS = frozenset(
    {
        "open_new",
        "write",
        "pwrite",
        "fsync",
        "start_writeback",
        "close",
        "link",
        "rename",
        "unlink",
        "fsync_dir",
        "makedirs",
    }
)

FILE_MODE = 0o644
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages, do not wait


def _load_sync_file_range() -> Any:
    """libc's sync_file_range, or None where there is none (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()


def _sync_file_range(fd: int, offset: int, nbytes: int) -> None:
    """Start writeback of a range; a no-op once the call has failed (ENOSYS, EINVAL)."""
    global _SYNC_FILE_RANGE
    fn = _SYNC_FILE_RANGE
    if fn is None or nbytes <= 0:
        return
    if fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) != 0:
        # A hint the kernel or a sandbox (gVisor) refuses; the fsync that follows
        # makes the data durable either way. Do not ask again in this process.
        _SYNC_FILE_RANGE = None


class FileSystem:
    """Real filesystem calls. Subclass and override `_before(op, arg)` to observe or
    interrupt them (that is how FaultyFileSystem and the kill -9 tests work)."""

    def _before(self, op: str, arg: object) -> None:
        """Hook run before every op; the real seam does nothing here."""

    def _after(self, op: str, arg: object) -> None:
        """Hook run after every op that returned normally."""

    def open_new(self, path: StrPath) -> int:
        """Create `path` for writing; FileExistsError if it exists. Mode is 0644
        regardless of umask (fchmod after open)."""
        self._before("open_new", path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)
        except BaseException:
            os.close(fd)
            raise
        self._after("open_new", path)
        return fd

    def write(self, fd: int, data: Buffer) -> None:
        """Write all of `data` at the current offset (loops on short writes)."""
        self._before("write", fd)
        view = memoryview(data).cast("B")
        while view.nbytes:
            n = os.write(fd, view)
            view = view[n:]
        self._after("write", fd)

    def pwrite(self, fd: int, data: Buffer, offset: int) -> None:
        """Write all of `data` at `offset` without moving the file offset."""
        self._before("pwrite", fd)
        view = memoryview(data).cast("B")
        while view.nbytes:
            n = os.pwrite(fd, view, offset)
            view = view[n:]
            offset += n
        self._after("pwrite", fd)

    def start_writeback(self, fd: int, offset: int, nbytes: int) -> None:
        """Ask the kernel to start writing bytes [offset, offset+nbytes) to disk now.

        A hint (Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`): it returns at once
        and never fails; durability still comes from `fsync`. Why: without it the
        page cache holds a whole window's dirty pages until the final fsync, so the
        disk idles while we write and we idle while it flushes. Started chunk by
        chunk, the flush runs behind the writes and the fsync waits only for the
        tail. Not `posix_fadvise(DONTNEED)`, which also drops the pages that
        consumers are about to read. Where the call does not exist (not Linux, a
        sandbox that refuses it) this does nothing.
        """
        self._before("start_writeback", fd)
        _sync_file_range(fd, offset, nbytes)
        self._after("start_writeback", fd)

    def fsync(self, fd: int) -> None:
        """fsync a file. Callers must never retry a failed fsync (the kernel may have
        dropped the dirty pages and a second fsync would report success)."""
        self._before("fsync", fd)
        os.fsync(fd)
        self._after("fsync", fd)

    def close(self, fd: int) -> None:
        self._before("close", fd)
        os.close(fd)
        self._after("close", fd)

    def link(self, src: StrPath, dst: StrPath) -> None:
        """Hard link; FileExistsError if `dst` exists (never overwrites)."""
        self._before("link", dst)
        os.link(src, dst)
        self._after("link", dst)

    def rename(self, src: StrPath, dst: StrPath) -> None:
        self._before("rename", dst)
        os.rename(src, dst)
        self._after("rename", dst)

    def unlink(self, path: StrPath) -> None:
        self._before("unlink", path)
        os.unlink(path)
        self._after("unlink", path)

    def fsync_dir(self, path: StrPath) -> None:
        """fsync a directory so that links/unlinks in it are durable."""
        self._before("fsync_dir", path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        except OSError as e:
            # EINVAL: this filesystem cannot sync a directory (some FUSE/9p mounts).
            # Nothing was lost, there is just nothing to sync; any other error counts.
            if e.errno != errno.EINVAL:
                raise
        finally:
            os.close(fd)
        self._after("fsync_dir", path)

    def makedirs(self, path: StrPath) -> None:
        """mkdir -p."""
        self._before("makedirs", path)
        Path(path).mkdir(parents=True, exist_ok=True)
        self._after("makedirs", path)

    def free_bytes(self, path: StrPath) -> int:
        """Bytes an unprivileged writer may still use on `path`'s filesystem (a reading,
        not an op: never counted or failed by FaultyFileSystem)."""
        return shutil.disk_usage(path).free


class FaultyFileSystem(FileSystem):
    """A FileSystem that fails on purpose, for tests and chaos runs.

    Args:
        fail_at: 1-based number of the counted call that raises.
        errno_: errno of the raised OSError (errno.EIO, errno.ENOSPC, ...).
        persistent: fail every counted call from `fail_at` on, not just that one.
        ops: count only these op names (see OPS); None counts every op.

    `calls` is the number of counted calls so far, `failures` how many raised and
    `log` the (op, arg) of every call, counted or not. A failing `close` still
    closes the descriptor (as Linux close(2) does on error), so loops don't leak fds.

    Example:
        fs = FaultyFileSystem(fail_at=1, errno_=errno.ENOSPC, ops={"write"})
    """

    def __init__(
        self,
        fail_at: int,
        errno_: int = errno.EIO,
        persistent: bool = False,
        ops: set[str] | frozenset[str] | None = None,
    ) -> None:
        if fail_at < 1:
            raise ValueError(f"fail_at must be >= 1 (1-based call number), got {fail_at}")
        if ops is not None and not set(ops) <= OPS:
            raise ValueError(f"unknown ops {sorted(set(ops) - OPS)}; known: {sorted(OPS)}")
        self.fail_at = fail_at
        self.errno_ = errno_
        self.persistent = persistent
        self.ops = None if ops is None else frozenset(ops)
        self.calls = 0
        self.failures = 0
        self.log: list[tuple[str, object]] = []
        self._lock = threading.Lock()

    def _should_fail(self, op: str, arg: object) -> bool:
        with self._lock:
            self.log.append((op, arg))
            if self.ops is not None and op not in self.ops:
                return False
            self.calls += 1
            fail = self.calls == self.fail_at or (self.persistent and self.calls > self.fail_at)
            if fail:
                self.failures += 1
            return fail

    def _raise(self, op: str, arg: object) -> None:
        raise OSError(
            self.errno_,
            f"{os.strerror(self.errno_)} (injected at {op} call {self.calls})",
            str(arg),
        )

    def _before(self, op: str, arg: object) -> None:
        if op == "close":
            return  # decided in close() itself: the fd is released first
        if self._should_fail(op, arg):
            self._raise(op, arg)

    def close(self, fd: int) -> None:
        fail = self._should_fail("close", fd)
        os.close(fd)
        if fail:
            self._raise("close", fd)
