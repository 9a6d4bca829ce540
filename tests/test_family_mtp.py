"""The MTP family (fanout.families.mtp) against speculators 0.9.0's MTP, its chained
drafting against plain greedy decoding, and its start from a verifier's own MTP weights.

speculators' `MTPDraftModel` is the oracle where it is installed (those tests skip
without it):

(a) a fanout checkpoint loads with `MTPDraftModel.from_pretrained` with no
    missing/unexpected keys, every tensor the file's and the draft's, and the config
    speculators expects (`mtp`, `MTPDraftModel`, one layer, the proposal's steps);
(b) with the same weights and rows (one document; fanout's last-layer states normed by
    the verifier's final norm as speculators' input), every step's logits and the loss
    equal speculators' `forward` (eager attention, fp32 on CPU), with the step weights
    its trainer computes, labels from input_ids and a loss mask with holes;
(c) a draft trained a few steps decodes as `fanout eval` does (a chain, vLLM's `mtp`)
    losslessly at T = 0 against `Decoder.greedy`, the cache giving the reference's
    tokens and rows, also after a save/load round trip;
(d) the verifier's own `mtp.*` weights (a tiny Gemma-3 from tests/verifier_zoo.py, whose
    zero-centred norms take w + 1, with such tensors added for the dense layer) start
    the draft, and ones that do not fit its config are refused in one line; bad
    configurations are refused in one line. (Qwen3-Next / Qwen3.5 verifiers get their
    own layer: tests/test_mtp_hybrid.py.)
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from fanout.checkpoints.load import load_draft
from fanout.checkpoints.save import save_checkpoint
from fanout.decode.spec_decode import Decoder
from fanout.errors import ConfigError
from fanout.families.mtp.model import MTPDraft
from fanout.families.mtp.propose import MTPContext
from fanout.families.registry import family, family_of_draft
from fanout.ops.adamw import make_optimizer
from greedy_training import greedy_rows
from speculators_parity import Drafts, Parity, load, perturbed, save_draft

# the parity fixtures (spec: they read PARITY and SPECULATORS)
from speculators_parity import spec as spec
from test_family_eagle3 import (
    V_LAYERS,
    VOCAB,
    H,
    _prompt,
    assert_cached_equals_uncached,
    assert_greedy_lossless,
    eagle_verifier,
)
from test_family_eagle3 import decoder as decoder  # fixture: eagle_decoder
from test_family_eagle3 import verifier_dir as verifier_dir  # fixture: eagle_verifier
from tiny_run import one_thread  # noqa: F401 (autouse: one intra-op thread)

STEPS = 3
T = 20


def _draft(vdir: Path, **kw: Any) -> MTPDraft:
    """An MTP draft, every weight moved off its init, rounded to bf16."""
    torch.manual_seed(1)
    d = family("mtp").build(vdir, mtp_steps=STEPS, **kw)
    assert isinstance(d, MTPDraft)
    return perturbed(d, 0.1)


def _saved(vdir: Path, tmp: pytest.TempPathFactory) -> Drafts:
    return {"default": save_draft(_draft(vdir), vdir, tmp.mktemp("mtp-ckpt"))}


@pytest.fixture(scope="module")
def saved(verifier_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[MTPDraft, Path]:
    return _saved(verifier_dir, tmp_path_factory)["default"]


SPECULATORS = {"mtp": "speculators.models.mtp"}  # the `spec` fixture's modules


def _load(spec: SimpleNamespace, path: Path) -> tuple[Any, dict[str, Any], list[str]]:
    """speculators' model from a fanout checkpoint (eager attention, fp32), its loading
    report and every warning said while loading (`spec`: skipped without speculators)."""
    return load(PARITY, path)


# ---- (a) speculators loads a fanout checkpoint: MTP's case of
# tests/test_speculators_parity.py


def _check_loaded(name: str, draft: MTPDraft, model: Any, path: Path, vdir: Path) -> None:
    file = load_file(str(path / "model.safetensors"))
    assert set(file) == set(draft.trainable_state())
    sd = model.state_dict()
    # the verifier's embedding and head, loaded by speculators itself
    assert torch.equal(sd["embed_tokens.weight"], draft.embed_weight)
    assert torch.equal(sd["lm_head.weight"], draft.lm_head_weight)
    c = model.config
    assert c.speculators_model_type == "mtp" and c.architectures == ["MTPDraftModel"]
    assert c.num_nextn_predict_layers == 1 and c.num_speculative_steps == STEPS
    assert c.transformer_layer_config.model_type == "qwen3"
    assert model.target_layer_ids == [V_LAYERS]  # speculators' numbering: the last layer
    assert c.speculators_config.verifier.name_or_path == str(vdir)
    raw = json.loads((path / "config.json").read_text())
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == STEPS


PARITY = Parity(
    family="mtp", module="speculators.models.mtp", config_class="MTPSpeculatorConfig",
    model_class="MTPDraftModel", verifier=eagle_verifier, drafts=_saved, loads=("default",),
    info_past=2,  # past both overrides
    reloads_verifier=False,  # the embedding and head are the verifier's, loaded by it
    check_loaded=_check_loaded,
)  # fmt: skip


# ---- (b) the same logits and loss as speculators' forward ------------------------------


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, T), generator=g)
    pos = torch.arange(T)[None]
    doc = torch.zeros(1, T, dtype=torch.long)
    lm = torch.ones(1, T, dtype=torch.uint8)
    lm[0, :4] = 0
    lm[0, 11] = 0
    return {
        "hidden_states": 2.0 * torch.randn(1, T, H, generator=g), "input_ids": ids,
        "target_ids": ids, "loss_mask": lm, "document_ids": doc,
        "position_ids": pos,
    }  # fmt: skip


def assert_matches_speculators(model: Any, draft: MTPDraft, batch: dict[str, Any]) -> None:
    """speculators' MTPDraftModel `model` and fanout's `draft` on one batch: the same
    logits per step, loss and per-step losses in fp32 (tests/test_mtp_hybrid.py too)."""
    steps = len(draft.cfg.step_weights())
    with torch.no_grad(), warnings.catch_warnings():
        # speculators 0.9.0 calls create_causal_mask(past_key_values=...), deprecated
        warnings.simplefilter("ignore", FutureWarning)
        normed = draft.fuse(batch["hidden_states"])  # speculators' input: the last states
        logits, loss, metrics = model(
            input_ids=batch["input_ids"], hidden_states=normed,
            loss_mask=batch["loss_mask"], position_ids=batch["position_ids"],
            step_weights=draft.cfg.step_weights(),
        )  # fmt: skip
        outs = draft.unroll(batch)
        out = draft.loss(batch, None)
    assert len(logits) == len(outs) == steps
    for theirs, mine in zip(logits, outs):
        torch.testing.assert_close(mine @ draft.lm_head_weight.t(), theirs, atol=2e-5, rtol=0)
    torch.testing.assert_close(out.loss, loss.float(), atol=0, rtol=2e-5)
    for k in range(steps):
        w = draft.cfg.step_weights()[k]
        assert out.extra[f"loss_{k}"] == pytest.approx(float(metrics[f"loss_step_{k}"]) / w, 2e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_logits_and_loss_match_speculators(
    seed: int, spec: SimpleNamespace, saved: tuple[MTPDraft, Path]
) -> None:
    draft, path = saved
    model, _, _ = _load(spec, path)
    batch = _batch(seed)
    assert_matches_speculators(model, draft, batch)


def test_step_weights_are_speculators(spec: SimpleNamespace, saved: tuple[MTPDraft, Path]) -> None:
    core: Any = pytest.importorskip("speculators.models.mtp.core")
    assert saved[0].cfg.step_weights() == pytest.approx(core.compute_step_weights(0.6, STEPS))


# ---- (c) decoding -------------------------------------------------------------------


def fit(draft: MTPDraft, batch: dict[str, Any], steps: int) -> MTPDraft:
    """`steps` AdamW steps on one batch; its loss must fall (tests/test_mtp_hybrid.py too)."""
    opt, _ = make_optimizer(draft.parameters(), lr=3e-3)
    first = None
    for _ in range(steps):
        out = draft.loss(batch, None)
        first = first if first is not None else float(out.loss.detach())
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert first is not None and float(out.loss.detach()) < first
    return draft.eval()


@pytest.fixture(scope="module")
def trained(verifier_dir: Path, decoder: Decoder) -> MTPDraft:
    """An MTP draft trained briefly on the verifier's own greedy continuations."""
    torch.manual_seed(0)
    draft = family("mtp").build(verifier_dir)
    assert isinstance(draft, MTPDraft) and draft.cfg.target_layer_ids == [V_LAYERS - 1]
    v = decoder.verifier
    ids = greedy_rows(decoder)  # [8, 48]
    b, t = ids.shape
    pos, doc = torch.arange(t).expand(b, t), torch.zeros(b, t, dtype=torch.long)
    hs = []

    def hook(_m: Any, _a: Any, out: Any) -> None:
        hs.append(out[0] if isinstance(out, tuple) else out)

    layer = decoder.layers[V_LAYERS - 1]
    handle = layer.register_forward_hook(hook)
    try:
        cap = v.capture(ids, pos, doc)
    finally:
        handle.remove()
    batch = {
        "hidden_states": hs[-1].float(), "input_ids": ids, "target_ids": cap.target_ids.long(),
        "loss_mask": torch.ones(b, t, dtype=torch.uint8), "document_ids": doc, "position_ids": pos,
    }  # fmt: skip
    return fit(draft, batch, steps=60)


