"""Fingerprinted on-disk cache of packed rows: safetensors shards + a manifest, atomic.

    from fanout.data.cache import fingerprint, ShardWriter, PackedDataset
    fp = fingerprint(["a.jsonl"], {"tokenizer": tok_fp, "seq_len": 4096, ...})
    w = ShardWriter(final_dir, seq_len=4096, rows_per_shard=1024)
    w.write(batch) ...; w.commit(manifest_extra)        # dir appears whole or not at all
    ds = PackedDataset(final_dir); ds.rows(np.arange(8))  # memmap random access

Layout of an entry: `shard-00000.safetensors …` (tensors `input_ids` int32,
`loss_mask` uint8, `document_ids` int32, `position_ids` int32, each [rows, T]) and
`manifest.json` (fingerprint, seq_len, shard row counts, summary), written last.
Everything is built in a sibling `<name>.tmp<temp_tag()>` directory (unique across
hosts: fanout.netfs.temp_tag), each file fsynced (`FileSystem.write_new`), then renamed
into place if no other writer's entry is there yet (`FileSystem.commit_dir_once`), so
a crash leaves only debris and never a partial entry, and two hosts building the same
entry at once (a cache in a shared run dir) never touch each other's temp: the
second discards its own and uses the first's. Reading maps the
safetensors data region with `np.memmap` (the format is an 8-byte header length,
a JSON header, then raw little-endian tensors), so `rows()` touches only the pages
it needs.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from fanout.errors import CorruptPreparedData, StorageError
from fanout.filesystem import FileSystem
from fanout.hashing import hasher
from fanout.netfs import temp_tag
from fanout.rows import INPUT_IDS, LOSS_MASK, PACKED_ROW

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_DTYPES = {"I32": np.int32, "U8": np.uint8}


def fingerprint(paths: list[str | Path], options: dict[str, Any]) -> str:
    """xxh3-128 (fanout.hashing) over every input file's bytes (in order) and the options JSON."""
    h = hasher()
    h.update(json.dumps({"v": FORMAT_VERSION, **options}, sort_keys=True).encode())
    for p in paths:
        h.update(b"\0file\0")
        with open(p, "rb") as f:
            while block := f.read(1 << 23):
                h.update(block)
    return h.hexdigest()


