"""Draft vocabulary: token counts against a slow count, top-N selection against its rule."""

from __future__ import annotations

import errno
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from fanout.data.cache import PackedDataset, ShardWriter
from fanout.data.draft_vocab import (
    TOKEN_COUNTS,
    count_tokens,
    coverage,
    read_token_counts,
    select_draft_vocab,
    write_token_counts,
)
from fanout.errors import ConfigError
from fanout.store.rundir import RunDir
from faults import after_rename, fail_each_call


def _dataset(tmp_path: Path, rows: int, t: int, vocab: int, seed: int) -> PackedDataset:
    rng = np.random.default_rng(seed)
    w = ShardWriter(tmp_path / "ds", t, rows_per_shard=7)  # several shards
    w.write(
        {
            "input_ids": rng.integers(0, vocab, (rows, t), dtype=np.int32),
            "loss_mask": rng.integers(0, 2, (rows, t), dtype=np.uint8),
            "document_ids": np.zeros((rows, t), np.int32),
            "position_ids": np.tile(np.arange(t, dtype=np.int32), (rows, 1)),
        }
    )
    w.commit({"fingerprint": "f", "tokenizer_fingerprint": "t", "pad_token_id": 0, "summary": {}})
    return PackedDataset(tmp_path / "ds")


def test_count_tokens_equals_a_slow_count(tmp_path: Path) -> None:
    ds = _dataset(tmp_path, rows=30, t=16, vocab=50, seed=0)
    slow: Counter[int] = Counter()
    for r in range(ds.num_rows):
        row = ds.rows(np.array([r]))
        for tok, m in zip(row["input_ids"][0], row["loss_mask"][0], strict=True):
            if m:
                slow[int(tok)] += 1
    counts = count_tokens(ds, 64)
    assert counts.dtype == np.int64 and counts.shape == (64,)
    assert {i: int(c) for i, c in enumerate(counts) if c} == dict(slow)
    # Kept beside the shards: the next call reads it (a planted value proves it) ...
    cached = ds.dir / TOKEN_COUNTS
    assert cached.is_file()
    save_file({"counts": np.full(64, 7, dtype=np.int64)}, str(cached))
    assert (count_tokens(ds, 64) == 7).all()
    # ... unless it was counted for another vocabulary size, or is unreadable.
    assert count_tokens(ds, 80)[:64].tolist() == counts.tolist()
    cached.write_bytes(b"garbage")
    assert count_tokens(ds, 64).tolist() == counts.tolist()
    cached.unlink()
    with pytest.raises(ConfigError, match="outside the verifier's vocabulary of 40"):
        count_tokens(ds, 40)


@settings(max_examples=50, deadline=None)
@given(
    counts=st.lists(st.integers(0, 5), min_size=1, max_size=60),
    frac=st.floats(0.01, 1.0),
)
def test_select_draft_vocab_follows_the_rule(counts: list[int], frac: float) -> None:
    c = np.array(counts, dtype=np.int64)
    size = max(1, int(frac * len(counts)))
    got = select_draft_vocab(c, size)
    # The rule, slowly: most counted first (ties: lower id), seen tokens only, then
    # the lowest ids not yet chosen; the result sorted.
    ranked = sorted((i for i in range(len(c)) if c[i] > 0), key=lambda i: (-c[i], i))[:size]
    for i in range(len(c)):
        if len(ranked) >= size:
            break
        if i not in ranked:
            ranked.append(i)
    assert got.tolist() == sorted(ranked)
    assert got.dtype == torch.int64
    seen = int(c.sum())
    assert coverage(c, got) == pytest.approx(c[sorted(ranked)].sum() / seen if seen else 1.0)


def test_token_counts_file_round_trip_and_errors(tmp_path: Path) -> None:
    counts = np.array([3, 0, 7, 1], dtype=np.int64)
    path = RunDir(tmp_path).token_counts
    with pytest.raises(ConfigError, match="missing: a producer writes it"):
        read_token_counts(path, "s1", timeout_s=0.3)
    write_token_counts(path, counts, "s1")
    np.testing.assert_array_equal(read_token_counts(path, "s1"), counts)
    with pytest.raises(ConfigError, match="counted for stream 's1'"):
        read_token_counts(path, "s2")
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ConfigError, match="unreadable token counts"):
        read_token_counts(path, "s1")
    with pytest.raises(ConfigError, match=r"in \[1, 4\]"):
        select_draft_vocab(counts, 5)


def test_token_counts_are_written_whole_or_not_at_all(tmp_path: Path) -> None:
    """A fault at any step (ENOSPC) leaves the old counts readable and no temp file."""
    old, new = np.arange(4, dtype=np.int64), np.array([9, 9, 9, 9], dtype=np.int64)
    path = RunDir(tmp_path).token_counts
    write_token_counts(path, old, "s1")

    def check(n: int, e: OSError) -> None:
        got = read_token_counts(path, "s1")
        want = new if after_rename(e) else old
        np.testing.assert_array_equal(got, want)
        assert os.listdir(tmp_path) == [path.name], (n, e)

    fail_each_call(lambda fs: write_token_counts(path, new, "s1", fs), check, errno_=errno.ENOSPC)
    np.testing.assert_array_equal(read_token_counts(path, "s1"), new)
    assert path.stat().st_mode & 0o777 == 0o644
