"""Reduced draft vocabularies: token counts from the producer, top-N ids for the trainer.

    python scripts/train.py --run-dir runs/x --draft-vocab-size 32000 ...   # uses it

A draft whose head covers only the most frequent verifier tokens spends far less on
its LM head (Qwen3: 151,936 → 32,000 rows). Which tokens: the producer counts the
loss-masked `input_ids` of the whole prepared dataset (the tokens the drafts are
trained to predict) once at start and writes `token_counts.safetensors` (int64
`[vocab]`, the run's stream id in its metadata) into the run directory
(fanout.store.rundir.RunDir.token_counts: callers pass that path), before the
coordinator database exists for a new run, so every trainer finds it. A trainer
asked for `--draft-vocab-size N` keeps the N most counted ids (ties: lower id),
filled with the lowest unseen ids when fewer than N were seen, sorted — the same
rule as speculators' `build_vocab_mappings_from_distribution`, so its `d2t`/`t2d`
mean the same. Labels outside the draft vocabulary are not supervised.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save

from fanout.data.cache import PackedDataset
from fanout.errors import ConfigError
from fanout.filesystem import FileSystem
from fanout.rows import INPUT_IDS, LOSS_MASK

TOKEN_COUNTS = "token_counts.safetensors"  # beside a prepared dataset's shards (its cache)
log = logging.getLogger(__name__)


def count_tokens(dataset: PackedDataset, vocab_size: int) -> np.ndarray:
    """How often each token id occurs where the loss mask is on: int64 [vocab_size].

    Counted once per prepared dataset and kept beside its shards (a 10B-token
    dataset takes about a minute to count; a restarted producer should not pay it
    again). A cache that cannot be written (read-only) only costs the recount.
    """
    cached = dataset.dir / TOKEN_COUNTS
    if cached.is_file():
        try:
            counts, _ = _load(cached)
            if counts.shape == (vocab_size,):
                return counts
        except (SafetensorError, OSError, KeyError):
            pass  # unreadable: count again and replace it
    counts = _count(dataset, vocab_size)
    try:
        _save_atomic(cached, counts, {"counted": "input_ids where loss_mask is on"})
    except OSError as e:
        log.warning("cannot cache token counts in %s: %s", dataset.dir, e)
    return counts


def _count(dataset: PackedDataset, vocab_size: int) -> np.ndarray:
    counts = np.zeros(vocab_size, dtype=np.int64)
    step = 1024  # rows per slice: bounded memory however large the shard
    for shard in dataset.shards():
        for s in range(0, shard[INPUT_IDS].shape[0], step):
            mask = shard[LOSS_MASK][s : s + step] > 0  # [rows, T]
            ids = shard[INPUT_IDS][s : s + step][mask]  # [tokens]
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ConfigError(
                    f"{dataset.dir}: token id {int(ids.max())} outside the verifier's "
                    f"vocabulary of {vocab_size} (tokenizer and verifier disagree)"
                )
            counts += np.bincount(ids, minlength=vocab_size)
    return counts


def write_token_counts(
    path: str | os.PathLike[str],
    counts: np.ndarray,
    stream_id: str,
    fs: FileSystem | None = None,
) -> Path:
    """Write the run's token counts to `path` (RunDir.token_counts) atomically and
    durably (`FileSystem.write_atomic`; `fs` injects faults in tests)."""
    path = Path(path)
    meta = {"stream_id": stream_id, "counted": "input_ids where loss_mask is on"}
    _save_atomic(path, counts, meta, fs)
    return path


def _load(path: Path) -> tuple[np.ndarray, dict[str, str]]:
    """A counts file's int64 [vocab] tensor and metadata, in one open."""
    with safe_open(str(path), framework="numpy") as f:
        return f.get_tensor("counts"), f.metadata() or {}


def _save_atomic(
    path: Path, counts: np.ndarray, metadata: dict[str, str], fs: FileSystem | None = None
) -> None:
    # [vocab] int64: ~1.2 MB for Qwen3, so serialised in memory and written through the seam
    data = save({"counts": np.ascontiguousarray(counts, dtype=np.int64)}, metadata)
    (fs or FileSystem()).write_atomic(path, data)


def read_token_counts(
    path: str | os.PathLike[str], stream_id: str, *, timeout_s: float = 0.0
) -> np.ndarray:
    """The run's token counts from `path` (RunDir.token_counts), waiting up to
    `timeout_s` for the producer to write them.

    Raises ConfigError when the file is missing (after the wait), unreadable, or was
    written for another stream.
    """
    path = Path(path)
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"{path} is missing: a producer writes it when it starts (fanout produce "
                "of this version); --draft-vocab-size needs it"
            )
        time.sleep(0.2)
    try:
        counts, meta = _load(path)
    except (SafetensorError, OSError, KeyError) as e:
        raise ConfigError(f"{path}: unreadable token counts: {e}") from None
    if meta.get("stream_id") != stream_id:
        raise ConfigError(
            f"{path}: counted for stream {meta.get('stream_id')!r}, this run is {stream_id!r}"
        )
    return counts


def select_draft_vocab(counts: np.ndarray, size: int) -> torch.Tensor:
    """The `size` most counted token ids (ties: lower id first), topped up with the lowest
    uncounted ids when fewer were seen; sorted ascending, int64 [size]."""
    vocab = int(counts.shape[0])
    if not 0 < size <= vocab:
        raise ConfigError(f"draft vocabulary size {size} must be in [1, {vocab}]")
    order = np.lexsort((np.arange(vocab), -counts))  # by count desc, then id asc
    seen = order[: min(size, int((counts > 0).sum()))]
    if seen.size < size:
        unseen = np.setdiff1d(np.arange(vocab), seen, assume_unique=True)[: size - seen.size]
        seen = np.concatenate([seen, unseen])
    return torch.from_numpy(np.sort(seen).astype(np.int64))


def coverage(counts: np.ndarray, ids: torch.Tensor) -> float:
    """Fraction of counted tokens that the draft vocabulary `ids` covers."""
    total = int(counts.sum())
    return float(counts[ids.numpy()].sum() / total) if total else 1.0
