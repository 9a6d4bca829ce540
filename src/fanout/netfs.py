"""What a filesystem shared by several hosts asks of fanout: which mounts are network
filesystems, how long another host's new name may take to show up here, who wrote a
temp file (and whether it is debris now), and a build lock that stays on this host.

    from fanout.netfs import on_network_filesystem, stale_view_s, temp_tag, temp_writer_gone
    tmp = entry.with_name(f"{entry.name}.tmp{temp_tag()}")   # unique across hosts
    temp_writer_gone(tmp)             # may a sweep remove it? (its pid, or its age)
    stale_view_s(run_dir)             # 5 s on NFS / sshfs / Lustre, 0 on a local disk

The mount table (`/proc/self/mountinfo`) says which filesystem holds a path
(`filesystem_type`, `on_network_filesystem`): SQLite refuses to live on a network one
(fanout.coord.sqlitedb) and window reads copy from one instead of mapping
(fanout.store.windowreader). Every temp name carries `temp_tag()`, `@<host>.<pid
space>.<pid>.<random>`; `temp_writer_gone` judges a temp of this pid space by its pid
(`pid_gone`) and one of another host or container only by age (`TEMP_STALE_S`).
`kernel_identity` and `proc_stat` say which process a pid means (the coordinator's
liveness records them, fanout.coord.liveness). `host_build_lock` keeps M replicas of one
host from building one cache entry M times; correctness never rests on it
(`fanout.filesystem.FileSystem.commit_dir_once` keeps the first complete entry).
Stdlib only (filelock, lazily, for the host lock), below the FileSystem seam that names
its temps with `temp_tag`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib  # 8 or 16 hex digits of a name (fanout.hashing is for file checksums)
import logging
import os
import re
import secrets
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

StrPath = str | os.PathLike[str]

# A temp of another host (or pid space) is removed as debris only once nothing in it
# changed for this long: its writer's pid cannot be checked from here.
TEMP_STALE_S = 3600.0


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


def complete_within(entry: Path, complete: Callable[[Path], bool]) -> bool:
    """Is `entry` complete (`complete(entry)`), now or within `stale_view_s` (another
    host's new entry may show up whole here late; on a local disk: one look)?"""
    deadline = time.monotonic() + stale_view_s(entry.parent)
    while not complete(entry):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


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


__all__ = [
    "NETWORK_FS_TYPES",
    "TEMP_STALE_S",
    "filesystem_type",
    "host_build_lock",
    "is_network_filesystem",
    "kernel_identity",
    "on_network_filesystem",
    "parse_mountinfo",
    "pid_gone",
    "proc_stat",
    "stale_view_s",
    "temp_tag",
    "temp_writer_gone",
]
