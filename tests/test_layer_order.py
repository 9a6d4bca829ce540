"""A draft's layers are in ascending order everywhere (issue 20.3, DESIGN.md "Layer order
is ascending").

    .venv/bin/pytest tests/test_layer_order.py -x -q

vLLM gathers a draft's auxiliary hidden states in layer order whatever order its config
lists, and `fanout eval`'s hooks fire in layer order, so a draft trained on [2, 0] in
that order would be served the wrong layer in each fc column block. The request is
sorted at the config boundary (`fanout.contract.ascending_layer_ids`): a trainer asked
for [2, 0] trains exactly the draft of [0, 2], its checkpoint says [1, 3] (serving
numbering), and τ from `fanout eval` equals τ from an independent decode loop that
concatenates HF `hidden_states` in ascending order. A checkpoint written before (ids
unsorted, fc in that order) is refused with a line naming `fanout upgrade-checkpoint`,
which permutes its fc columns (and optimizer moments) into the sorted draft, bit for bit,
crash-safely.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from fanout.bench.assets import generate_corpus
from fanout.bench.report import eval_markdown
from fanout.checkpoints.format import read_config
from fanout.checkpoints.layout import latest_checkpoint
from fanout.checkpoints.load import load_draft
from fanout.checkpoints.resume import load_checkpoint
from fanout.checkpoints.upgrade import upgrade_checkpoint
from fanout.contract import ascending_layer_ids
from fanout.coord.coordinator import Coordinator
from fanout.decode.config import EvalConfig
from fanout.decode.eval import EvalSession, evaluate
from fanout.errors import CheckpointError
from fanout.families.dflash.model import DFlashDraft
from fanout.model.draft_cache import IndependentSlots, UncachedDraft
from fanout.model.draft_config import DraftConfig
from fanout.produce.producer import Producer
from fanout.status.snapshot import snapshot
from fanout.train.config import TrainConfig
from fanout.train.consumer import ConsumerConfig
from fanout.train.trainer import Trainer
from fanout.train.trainlog import read_train_log
from faults import after_rename, fail_each_call
from tiny_run import build_tiny_assets, one_thread, tiny_producer_config  # noqa: F401 (autouse)

# Layer 3 of the 4-layer verifier is left out: HF's last `hidden_states` entry is after
# the final norm, not the decoder layer's output the capture hooks.
SORTED, UNSORTED = [0, 2], [2, 0]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("order")
    data, tok, ver = build_tiny_assets(root, generate_corpus(60, seed=4))
    run = root / "run"
    cfg = tiny_producer_config(
        root, run, capture_layer_ids=[2, 1, 0], max_windows=2,
        max_live_windows=1000, expected_consumers=1000,  # never evicts: all read all
    )  # fmt: skip
    Producer(cfg).run()
    out: dict[str, Any] = {"root": root, "data": data, "tok": tok, "ver": ver, "run": run}
    for name, layers in (("sorted", SORTED), ("unsorted", UNSORTED), ("default", None)):
        tcfg = TrainConfig(
            run_dir=str(run), consumer_id=name, verifier_name_or_path=str(ver),
            target_layer_ids=layers, num_layers=1, block_size=4, max_anchors=16, rows_per_step=2,
            max_steps=4, save_path=str(root / "drafts" / name), lr=1e-2, warmup_ratio=0.0,
            scheduler_type="constant", heartbeat_s=0.5, checkpoint_every=1000,
            acquire_timeout_s=60,
        )  # fmt: skip
        out[name] = (tcfg, Trainer(tcfg).run())
    return out


def _log(cfg: TrainConfig) -> list[dict[str, Any]]:
    return read_train_log(cfg.save_path)


def _ckpt(env: dict[str, Any], name: str) -> Path:
    path = latest_checkpoint(env[name][0].save_path)
    assert path is not None
    return path


def test_the_order_is_decided_once_at_the_config_boundary(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert ascending_layer_ids([5, 2, 9]) == [2, 5, 9]
    with caplog.at_level(logging.INFO, logger="fanout.contract"):
        cfg = ConsumerConfig(run_dir="r", consumer_id="c", target_layer_ids=[5, 2])
    assert cfg.draft_layer_ids == [2, 5]
    assert any("[5, 2]" in r.getMessage() and "[2, 5]" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fanout.contract"):
        ConsumerConfig(run_dir="r", consumer_id="c", target_layer_ids=[2, 5])
    assert not caplog.records  # nothing reordered, nothing said
    # what is built past the boundary refuses any other order rather than carry it
    shape = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, vocab_size=64, mask_token_id=1)  # fmt: skip
    assert DraftConfig(**shape, target_layer_ids=[2, 5]).target_layer_ids == [2, 5]
    for bad in ([5, 2], [2, 2]):
        with pytest.raises(ValueError, match="ascending"):
            DraftConfig(**shape, target_layer_ids=bad)


def test_an_unsorted_request_trains_the_sorted_draft(env: dict[str, Any]) -> None:
    (s_cfg, s_sum), (u_cfg, u_sum), d_cfg = env["sorted"], env["unsorted"], env["default"][0]
    assert u_cfg.draft_layer_ids == SORTED
    assert [r["loss"] for r in _log(u_cfg)] == [r["loss"] for r in _log(s_cfg)]
    assert u_sum["param_checksum"] == s_sum["param_checksum"]
    for name in ("sorted", "unsorted"):
        spec = json.loads((_ckpt(env, name) / "config.json").read_text())
        assert spec["aux_hidden_state_layer_ids"] == [1, 3]
        assert spec["fanout"]["draft_config"]["target_layer_ids"] == SORTED
    a, b = (load_file(str(_ckpt(env, n) / "model.safetensors")) for n in ("sorted", "unsorted"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the default (every captured layer) is ascending too, though captured as [2, 1, 0]
    spec = json.loads((_ckpt(env, "default") / "config.json").read_text())
    assert spec["aux_hidden_state_layer_ids"] == [1, 2, 3]
    with Coordinator.open(env["run"]) as co:
        got = {c["id"]: c["target_layer_ids"] for c in snapshot(co)["consumers"]}
    assert got["unsorted:dp0"] == got["sorted:dp0"] == SORTED
    assert got["default:dp0"] == [0, 1, 2]
    # negative control: the layers side by side in the other order are another context
    assert _log(d_cfg)[0]["loss"] != _log(s_cfg)[0]["loss"]


def _reference_decode(
    model: Any, prompt: list[int], draft: DFlashDraft, max_new: int, eos: set[int]
) -> tuple[list[int], list[int], list[list[int]]]:
    """Greedy DFlash speculative decoding written independently of fanout's Decoder: no
    KV caches (every step reruns the whole sequence; the draft through its training
    forward, `UncachedDraft`), no hooks; the context is HF
    `hidden_states[i + 1]` of the draft's layers concatenated in ascending layer order,
    what vLLM gathers. Returns (tokens, accepted drafts per verify step, proposals)."""
    layers = sorted(draft.cfg.target_layer_ids)
    bs = draft.cfg.block_size

    def run(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        hidden = torch.cat([out.hidden_states[i + 1][0] for i in layers], -1)  # [n, k·H]
        return out.logits[0].argmax(-1), hidden

    pred, _ = run(prompt)
    tokens, accepted, proposals = [int(pred[-1])], [], []
    while len(tokens) < max_new and tokens[-1] not in eos:
        seq = prompt + tokens  # positions 0..p, the anchor at p
        p = len(seq) - 1
        _, hidden = run(seq[:p])
        ctx = UncachedDraft(draft)  # the training forward (block_hidden), one anchor
        ctx.extend(hidden)
        proposals.append(ctx.logits(seq).argmax(-1).tolist())
        block = [tokens[-1], *proposals[-1]]
        y = run(seq[:p] + block)[0][p:].tolist()  # the verifier's choice after each slot
        n = 0
        while n < bs - 1 and block[n + 1] == y[n]:
            n += 1
        accepted.append(n)
        new = [*block[1 : n + 1], y[n]]
        tokens.extend(new)
        if any(t in eos for t in new):
            break
    return tokens, accepted, proposals


class RecordingContext(IndependentSlots):
    """The draft context `Decoder.speculative` feeds (its `context=` seam): records the
    verifier states it is given and the draft's proposals."""

    def __init__(self, draft: DFlashDraft) -> None:
        self.inner = UncachedDraft(draft)
        self.hidden: list[torch.Tensor] = []  # [n, k·H] pieces
        self.proposals: list[list[int]] = []

    def extend(self, hidden: torch.Tensor) -> None:
        self.hidden.append(hidden.clone())
        self.inner.extend(hidden)

    def logits(self, seq: list[int]) -> torch.Tensor:
        out = self.inner.logits(seq)
        self.proposals.append(out.argmax(-1).tolist())
        return out


