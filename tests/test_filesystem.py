"""The filesystem seam: real calls behave, and FaultyFileSystem fails exactly when told.

.venv/bin/pytest tests/test_filesystem.py -x -q

The atomic write built on the seam (write_new, write_atomic, commit_dir) is tested
here with a fault at every one of its calls and a kill -9 at every step.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import pickle
import shutil
import signal
from pathlib import Path

import pytest

from fanout.filesystem import OPS, AtomicWriteError, FaultyFileSystem, FileSystem, TempFile
from faults import Recording, fail_each_call


def _fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError as e:
        assert e.errno == errno.EBADF
        return False
    return True


def test_open_new_is_exclusive_and_0644_despite_umask(tmp_path: Path) -> None:
    fs = FileSystem()
    old = os.umask(0o077)
    try:
        fd = fs.open_new(tmp_path / "a")
    finally:
        os.umask(old)
    fs.close(fd)
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o644
    with pytest.raises(FileExistsError):
        fs.open_new(tmp_path / "a")


def test_write_pwrite_fsync_roundtrip(tmp_path: Path) -> None:
    fs = FileSystem()
    data = os.urandom(3 << 20)  # several MiB: exercises the short-write loop path
    fd = fs.open_new(tmp_path / "f")
    fs.write(fd, b"\0" * 8)
    fs.write(fd, memoryview(data))
    fs.pwrite(fd, b"HEADER!!", 0)
    fs.write(fd, b"tail")  # pwrite must not have moved the offset
    fs.fsync(fd)
    fs.close(fd)
    assert (tmp_path / "f").read_bytes() == b"HEADER!!" + data + b"tail"


def test_link_never_overwrites_and_dir_ops(tmp_path: Path) -> None:
    fs = FileSystem()
    fs.makedirs(tmp_path / "x" / "y")
    fs.makedirs(tmp_path / "x" / "y")  # mkdir -p is idempotent
    (tmp_path / "src").write_bytes(b"new")
    (tmp_path / "dst").write_bytes(b"old")
    with pytest.raises(FileExistsError):
        fs.link(tmp_path / "src", tmp_path / "dst")
    assert (tmp_path / "dst").read_bytes() == b"old"
    fs.link(tmp_path / "src", tmp_path / "x" / "y" / "l")
    fs.fsync_dir(tmp_path / "x" / "y")
    fs.rename(tmp_path / "x" / "y" / "l", tmp_path / "moved")
    fs.unlink(tmp_path / "src")
    assert (tmp_path / "moved").read_bytes() == b"new"
    with pytest.raises(FileNotFoundError):
        fs.unlink(tmp_path / "src")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_faulty_fails_exactly_call_n_once(tmp_path: Path, n: int) -> None:
    fs = FaultyFileSystem(fail_at=n, errno_=errno.EIO)
    results = []
    for i in range(5):
        try:
            fs.makedirs(tmp_path / f"d{i}")
            results.append(True)
        except OSError as e:
            assert e.errno == errno.EIO
            results.append(False)
    assert results == [i + 1 != n for i in range(5)]
    assert fs.calls == 5 and fs.failures == 1
    # The failing call did not happen: its directory does not exist.
    assert not (tmp_path / f"d{n - 1}").exists()


def test_faulty_persistent_and_ops_filter(tmp_path: Path) -> None:
    fs = FaultyFileSystem(fail_at=2, errno_=errno.ENOSPC, persistent=True, ops={"write"})
    fd = fs.open_new(tmp_path / "f")  # not counted
    fs.write(fd, b"a")  # write #1 ok
    for _ in range(3):
        with pytest.raises(OSError) as ei:
            fs.write(fd, b"b")
        assert ei.value.errno == errno.ENOSPC
    fs.fsync(fd)  # other ops still work
    fs.close(fd)
    assert (tmp_path / "f").read_bytes() == b"a"
    assert fs.calls == 4 and fs.failures == 3
    assert [op for op, _ in fs.log] == [
        "open_new",
        "write",
        "write",
        "write",
        "write",
        "fsync",
        "close",
    ]


def test_faulty_close_still_releases_fd(tmp_path: Path) -> None:
    fs = FaultyFileSystem(fail_at=1, ops={"close"})
    fd = fs.open_new(tmp_path / "f")
    with pytest.raises(OSError):
        fs.close(fd)
    assert not _fd_is_open(fd)


def test_faulty_validates_arguments() -> None:
    with pytest.raises(ValueError, match="fail_at"):
        FaultyFileSystem(fail_at=0)
    with pytest.raises(ValueError, match="unknown ops"):
        FaultyFileSystem(fail_at=1, ops={"wirte"})
    assert {"write", "fsync", "link", "unlink", "rename", "fsync_dir", "makedirs"} <= OPS


# -- the atomic write (write_new, write_atomic, commit_dir) ------------------------------


def _listing(d: Path) -> list[str]:
    return sorted(os.listdir(d))


@pytest.mark.parametrize("errno_", [errno.EIO, errno.ENOSPC])
def test_write_atomic_fails_whole_at_every_step(tmp_path: Path, errno_: int) -> None:
    """Each call (create, write, fsync, close, rename, dir fsync) fails once: the old
    file stays whole (or, once renamed, the new one is), no temp is left, and the
    error names the step and keeps the errno."""
    path = tmp_path / "stream.json"
    FileSystem().write_atomic(path, b"old")
    steps: list[str] = []

    def check(n: int, e: OSError) -> None:
        assert isinstance(e, AtomicWriteError) and e.errno == errno_
        steps.append(e.step)
        assert str(e.path) in str(e) and e.step in str(e)
        want = b"new" if e.step == "fsync directory" else b"old"  # a rename is not undone
        assert path.read_bytes() == want, (n, e)
        assert _listing(tmp_path) == ["stream.json"], (n, e)

    _, failures = fail_each_call(lambda fs: fs.write_atomic(path, b"new"), check, errno_=errno_)
    assert steps == ["create", "write", "fsync", "close", "rename", "fsync directory"]
    assert path.read_bytes() == b"new" and path.stat().st_mode & 0o777 == 0o644
    assert _listing(tmp_path) == ["stream.json"] and failures == 6


def test_write_atomic_calls_in_order_and_fsyncs(tmp_path: Path) -> None:
    fs = Recording()
    fs.write_atomic(tmp_path / "a", b"x")
    assert fs.ops == ["open_new", "write", "fsync", "close", "rename", "fsync_dir"]
    fs = Recording()
    fs.write_atomic(tmp_path / "b", b"x", tmp=tmp_path / "b.tmp", overwrite=False)
    assert fs.ops == ["open_new", "write", "fsync", "close", "link", "unlink", "fsync_dir"]
    assert fs.log[-1] == ("fsync_dir", tmp_path)


def test_persistent_enospc_leaves_old_file_and_no_temp(tmp_path: Path) -> None:
    """A full disk: every write (or every call from the first write on) fails."""
    path = tmp_path / "contract.json"
    FileSystem().write_atomic(path, b"old contents")
    for ops in ({"write"}, {"fsync"}, None):
        fs = FaultyFileSystem(fail_at=1, errno_=errno.ENOSPC, persistent=True, ops=ops)
        with pytest.raises(OSError) as ei:
            fs.write_atomic(path, b"new contents" * 1000)
        assert ei.value.errno == errno.ENOSPC
        assert path.read_bytes() == b"old contents"
        if ops is None:  # cleanup failed too: the temp may be left, never a torn final
            for name in _listing(tmp_path):
                if name != "contract.json":
                    assert name.endswith(".tmp")
                    (tmp_path / name).unlink()
        assert _listing(tmp_path) == ["contract.json"], ops
        assert [op for op, _ in fs.log].count("fsync") <= 1  # never retried


def test_write_atomic_without_overwrite_never_replaces(tmp_path: Path) -> None:
    path = tmp_path / "w"
    FileSystem().write_atomic(path, b"first", overwrite=False)
    with pytest.raises(AtomicWriteError) as ei:
        FileSystem().write_atomic(path, b"second", overwrite=False)
    assert ei.value.errno == errno.EEXIST and ei.value.step == "link"
    assert path.read_bytes() == b"first" and _listing(tmp_path) == ["w"]

    def check(n: int, e: OSError) -> None:  # a failure after the link removes it again
        assert _listing(tmp_path) == [], (n, e)

    path.unlink()
    fail_each_call(lambda fs: fs.write_atomic(path, b"x", overwrite=False), check)
    assert path.read_bytes() == b"x"


def test_writers_fd_and_path(tmp_path: Path) -> None:
    """A writer gets the open temp file: writes through the seam are counted (and fail
    under injection); a library that replaces the file at `path` (as safetensors does)
    gets the new file fsynced and made 0644."""

    def by_fd(t: TempFile) -> int:
        fs.write(t.fd, b"abc")
        fs.pwrite(t.fd, b"A", 0)
        return 7

    fs = Recording()
    assert fs.write_atomic(tmp_path / "fd", by_fd) == 7
    assert (tmp_path / "fd").read_bytes() == b"Abc"

    def by_path(t: TempFile) -> str:
        repl = t.path.with_name("elsewhere")
        repl.write_bytes(b"library")
        os.chmod(repl, 0o600)
        os.replace(repl, t.path)
        return "done"

    fs = Recording()
    assert fs.write_atomic(tmp_path / "lib", by_path) == "done"
    assert (tmp_path / "lib").read_bytes() == b"library"
    assert (tmp_path / "lib").stat().st_mode & 0o777 == 0o644
    assert fs.ops == ["open_new", "close", "open_existing", "fsync", "close", "rename", "fsync_dir"]


def test_a_failing_writer_leaves_no_temp(tmp_path: Path) -> None:
    def boom(t: TempFile) -> None:
        os.write(t.fd, b"partial")
        raise KeyError("not an OSError: passes through unchanged")

    with pytest.raises(KeyError):
        FileSystem().write_atomic(tmp_path / "f", boom)
    assert _listing(tmp_path) == []


def test_atomic_write_error_pickles() -> None:
    e = AtomicWriteError("fsync", "/x/y", OSError(errno.ENOSPC, "No space left on device"))
    back = pickle.loads(pickle.dumps(e))
    assert (back.errno, back.step, back.path, str(back)) == (e.errno, e.step, e.path, str(e))


def _write_and_die(path: str, at: int, after: bool) -> None:
    class Killing(FileSystem):
        n = 0

        def _before(self, op: str, arg: object) -> None:
            self.n += 1
            if self.n == at and not after:
                os.kill(os.getpid(), signal.SIGKILL)

        def _after(self, op: str, arg: object) -> None:
            if self.n == at and after:
                os.kill(os.getpid(), signal.SIGKILL)

    Killing().write_atomic(path, b"new" * 1000)
    os._exit(3)


def test_kill9_at_every_step_leaves_old_or_new_whole(tmp_path: Path) -> None:
    path = tmp_path / "f"
    ctx = multiprocessing.get_context("fork")
    for at in range(1, 7):
        for after in (False, True):
            FileSystem().write_atomic(path, b"old")
            p = ctx.Process(target=_write_and_die, args=(str(path), at, after))
            p.start()
            p.join(30)
            assert p.exitcode == -signal.SIGKILL, (at, after)
            renamed = at > 5 or (at == 5 and after)
            assert path.read_bytes() == (b"new" * 1000 if renamed else b"old"), (at, after)
            for name in _listing(tmp_path):  # debris is a temp name, never the final one
                if name != "f":
                    assert name.startswith(".f.") and name.endswith(".tmp")
                    (tmp_path / name).unlink()


def _make_dir(d: Path, tag: bytes) -> None:
    fs = FileSystem()
    fs.makedirs(d / "sub")
    fs.write_new(d / "a", tag)
    (d / "sub" / "b").write_bytes(tag)  # not fsynced yet: commit_dir does it


def test_commit_dir_fails_whole_at_every_step(tmp_path: Path) -> None:
    final, tmp = tmp_path / "entry", tmp_path / "entry.tmp-1"

    def attempt(fs: FileSystem) -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        _make_dir(tmp, b"old")
        FileSystem().commit_dir(tmp, final)  # the entry a reader has now
        _make_dir(tmp, b"new")
        fs.commit_dir(tmp, final)

    def check(n: int, e: OSError) -> None:
        assert isinstance(e, AtomicWriteError)
        got = {(final / "a").read_bytes(), (final / "sub" / "b").read_bytes()}
        assert got == ({b"new"} if e.step == "fsync directory" and e.path == tmp_path else {b"old"})
        assert [n for n in _listing(tmp_path) if ".old-" in n] == [], (n, e)

    fs = Recording()
    attempt(fs)
    assert fs.ops.count("fsync") == 2 and fs.ops.count("fsync_dir") == 3  # a, b; sub, tmp, parent
    _, failures = fail_each_call(attempt, check)
    assert failures == len(fs.log)
    assert (final / "a").read_bytes() == b"new" and _listing(tmp_path) == ["entry"]
