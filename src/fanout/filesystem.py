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
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib  # 8 or 16 hex digits of a name (fanout.hashing is for file checksums)
import logging
import os
import re
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, overload

log = logging.getLogger(__name__)

StrPath = str | os.PathLike[str]
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
# A temp of another host (or pid space) is removed as debris only once nothing in it
# changed for this long: its writer's pid cannot be checked from here.
TEMP_STALE_S = 3600.0
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


# Network filesystems: another host's view of a file may lag, lock and rename
# semantics vary, and a file removed on another host may vanish under an mmap (SIGBUS).
# SQLite refuses to live on them (fanout.coord.sqlitedb); window reads copy from them
# instead of mapping (fanout.store.windowfile).
NETWORK_FS_TYPES = frozenset(
    {
        "nfs", "nfs4", "cifs", "smb", "smb3", "smbfs", "fuse.sshfs", "sshfs",
        "lustre", "gpfs", "ceph", "fuse.ceph", "fuse.cephfs", "glusterfs",
        "fuse.glusterfs", "beegfs", "fuse.beegfs", "panfs", "afs", "ocfs2", "gfs2",
        "orangefs", "pvfs2", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone", "fuse.juicefs",
        "wekafs", "9p", "fuse.weka",
    }
)  # fmt: skip


def parse_mountinfo(text: str) -> list[tuple[str, str]]:
    """(mount point, fs type) per line of /proc/self/mountinfo (octal escapes decoded).

    Format (proc(5)): `id parent major:minor root MOUNTPOINT opts [optional...] - FSTYPE src sopts`.
    """
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        point = fields[4].encode().decode("unicode_escape")  # "\040" -> " "
        out.append((point, right.split()[0]))
    return out


def filesystem_type(path: Path, mountinfo: str | None = None) -> tuple[str, str]:
    """(fs type, mount point) of the filesystem holding `path` (longest mount prefix)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return ("unknown", "/")
    target = os.path.realpath(path)
    best = ("unknown", "/")
    best_len = -1
    for point, fstype in parse_mountinfo(mountinfo):
        p = point.rstrip("/") or "/"
        inside = target == p or p == "/" or target.startswith(p + "/")
        # ">=" so that a later mount stacked on the same point wins, as the kernel does.
        if inside and len(p) >= best_len:
            best, best_len = (fstype, p), len(p)
    return best


def is_network_filesystem(fstype: str) -> bool:
    """Is `fstype` (a /proc/self/mountinfo type) a network filesystem?"""
    return fstype in NETWORK_FS_TYPES or fstype.startswith(("nfs", "fuse.ceph"))


def on_network_filesystem(path: StrPath) -> bool:
    """Is `path` on a network filesystem (per /proc/self/mountinfo)? Answered once per
    filesystem (device) for the life of the process; False where /proc cannot tell."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return False
    cached = _NETWORK_BY_DEV.get(dev)
    if cached is None:
        cached = _NETWORK_BY_DEV[dev] = is_network_filesystem(filesystem_type(Path(path))[0])
    return cached


_NETWORK_BY_DEV: dict[int, bool] = {}


def stale_view_s(path: StrPath) -> float:
    """How long a reader under `path` waits for a name another host made to show up
    (NFS attribute and directory caches, or sshfs's, can hide a new name from another
    host for a while): `FANOUT_STALE_VIEW_S` if set, else 5 s on a network filesystem
    and 0 on a local one (its view is never stale). One rule for every such wait."""
    raw = os.environ.get("FANOUT_STALE_VIEW_S", "").strip()
    if raw:
        try:
            return max(0.0, float(raw))
        except ValueError:
            pass
    return 5.0 if on_network_filesystem(path) else 0.0


@functools.cache
def kernel_identity() -> str:
    """This boot of this kernel and our pid namespace, "<boot id>/<pid ns>": where a pid
    means one process ("" where /proc cannot tell). Temp names carry its hash
    (`_pid_space`); the coordinator's liveness records it whole (fanout.coord.liveness)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def _pid_space() -> str:
    """8 hex digits naming this kernel boot and pid namespace, "x" where /proc cannot tell."""
    kernel = kernel_identity()
    return hashlib.blake2s(kernel.encode(), digest_size=4).hexdigest() if kernel else "x"


def proc_stat(pid: int) -> tuple[str, str] | None:
    """(state letter, start time in clock ticks) of `pid` in this pid namespace, None if
    there is no such process; OSError where /proc cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):  # fields: after "pid (comm)"
        return None
    return fields[0], fields[19]  # fields 3 (state) and 22 (starttime) of proc(5)


def pid_gone(pid: int) -> bool:
    """Has process `pid` of this pid namespace exited (no such process, or a zombie)?
    For names that carry only a pid; False where /proc cannot tell. A reused pid reads
    as live: the safe side for "may I remove its files"."""
    try:
        st = proc_stat(pid)
    except OSError:
        return False
    return st is None or st[0] in ("Z", "X", "x")


