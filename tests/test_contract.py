from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from fanout.contract import CaptureContract, LayersNotCaptured
from fanout.errors import ConfigError, ContractMismatch
from faults import Recording, after_rename, fail_each_call


def make(**over: object) -> CaptureContract:
    base: dict[str, object] = dict(
        verifier_config_hash="c" * 8,
        verifier_weights_fingerprint="w" * 8,
        verifier_num_layers=4,
        hidden_size=64,
        vocab_size=1000,
        target_layer_ids=(1, 2),
        dataset_fingerprint="d",
        tokenizer_fingerprint="t",
        seq_len=128,
        window_rows=4,
        shuffle_seed=0,
    )
    base.update(over)
    return CaptureContract.model_validate(base)


def test_hash_changes_with_any_field_and_roundtrips(tmp_path: Path) -> None:
    a = make()
    assert a.stream_id == make().stream_id
    assert a.stream_id != make(target_layer_ids=(1, 3)).stream_id
    a.save(tmp_path / "contract.json")
    assert CaptureContract.load(tmp_path / "contract.json") == a
    assert (tmp_path / "contract.json").stat().st_mode & 0o777 == 0o644


def test_require_names_differing_fields() -> None:
    a = make()
    a.require({"target_layer_ids": [1, 2], "seq_len": 128})
    with pytest.raises(ContractMismatch) as e:
        a.require({"target_layer_ids": (1, 3), "seq_len": 64})
    assert set(e.value.fields) == {"target_layer_ids", "seq_len"}
    assert "seq_len" in str(e.value)
    with pytest.raises(ConfigError, match="unknown contract fields"):
        a.require({"block_size": 8})


def test_invalid_layers_rejected() -> None:
    with pytest.raises(ValueError, match="duplicates"):
        make(target_layer_ids=(1, 1))


def test_target_layers_may_be_any_subset_of_the_captured_ones_in_any_order() -> None:
    a = make(target_layer_ids=(1, 9, 17, 25, 33))
    for ok in ([1, 9, 17, 25, 33], [33, 1], [17], (25, 9, 1)):
        a.require({"target_layer_ids": ok, "seq_len": 128})
    with pytest.raises(LayersNotCaptured, match=r"\[2\] were not captured.*\[1, 9, 17, 25, 33\]"):
        a.require({"target_layer_ids": [1, 2]}, where="consumer x:dp0")
    with pytest.raises(ContractMismatch) as e:  # with another mismatch: every field named
        a.require({"target_layer_ids": [2], "seq_len": 64})
    assert set(e.value.fields) == {"target_layer_ids", "seq_len"}
    with pytest.raises(ConfigError, match="distinct"):
        a.require({"target_layer_ids": [1, 1]})
    with pytest.raises(ConfigError, match="window format 1"):
        make(format_version=1).require({})


def test_save_is_durable_and_never_torn(tmp_path: Path) -> None:
    """contract.json goes through FileSystem.write_atomic: fsynced, renamed, directory
    fsynced; a fault at any step leaves the old contract loadable and no temp file."""
    path = tmp_path / "contract.json"
    fs = Recording()
    make().save(path, fs)
    assert fs.ops == ["open_new", "write", "fsync", "close", "rename", "fsync_dir"]
    old, new = make(), make(seq_len=256)

    def check(n: int, e: OSError) -> None:
        got = CaptureContract.load(path)
        assert got == (new if after_rename(e) else old), (n, e)
        assert os.listdir(tmp_path) == ["contract.json"]

    fail_each_call(lambda fs: new.save(path, fs), check, errno_=errno.ENOSPC)
    assert CaptureContract.load(path) == new
