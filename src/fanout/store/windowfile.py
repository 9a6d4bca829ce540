"""The window file format: a safetensors file whose metadata says what it holds.

    from fanout.store.windowfile import WindowReader, hidden_name, verify_file
    with WindowReader(path, expect_contract=h, tensors=[hidden_name(9)]) as w:
        h9 = w.get(hidden_name(9))[0]          # [T, H] bf16, a view of the mmap (verified)
        h17 = w.get(hidden_name(17))           # verified now, on first use
    verify_file(path)                          # every tensor -> WindowMeta or CorruptWindow

Plain safetensors (8-byte little-endian header length, JSON header, tensor
bytes), so `safetensors.safe_open` reads it too. Tensors are laid out by falling
itemsize (then name, numbers in names compared as numbers), so each starts
aligned and one tensor's bytes are one contiguous range. `__metadata__` carries
format, contract hash, window, generation, epoch, row range, producer version and
checksums (xxh3-128, fanout.hashing):

- `checksum.<tensor>`, one per tensor: over that tensor's bytes alone;
- `checksum`: over the 8-byte length + the header JSON with this one value zeroed
  — so it covers every tensor's name, dtype, shape, offsets and checksum.

A reader verifies the header at open and each tensor it reads, once, when it is
first read (or up front: `tensors=`). A consumer that trains on 3 of 9 captured
layers therefore maps and hashes only those layers' bytes, and a flipped bit in
a layer it never reads costs it nothing — yet is caught by any reader of that
layer. A flipped bit in the header, or any truncation, is caught by every reader.
safetensors itself checks neither data bits nor metadata.

The tensors a window holds per row are named in fanout.rows (`input_ids`,
`loss_mask`, `document_ids`, `position_ids`, `target_ids`, optionally
`last_hidden_states`): this format's vocabulary, kept in the core layer so that packing
and the draft models below the store spell it the same way. Hidden states are stored
one tensor per captured layer, `hidden_states.<layer>` `[R, T, H]` (plus
`hidden_states_scale.<layer>` `[R, T]` float32 for fp8); see `hidden_name`. Format 1 (`fanout-window-1`: one `[R, T, n·H]` tensor, one checksum
over the whole file) is refused with `WindowFormatError`.

Reads mmap the file copy-on-write (MAP_PRIVATE): tensors are zero-copy views,
and a consumer that writes into one changes only its private copy, never the
file. On a network filesystem (or with `FANOUT_WINDOW_READS=copy`) they read each
tensor's bytes into memory instead: a file another host removes or truncates under
a mapping raises SIGBUS at the next fault (NFS, Lustre), a read only a short read,
which is a CorruptWindow. A file just published on another host may not show up
here at once (directory caches): `wait_s` retries the open for that long. Writing lives in fanout.store.store (the publish protocol); this module only
lays out the header (`encode_header`) and reads.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import struct
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fanout import __version__
from fanout.errors import CorruptWindow, WindowFormatError
from fanout.filesystem import on_network_filesystem
from fanout.hashing import CHECKSUM_ALGO, HEX_DIGITS, hasher, labelled
from fanout.rows import HIDDEN_STATES, HIDDEN_STATES_SCALE

FORMAT = "fanout-window-2"
# Formats this reader refuses, and what they were (for the error message).
OLD_FORMATS = {
    "fanout-window-1": "one [R, T, n·H] hidden_states tensor and one checksum over the file",
}
_FORMAT_IS = "one tensor per captured layer, a checksum per tensor"
CHECKSUM_ZERO = f"{CHECKSUM_ALGO}:{'0' * HEX_DIGITS}"
TENSOR_CHECKSUM = "checksum."  # metadata key prefix: `checksum.<tensor name>`
_CHECKSUM_RE = re.compile(rf"^{CHECKSUM_ALGO}:[0-9a-f]{{{HEX_DIGITS}}}$")
_UINT_RE = re.compile(r"^(0|[1-9][0-9]*)$")
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit; a larger length means a corrupt prefix
# Verifying a tensor (WindowReader._verify_tensor): hash granularity; reads requested
# per MADV_WILLNEED (below any disk's readahead/IO size: the kernel caps one such
# request there); how far ahead of the hash reads are requested.
_HASH_STEP = 1 << 20
_READ_STEP = 256 << 10
_READ_AHEAD = 8 << 20

# torch dtype <-> safetensors dtype string.
DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.int64: "I64",
    torch.uint64: "U64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_TORCH_DTYPES = {v: k for k, v in DTYPES.items()}

_NAME_RE = re.compile(r"^([0-9]{8,})\.g([0-9]+)\.safetensors$")

HIDDEN = HIDDEN_STATES  # per layer: `hidden_states.<layer>`
HIDDEN_SCALE = HIDDEN_STATES_SCALE


def hidden_name(layer: int) -> str:
    """Tensor name of captured layer `layer`'s hidden states: `hidden_states.9` [R, T, H]."""
    return f"{HIDDEN}.{int(layer)}"