@pytest.mark.parametrize("k", [None, 1, 5])
def test_greedy_lossless_chained(k: int | None, trained: MTPDraft, decoder: Decoder) -> None:
    fam = family_of_draft(trained)
    assert fam.name == "mtp" and fam.serving_method == "mtp"
    taus = assert_greedy_lossless(trained, decoder, k, k or STEPS)
    if k != 1:
        assert sum(taus[:2]) / 2 > 1.2  # trained prompts: drafts are accepted


def test_cached_equals_uncached(trained: MTPDraft, decoder: Decoder) -> None:
    assert_cached_equals_uncached("mtp", trained, decoder, MTPContext, k=4)


def test_checkpoint_round_trip_decodes(
    trained: MTPDraft, decoder: Decoder, verifier_dir: Path, tmp_path: Path
) -> None:
    opt = torch.optim.SGD(trained.parameters(), lr=0.1)
    path = save_checkpoint(
        tmp_path, trained, opt, {"step": 1}, verifier_name_or_path=str(verifier_dir)
    )
    back = load_draft(path, verifier_dir)
    assert isinstance(back, MTPDraft) and back.cfg == trained.cfg
    for k, v in trained.trainable_state().items():
        assert torch.equal(back.trainable_state()[k], v.bfloat16().float()), k  # bf16 file
    prompt = _prompt(6, 100)
    assert decoder.speculative(prompt, back, 20).tokens == decoder.greedy(prompt, 20).tokens


