"""Fault injection at every step of a write, through the FileSystem seam.

    from faults import fail_each_call
    result, failures = fail_each_call(lambda fs: contract.save(path, fs), check)

`fail_each_call` runs `write(fs)` with a FaultyFileSystem failing call 1, then call
2, ... until one run completes, calling `check(n, error)` after each failed run.
Every step of the write (create, each write, fsync, close, rename or link, the
directory fsync, ...) thus fails once, and `check` asserts what a reader would
find there at that moment.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import TypeVar

from fanout.filesystem import AtomicWriteError, FaultyFileSystem, FileSystem

T = TypeVar("T")


def fail_each_call(
    write: Callable[[FileSystem], T],
    check: Callable[[int, OSError], None],
    *,
    errno_: int = errno.EIO,
    ops: set[str] | None = None,
    limit: int = 1000,
) -> tuple[T, int]:
    """The result of the first run that completed and the number of failed runs.

    Args:
        write: the write under test, given the FileSystem to use.
        check: called with (failing call number, the OSError raised) after each failed run.
        errno_: errno of the injected error.
        ops: count (and fail) only these ops; None: all.
        limit: give up (AssertionError) after this many failed runs.
    """
    for n in range(1, limit + 1):
        fs = FaultyFileSystem(fail_at=n, errno_=errno_, ops=ops)
        try:
            result = write(fs)
        except OSError as e:
            assert fs.failures == 1, (n, e)  # the injected fault, not another error
            assert e.errno == errno_, (n, e)
            check(n, e)
            continue
        assert fs.failures == 0, (n, fs.log)
        return result, n - 1
    raise AssertionError(f"the write never completed in {limit} runs")


def after_rename(e: BaseException) -> bool:
    """The fault hit the last step of an atomic write, the directory fsync after the
    rename: the new file is already in place (whole), just not yet durable."""
    return isinstance(e, AtomicWriteError) and e.step == "fsync directory"


class Recording(FileSystem):
    """A real FileSystem that records (op, arg) of every call."""

    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []

    def _before(self, op: str, arg: object) -> None:
        self.log.append((op, arg))

    @property
    def ops(self) -> list[str]:
        return [op for op, _ in self.log]
