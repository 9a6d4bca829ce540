"""The filesystem seam: every write-side call of the store passes through one object.

    from fanout.filesystem import FileSystem, FaultyFileSystem
    fs = FaultyFileSystem(fail_at=3, errno_=errno.EIO)   # the 3rd call raises EIO
    Store(RunDir(root).create(), fs=fs).publish(tensors, meta)

`FileSystem` makes the real calls (open with O_EXCL and mode 0644, open an
existing file to fsync it, write loops on short writes, fsync, hard link that
never overwrites, rename, unlink, fsync of a directory, mkdir -p). Reads are not part of the seam: they cannot leave
debris behind, and the reader validates everything it maps anyway.

`FaultyFileSystem` counts calls (all of them, or only the op names in `ops`)
and raises `OSError(errno_)` at call number `fail_at` (1-based) — once, or on
every counted call from then on when `persistent` is set. Tests and chaos runs
inject EIO/ENOSPC with it instead of monkeypatching `os`.

The one atomic write of the package is built from those calls, so a fault
injected into the seam reaches every file written with it:

    fs.write_atomic(run / "stream.json", text.encode())   # replace whole or not at all
    fs.write_atomic(windows / name, writer, tmp=tmp_path, overwrite=False)  # publish
    fs.write_new(tmp_dir / "config.json", data)           # a file of a directory ...
    fs.commit_dir(tmp_dir, final_dir)                     # ... renamed into place whole

`write_atomic`: temp file (O_EXCL, 0644) → write → fsync → close → rename over the
final name (or, with `overwrite=False`, hard link that fails if it exists, then
unlink the temp) → fsync the final name's directory. A reader sees the old file
or the new one, never a torn one; when the call returns, the new one survives a
crash. On failure the temp file is removed (and, with `overwrite=False`, the
final link too), so the old file is intact; a failed fsync is never retried. The
error is an `AtomicWriteError`: an OSError with the cause's errno (ENOSPC stays
ENOSPC) naming the step and the file.

What sharing the filesystem with other hosts asks beyond that (which mounts are
network filesystems, `temp_tag` and whose temp is debris, how long another host's new
name may take to show up, a host-local build lock) is fanout.netfs, below this seam.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar, overload

from fanout.netfs import StrPath, complete_within, temp_tag

# What write() accepts: anything exposing the buffer protocol, passed as a memoryview
# when it is not bytes (numpy arrays, mmap slices) so no copy is made.
Buffer = bytes | bytearray | memoryview

# Op names, as counted by FaultyFileSystem and accepted in its `ops` filter.
OPS = frozenset(
    {
        "open_new",
        "symlink",
        "open_existing",
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
# What a rename onto another writer's new directory fails with: ENOTEMPTY/EEXIST
# locally, EPERM/EACCES through sshfs (SFTP's generic failure).
_RENAME_LOST = frozenset({errno.ENOTEMPTY, errno.EEXIST, errno.EPERM, errno.EACCES})
T = TypeVar("T")
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


class AtomicWriteError(OSError):
    """An atomic write failed at `step` ("create", "write", "fsync", "rename", "link",
    "fsync directory", ...) on `path`. Its errno is the cause's, so `except OSError`
    and errno checks (ENOSPC, EEXIST) work as on the cause itself."""

    def __init__(self, step: str, path: StrPath, cause: OSError) -> None:
        self.reason = cause.strerror or str(cause)
        super().__init__(cause.errno, f"{step} failed on {path}: {self.reason}")
        self.step = step
        self.path = Path(path)

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across processes
        return (type(self), (self.step, self.path, OSError(self.errno, self.reason)))


@dataclass(frozen=True, slots=True)
class TempFile:
    """The file a writer passed to `write_new`/`write_atomic` fills: already created
    (0644, empty), open for writing at `fd`. Write through the FileSystem
    (`fs.write(t.fd, ...)`, `fs.pwrite`) so faults reach the writes, or hand `path`
    to a library that only takes a path (safetensors' save_file); the file found at
    `path` afterwards is the one made durable, even if the library replaced it."""

    fd: int
    path: Path


# What write_new / write_atomic put in the file: bytes, or a writer that fills it.
Data = Buffer | Callable[[TempFile], Any]


def _raise_named(e: BaseException, step: str, path: StrPath) -> NoReturn:
    """Raise `e` again, an OSError as the AtomicWriteError naming `step` and `path`
    (one an inner step already named, or any other error, as it is): how every atomic
    write below fails."""
    if isinstance(e, OSError) and not isinstance(e, AtomicWriteError):
        raise AtomicWriteError(step, path, e) from e
    raise e


def _mode_0644(fd: int) -> int:
    """`fd`, its file's mode made 0644 whatever the umask (fchmod after open); the fd
    is closed if that fails."""
    try:
        if os.fstat(fd).st_mode & 0o777 != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _replaced(fd: int, path: Path) -> bool:
    """Whether `path` is no longer the file open at `fd` (a library wrote a new one)."""
    st = os.stat(path)
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) != (fst.st_dev, fst.st_ino)


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
        fd = _mode_0644(
            os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        )
        self._after("open_new", path)
        return fd

    def open_existing(self, path: StrPath) -> int:
        """Open an existing file read-only to fsync what another writer (a library, a
        subprocess, a hard link) put there, setting its mode to 0644 as open_new does."""
        self._before("open_existing", path)
        fd = _mode_0644(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
        self._after("open_existing", path)
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

    def point(self, link: StrPath, target: str) -> None:
        """Make symlink `link` point at `target` (relative to its directory), atomically:
        a reader resolving `link` finds the old target or the new one, never nothing
        (a new symlink beside it, renamed over it, the directory fsynced). Raises
        AtomicWriteError naming the step; the old link is intact on failure."""
        link = Path(link)
        tmp = link.with_name(f".{link.name}.new{temp_tag()}")
        step = "symlink"
        try:
            self._before("symlink", tmp)
            os.symlink(target, tmp)
            self._after("symlink", tmp)
            step = "rename"
            self.rename(tmp, link)
            step = "fsync directory"
            self.fsync_dir(link.parent)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise AtomicWriteError(step, link, e) from e

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

    # -- the atomic write, built from the calls above ----------------------------------

    @overload
    def write_new(self, path: StrPath, data: Buffer) -> None: ...
    @overload
    def write_new(self, path: StrPath, data: Callable[[TempFile], T]) -> T: ...
    def write_new(self, path: StrPath, data: Data) -> Any:
        """Create `path` (never overwrites: FileExistsError), fill it, fsync, close.

        The content is durable when this returns; the name is durable once its
        directory is fsynced (`write_atomic` and `commit_dir` do that). `data` is bytes
        or a writer called with the TempFile (its result is returned). On any failure
        the partial file is removed and the error re-raised, an OSError as
        AtomicWriteError. Never retries a failed fsync.
        """
        path = Path(path)
        step, fd, made, out = "create", None, False, None
        try:
            try:
                fd = self.open_new(path)
            except FileExistsError:
                raise  # not ours: leave it
            except BaseException:
                made = True  # open_new may have created it before failing (fchmod)
                raise
            made = True
            step = "write"
            if callable(data):
                out = data(TempFile(fd, path))
            else:
                self.write(fd, data)
            if _replaced(fd, path):  # the writer put a new file at `path`: sync that one
                step, fd_, fd = "reopen", fd, None
                self.close(fd_)
                fd = self.open_existing(path)
            step = "fsync"
            self.fsync(fd)  # never retried: the kernel may have dropped the pages
            step, fd_, fd = "close", fd, None
            self.close(fd_)
        except BaseException as e:
            if fd is not None:
                with contextlib.suppress(OSError):
                    self.close(fd)
            if made:
                with contextlib.suppress(OSError):
                    self.unlink(path)
            _raise_named(e, step, path)
        return out

    @overload
    def write_atomic(
        self, path: StrPath, data: Buffer, *, tmp: StrPath | None = None, overwrite: bool = True
    ) -> None: ...
    @overload
    def write_atomic(
        self,
        path: StrPath,
        data: Callable[[TempFile], T],
        *,
        tmp: StrPath | None = None,
        overwrite: bool = True,
    ) -> T: ...
    def write_atomic(
        self, path: StrPath, data: Data, *, tmp: StrPath | None = None, overwrite: bool = True
    ) -> Any:
        """Put `data` under `path` whole or not at all, durably.

        Steps: `write_new(tmp)` (create O_EXCL 0644 → write → fsync → close) → rename
        `tmp` over `path` → fsync `path`'s directory. With `overwrite=False` the
        rename is a hard link that fails if `path` exists (FileExistsError inside an
        AtomicWriteError of step "link"), then the temp name is unlinked.

        Args:
            path: the final name.
            data: bytes, or a writer called with the TempFile (its result is returned).
            tmp: the temp file's name; default `.<name>.<temp_tag()>.tmp` beside
                `path`. One on another directory of the same filesystem (the store's
                tmp/) is fine: only `path`'s directory is fsynced.
            overwrite: replace an existing `path` (rename) or refuse to (link).

        On failure the temp file is removed, and with `overwrite=False` so is a
        final link already made: the old file (or no file) stays. With
        `overwrite=True` a failure of the last directory fsync leaves the new, whole
        file in place (the rename cannot be undone). Raises AtomicWriteError (an
        OSError with the cause's errno) or whatever the writer raised.
        """
        path = Path(path)
        if tmp is None:
            tmp = path.with_name(f".{path.name}.{temp_tag()}.tmp")
        tmp = Path(tmp)
        out = self.write_new(tmp, data)
        step, where, linked, tmp_left = "rename", path, False, True
        try:
            if overwrite:
                self.rename(tmp, path)
                tmp_left = False
            else:
                step = "link"
                self.link(tmp, path)
                linked = True
                step, where = "unlink temp file", tmp
                self.unlink(tmp)
                tmp_left = False
            step, where = "fsync directory", path.parent
            self.fsync_dir(path.parent)
        except BaseException as e:
            for p in (path if linked else None, tmp if tmp_left else None):
                if p is not None:
                    with contextlib.suppress(OSError):
                        self.unlink(p)
            _raise_named(e, step, where)
        return out

    def _sync_tree(self, tmp: Path) -> None:
        """fsync every file (`open_existing` → fsync → close) and directory under `tmp`;
        AtomicWriteError naming the step and the path."""
        step, where = "fsync", tmp
        try:
            for dirpath, _, files in os.walk(tmp):
                for f in files:
                    where = Path(dirpath) / f
                    if where.is_symlink():
                        continue
                    fd = self.open_existing(where)
                    try:
                        self.fsync(fd)
                    finally:
                        self.close(fd)
                step, where = "fsync directory", Path(dirpath)
                self.fsync_dir(dirpath)
                step = "fsync"
        except BaseException as e:
            _raise_named(e, step, where)

    def commit_dir(self, tmp: StrPath, final: StrPath) -> None:
        """Move a fully written directory `tmp` into place as `final`, whole or not at all.

        Steps: fsync every file (`open_existing` → fsync → close) and directory under
        `tmp` (cheap for files already written with write_new) → rename an existing
        `final` aside to `.<name>.old-<temp_tag()>` → rename `tmp` to `final` → fsync the
        parent → remove the old one. `tmp` and `final` must be siblings. A reader
        sees the old directory, none (only between the two renames) or the new one,
        never a partial one. On failure before the rename `tmp` is left for the
        caller to remove and the old `final` is put back; raises AtomicWriteError.
        For an entry several hosts may build at once, `commit_dir_once`.
        """
        tmp, final = Path(tmp), Path(final)
        self._sync_tree(tmp)
        old = final.with_name(f".{final.name}.old-{temp_tag()}")
        moved = False
        step, where = "rename aside", final
        try:
            if os.path.lexists(final):
                self.rename(final, old)
                moved = True
            step, where = "rename", final
            self.rename(tmp, final)
            moved = False  # the old one is debris now
            step, where = "fsync directory", final.parent
            self.fsync_dir(final.parent)
        except BaseException as e:
            if moved:
                with contextlib.suppress(OSError):
                    self.rename(old, final)
            _raise_named(e, step, where)
        finally:
            if not moved:
                shutil.rmtree(old, ignore_errors=True)

    def commit_dir_once(
        self, tmp: StrPath, final: StrPath, complete: Callable[[Path], bool]
    ) -> bool:
        """Commit `tmp` as `final` unless a complete `final` is there: for an entry that
        several processes, on several hosts, may build at once (a shared cache).

        Returns True when `tmp` became `final`; False when another writer's complete
        entry (`complete(final)`) was there first or won the rename, in which case `tmp`
        is removed and the caller uses the winner's. Never removes or replaces a
        complete entry, so a reader of the winner's files never loses them; an
        incomplete or outdated `final` (`complete` is False) is set aside and replaced.
        A rename that fails because `final` appeared meanwhile is a loss, judged by
        `complete(final)` for up to `stale_view_s` (another host's new name may show
        up late here); any other failure raises AtomicWriteError, `tmp` left for the
        caller to remove. No lock: correct wherever rename(2) onto a non-empty directory
        fails, whatever errno a network filesystem turns that into.
        """
        tmp, final = Path(tmp), Path(final)
        if complete(final):
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        self._sync_tree(tmp)
        if os.path.lexists(final):
            # another writer's entry, committed since the first look or not yet shown
            # whole here: moved aside even for a moment, its readers lose files (a
            # replica on another host did). Only one incomplete after the wait is debris.
            if complete_within(final, complete):
                shutil.rmtree(tmp, ignore_errors=True)
                return False
            old = final.with_name(f".{final.name}.old-{temp_tag()}")  # set aside, never reused
            with contextlib.suppress(FileNotFoundError):
                self.rename(final, old)
                if complete(old):  # another writer's, committed since we looked: put it back
                    with contextlib.suppress(OSError):
                        self.rename(old, final)
                else:
                    shutil.rmtree(old, ignore_errors=True)
        try:
            self.rename(tmp, final)
        except OSError as e:
            if e.errno not in _RENAME_LOST and not os.path.lexists(final):
                raise AtomicWriteError("rename", final, e) from e  # EIO, ENOSPC: not a race
            if not complete_within(final, complete):
                raise AtomicWriteError("rename", final, e) from e
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        try:
            self.fsync_dir(final.parent)
        except OSError as e:
            raise AtomicWriteError("fsync directory", final.parent, e) from e
        return True


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