def _host() -> str:
    """This host's name as a temp name can carry it: letters, digits, '-', '_'."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:40] or "host"


_TAG_RE = re.compile(r"@([A-Za-z0-9_-]+)\.([0-9a-f]{8}|x)\.(\d+)\.([0-9a-f]{8})")
# A name from before tags: a pid after the last '-' or '.' (`.tmp-x-<pid>`,
# `x.tmp-<pid>`, `.x.<pid>-<hex>.tmp`).
_LEGACY_PID_RE = re.compile(r"[-.](\d+)$|\.(\d+)-[0-9a-f]+\.tmp$")


def temp_tag() -> str:
    """`@<host>.<pid space>.<pid>.<random>`: the part of every temp name that makes it
    unique across hosts, containers, processes and calls. Put it in a name as it is
    (`f".{name}.{temp_tag()}.tmp"`); `temp_writer_gone` finds it anywhere in the name."""
    return f"@{_host()}.{_pid_space()}.{os.getpid()}.{secrets.token_hex(4)}"


def _newest_mtime(path: Path) -> float | None:
    """The newest mtime of `path` and, for a directory, of its direct entries."""
    try:
        newest = path.lstat().st_mtime
    except FileNotFoundError:
        return None
    if path.is_dir() and not path.is_symlink():
        with contextlib.suppress(OSError), os.scandir(path) as it:
            for e in it:
                with contextlib.suppress(OSError):
                    newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
    return newest


def temp_writer_gone(path: StrPath, stale_s: float = TEMP_STALE_S) -> bool:
    """May the temp file or directory `path` be removed as debris?

    Tagged (`temp_tag`) by this pid space: when its pid has exited (never this
    process's). Tagged by another host or container: only once nothing in it changed
    for `stale_s` seconds, since its pid cannot be checked from here. An untagged name
    of an older fanout: by the pid it ends with. A name with neither: debris."""
    p = Path(path)
    m = _TAG_RE.search(p.name)
    if m is not None:
        space, pid = m[2], int(m[3])
        if space == _pid_space() and space != "x":
            return pid != os.getpid() and pid_gone(pid)
        newest = _newest_mtime(p)
        return newest is None or time.time() - newest >= stale_s
    legacy = _LEGACY_PID_RE.search(p.name)
    if legacy is None:
        return True
    pid = int(legacy[1] or legacy[2])
    return pid != os.getpid() and pid_gone(pid)


@contextlib.contextmanager
def host_build_lock(entry: StrPath, on_wait: Callable[[], None] | None = None) -> Iterator[bool]:
    """Best effort: one process of this host at a time builds `entry` (M producer
    replicas started together on one host prepare the same rows once, not M times on
    the same cores). Yields whether the lock is held.

    Never a lock across hosts and never one that correctness rests on: the lock file
    lives in this host's temp dir (`$TMPDIR/fanout-locks`), never beside `entry` on a
    shared filesystem, where `flock` is per host, granted to everyone (Lustre, GPFS)
    or refused (`PermissionError` through sshfs). A lock that cannot be taken is
    logged in one line and the build goes on without it: builders write unique temps
    and `commit_dir_once` keeps the first complete entry. `on_wait` is called once if
    another process of this host holds it (then this one waits for it). filelock's
    flock: released when its holder dies, kill -9 included."""
    from filelock import FileLock, Timeout

    path = Path(entry).absolute()
    key = hashlib.blake2s(str(path).encode(), digest_size=8).hexdigest()
    locks = Path(tempfile.gettempdir()) / "fanout-locks"
    lock: Any = None
    try:
        with contextlib.suppress(FileExistsError):
            locks.mkdir()
            locks.chmod(0o1777)  # every user's builds share it, as /tmp (umask aside)
        # 4096 files at most, ever: lock files stay (removing one a waiter holds open
        # would let a third process in); two entries sharing one just wait in turn
        lock = FileLock(str(locks / f"{key[:3]}.lock"), mode=0o666)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if on_wait is not None:
                on_wait()
            lock.acquire()
    except OSError as e:
        log.warning("building %s without a lock (%s): any writer's complete copy wins", path, e)
        lock = None
    try:
        yield lock is not None
    finally:
        if lock is not None:
            with contextlib.suppress(OSError):
                lock.release()


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


def _named(e: BaseException, step: str, path: StrPath) -> AtomicWriteError | None:
    """The AtomicWriteError to raise for `e`, or None to re-raise `e` as it is (not an
    OSError, or already named by an inner step)."""
    if isinstance(e, OSError) and not isinstance(e, AtomicWriteError):
        return AtomicWriteError(step, path, e)
    return None


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
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)
        except BaseException:
            os.close(fd)
            raise
        self._after("open_new", path)
        return fd

    def open_existing(self, path: StrPath) -> int:
        """Open an existing file read-only to fsync what another writer (a library, a
        subprocess, a hard link) put there, setting its mode to 0644 as open_new does."""
        self._before("open_existing", path)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_mode & 0o777 != FILE_MODE:
                os.fchmod(fd, FILE_MODE)
        except BaseException:
            os.close(fd)
            raise
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
            named = _named(e, step, path)
            if named is None:
                raise
            raise named from e
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
            named = _named(e, step, where)
            if named is None:
                raise
            raise named from e
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
            named = _named(e, step, where)
            if named is None:
                raise
            raise named from e

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
            named = _named(e, step, where)
            if named is None:
                raise
            raise named from e
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
        if os.path.lexists(final):  # outdated or incomplete: set aside, never reused
            old = final.with_name(f".{final.name}.old-{temp_tag()}")
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
            deadline = time.monotonic() + stale_view_s(final.parent)
            while True:
                if complete(final):
                    shutil.rmtree(tmp, ignore_errors=True)
                    return False
                if time.monotonic() >= deadline:
                    raise AtomicWriteError("rename", final, e) from e
                time.sleep(0.1)
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
