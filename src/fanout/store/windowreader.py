"""Reading a window file: mapped copy-on-write or read into memory, every byte verified.

    from fanout.store.windowreader import WindowReader, verify_file
    with WindowReader(path, expect_contract=h, tensors=[hidden_name(9)]) as w:
        h9 = w.get(hidden_name(9))[0]          # [T, H] bf16, a view of the mmap (verified)
        h17 = w.get(hidden_name(17))           # verified now, on first use
    verify_file(path)                          # every tensor -> WindowMeta or CorruptWindow

The format (names, metadata, header layout, checksums) is fanout.store.windowfile's;
this module reads it. A reader verifies the header at open and each tensor it reads,
once, when it is first read (or up front: `tensors=`). A consumer that trains on 3 of 9
captured layers therefore maps and hashes only those layers' bytes, and a flipped bit
in a layer it never reads costs it nothing — yet is caught by any reader of that layer.
A flipped bit in the header, or any truncation, is caught by every reader.

Reads mmap the file copy-on-write (MAP_PRIVATE): tensors are zero-copy views,
and a consumer that writes into one changes only its private copy, never the
file. On a network filesystem (or with `FANOUT_WINDOW_READS=copy`) they read each
tensor's bytes into memory instead: a file another host removes or truncates under
a mapping raises SIGBUS at the next fault (NFS, Lustre), a read only a short read,
which is a CorruptWindow. A file just published on another host may not show up
here at once (directory caches): `wait_s` retries the open for that long.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from fanout.errors import CorruptWindow, WindowFormatError
from fanout.hashing import CHECKSUM_ALGO, hasher, labelled
from fanout.netfs import on_network_filesystem
from fanout.store.windowfile import (
    _CHECKSUM_RE,
    _FORMAT_IS,
    _TORCH_DTYPES,
    CHECKSUM_ZERO,
    FORMAT,
    OLD_FORMATS,
    TENSOR_CHECKSUM,
    WindowMeta,
    _checksum_field,
)

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit; a larger length means a corrupt prefix
# Verifying a tensor (WindowReader._verify_tensor): hash granularity; reads requested
# per MADV_WILLNEED (below any disk's readahead/IO size: the kernel caps one such
# request there); how far ahead of the hash reads are requested.
_HASH_STEP = 1 << 20
_READ_STEP = 256 << 10
_READ_AHEAD = 8 << 20


@dataclass(frozen=True)
class _Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # offset into the data section
    nbytes: int


class WindowReader:
    """A window file mapped copy-on-write (tensors are zero-copy views), or read into
    memory tensor by tensor (`copy`; tensors own their bytes).

    Use as a context manager. Tensors handed out stay valid after `close()`: the
    mapping lives until the last of them is garbage collected.

    `copy`: None (default) copies on a network filesystem and maps elsewhere
    (`FANOUT_WINDOW_READS=copy|map` decides instead); `wait_s`: how long a missing
    file is retried before it is CorruptWindow (another host's new file may show up
    late here; the store passes fanout.netfs.stale_view_s: 0 on a local disk).

    With `verify` (the default) the header is verified at open, the tensors named in
    `tensors` too (None: all of them; `[]`: none), and any other tensor when `get`
    first hands it out — so only the bytes a reader uses are ever hashed, and it
    never uses a byte that was not verified.

    Raises CorruptWindow(path, reason) on any problem: missing or short file, bad
    header, offsets, sizes, metadata, checksum, a tensor named in `tensors` that the
    file lacks, or an unexpected contract/window/generation; WindowFormatError for a
    file in an older format.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        verify: bool = True,
        tensors: list[str] | tuple[str, ...] | None = None,
        expect_contract: str | None = None,
        expect_window: int | None = None,
        expect_generation: int | None = None,
        copy: bool | None = None,
        wait_s: float = 0.0,
    ) -> None:
        self.path = Path(path)
        where = str(self.path)
        fd = _open_waiting(self.path, wait_s)
        self.copy = _reads_copy(self.path) if copy is None else copy
        self._fd: int | None = None
        self._mm: mmap.mmap | None = None
        try:
            self.nbytes = os.fstat(fd).st_size
            if self.nbytes < 8:
                raise CorruptWindow(where, f"{self.nbytes} bytes, shorter than the 8-byte prefix")
            # Length + header with pread, not through the mapping: a fault on the mapping
            # would read around the header, into tensors this reader may never use.
            (n,) = struct.unpack("<Q", _pread(fd, 8, 0))
            if n > self.nbytes - 8 or n > MAX_HEADER_BYTES:
                raise CorruptWindow(
                    where, f"header length {n} does not fit a {self.nbytes}-byte file"
                )
            self._head = _pread(fd, 8 + n, 0)  # prefix + header JSON
            if len(self._head) != 8 + n:
                raise CorruptWindow(where, f"file shrank while reading its {n}-byte header")
            if self.copy:
                # read, not mapped: a file removed or truncated under us is a short
                # read here, never a SIGBUS; readahead stops at each tensor's end
                self._fd = fd
                self._closer = weakref.finalize(self, os.close, fd)
                with contextlib.suppress(OSError, AttributeError):  # a hint
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            else:
                # ACCESS_COPY = MAP_PRIVATE: writes into a tensor stay private to this
                # process.
                self._mm = mmap.mmap(fd, self.nbytes, access=mmap.ACCESS_COPY)
        finally:
            if self._fd is None:
                os.close(fd)
        self._verify_reads = verify
        self.verified: set[str] = set()  # tensors whose bytes matched their checksum
        self._cache: dict[str, torch.Tensor] = {}
        try:
            self.meta, self._entries, self._data_start, self.checksums = self._parse(where)
            m = self.meta
            for what, got, want in (
                ("contract hash", m.contract_hash, expect_contract),
                ("window", m.window, expect_window),
                ("generation", m.generation, expect_generation),
            ):
                if want is not None and got != want:
                    raise CorruptWindow(where, f"{what} is {got!r}, expected {want!r}")
            if tensors is not None:
                missing = [k for k in tensors if k not in self._entries]
                if missing:
                    raise CorruptWindow(where, f"no tensor {missing}; it has {self.names()}")
            if verify:
                self._verify_header(where)
                for k in self.names() if tensors is None else tensors:
                    self._verify_tensor(k)
        except BaseException:
            self.close()
            raise
        self.rows = self.meta.rows

    def _parse(self, where: str) -> tuple[WindowMeta, dict[str, _Entry], int, dict[str, str]]:
        n = len(self._head) - 8
        try:
            header = json.loads(self._head[8:])
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise CorruptWindow(where, f"header is not valid JSON: {e}") from None
        if not isinstance(header, dict):
            raise CorruptWindow(where, "header is not a JSON object")
        raw_meta = header.pop("__metadata__", None)
        if not isinstance(raw_meta, dict):
            raise CorruptWindow(where, "no __metadata__ in header (not a fanout window)")
        if (found := raw_meta.get("format")) in OLD_FORMATS:
            raise WindowFormatError(where, found, OLD_FORMATS[found], f"{FORMAT!r} ({_FORMAT_IS})")
        try:
            meta = WindowMeta.from_metadata(raw_meta)
        except ValueError as e:
            raise CorruptWindow(where, str(e)) from None
        sums = {
            k[len(TENSOR_CHECKSUM) :]: v
            for k, v in raw_meta.items()
            if k.startswith(TENSOR_CHECKSUM)
        }
        entries: dict[str, _Entry] = {}
        for k, v in header.items():
            bad = f"tensor {k!r}: bad header entry {v!r}"
            if not isinstance(v, dict) or set(v) != {"dtype", "shape", "data_offsets"}:
                raise CorruptWindow(where, bad)
            dtype = _TORCH_DTYPES.get(v["dtype"]) if isinstance(v["dtype"], str) else None
            shape, offs = v["shape"], v["data_offsets"]
            ints = (
                isinstance(shape, list)
                and isinstance(offs, list)
                and len(offs) == 2
                and all(type(x) is int and x >= 0 for x in [*shape, *offs])
            )
            if dtype is None or not ints or len(shape) < 1:
                raise CorruptWindow(where, bad)
            numel = 1
            for s in shape:
                numel *= s
            nb = numel * torch.empty((), dtype=dtype).element_size()
            if offs[1] - offs[0] != nb:
                raise CorruptWindow(
                    where, f"tensor {k!r}: {offs} spans {offs[1] - offs[0]} bytes, shape needs {nb}"
                )
            if shape[0] != meta.rows:
                raise CorruptWindow(
                    where, f"tensor {k!r}: first dim {shape[0]} != rows {meta.rows}"
                )
            entries[k] = _Entry(dtype, tuple(shape), offs[0], nb)
        if not entries:
            raise CorruptWindow(where, "no tensors")
        end = 0  # tensors must tile the data section exactly: no gap, no overlap
        for k, ent in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].nbytes)):
            if ent.begin != end:
                raise CorruptWindow(where, f"tensor {k!r} starts at {ent.begin}, expected {end}")
            end += ent.nbytes
        if 8 + n + end != self.nbytes:
            raise CorruptWindow(
                where,
                f"file is {self.nbytes} bytes, header describes {8 + n + end} (truncated or padded)",
            )
        return meta, entries, 8 + n, sums

    def _verify_header(self, where: str) -> None:
        """The header checksum (prefix + header JSON, its own value zeroed), and that
        every tensor has a well-formed checksum of its own and nothing else does."""
        stored = self.meta.checksum
        if not _CHECKSUM_RE.match(stored):
            raise CorruptWindow(where, f"checksum {stored!r} is not {CHECKSUM_ALGO}:<32 hex>")
        head = self._head  # prefix + header, as read at open
        if head.count(_checksum_field(stored)) != 1:
            raise CorruptWindow(where, "checksum field not found exactly once in the header")
        got = labelled(
            hasher(head.replace(_checksum_field(stored), _checksum_field(CHECKSUM_ZERO)))
        )
        if got != stored:
            raise CorruptWindow(
                where, f"header checksum mismatch: file says {stored}, header hashes to "
                f"{got}",
            )  # fmt: skip
        if set(self.checksums) != set(self._entries):
            raise CorruptWindow(
                where, f"tensor checksums for {sorted(self.checksums)}, tensors {self.names()}"
            )
        for k, v in self.checksums.items():
            if not _CHECKSUM_RE.match(v):
                raise CorruptWindow(
                    where, f"checksum of {k!r} {v!r} is not {CHECKSUM_ALGO}:<32 hex>"
                )

    def _verify_tensor(self, name: str) -> None:
        """Hash tensor `name`'s bytes (straight from the page cache) against its checksum,
        reading from disk only this tensor's pages.

        Why not plain faults: the kernel reads around a faulting page and ahead of a
        sequential reader by up to the disk's readahead (8 MiB on some virtual disks),
        far into the next tensors — a reader of 2 of 7 layers of a small window would
        read all of it. So faults here read only their own page (MADV_RANDOM), and the
        reads are requested explicitly, `_READ_STEP` bytes at a time, up to `_READ_AHEAD`
        ahead of the hash (MADV_WILLNEED, which reads exactly the range it is given and
        returns at once): the disk streams this tensor and stops at its end.
        """
        if name in self.verified:
            return
        if self.copy:
            self._read(name, verify=True)
            return
        mm, e = self._mm, self._entries[name]
        assert mm is not None
        start, end = self._data_start + e.begin, self._data_start + e.begin + e.nbytes
        h = hasher()
        if e.nbytes:
            first = start - start % mmap.PAGESIZE
            mm.madvise(mmap.MADV_RANDOM, first, end - first)
            requested = first
            with memoryview(mm) as mv:
                for off in range(start, end, _HASH_STEP):
                    want = min(end, off + _HASH_STEP + _READ_AHEAD)
                    while requested < want:
                        step = min(_READ_STEP, end - requested)
                        mm.madvise(mmap.MADV_WILLNEED, requested, step)
                        requested += step
                    h.update(mv[off : min(end, off + _HASH_STEP)])
            mm.madvise(mmap.MADV_NORMAL, first, end - first)
        self._check(name, labelled(h))

    def _check(self, name: str, got: str) -> None:
        if got != self.checksums[name]:
            raise CorruptWindow(
                str(self.path),
                f"checksum mismatch in tensor {name!r}: file says {self.checksums[name]}, "
                f"its bytes hash to {got}",
            )
        self.verified.add(name)

    def _read(self, name: str, verify: bool) -> torch.Tensor:
        """Tensor `name` read into memory (copy mode), hashed while it is read when
        `verify`; cached. A file that shrank meanwhile is CorruptWindow."""
        t = self._cache.get(name)
        if t is not None:
            return t
        fd, e = self._fd, self._entries[name]
        if fd is None:
            raise ValueError(f"{self.path} is closed")
        start = self._data_start + e.begin
        buf = torch.empty(e.nbytes, dtype=torch.uint8)  # [nbytes]
        h = hasher()
        if e.nbytes:
            mv = memoryview(buf.numpy())  # type: ignore[arg-type]
            requested = 0
            for off in range(0, e.nbytes, _HASH_STEP):
                end = min(e.nbytes, off + _HASH_STEP)
                if requested < end:  # the disk reads ahead of us, this tensor only
                    ahead = min(e.nbytes, off + _READ_AHEAD) - requested
                    with contextlib.suppress(OSError, AttributeError):  # a hint
                        os.posix_fadvise(fd, start + requested, ahead, os.POSIX_FADV_WILLNEED)
                    requested += ahead
                got = off
                while got < end:
                    try:
                        n = os.preadv(fd, [mv[got:end]], start + got)
                    except OSError as err:  # EIO; ESTALE: removed on the server
                        raise CorruptWindow(
                            str(self.path), f"cannot read tensor {name!r}: {err.strerror}"
                        ) from err
                    if n == 0:
                        raise CorruptWindow(
                            str(self.path),
                            f"file shrank while reading tensor {name!r} (removed or "
                            "truncated under the reader?)",
                        )
                    got += n
                if verify:
                    h.update(mv[off:end])
        if verify:
            self._check(name, labelled(h))
        t = buf.view(e.dtype).view(e.shape) if e.nbytes else torch.empty(e.shape, dtype=e.dtype)
        self._cache[name] = t
        return t

    def names(self) -> list[str]:
        """Tensor names, in file order."""
        return sorted(self._entries, key=lambda k: self._entries[k].begin)

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor `name` ([R, ...]), a view of the mapping; verified against
        its checksum the first time it is handed out (unless opened with verify=False).
        Raises KeyError for a name the file lacks, CorruptWindow on a checksum mismatch."""
        t = self._cache.get(name)
        if t is not None:
            return t
        if self._mm is None and self._fd is None:
            raise ValueError(f"{self.path} is closed")
        e = self._entries.get(name)
        if e is None:
            raise KeyError(f"{self.path} has no tensor {name!r}; it has {self.names()}")
        if self.copy:
            return self._read(name, verify=self._verify_reads and name not in self.verified)
        if self._verify_reads:
            self._verify_tensor(name)
        if e.nbytes == 0:
            t = torch.empty(e.shape, dtype=e.dtype)
        else:
            numel = e.nbytes // torch.empty((), dtype=e.dtype).element_size()
            t = torch.frombuffer(
                self._mm, dtype=e.dtype, count=numel, offset=self._data_start + e.begin
            )
            t = t.view(e.shape)
        self._cache[name] = t
        return t

    def row(self, i: int) -> dict[str, torch.Tensor]:
        """Row i (0-based within the window) of every tensor, as views."""
        if not 0 <= i < self.rows:
            raise IndexError(f"row {i} out of range for {self.rows} rows in {self.path}")
        return {k: self.get(k)[i] for k in self.names()}

    def close(self) -> None:
        """Drop this reader's references. The mapping is unmapped as soon as no tensor
        from `get`/`row` is alive (each holds a reference to it): closing it by hand
        would leave those tensors pointing at unmapped memory. A copying reader closes
        its file now (its tensors own their bytes)."""
        self._cache = {}
        self._mm = None
        if self._fd is not None:
            self._fd = None
            self._closer()

    def __enter__(self) -> WindowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_waiting(path: Path, wait_s: float) -> int:
    """open(path) read-only, retrying a missing file for up to `wait_s` seconds (a name
    another host just made may show up late); CorruptWindow when it never does."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                waited = f" (waited {wait_s:g} s for it to show up)" if wait_s else ""
                raise CorruptWindow(str(path), f"file is missing{waited}") from None
        except OSError as e:
            raise CorruptWindow(str(path), f"cannot open: {e.strerror}") from e
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def _reads_copy(path: Path) -> bool:
    """Read `path`'s tensors into memory rather than map them? `FANOUT_WINDOW_READS`
    (`copy`, `map`) decides, else whether it is on a network filesystem."""
    how = os.environ.get("FANOUT_WINDOW_READS", "").strip().lower()
    if how in ("copy", "map"):
        return how == "copy"
    return on_network_filesystem(path)


def _pread(fd: int, n: int, offset: int) -> bytes:
    """Up to `n` bytes at `offset` (fewer only at end of file)."""
    parts, got = [], 0
    while got < n:
        b = os.pread(fd, n - got, offset + got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def verify_file(path: str | os.PathLike[str]) -> WindowMeta:
    """Fully validate a window file (header, offsets, sizes, every tensor's checksum);
    return its metadata or raise CorruptWindow."""
    with WindowReader(path, verify=True) as r:
        return r.meta
