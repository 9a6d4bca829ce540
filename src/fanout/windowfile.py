"""The window file format: a safetensors file whose metadata says what it holds.

    from fanout.windowfile import WindowReader, verify_file
    with WindowReader("runs/demo/windows/00000003.g0.safetensors", expect_contract=h) as w:
        h0 = w.get("hidden_states")[0]                   # [T, n·H] bf16, a view of the mmap
    verify_file(path)                                    # -> WindowMeta or CorruptWindow

Plain safetensors (8-byte little-endian header length, JSON header, tensor
bytes), so `safetensors.safe_open` reads it too. Tensors are laid out by falling
itemsize, so each starts aligned. `__metadata__` carries format, contract hash,
window, generation, epoch, row range, producer version and a checksum: xxh3-128
over the 8-byte length + the header (with the checksum value zeroed) + all
tensor bytes. A flipped bit anywhere — data, header, metadata — and any
truncation is caught on read; safetensors itself checks neither data bits nor
metadata.

Reads mmap the file copy-on-write (MAP_PRIVATE): tensors are zero-copy views,
and a consumer that writes into one changes only its private copy, never the
file. Writing lives in fanout.store (the publish protocol); this module only
lays out the header (`encode_header`) and reads.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from fanout import __version__
from fanout.errors import CorruptWindow

FORMAT = "fanout-window-1"
CHECKSUM_ALGO = "xxh3_128"
CHECKSUM_ZERO = f"{CHECKSUM_ALGO}:{'0' * 32}"
_CHECKSUM_RE = re.compile(rf"^{CHECKSUM_ALGO}:[0-9a-f]{{32}}$")
_UINT_RE = re.compile(r"^(0|[1-9][0-9]*)$")
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit; a larger length means a corrupt prefix

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


def encode_header(
    tensors: Mapping[str, torch.Tensor], meta: WindowMeta
) -> tuple[bytes, list[memoryview], int]:
    """Validate tensors and lay out a window file.

    Returns (8-byte length + header JSON with a zeroed checksum, each tensor's
    bytes as a zero-copy view in file order, total data bytes). The writer hashes
    prefix + views, then swaps the real checksum in with `with_checksum`.
    Raises ValueError naming the tensor if one is not a contiguous CPU tensor of
    a storable dtype whose first dim is meta.rows.
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
    # Falling itemsize, then name: every tensor starts aligned to its itemsize.
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": {**meta.to_metadata(), "checksum": CHECKSUM_ZERO}}
    views, offset = [], 0
    for k in order:
        t = tensors[k]
        nb = t.numel() * t.element_size()
        header[k] = {
            "dtype": DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nb],
        }
        views.append(_tensor_bytes(t))
        offset += nb
    js = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    js += b" " * (-len(js) % 8)  # pad so the data section starts 8-aligned
    return struct.pack("<Q", len(js)) + js, views, offset