class ShardWriter:
    """Accumulates row batches into shards under a temp dir; `commit` renames it into place.
    `fs`: the filesystem seam every write goes through (a FaultyFileSystem in tests)."""

    def __init__(
        self,
        final_dir: str | Path,
        seq_len: int,
        rows_per_shard: int = 1024,
        fs: FileSystem | None = None,
        *,
        replace: bool = False,
    ) -> None:
        # replace: `final` is the user's --out (prepare --no-cache), whose older
        # contents this build replaces; else a cache entry named by its fingerprint,
        # which the first complete writer keeps
        self.replace = replace
        self.fs = fs or FileSystem()
        self.final = Path(final_dir)
        self.fs.makedirs(self.final.parent)
        self.tmp = self.final.with_name(f"{self.final.name}.tmp{temp_tag()}")
        self.fs.makedirs(self.tmp)
        self.seq_len = seq_len
        self.rows_per_shard = rows_per_shard
        self._pending: list[dict[str, np.ndarray]] = []
        self._pending_rows = 0
        self.shards: list[dict[str, Any]] = []
        self.bytes = 0

    def write(self, batch: dict[str, np.ndarray]) -> None:
        self._pending.append(batch)
        self._pending_rows += batch[INPUT_IDS].shape[0]
        while self._pending_rows >= self.rows_per_shard:
            self._flush(self.rows_per_shard)

    def _flush(self, n: int) -> None:
        cat = {k: np.concatenate([b[k] for b in self._pending]) for k in PACKED_ROW}
        head = {k: np.ascontiguousarray(v[:n]) for k, v in cat.items()}  # [n, T] each
        rest = {k: v[n:] for k, v in cat.items()}
        self._pending = [rest] if rest[INPUT_IDS].shape[0] else []
        self._pending_rows -= n
        name = f"shard-{len(self.shards):05d}.safetensors"
        path = self.tmp / name
        try:
            self.fs.write_new(path, lambda t: save_file(head, str(t.path)))
        except OSError as e:
            raise StorageError(f"writing cache shard {path}: {e}") from e
        self.bytes += path.stat().st_size
        self.shards.append({"file": name, "rows": n})

    def commit(self, extra: dict[str, Any]) -> Path:
        """Write remaining rows and the manifest, then rename the entry into place; if
        another writer's (the same rows: an entry is named by its fingerprint) got there
        first, this one's is discarded and that one's path returned."""
        if self._pending_rows:
            self._flush(self._pending_rows)
        manifest = {
            "format_version": FORMAT_VERSION,
            "seq_len": self.seq_len,
            "num_rows": sum(s["rows"] for s in self.shards),
            "shards": self.shards,
            "bytes": self.bytes,
            **extra,
        }
        try:
            self.fs.write_new(self.tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
            # a racing identical entry is kept (its readers keep their files), ours
            # dropped; a directory without a manifest (an older layout's debris) replaced
            if self.replace:
                self.fs.commit_dir(self.tmp, self.final)
            else:
                self.fs.commit_dir_once(self.tmp, self.final, lambda p: (p / MANIFEST).is_file())
        except OSError as e:
            raise StorageError(f"committing cache entry {self.final}: {e}") from e
        return self.final

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def _memmap_safetensors(path: Path) -> dict[str, np.ndarray]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CorruptPreparedData(str(path), "truncated header")
        n = int.from_bytes(raw, "little")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CorruptPreparedData(str(path), f"bad header: {e}") from None
    size = path.stat().st_size
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if 8 + n + end > size:
            raise CorruptPreparedData(str(path), f"tensor {name} runs past the end of the file")
        dtype = _DTYPES[info["dtype"]]
        out[name] = np.memmap(
            path, dtype=dtype, mode="r", offset=8 + n + start, shape=tuple(info["shape"])
        )
    return out


class PackedDataset:
    """A prepared dataset on disk: `rows(indices)` gathers [n, T] arrays from memmaps."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        mpath = self.dir / MANIFEST
        if not mpath.is_file():
            raise CorruptPreparedData(str(self.dir), "no manifest.json (not a prepared dataset?)")
        self.manifest: dict[str, Any] = json.loads(mpath.read_text())
        self.seq_len: int = self.manifest["seq_len"]
        self.num_rows: int = self.manifest["num_rows"]
        self.fingerprint: str = self.manifest["fingerprint"]
        self.tokenizer_fingerprint: str = self.manifest["tokenizer_fingerprint"]
        self.pad_token_id: int = self.manifest["pad_token_id"]
        self.summary: dict[str, Any] = self.manifest["summary"]
        self._shards = [_memmap_safetensors(self.dir / s["file"]) for s in self.manifest["shards"]]
        counts = np.array([s["rows"] for s in self.manifest["shards"]], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])  # [S+1]

    def __len__(self) -> int:
        return self.num_rows

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Rows at `indices` (any order, repeats allowed) as dict of [n, T] arrays."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_rows):
            raise IndexError(f"row index out of range [0, {self.num_rows}) in {self.dir}")
        shard = np.searchsorted(self._starts, idx, side="right") - 1  # [n]
        out: dict[str, np.ndarray] = {
            k: np.empty((idx.size, self.seq_len), self._dtype(k)) for k in PACKED_ROW
        }  # [n, T] each
        for s in np.unique(shard):
            sel = np.flatnonzero(shard == s)
            local = idx[sel] - self._starts[s]
            for k in PACKED_ROW:
                out[k][sel] = self._shards[s][k][local]
        return out

    def shards(self) -> Iterator[dict[str, np.ndarray]]:
        """Every shard's arrays ([rows, T] memmaps, read-only) in row order: for whole-
        dataset passes that need only some columns."""
        yield from self._shards

    @staticmethod
    def _dtype(key: str) -> type:
        return np.uint8 if key == LOSS_MASK else np.int32
