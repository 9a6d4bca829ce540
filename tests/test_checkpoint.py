"""Checkpoints: speculators layout, atomic commit, pruning, exact resume."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from fanout.bench.assets import tiny_qwen3_verifier
from fanout.checkpoints.format import FORMAT_VERSION
from fanout.checkpoints.layout import MARKER, latest_checkpoint
from fanout.checkpoints.load import load_draft
from fanout.checkpoints.resume import load_checkpoint
from fanout.checkpoints.save import save_checkpoint
from fanout.checkpoints.upgrade import upgrade_checkpoint
from fanout.errors import CheckpointError, ConfigError
from fanout.families.dflash.model import DFlashDraft
from fanout.ops.adamw import ClippedAdamW, make_optimizer
from faults import Recording, after_rename, fail_each_call
from tiny_run import tiny_dflash


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3_verifier(
        tmp_path_factory.mktemp("verifier"),
        256,
        hidden_size=32,
        num_layers=4,
        head_dim=8,
        intermediate_size=64,
    )


def _draft(vdir: Path, seed: int = 1, **kw: Any) -> DFlashDraft:
    return tiny_dflash(vdir, seed, **({"max_anchors": 6} | kw))


def _batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    b, t = 2, 40
    return {
        "hidden_states": torch.randn(b, t, 64, generator=g),
        "input_ids": torch.randint(0, 250, (b, t), generator=g),
        "target_ids": torch.randint(0, 250, (b, t), generator=g),
        "loss_mask": torch.ones(b, t, dtype=torch.uint8),
        "document_ids": torch.zeros(b, t, dtype=torch.int32),
        "position_ids": torch.arange(t).expand(b, t),
    }


def _step(d: DFlashDraft, opt: ClippedAdamW, gen: torch.Generator, i: int) -> float:
    out = d.loss(_batch(i), gen)
    opt.zero_grad()
    out.loss.backward()
    opt.step()
    return out.loss.item()


def test_resume_gives_identical_next_step(verifier_dir: Path, tmp_path: Path) -> None:
    d = _draft(verifier_dir)
    opt, _ = make_optimizer(d.parameters(), lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)
    gen = torch.Generator().manual_seed(0)
    for i in range(3):
        _step(d, opt, gen, i)
    stream = _Position({"cursor": 12, "rows_done": 3})
    path = save_checkpoint(
        tmp_path, d, opt, {"step": 3}, states={"stream": stream}, generators={"anchors": gen}
    )
    expect = [_step(d, opt, gen, i) for i in (3, 4)]

    d2 = _draft(verifier_dir, seed=99)  # different init: everything must come from disk
    opt2, _ = make_optimizer(d2.parameters(), lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)
    gen2 = torch.Generator().manual_seed(12345)
    stream2 = _Position({})
    state = load_checkpoint(
        path, d2, opt2, states={"stream": stream2}, generators={"anchors": gen2}
    )
    assert state == {"step": 3, "stream": {"cursor": 12, "rows_done": 3}}
    assert stream2.state == {"cursor": 12, "rows_done": 3}  # restored in place
    got = [_step(d2, opt2, gen2, i) for i in (3, 4)]
    assert got == expect  # bit-identical, not approximately equal


class _Position:
    """A stateful object as a checkpoint sees one (the consumer stream's shape)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)


def test_a_checkpoint_from_before_the_streams_state_resumes_its_position(
    verifier_dir: Path, tmp_path: Path
) -> None:
    """Checkpoints that kept cursor and rows_done at the top of training_state.json (before
    the consumer stream had a state_dict) resume the stream there; a state asked for that
    the checkpoint does not hold is an error naming it."""
    d = _draft(verifier_dir)
    opt, _ = make_optimizer(d.parameters(), lr=1e-2)
    path = save_checkpoint(tmp_path, d, opt, {"step": 1, "cursor": 4, "rows_done": 2})
    stream = _Position({})
    load_checkpoint(path, _draft(verifier_dir), None, states={"stream": stream})
    assert stream.state == {"cursor": 4, "rows_done": 2}
    with pytest.raises(ConfigError, match="no saved state for 'scheduler'"):
        load_checkpoint(path, _draft(verifier_dir), None, states={"scheduler": _Position({})})


def test_layout_is_speculators_dflash(verifier_dir: Path, tmp_path: Path) -> None:
    d = _draft(verifier_dir)
    opt, _ = make_optimizer(d.parameters(), lr=1e-3)
    path = save_checkpoint(tmp_path, d, opt, {"step": 0}, verifier_name_or_path="tiny")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash"
    # serving numbering: HF hidden_states indices = decoder-layer ids + 1
    assert cfg["aux_hidden_state_layer_ids"] == [2, 3]
    assert cfg["fanout"]["draft_config"]["target_layer_ids"] == [1, 2]
    assert cfg["fanout"]["format_version"] == FORMAT_VERSION == 2
    assert cfg["speculators_version"] == "0.9.0"
    assert cfg["dtype"] == "bfloat16" and "torch_dtype" not in cfg
    tl = cfg["transformer_layer_config"]
    assert "rope_theta" not in tl and tl["rope_parameters"]["rope_theta"] == d.cfg.rope_theta
    assert cfg["block_size"] == 4 and cfg["mask_token_id"] == 255
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.k_norm.weight",
        "layers.0.mlp.down_proj.weight",
        "layers.0.input_layernorm.weight",
    } <= keys
    assert not any("embed" in k or "lm_head" in k for k in keys)
    assert (path / MARKER).is_file()
    assert oct((path / "model.safetensors").stat().st_mode & 0o777) == "0o644"