def scale_name(layer: int) -> str:
    """Tensor name of layer `layer`'s fp8 scales: `hidden_states_scale.9` [R, T] float32."""
    return f"{HIDDEN_SCALE}.{int(layer)}"


def layer_tensor_names(layers: list[int] | tuple[int, ...], fp8: bool) -> list[str]:
    """What a reader of `layers` reads of the hidden states (values, then fp8 scales)."""
    names = [hidden_name(i) for i in layers]
    return names + [scale_name(i) for i in layers] if fp8 else names


def _natural(name: str) -> list[Any]:
    """Sort key comparing digit runs as numbers: hidden_states.2 before hidden_states.10."""
    return [int(p) if i % 2 else p for i, p in enumerate(re.split(r"([0-9]+)", name))]


def window_name(window: int, generation: int) -> str:
    """File name of (window, generation): `00000042.g3.safetensors`."""
    if window < 0 or generation < 0:
        raise ValueError(f"window and generation must be >= 0, got {window}, {generation}")
    return f"{window:08d}.g{generation}.safetensors"


def parse_window_name(name: str) -> tuple[int, int] | None:
    """(window, generation) of a canonical window file name, else None."""
    m = _NAME_RE.match(name)
    if m is None:
        return None
    w, g = int(m.group(1)), int(m.group(2))
    return (w, g) if window_name(w, g) == name else None


@dataclass(frozen=True)
class WindowMeta:
    """What a window file says about itself (its safetensors `__metadata__`).

    Rows [row_start, row_end) of the stream; `checksum` is filled in by publish.
    """

    contract_hash: str
    window: int
    generation: int
    epoch: int
    row_start: int
    row_end: int
    checksum: str = ""
    producer_version: str = __version__

    def __post_init__(self) -> None:
        for f in ("window", "generation", "epoch", "row_start", "row_end"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"WindowMeta.{f} must be an int >= 0, got {v!r}")
        if self.row_end <= self.row_start:
            raise ValueError(
                f"WindowMeta.row_end ({self.row_end}) must be > row_start ({self.row_start})"
            )
        if not self.contract_hash:
            raise ValueError("WindowMeta.contract_hash must not be empty")

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start

    def to_metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT,
            "contract_hash": self.contract_hash,
            "window": str(self.window),
            "generation": str(self.generation),
            "epoch": str(self.epoch),
            "row_start": str(self.row_start),
            "row_end": str(self.row_end),
            "checksum": self.checksum,
            "producer_version": self.producer_version,
        }

    @classmethod
    def from_metadata(cls, d: Mapping[str, str]) -> WindowMeta:
        """Inverse of to_metadata; ValueError naming the field on anything odd."""
        if d.get("format") != FORMAT:
            raise ValueError(f"metadata field 'format' is {d.get('format')!r}, expected {FORMAT!r}")
        ints: dict[str, int] = {}
        for f in ("window", "generation", "epoch", "row_start", "row_end"):
            v = d.get(f)
            if not isinstance(v, str) or not _UINT_RE.match(v):
                raise ValueError(f"metadata field {f!r} is {v!r}, expected a decimal int >= 0")
            ints[f] = int(v)
        strs: dict[str, str] = {}
        for f in ("contract_hash", "checksum", "producer_version"):
            v = d.get(f)
            if not isinstance(v, str):
                raise ValueError(f"metadata field {f!r} is {v!r}, expected a string")
            strs[f] = v
        return cls(**strs, **ints)  # type: ignore[arg-type]