def with_checksum(prefix: bytes, checksum: str) -> bytes:
    """The prefix from encode_header with the zeroed checksum replaced (same length)."""
    if not _CHECKSUM_RE.match(checksum):
        raise ValueError(f"checksum {checksum!r} is not {CHECKSUM_ALGO}:<32 hex>")
    return prefix.replace(_checksum_field(CHECKSUM_ZERO), _checksum_field(checksum), 1)


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
    """A window file mapped copy-on-write; tensors are zero-copy views.

    Use as a context manager. Tensors handed out stay valid after `close()`: the
    mapping lives until the last of them is garbage collected.

    Raises CorruptWindow(path, reason) on any problem: missing or short file, bad
    header, offsets, sizes, metadata, checksum, or an unexpected contract/window/generation.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        verify: bool = True,
        expect_contract: str | None = None,
        expect_window: int | None = None,
        expect_generation: int | None = None,
    ) -> None:
        self.path = Path(path)
        where = str(self.path)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CorruptWindow(where, "file is missing") from None
        except OSError as e:
            raise CorruptWindow(where, f"cannot open: {e.strerror}") from e
        try:
            self.nbytes = os.fstat(fd).st_size
            if self.nbytes < 8:
                raise CorruptWindow(where, f"{self.nbytes} bytes, shorter than the 8-byte prefix")
            # ACCESS_COPY = MAP_PRIVATE: writes into a tensor stay private to this process.
            self._mm: mmap.mmap | None = mmap.mmap(fd, self.nbytes, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        try:
            self.meta, self._entries, self._data_start = self._parse(where)
            m = self.meta
            for what, got, want in (
                ("contract hash", m.contract_hash, expect_contract),
                ("window", m.window, expect_window),
                ("generation", m.generation, expect_generation),
            ):
                if want is not None and got != want:
                    raise CorruptWindow(where, f"{what} is {got!r}, expected {want!r}")
            if verify:
                self._verify(where)
        except BaseException:
            self.close()
            raise
        self.rows = self.meta.rows
        self._cache: dict[str, torch.Tensor] = {}

    def _parse(self, where: str) -> tuple[WindowMeta, dict[str, _Entry], int]:
        mm = self._mm
        assert mm is not None
        (n,) = struct.unpack_from("<Q", mm, 0)
        if n > self.nbytes - 8 or n > MAX_HEADER_BYTES:
            raise CorruptWindow(where, f"header length {n} does not fit a {self.nbytes}-byte file")
        try:
            header = json.loads(mm[8 : 8 + n])
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise CorruptWindow(where, f"header is not valid JSON: {e}") from None
        if not isinstance(header, dict):
            raise CorruptWindow(where, "header is not a JSON object")
        raw_meta = header.pop("__metadata__", None)
        if not isinstance(raw_meta, dict):
            raise CorruptWindow(where, "no __metadata__ in header (not a fanout window)")
        try:
            meta = WindowMeta.from_metadata(raw_meta)
        except ValueError as e:
            raise CorruptWindow(where, str(e)) from None
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
        return meta, entries, 8 + n

    def _verify(self, where: str) -> None:
        mm = self._mm
        assert mm is not None
        stored = self.meta.checksum
        if not _CHECKSUM_RE.match(stored):
            raise CorruptWindow(where, f"checksum {stored!r} is not {CHECKSUM_ALGO}:<32 hex>")
        head = mm[: self._data_start]  # small copy: prefix + header
        if head.count(_checksum_field(stored)) != 1:
            raise CorruptWindow(where, "checksum field not found exactly once in the header")
        h = xxhash.xxh3_128()
        h.update(head.replace(_checksum_field(stored), _checksum_field(CHECKSUM_ZERO)))
        mm.madvise(mmap.MADV_SEQUENTIAL)
        with memoryview(mm) as mv:
            h.update(mv[self._data_start :])  # hashed straight from the page cache
        got = f"{CHECKSUM_ALGO}:{h.hexdigest()}"
        if got != stored:
            raise CorruptWindow(
                where, f"checksum mismatch: file says {stored}, bytes hash to {got}"
            )

    def names(self) -> list[str]:
        """Tensor names, in file order."""
        return sorted(self._entries, key=lambda k: self._entries[k].begin)

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor `name` ([R, ...]), a view of the mapping."""
        t = self._cache.get(name)
        if t is not None:
            return t
        if self._mm is None:
            raise ValueError(f"{self.path} is closed")
        e = self._entries.get(name)
        if e is None:
            raise KeyError(f"{self.path} has no tensor {name!r}; it has {self.names()}")
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
        would leave those tensors pointing at unmapped memory."""
        self._cache = {}
        self._mm = None

    def __enter__(self) -> WindowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def verify_file(path: str | os.PathLike[str]) -> WindowMeta:
    """Fully validate a window file (header, offsets, sizes, checksum); return its
    metadata or raise CorruptWindow."""
    with WindowReader(path, verify=True) as r:
        return r.meta