def test_keep_two_and_uncommitted_is_ignored(verifier_dir: Path, tmp_path: Path) -> None:
    d = _draft(verifier_dir)
    opt, _ = make_optimizer(d.parameters(), lr=1e-3)
    for s in (1, 2, 3):
        save_checkpoint(tmp_path, d, opt, {"step": s})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["checkpoint-00000002", "checkpoint-00000003"]
    # a crash after rename but before the marker: newer dir without COMMITTED
    (tmp_path / "checkpoint-00000004").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-00000003"
    with pytest.raises(ConfigError, match="not a committed"):
        load_checkpoint(tmp_path / "checkpoint-00000004", d, opt)
    assert latest_checkpoint(tmp_path / "nope") is None


def test_pruning_never_deletes_the_checkpoint_just_written(
    verifier_dir: Path, tmp_path: Path
) -> None:
    """Pruning keeps the newest `keep` by step name; a checkpoint of a lower step written
    beside higher ones (a trainer started from 0 on a used save path) was deleted the
    moment it was committed. It stays, and so do the newest `keep - 1` others."""
    d = _draft(verifier_dir)
    opt, _ = make_optimizer(d.parameters(), lr=1e-3)
    for s in (8, 12):
        save_checkpoint(tmp_path, d, opt, {"step": s})
    path = save_checkpoint(tmp_path, d, opt, {"step": 6})
    assert (path / MARKER).is_file(), "the checkpoint just written was pruned"
    names = sorted(p.name for p in tmp_path.glob("checkpoint-*"))
    assert names == ["checkpoint-00000006", "checkpoint-00000012"]


def test_load_refuses_other_shape(verifier_dir: Path, tmp_path: Path) -> None:
    d = _draft(verifier_dir)
    opt, _ = make_optimizer(d.parameters(), lr=1e-3)
    path = save_checkpoint(tmp_path, d, opt, {"step": 0})
    other = _draft(verifier_dir, block_size=8)
    with pytest.raises(ConfigError, match="block_size"):
        load_checkpoint(path, other, None)


def test_bad_step_rejected(verifier_dir: Path, tmp_path: Path) -> None:
    d = _draft(verifier_dir)
    opt, _ = make_optimizer(d.parameters(), lr=1e-3)
    with pytest.raises(ConfigError, match="step"):
        save_checkpoint(tmp_path, d, opt, {"epoch": 1})