# ---- (d) the verifier's own MTP weights; bad input ------------------------------------


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from verifier_zoo import build

    # a dense verifier with zero-centred norms (a hybrid one gets its own MTP layer)
    return Path(build("gemma3_text", tmp_path_factory.mktemp("gemma3")))


_NAMES = {
    "mtp_layers.0.input_proj.weight": "mtp.fc.weight",
    "mtp_layers.0.final_layernorm.weight": "mtp.norm.weight",
    "mtp_layers.0.hidden_layernorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "mtp_layers.0.token_layernorm.weight": "mtp.pre_fc_norm_embedding.weight",
}


def _with_mtp(
    src: Path,
    dst: Path,
    shapes: dict[str, torch.Size],
    bad: str | None = None,
    extra: dict[str, torch.Size] | None = None,
) -> dict[str, torch.Tensor]:
    """A copy of verifier `src` whose safetensors add `mtp.*` tensors (the names
    speculators' MTPConverter reads, as Qwen3-Next's checkpoints name them) of `shapes`
    (the draft's), `bad` one of them of the wrong shape."""
    import shutil

    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(7)
    added = {}
    for k, shape in shapes.items():
        name = _NAMES.get(k, k.replace("mtp_layers.0.", "mtp.layers.0."))
        shape = torch.Size([shape[0] + 1, *shape[1:]]) if name == bad else shape
        added[name] = (0.1 * torch.randn(shape, generator=g)).bfloat16()
    for name, shape in (extra or {}).items():  # e.g. a MoE layer's experts
        added[name] = torch.zeros(shape, dtype=torch.bfloat16)
    first = sorted(dst.glob("*.safetensors"))[0]
    save_file({**load_file(str(first)), **added}, str(first), metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    if index.exists():
        idx = json.loads(index.read_text())
        idx["weight_map"] |= {n: first.name for n in added}
        index.write_text(json.dumps(idx))
    return added


def test_starts_from_the_verifiers_mtp_weights(
    next_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fam = family("mtp")
    with caplog.at_level(logging.INFO, logger="fanout.families.mtp"):
        plain = fam.build(next_dir)
    assert "speculators' initialisation" in caplog.text
    shapes = {k: v.shape for k, v in plain.trainable_state().items()}
    vdir = tmp_path / "with-mtp"
    added = _with_mtp(next_dir, vdir, shapes)
    assert len(added) == len(shapes)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fanout.families.mtp"):
        d = fam.build(vdir)
    assert "own MTP weights" in caplog.text
    from fanout.model.verifier_dir import text_tensors

    offset = text_tensors(vdir).norm_offset  # Gemma-3: zero-centred norms (w + 1)
    assert offset == 1
    state = d.trainable_state()
    assert torch.equal(state["mtp_layers.0.input_proj.weight"], added["mtp.fc.weight"].float())
    assert torch.equal(
        state["mtp_layers.0.self_attn.q_proj.weight"],
        added["mtp.layers.0.self_attn.q_proj.weight"].float(),
    )
    assert torch.equal(
        state["mtp_layers.0.final_layernorm.weight"], added["mtp.norm.weight"].float() + 1
    )
    assert not torch.equal(
        state["mtp_layers.0.input_proj.weight"],
        plain.trainable_state()["mtp_layers.0.input_proj.weight"],
    )


EXPERT = "mtp.layers.0.mlp.experts.0.gate_proj.weight"


@pytest.mark.parametrize(
    ("bad", "extra", "named"),
    [
        ("mtp.layers.0.self_attn.q_proj.weight", None, "mtp.layers.0.self_attn.q_proj.weight"),
        (None, {EXPERT: torch.Size([8, 8])}, EXPERT),  # a MoE MTP layer, half shipped
    ],
)
def test_mismatched_verifier_mtp_weights_refused(
    bad: str | None, extra: Any, named: str, next_dir: Path, tmp_path: Path
) -> None:
    fam = family("mtp")
    plain = fam.build(next_dir)
    shapes = {k: v.shape for k, v in plain.trainable_state().items()}
    vdir = tmp_path / "bad-mtp"
    _with_mtp(next_dir, vdir, shapes, bad=bad, extra=extra)
    with pytest.raises(ConfigError) as e:
        fam.build(vdir)
    assert "\n" not in str(e.value) and named in str(e.value)
    assert "--draft-family mtp" in str(e.value)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"block_size": 8}, "MTP drafts a chain"),
        ({"gamma": 4.0}, "--gamma 4.0: MTP trains cross-entropy"),
        ({"loss_type": "kl"}, "--loss-type kl"),
        ({"loss_weighting": "dpace"}, "dpace"),
        ({"mtp_steps": 0}, "mtp_steps"),
        ({"target_layer_ids": [1]}, "last layer only"),
    ],
)
def test_bad_config_refused(fields: dict[str, Any], match: str, verifier_dir: Path) -> None:
    with pytest.raises(ConfigError, match=match):
        family("mtp").build(verifier_dir, **fields)


def test_shared_conflict_one_line() -> None:
    fam = family("mtp")
    assert fam.shared_conflict({"block_size": 16}, set()) is None
    msg = fam.shared_conflict({"block_size": 6, "draft_vocab_size": 100}, {"block_size"})
    assert msg is not None and "--block-size 6" in msg and "\n" not in msg
    msg = fam.shared_conflict({"draft_vocab_size": 100}, set())
    assert msg is not None and "--draft-vocab-size 100" in msg