def test_tau_of_the_unsorted_request_matches_an_independent_ascending_decode(
    env: dict[str, Any],
) -> None:
    paths = {n: _ckpt(env, n) for n in ("sorted", "unsorted")}
    ecfg = EvalConfig(
        verifier_name_or_path=str(env["ver"]), draft=[str(p) for p in paths.values()],
        data=str(env["data"]), tokenizer=str(env["tok"]), num_prompts=3, max_new_tokens=24,
    )  # fmt: skip
    report = evaluate(ecfg, echo=lambda *_: None)
    assert report["lossless"] is True
    taus = [d["acceptance_length"] for d in report["drafts"].values()]
    per_pos = [d["per_position_acceptance"] for d in report["drafts"].values()]
    assert len(taus) == 2 and taus[0] == taus[1] and per_pos[0] == per_pos[1]
    md = eval_markdown(report)  # the demo's report.md table, from this same report
    for name, d in report["drafts"].items():
        row = next(x for x in md if x.startswith(f"| {name} |"))
        pos = " ".join(f"{a:.2f}" for a in d["per_position_acceptance"])
        assert f"| 4 | {taus[0]:.2f} | {d['train_eal']:.2f} |" in row and pos in row, md
    session = EvalSession(ecfg, SORTED)
    draft = load_draft(paths["unsorted"], env["ver"])
    assert isinstance(draft, DFlashDraft)
    model, eos = session.verifier.model, set(session.decoder.eos)
    steps = 0
    for p in session.prompts:
        rec = RecordingContext(draft)
        r = session.decoder.speculative(p.ids, draft, ecfg.max_new_tokens, context=rec)
        tokens, accepted, proposals = _reference_decode(
            model, p.ids, draft, ecfg.max_new_tokens, eos
        )
        assert r.accepted == accepted and rec.proposals == proposals, p.index
        assert r.tokens == tokens[: len(r.tokens)], p.index
        steps += len(accepted)
        # the context fanout eval fed the draft is HF's states in ascending layer order...
        fed = torch.cat(rec.hidden)  # [P, 2·H]
        with torch.no_grad():
            hs = model(input_ids=torch.tensor([(p.ids + r.tokens)[: len(fed)]]),
                       output_hidden_states=True).hidden_states  # fmt: skip
        assert torch.allclose(fed, torch.cat([hs[1][0], hs[3][0]], -1), atol=1e-5)
        # ... and not in the other order (the test can tell them apart)
        assert not torch.allclose(fed, torch.cat([hs[3][0], hs[1][0]], -1), atol=1e-2)
    assert steps == next(iter(report["drafts"].values()))["verify_steps"]