def _checksum_field(value: str) -> bytes:
    return b'"checksum":"' + value.encode() + b'"'


@dataclass(frozen=True)
class WindowLayout:
    """A window laid out for writing: tensor names and bytes in file order, and the
    header (`header()`), whose length does not depend on the checksums in it."""

    names: list[str]  # file order
    views: list[memoryview]  # each tensor's bytes, zero-copy, in file order
    data_bytes: int
    _entries: dict[str, Any]
    _meta: dict[str, str]

    def header(self, tensor_checksums: Mapping[str, str] | None = None) -> tuple[bytes, str]:
        """(8-byte length + header JSON, the header checksum).

        Without `tensor_checksums` every checksum is zeroed: the placeholder a writer
        starts the file with. With them (one `xxh3_128:<hex>` per tensor), the header
        checksum is computed over the finished header and swapped in (same length).
        """
        md = dict(self._meta, checksum=CHECKSUM_ZERO)
        for k in self.names:
            v = CHECKSUM_ZERO if tensor_checksums is None else tensor_checksums[k]
            if not _CHECKSUM_RE.match(v):
                raise ValueError(f"checksum {v!r} of {k!r} is not {CHECKSUM_ALGO}:<32 hex>")
            md[TENSOR_CHECKSUM + k] = v
        prefix = self._encode(md)
        if tensor_checksums is None:
            return prefix, CHECKSUM_ZERO
        md["checksum"] = labelled(hasher(prefix))
        final = self._encode(md)
        assert len(final) == len(prefix)
        return final, md["checksum"]

    def _encode(self, md: dict[str, str]) -> bytes:
        js = json.dumps(
            {"__metadata__": md, **self._entries}, separators=(",", ":"), ensure_ascii=True
        ).encode()
        js += b" " * (-len(js) % 8)  # pad so the data section starts 8-aligned
        return struct.pack("<Q", len(js)) + js


def encode_header(tensors: Mapping[str, torch.Tensor], meta: WindowMeta) -> WindowLayout:
    """Validate tensors and lay out a window file (see `WindowLayout`).

    The writer writes `layout.header()` (checksums zeroed), then each of
    `layout.views` while hashing it, then `layout.header(checksums)` over the first.
    Raises ValueError naming the tensor if one is not a contiguous CPU tensor of
    a storable dtype whose first dim is meta.rows, or its name is reserved.
    """
    name = window_name(meta.window, meta.generation)
    if not tensors:
        raise ValueError(f"window {name}: no tensors to publish")
    for k, t in tensors.items():
        where = f"window {name}: tensor {k!r}"
        if not isinstance(k, str) or not k or k == "__metadata__":
            raise ValueError(f"window {name}: invalid tensor name {k!r}")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where} is a {type(t).__name__}, not a torch.Tensor")
        if t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous():
            raise ValueError(f"{where} must be a contiguous CPU tensor ({t.device}, {t.layout})")
        if t.dtype not in DTYPES:
            raise ValueError(f"{where}: dtype {t.dtype} cannot be stored")
        if t.dim() < 1 or t.shape[0] != meta.rows:
            raise ValueError(f"{where}: shape {tuple(t.shape)}, first dim must be rows={meta.rows}")
    # Falling itemsize, then name: every tensor starts aligned to its itemsize, and the
    # layers of one kind lie in layer order (a reader of layers 1-4 reads one range).
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), _natural(k)))
    entries: dict[str, Any] = {}
    views, offset = [], 0
    for k in order:
        t = tensors[k]
        nb = t.numel() * t.element_size()
        entries[k] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                      "data_offsets": [offset, offset + nb]}  # fmt: skip
        views.append(_tensor_bytes(t))
        offset += nb
    return WindowLayout(order, views, offset, entries, meta.to_metadata())


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes as a flat memoryview of its own memory (no copy)."""
    flat = t.detach().reshape(-1).view(torch.uint8).numpy()  # [numel·itemsize]
    return memoryview(flat)  # type: ignore[arg-type]


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
    late here; the store passes fanout.filesystem.stale_view_s: 0 on a local disk).

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
