"""The filesystem seam: real calls behave, and FaultyFileSystem fails exactly when told.

.venv/bin/pytest tests/test_filesystem.py -x -q
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from fanout.filesystem import OPS, FaultyFileSystem, FileSystem


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