# ---- a checkpoint from before the order was canonical --------------------------------


def _blocks_swapped(w: torch.Tensor) -> torch.Tensor:
    """fc [H, 2·H] with its two column blocks exchanged: the fc of the [2, 0] order."""
    h = w.shape[1] // 2
    return torch.cat([w[:, h:], w[:, :h]], dim=1)


def _as_written_before(src: Path, dst: Path) -> Path:
    """What fanout wrote for a draft trained on [2, 0] before the order was canonical:
    that order in the config, fc's column blocks (and their Adam moments) in it too."""
    shutil.copytree(src, dst)
    for name, keys in (("model.safetensors", ["fc.weight"]), ("resume.safetensors", None)):
        t = load_file(str(dst / name))
        fc_shape = t["fc.weight" if keys else "w.fc.weight"].shape
        for k in keys or [k for k in t if k == "w.fc.weight" or k.startswith("opt.0.")]:
            if t[k].shape == fc_shape:
                t[k] = _blocks_swapped(t[k]).contiguous()
        save_file(t, str(dst / name), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["aux_hidden_state_layer_ids"] = [3, 1]
    cfg["fanout"]["draft_config"]["target_layer_ids"] = UNSORTED
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _same_files(a: Path, b: Path) -> None:
    for name in ("model.safetensors", "resume.safetensors"):
        x, y = load_file(str(a / name)), load_file(str(b / name))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name
    assert json.loads((a / "config.json").read_text()) == json.loads(
        (b / "config.json").read_text()
    )


def test_fc_is_the_first_parameter_so_its_optimizer_state_is_opt_0(env: dict[str, Any]) -> None:
    draft = load_draft(_ckpt(env, "sorted"), env["ver"])
    assert next(iter(draft.named_parameters()))[0] == "fc.weight"
    t = load_file(str(_ckpt(env, "sorted") / "resume.safetensors"))
    moments = [k for k in t if k.startswith("opt.0.") and t[k].shape == t["w.fc.weight"].shape]
    assert len(moments) >= 2, sorted(t)  # Adam's two moments of fc, what upgrade permutes


def test_an_old_unsorted_checkpoint_is_refused_then_upgraded_bit_for_bit(
    env: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fanout.cli import main as cli_main

    good = _ckpt(env, "sorted")
    old = _as_written_before(good, tmp_path / good.name)
    assert not torch.equal(
        load_file(str(old / "model.safetensors"))["fc.weight"],
        load_file(str(good / "model.safetensors"))["fc.weight"],
    )
    for load in (read_config, lambda p: load_draft(p, env["ver"])):
        with pytest.raises(CheckpointError, match=r"not in ascending.*fanout upgrade-checkpoint"):
            load(old)
    sorted_draft = load_draft(good, env["ver"])
    with pytest.raises(CheckpointError, match="upgrade-checkpoint"):
        load_checkpoint(old, sorted_draft, None)
    argv = ["eval", "--verifier-name-or-path", str(env["ver"]), "--draft", str(old),
            "--data", str(env["data"]), "--tokenizer", str(env["tok"])]  # fmt: skip
    assert cli_main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "upgrade-checkpoint" in err[0], err
    assert cli_main(["upgrade-checkpoint", str(old)]) == 0
    assert "ascending" in capsys.readouterr().out
    _same_files(old, good)
    assert load_checkpoint(old, sorted_draft, None)["step"] == 4


def test_an_interrupted_upgrade_finishes_when_run_again(
    env: dict[str, Any], tmp_path: Path
) -> None:
    good = _ckpt(env, "sorted")
    pristine = _as_written_before(good, tmp_path / "pristine")
    work = tmp_path / good.name

    def fresh() -> None:
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(pristine, work)

    fresh()
    seen = 0

    def check(n: int, e: OSError) -> None:
        nonlocal seen
        seen += 1
        assert not [p.name for p in work.iterdir() if p.name.startswith(".")], (n, e)
        try:  # either still refused, or (the fault hit the last directory fsync) done
            read_config(work)
            assert after_rename(e), (n, e)
        except CheckpointError:
            upgrade_checkpoint(work)  # the re-run finishes it, permuting nothing twice
        _same_files(work, good)
        fresh()

    fail_each_call(lambda fs: upgrade_checkpoint(work, fs), check)
    _same_files(work, good)
    assert seen >= 18  # three atomic writes, six steps each, every one failed once
