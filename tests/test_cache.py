"""The packed-row cache: an entry appears whole or not at all.

.venv/bin/pytest tests/test_cache.py -x -q
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from fanout.data.cache import PackedDataset, ShardWriter
from fanout.errors import CorruptPreparedData, CorruptWindow, StorageError
from fanout.filesystem import FileSystem
from fanout.rows import PACKED_ROW
from faults import after_rename, fail_each_call


def test_a_failed_shard_write_leaves_no_entry(tmp_path: Path) -> None:
    """The cache entry appears whole (every shard and the manifest fsynced, then the
    directory renamed) or not at all, whichever write fails."""

    def build(fs: FileSystem) -> PackedDataset:
        shutil.rmtree(tmp_path / f"ds.tmp-{os.getpid()}", ignore_errors=True)
        w = ShardWriter(tmp_path / "ds", 8, rows_per_shard=2, fs=fs)
        try:
            rows = np.arange(40, dtype=np.int32).reshape(5, 8)
            w.write(
                {k: rows.astype(np.uint8 if k == "loss_mask" else np.int32) for k in PACKED_ROW}
            )
            w.commit(
                {"fingerprint": "f", "tokenizer_fingerprint": "t", "pad_token_id": 0, "summary": {}}
            )
        except BaseException as e:
            w.abort()
            if isinstance(e, StorageError) and isinstance(e.__cause__, OSError):
                raise e.__cause__ from None  # a failed shard: the injected error
            raise
        return PackedDataset(tmp_path / "ds")

    def check(n: int, e: OSError) -> None:
        if (tmp_path / "ds").exists():  # only a failed fsync of the parent after the rename
            assert after_rename(e), (n, e)
            shutil.rmtree(tmp_path / "ds")
        assert os.listdir(tmp_path) == [], (n, e)

    ds, failures = fail_each_call(build, check)
    assert ds.num_rows == 5 and failures > 10


def test_a_damaged_entry_is_named_a_prepared_dataset_not_a_window(tmp_path: Path) -> None:
    """A truncated shard or a missing manifest raises CorruptPreparedData naming the file,
    never CorruptWindow: that one means a window file, which a trainer reports to the
    coordinator to have it recaptured (fanout.train.consumer)."""
    w = ShardWriter(tmp_path / "ds", 8, rows_per_shard=2)
    rows = np.arange(40, dtype=np.int32).reshape(5, 8)
    w.write({k: rows.astype(np.uint8 if k == "loss_mask" else np.int32) for k in PACKED_ROW})
    w.commit({"fingerprint": "f", "tokenizer_fingerprint": "t", "pad_token_id": 0, "summary": {}})
    shard = tmp_path / "ds" / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:4])
    with pytest.raises(CorruptPreparedData, match="truncated header") as e:
        PackedDataset(tmp_path / "ds")
    assert not isinstance(e.value, CorruptWindow) and str(shard) in str(e.value)
    (tmp_path / "ds" / "manifest.json").unlink()
    with pytest.raises(CorruptPreparedData, match=r"no manifest\.json"):
        PackedDataset(tmp_path / "ds")
