"""The artifact store: publish, open, quarantine, evict and sweep window files.

    from fanout.store.store import RunDir, Store, WindowMeta
    from fanout.store.windowfile import hidden_name
    store = Store(RunDir("runs/demo").create())          # h9, h17: layers 9, 17 [R, T, H]
    pub = store.publish({hidden_name(9): h9, hidden_name(17): h17, "input_ids": ids},
        WindowMeta(contract_hash=c.stream_id, window=3, generation=0, epoch=0,
                   row_start=12, row_end=16))            # R = 4 rows: 12..15
    with store.open(pub.name, expect_contract=c.stream_id, expect_window=3) as w:
        h0 = w.get(hidden_name(9))[0]                    # [T, H] bf16, a view of the mmap

Publish never leaves a partial file under a final name, and an fsync error
aborts the window (it is never retried):
tmp/<name>.<temp_tag()>.tmp (O_EXCL, 0644; fanout.netfs.temp_tag) → header with
zeroed checksums → tensor bytes straight from tensor memory, each tensor hashed chunk
by chunk as it is written → real header (every tensor's checksum, then the header's
own) pwritten at offset 0 → fsync → close → link to
windows/<name> (fails if it exists) → unlink tmp → fsync windows/: the
package's one atomic write, `FileSystem.write_atomic(..., overwrite=False)`, with
a writer that streams and hashes the tensors. The caller then commits the window
in the coordinator. Every write-side call goes through the `FileSystem` seam
(fanout.filesystem), so tests inject EIO/ENOSPC and kills.
The file format lives in fanout.store.windowfile, its reader in fanout.store.windowreader,
the run directory's layout in fanout.store.rundir (re-exported here).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fanout.errors import CorruptWindow, StorageError, StorageFull
from fanout.filesystem import AtomicWriteError, FileSystem, TempFile
from fanout.hashing import hasher, labelled
from fanout.netfs import stale_view_s, temp_tag
from fanout.store.rundir import RunDir
from fanout.store.windowfile import (
    WindowFormatError,
    WindowMeta,
    encode_header,
    parse_window_name,
    window_name,
)
from fanout.store.windowreader import WindowReader, verify_file

__all__ = [
    "Published",
    "RunDir",
    "Store",
    "SweepReport",
    "WindowFormatError",
    "WindowMeta",
    "WindowReader",
    "parse_window_name",
    "verify_file",
    "window_name",
]

DEFAULT_CHUNK_BYTES = 4 << 20  # hash + write granularity: small enough to stay in cache
# Windows from 16 MiB up start writeback behind every chunk (256 MiB: 1.4 -> 2.3 GB/s
# here); small ones (the demo's 150 KB) skip the syscalls, which under CPU contention
# cost more than they saved (~10% of the demo producer's throughput).
DEFAULT_WRITEBACK_BYTES = 16 << 20
# Chunks below this are hashed on the writing thread (small tensors: scales, ids).
_INLINE_HASH_BYTES = 256 << 10


def _parse_tmp_name(name: str) -> tuple[int, int] | None:
    """(window, generation) of a publish temp file `<final name>.<temp_tag()>.tmp`."""
    if not name.endswith(".tmp"):
        return None
    cut = name.find(".safetensors.")
    return None if cut < 0 else parse_window_name(name[: cut + len(".safetensors")])


@dataclass(frozen=True)
class Published:
    """A window file that is durable under its final name (not yet committed)."""

    name: str
    path: Path
    nbytes: int
    checksum: str
    verifier_version: int | None = None  # WindowMeta's: the coordinator records it too


@dataclass
class SweepReport:
    """What one sweep removed (names) and how many final-named live files it kept."""

    tmp_removed: list[str] = field(default_factory=list)
    orphans_removed: list[str] = field(default_factory=list)
    kept: int = 0

    @property
    def removed(self) -> int:
        return len(self.tmp_removed) + len(self.orphans_removed)


def _storage_error(e: OSError, name: str, op: str, path: Path) -> StorageError:
    cls = StorageFull if e.errno in _FULL_ERRNOS else StorageError
    reason = e.reason if isinstance(e, AtomicWriteError) else e.strerror or e
    return cls(f"window {name}: {op} failed on {path}: {reason}")


_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


class Store:
    """Publishes, opens, evicts and sweeps window files of one run directory.

    Args:
        run_dir: the run directory (created with RunDir.create()).
        fs: filesystem seam for every write-side call; a FaultyFileSystem in tests.
        chunk_bytes: hash/write granularity of publish (bytes).
        writeback_bytes: windows of at least this many bytes start disk writeback
            behind every chunk (`FileSystem.start_writeback`); smaller ones are left to
            their fsync.
    """

    def __init__(
        self,
        run_dir: RunDir,
        fs: FileSystem | None = None,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        writeback_bytes: int = DEFAULT_WRITEBACK_BYTES,
    ) -> None:
        if chunk_bytes <= 0 or writeback_bytes <= 0:
            raise ValueError(
                f"chunk_bytes and writeback_bytes must be > 0, got {chunk_bytes}, {writeback_bytes}"
            )
        self.run_dir = run_dir
        self.fs = fs or FileSystem()
        self.chunk_bytes = chunk_bytes
        self.writeback_bytes = writeback_bytes

    def path(self, name: str) -> Path:
        return self.run_dir.windows / name

    # -- publish ----------------------------------------------------------------

    def publish(self, tensors: Mapping[str, torch.Tensor], meta: WindowMeta) -> Published:
        """Write one window durably under windows/<window_name(meta)>.

        Raises:
            ValueError: tensors are not contiguous CPU tensors with first dim == rows.
            StorageFull: ENOSPC/EDQUOT at any step (temp removed, nothing final-named).
            StorageError: any other OSError, incl. an existing final file (never overwritten).
        """
        name = window_name(meta.window, meta.generation)
        layout = encode_header(tensors, meta)
        prefix, _ = layout.header()  # checksums zeroed; same length as the real one
        final = self.run_dir.windows / name
        tmp = self.run_dir.tmp / f"{name}.{temp_tag()}.tmp"

        def write(t: TempFile) -> str:
            self.fs.write(t.fd, prefix)
            sums = self._write_hashed(t.fd, len(prefix), layout.names, layout.views)
            real, checksum = layout.header(sums)
            self.fs.pwrite(t.fd, real, 0)
            return checksum

        try:  # fsync never retried; link never overwrites; temp (and link) gone on failure
            checksum = self.fs.write_atomic(final, write, tmp=tmp, overwrite=False)
        except AtomicWriteError as e:
            if e.errno == errno.EEXIST and e.step == "link":
                raise StorageError(f"window {name}: {final} already exists; not overwritten") from e
            raise _storage_error(e, name, e.step, e.path) from e
        return Published(
            name, final, len(prefix) + layout.data_bytes, checksum, meta.verifier_version
        )

    def _write_hashed(
        self, fd: int, offset: int, names: list[str], views: list[memoryview]
    ) -> dict[str, str]:
        """Write every view chunk by chunk (from file offset `offset` on) and return
        each tensor's xxh3-128 checksum. A helper thread hashes chunk i while this
        thread writes it (xxhash and write(2) both release the GIL), so the hash costs
        about nothing next to the write; both read the same bytes while they are hot
        in cache."""
        sums: dict[str, str] = {}
        hint = offset + sum(v.nbytes for v in views) >= self.writeback_bytes
        with ThreadPoolExecutor(1, thread_name_prefix="fanout-hash") as pool:
            for k, v in zip(names, views, strict=True):
                h = hasher()
                for i in range(0, v.nbytes, self.chunk_bytes):
                    chunk = v[i : i + self.chunk_bytes]
                    if chunk.nbytes < _INLINE_HASH_BYTES:  # a hand-off costs more than that
                        h.update(chunk)
                        self.fs.write(fd, chunk)
                    else:
                        hashed = pool.submit(h.update, chunk)
                        try:
                            self.fs.write(fd, chunk)
                        finally:
                            hashed.result()  # in order: one chunk in flight at a time
                    if hint:  # the disk flushes this chunk while we write the next ones
                        self.fs.start_writeback(fd, offset, chunk.nbytes)
                    offset += chunk.nbytes
                sums[k] = labelled(h)
        return sums

    # -- read, quarantine, evict, sweep ------------------------------------------

    def open(
        self,
        name: str,
        *,
        verify: bool = True,
        tensors: list[str] | tuple[str, ...] | None = None,
        expect_contract: str | None = None,
        expect_window: int | None = None,
    ) -> WindowReader:
        """Open windows/<name> (mapped; read into memory on a network filesystem),
        verifying its header and the tensors named in `tensors` (None: all; others are
        verified when first read). A missing file is retried for
        fanout.netfs.stale_view_s (5 s on a network filesystem, 0 on a local one;
        `FANOUT_STALE_VIEW_S`): a window published on another host may show up late in
        this host's view of the directory.
        CorruptWindow on a bad name, a file still missing then, bad header, checksum
        mismatch or unexpected contract/window/generation; WindowFormatError for a
        file in an older format."""
        wg = parse_window_name(name)
        if wg is None:
            raise CorruptWindow(str(self.path(name)), "not a window file name")
        if expect_window is not None and expect_window != wg[0]:
            raise CorruptWindow(
                str(self.path(name)), f"is window {wg[0]}, expected {expect_window}"
            )
        return WindowReader(
            self.path(name),
            verify=verify,
            tensors=tensors,
            expect_contract=expect_contract,
            expect_window=wg[0],
            expect_generation=wg[1],
            wait_s=stale_view_s(self.run_dir.windows),
        )

    def quarantine(self, name: str) -> Path:
        """Move windows/<name> to quarantine/<name>.<unix_ns> and return that path.
        If the file is already gone nothing moves (the returned path does not exist)."""
        dst = self.run_dir.quarantine / f"{name}.{time.time_ns()}"
        try:
            self.fs.rename(self.path(name), dst)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _storage_error(e, name, "quarantine", self.path(name)) from e
        return dst

    def remove(self, name: str) -> bool:
        """Unlink windows/<name> (eviction); False if it was already gone."""
        try:
            self.fs.unlink(self.path(name))
        except FileNotFoundError:
            return False
        except OSError as e:
            raise _storage_error(e, name, "remove", self.path(name)) from e
        return True

    def sweep(self, is_live: Callable[[int, int], bool]) -> SweepReport:
        """Remove debris: temp files (and unparseable names) in tmp/ and final-named
        files in windows/ whose (window, generation) is not live.

        `is_live(window, generation)` must be True for a window being published now
        (capturing, claimed at that generation) as well as for ready ones, or a
        sweep racing a publish deletes its file. Idempotent; safe to run twice at
        once (a file another sweeper removed first is skipped). Looks only inside
        tmp/ and windows/, and never at a *.sqlite3* name.
        """
        report = SweepReport()
        for d, parse, removed in (
            (self.run_dir.tmp, _parse_tmp_name, report.tmp_removed),
            (self.run_dir.windows, parse_window_name, report.orphans_removed),
        ):
            try:
                entries = sorted(
                    e.name for e in os.scandir(d) if not e.is_dir(follow_symlinks=False)
                )
            except FileNotFoundError:
                continue
            for n in entries:
                if ".sqlite3" in n:
                    continue
                wg = parse(n)
                if d == self.run_dir.windows and wg is None:
                    continue  # not ours to judge
                if wg is not None and is_live(*wg):
                    report.kept += d == self.run_dir.windows
                    continue
                try:
                    self.fs.unlink(d / n)
                except FileNotFoundError:
                    continue  # another sweeper (or an eviction) got there first
                except OSError as e:
                    raise _storage_error(e, n, "sweep", d / n) from e
                removed.append(n)
        return report