def test_reduced_vocab_checkpoint_round_trips_and_refuses_other_tokens(
    verifier_dir: Path, tmp_path: Path
) -> None:
    ids = torch.arange(0, 200, 2)  # 100 of the 256 verifier tokens
    d = _draft(verifier_dir, draft_vocab_size=100, draft_vocab_ids=ids)
    opt, _ = make_optimizer(d.parameters(), lr=1e-3)
    path = save_checkpoint(tmp_path, d, opt, {"step": 0})
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("lm_head.weight").shape == (100, 32)
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert torch.equal(d2t + torch.arange(100), ids)  # speculators: verifier id = d + d2t[d]
    assert torch.equal(t2d.nonzero().flatten(), ids)
    load_checkpoint(path, _draft(verifier_dir, draft_vocab_size=100, draft_vocab_ids=ids), None)
    other = _draft(verifier_dir, draft_vocab_size=100, draft_vocab_ids=torch.arange(100))
    with pytest.raises(ConfigError, match="d2t"):
        load_checkpoint(path, other, None)


def test_aux_layer_ids_index_hf_hidden_states(verifier_dir: Path, tmp_path: Path) -> None:
    """The oracle is HF itself: the layers fanout captures for the draft are exactly the
    `output_hidden_states` entries the checkpoint's aux_hidden_state_layer_ids name (the
    numbering speculators and vLLM read). Off by one, they would be the layer below."""
    from transformers import AutoModelForCausalLM

    from fanout.model.verifier import load_verifier

    d = _draft(verifier_dir)
    opt, _ = make_optimizer(d.parameters(), lr=1e-3)
    path = save_checkpoint(tmp_path, d, opt, {"step": 0}, verifier_name_or_path=str(verifier_dir))
    aux = json.loads((path / "config.json").read_text())["aux_hidden_state_layer_ids"]
    v = load_verifier(verifier_dir, device="cpu", capture_layer_ids=[1, 2], storage_dtype="float32")
    ids = torch.randint(0, 250, (1, 24), generator=torch.Generator().manual_seed(3))
    cap = v.capture(ids, torch.arange(24)[None], torch.zeros(1, 24, dtype=torch.long))
    hf = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32)
    with torch.no_grad():
        hs = hf(input_ids=ids, output_hidden_states=True).hidden_states
    want = torch.cat([hs[j] for j in aux], dim=-1)  # [1, T, n·H]
    torch.testing.assert_close(cap.hidden_states, want, rtol=1e-4, atol=1e-4)
    wrong = torch.cat([hs[j - 1] for j in aux], dim=-1)
    assert not torch.allclose(cap.hidden_states, wrong, atol=1e-3)


