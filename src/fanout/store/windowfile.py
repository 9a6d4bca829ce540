"""The window file format: a safetensors file whose metadata says what it holds.

    from fanout.store.windowfile import WindowMeta, encode_header, hidden_name
    layout = encode_header({hidden_name(9): h9, "input_ids": ids}, meta)   # for a writer
    prefix, _ = layout.header()                # 8-byte length + header JSON, checksums zeroed

Plain safetensors (8-byte little-endian header length, JSON header, tensor
bytes), so `safetensors.safe_open` reads it too. Tensors are laid out by falling
itemsize (then name, numbers in names compared as numbers), so each starts
aligned and one tensor's bytes are one contiguous range. `__metadata__` carries
format, contract hash, window, generation, epoch, row range, producer version, the
verifier version it was captured with (`verifier_version`, only under `fanout produce
--follow-verifier`; fanout.checkpoints.versions) and checksums (xxh3-128,
fanout.hashing):

- `checksum.<tensor>`, one per tensor: over that tensor's bytes alone;
- `checksum`: over the 8-byte length + the header JSON with this one value zeroed
  — so it covers every tensor's name, dtype, shape, offsets and checksum.

safetensors itself checks neither data bits nor metadata: the reader
(fanout.store.windowreader) verifies the header at open and each tensor's bytes when it
is first read.

The tensors a window holds per row are named in fanout.rows (`input_ids`,
`loss_mask`, `document_ids`, `position_ids`, `target_ids`, optionally
`last_hidden_states`): this format's vocabulary, kept in the core layer so that packing
and the draft models below the store spell it the same way. Hidden states are stored
one tensor per captured layer, `hidden_states.<layer>` `[R, T, H]` (plus
`hidden_states_scale.<layer>` `[R, T]` float32 for fp8); see `hidden_name`. Format 1
(`fanout-window-1`: one `[R, T, n·H]` tensor, one checksum over the whole file) is
refused with `WindowFormatError`.

Writing lives in fanout.store.store (the publish protocol), reading in
fanout.store.windowreader; this module names and lays out (`encode_header`).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fanout import __version__
from fanout.errors import WindowFormatError as WindowFormatError  # what format 1 raises
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
    # the verifier version it was captured with (`produce --follow-verifier`; None: a
    # fixed verifier, and no such field in the file)
    verifier_version: int | None = None

    def __post_init__(self) -> None:
        for f in ("window", "generation", "epoch", "row_start", "row_end"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"WindowMeta.{f} must be an int >= 0, got {v!r}")
        v = self.verifier_version
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"WindowMeta.verifier_version must be an int >= 0, got {v!r}")
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
        version = {} if self.verifier_version is None else {
            "verifier_version": str(self.verifier_version)
        }  # fmt: skip
        return version | {
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
        version = d.get("verifier_version")  # only a --follow-verifier capture has one
        if version is not None and (not isinstance(version, str) or not _UINT_RE.match(version)):
            raise ValueError(
                f"metadata field 'verifier_version' is {version!r}, expected a decimal int >= 0"
            )
        made: dict[str, Any] = {**strs, **ints}
        made["verifier_version"] = None if version is None else int(version)
        return cls(**made)


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