def test_verifier_identity_is_absolute_with_architectures(
    verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = _draft(verifier_dir)
    opt, _ = make_optimizer(d.parameters(), lr=1e-3)
    monkeypatch.chdir(verifier_dir.parent)
    path = save_checkpoint(
        tmp_path / "a", d, opt, {"step": 0}, verifier_name_or_path=verifier_dir.name
    )
    ver = json.loads((path / "config.json").read_text())["speculators_config"]["verifier"]
    assert ver["name_or_path"] == str(verifier_dir.resolve())
    assert ver["architectures"] == ["Qwen3ForCausalLM"]
    path = save_checkpoint(
        tmp_path / "b",
        d,
        opt,
        {"step": 0},
        verifier_name_or_path=verifier_dir.name,
        verifier_serving_name="Qwen/Qwen3-8B",
    )
    ver = json.loads((path / "config.json").read_text())["speculators_config"]["verifier"]
    assert ver == {"name_or_path": "Qwen/Qwen3-8B", "architectures": ["Qwen3ForCausalLM"]}


def _as_format_1(path: Path) -> None:
    """What fanout wrote before format 2: the decoder-layer ids unchanged, format 1."""
    cfg = json.loads((path / "config.json").read_text())
    cfg["aux_hidden_state_layer_ids"] = cfg["fanout"]["draft_config"]["target_layer_ids"]
    cfg["fanout"]["format_version"] = 1
    (path / "config.json").write_text(json.dumps(cfg))


def test_format_1_is_refused_then_upgraded(verifier_dir: Path, tmp_path: Path) -> None:
    d = _draft(verifier_dir)
    opt, _ = make_optimizer(d.parameters(), lr=1e-3)
    path = save_checkpoint(tmp_path, d, opt, {"step": 3}, verifier_name_or_path=str(verifier_dir))
    _as_format_1(path)
    with pytest.raises(CheckpointError, match=r"format 1.*upgrade"):
        load_checkpoint(path, _draft(verifier_dir), None)
    with pytest.raises(CheckpointError, match="format 1"):
        load_draft(path, verifier_dir)
    upgrade_checkpoint(path)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["aux_hidden_state_layer_ids"] == [2, 3]
    assert load_draft(path, verifier_dir).cfg.target_layer_ids == [1, 2]
    assert load_checkpoint(path, _draft(verifier_dir), None)["step"] == 3


def test_upgrade_checkpoint_command(
    verifier_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fanout upgrade-checkpoint DIR` (the CLI) upgrades a format-1 checkpoint; a second
    run, on a format-2 one, is one named error line and exit 1."""
    from fanout.cli import main as cli_main

    d = _draft(verifier_dir)
    opt, _ = make_optimizer(d.parameters(), lr=1e-3)
    path = save_checkpoint(tmp_path, d, opt, {"step": 3}, verifier_name_or_path=str(verifier_dir))
    _as_format_1(path)
    assert cli_main(["upgrade-checkpoint", str(path)]) == 0
    assert f"upgraded {path} to format {FORMAT_VERSION}" in capsys.readouterr().out
    assert load_draft(path, verifier_dir).cfg.target_layer_ids == [1, 2]
    assert cli_main(["upgrade-checkpoint", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a format-1 fanout checkpoint" in err[0], err
    # a checkpoint of another family was never written in either old form: named, exit 1
    from fanout.families.registry import family

    other = family("dspark").build(verifier_dir, target_layer_ids=[1, 2], block_size=4,
                                   num_layers=1)  # fmt: skip
    opt, _ = make_optimizer(other.parameters(), lr=1e-3)
    spark = save_checkpoint(tmp_path / "dspark", other, opt, {"step": 1},
                            verifier_name_or_path=str(verifier_dir))  # fmt: skip
    assert cli_main(["upgrade-checkpoint", str(spark)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a dspark checkpoint" in err[0], err


def test_inconsistent_layer_ids_refused(verifier_dir: Path, tmp_path: Path) -> None:
    d = _draft(verifier_dir)
    opt, _ = make_optimizer(d.parameters(), lr=1e-3)
    path = save_checkpoint(tmp_path, d, opt, {"step": 0}, verifier_name_or_path=str(verifier_dir))
    cfg = json.loads((path / "config.json").read_text())
    cfg["aux_hidden_state_layer_ids"] = [1, 2]  # hand-edited to the old numbering
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"is not fanout.draft_config.target_layer_ids"):
        load_draft(path, verifier_dir)


def test_load_draft_round_trip_same_layers_same_loss(verifier_dir: Path, tmp_path: Path) -> None:
    """save -> load_draft (speculators files only) -> same layers, same loss as the
    trained draft with its weights rounded to bf16 (what model.safetensors holds)."""
    d = _draft(verifier_dir)
    opt, _ = make_optimizer(d.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    for i in range(3):
        _step(d, opt, gen, i)
    path = save_checkpoint(tmp_path, d, opt, {"step": 3}, verifier_name_or_path=str(verifier_dir))
    loaded = load_draft(path, verifier_dir)
    assert loaded.cfg.target_layer_ids == d.cfg.target_layer_ids == [1, 2]
    assert loaded.cfg.block_size == 4 and loaded.cfg.mask_token_id == 255
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    a = d.loss(_batch(9), torch.Generator().manual_seed(5)).loss.item()
    b = loaded.loss(_batch(9), torch.Generator().manual_seed(5)).loss.item()
    assert a == pytest.approx(b, rel=1e-6)


def test_load_draft_named_errors(verifier_dir: Path, tmp_path: Path) -> None:
    d = _draft(verifier_dir)
    opt, _ = make_optimizer(d.parameters(), lr=1e-3)
    path = save_checkpoint(tmp_path, d, opt, {"step": 0}, verifier_name_or_path=str(verifier_dir))
    other = tiny_qwen3_verifier(tmp_path / "wide", 256, hidden_size=48, num_layers=4, head_dim=8)
    with pytest.raises(CheckpointError, match="hidden_size = 32 but verifier"):
        load_draft(path, other)
    shallow = tiny_qwen3_verifier(
        tmp_path / "shallow", 256, hidden_size=32, num_layers=2, head_dim=8
    )
    with pytest.raises(CheckpointError, match="do not exist in the 2-layer verifier"):
        load_draft(path, shallow)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        load_draft(tmp_path / "nope", verifier_dir)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors: missing"):
        load_draft(path, verifier_dir)


def test_a_fault_at_any_step_of_a_save_keeps_a_whole_commit(
    verifier_dir: Path, tmp_path: Path
) -> None:
    """Every write of a save goes through the FileSystem seam; failing each call in turn
    (ENOSPC) leaves the newest committed checkpoint whole and loadable, and no temp
    or set-aside directory behind."""
    d = _draft(verifier_dir)
    opt, _ = make_optimizer(d.parameters(), lr=1e-3)
    save_checkpoint(tmp_path, d, opt, {"step": 2, "cursor": 2})
    steps: set[str] = set()

    def check(n: int, e: OSError) -> None:
        steps.add(getattr(e, "step", "makedirs"))
        latest = latest_checkpoint(tmp_path)
        assert latest is not None and latest.name in ("checkpoint-00000002", "checkpoint-00000003")
        assert load_checkpoint(latest, _draft(verifier_dir), None)["cursor"] == int(latest.name[-1])
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")], (n, e)

    path, failures = fail_each_call(
        lambda fs: save_checkpoint(tmp_path, d, opt, {"step": 3, "cursor": 3}, fs=fs),
        check,
        errno_=errno.ENOSPC,
    )
    assert {"create", "write", "fsync", "rename", "fsync directory"} <= steps
    assert failures > 20 and latest_checkpoint(tmp_path) == path
    assert load_checkpoint(path, _draft(verifier_dir), opt)["step"] == 3


def test_upgrade_rewrites_config_atomically_and_durably(verifier_dir: Path, tmp_path: Path) -> None:
    d = _draft(verifier_dir)
    opt, _ = make_optimizer(d.parameters(), lr=1e-3)
    path = save_checkpoint(tmp_path, d, opt, {"step": 3}, verifier_name_or_path=str(verifier_dir))
    _as_format_1(path)
    old = (path / "config.json").read_bytes()

    def check(n: int, e: OSError) -> None:
        assert (path / "config.json").read_bytes() == old or after_rename(e), (n, e)
        assert not [p.name for p in path.iterdir() if p.name.startswith(".")], (n, e)
        (path / "config.json").write_bytes(old)

    fail_each_call(lambda fs: upgrade_checkpoint(path, fs), check)
    fs = Recording()
    (path / "config.json").write_bytes(old)
    upgrade_checkpoint(path, fs)
    assert fs.ops == ["open_new", "write", "fsync", "close", "rename", "fsync_dir"]
    assert load_draft(path, verifier_dir).cfg.target_layer_ids == [1, 2]


def test_a_checkpoint_from_before_the_family_seam_loads_and_resumes(
    verifier_dir: Path, tmp_path: Path
) -> None:
    """fanout wrote the draft's config under `fanout.dflash_config` until the family seam
    (now `fanout.draft_config`): such a checkpoint still loads, resumes and upgrades."""
    d = _draft(verifier_dir, max_anchors=5)
    opt, _ = make_optimizer(d.parameters(), lr=1e-3)
    path = save_checkpoint(tmp_path, d, opt, {"step": 1}, verifier_name_or_path=str(verifier_dir))
    cfg = json.loads((path / "config.json").read_text())
    cfg["fanout"]["dflash_config"] = cfg["fanout"].pop("draft_config")
    (path / "config.json").write_text(json.dumps(cfg))
    loaded = load_draft(path, verifier_dir)
    assert loaded.cfg.max_anchors == 5  # a training-only field: read from the old key
    load_checkpoint(path, _draft(verifier_dir, max_anchors=5), None)
    with pytest.raises(ConfigError, match="max_anchors: checkpoint 5, draft 6"):
        load_checkpoint(path, _draft(verifier_dir, max_anchors=6), None)
