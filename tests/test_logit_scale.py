"""A verifier whose forward scales its logits (Falcon-H1's `lm_head_multiplier`) or its
input embedding (`embedding_multiplier`): what fanout computes from the verifier's
weights equals what transformers' own forward computes, with every one of Falcon-H1's
multipliers away from 1 as in the real checkpoints.

.venv/bin/python -m pytest tests/test_logit_scale.py -x -q

The oracle is transformers' `FalconH1ForCausalLM` (tests/verifier_zoo.py's tiny entry,
its multipliers overridden), each document run alone: `model(ids).logits` and its
hidden states. Checked:
- the teacher every family reads, the captured `last_hidden_states` through the draft's
  frozen head (`last · Wᵀ`, docs/model.md), is the model's own logits;
- the draft's final-norm gain taken from the verifier (`verifier_norm_weight`, what
  the block drafters initialise their final norm to) turns the last decoder layer's
  output into the model's logits through the same head;
- the captured layers are the model's (its forward applies `embedding_multiplier`
  and the per-layer multipliers itself), and the draft's embedding is the raw table,
  as serving engines hand it to drafts (docs/producer.md, "Logit and embedding
  multipliers");
- every other architecture is read as before (scale 1, the stored gain untouched),
  and a multiplier that is not a positive number is refused in one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fanout.errors import ConfigError
from fanout.families.dflash.model import DFlashDraft
from fanout.model.verifier import Capture, Verifier, load_verifier
from fanout.model.verifier_dir import read_text_tensors, text_tensors
from tiny_run import one_thread  # noqa: F401 (autouse: one intra-op thread)
from verifier_zoo import build, doc_spans, load_oracle, packed_row

# Falcon-H1's multipliers, none of them 1: the two this file is about near mlx-lm's
# Falcon-H1 defaults (embedding 5.6569, head 0.039), the per-layer ones arbitrary
# (transformers' forward applies them; fanout's packed capture must too)
MULTIPLIERS: dict[str, Any] = {
    "embedding_multiplier": 5.656854249492381,
    "lm_head_multiplier": 0.0390625,
    "key_multiplier": 0.5,
    "attention_in_multiplier": 1.5,
    "attention_out_multiplier": 0.9375,
    "ssm_in_multiplier": 1.25,
    "ssm_out_multiplier": 0.75,
    "mlp_multipliers": [0.8, 1.3],
    "ssm_multipliers": [0.5, 1.5, 0.7, 1.2, 0.9],
}
DOCS = (12, 19)  # one packed row of two documents


@pytest.fixture(scope="module")
def falcon(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("falcon_h1", tmp_path_factory.mktemp("falcon") / "v", **MULTIPLIERS)


@torch.inference_mode()
def _alone(model: Any, ids: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """One document `[n]` alone in plain transformers: its decoder layers' outputs
    (`[n, H]` each; the last one raw, before the final norm) and its logits `[n, V]`."""
    outs: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_hook(lambda _m, _a, o: outs.append(o[0] if isinstance(o, tuple) else o))
        for layer in model.model.layers
    ]  # fmt: skip
    try:
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
    finally:
        for h in hooks:
            h.remove()
    return tuple(o[0] for o in outs), logits


@pytest.fixture(scope="module")
def captured(falcon: Path) -> tuple[Verifier, Capture]:
    """fanout's Verifier (every layer, last_hidden_states in fp32) and its capture of
    the packed row."""
    v = load_verifier(
        falcon,
        device="cpu",
        dtype="float32",
        storage_dtype="float32",
        capture_layer_ids=["all"],
        store_last_hidden_states=True,
    )
    return v, v.capture(*packed_row(DOCS))


@pytest.fixture(scope="module")
def oracle(falcon: Path) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """Per document: its layers' outputs and logits, alone in plain transformers."""
    model = load_oracle("falcon_h1", falcon)
    ids = packed_row(DOCS)[0][0]
    return [_alone(model, ids[s:e]) for s, e in doc_spans(DOCS)]


@pytest.fixture(scope="module")
def draft(falcon: Path) -> DFlashDraft:
    """A draft built from the verifier (its frozen tensors are every family's)."""
    return DFlashDraft.from_verifier(falcon, target_layer_ids=[0, 1], block_size=4)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = want.abs().max().item()
    rel = (got.float() - want).abs().max().item() / scale
    assert rel < 1e-5, f"{what}: max |diff| / max |want| = {rel:.2e}"


def test_the_teacher_through_the_frozen_head_is_the_verifiers_logits(
    captured: tuple[Verifier, Capture], oracle: list[Any], draft: DFlashDraft
) -> None:
    _, cap = captured
    assert cap.last_hidden_states is not None
    head = draft.lm_head_weight  # [V, H] what every family multiplies teacher rows by
    for k, (s, e) in enumerate(doc_spans(DOCS)):
        _, logits = oracle[k]
        teacher = cap.last_hidden_states[0, s:e].float() @ head.float().t()  # [n, V]
        _close(teacher, logits, f"document {k}: last_hidden_states · Wᵀ vs model(ids).logits")


def test_the_drafts_final_norm_reads_the_last_layer_as_the_verifiers_head(
    captured: tuple[Verifier, Capture], oracle: list[Any], draft: DFlashDraft
) -> None:
    # The block drafters start their final norm at the verifier's gain, so that their
    # first logits are on the verifier's scale; MTP normalises the last layer with it.
    v, cap = captured
    gain, head = draft.verifier_norm_weight, draft.lm_head_weight
    assert torch.equal(draft.norm.weight.detach(), gain)
    eps = draft.cfg.rms_norm_eps
    for k, (s, e) in enumerate(doc_spans(DOCS)):
        _, logits = oracle[k]
        raw = cap.layers[v.num_layers - 1][0, s:e]  # [n, H] the last layer, before the norm
        got = F.rms_norm(raw, (raw.shape[-1],), gain, eps) @ head.t()
        _close(got, logits, f"document {k}: the draft's final norm, then the head")


def test_capture_applies_the_verifiers_multipliers_and_the_draft_embeds_raw(
    falcon: Path, captured: tuple[Verifier, Capture], oracle: list[Any], draft: DFlashDraft
) -> None:
    _, cap = captured
    for k, (s, e) in enumerate(doc_spans(DOCS)):
        layers, _ = oracle[k]
        for j, want in enumerate(layers):
            _close(cap.layers[j][0, s:e], want, f"document {k} layer {j}")
    # the draft's inputs are the embedding table's rows, not the verifier's scaled first
    # residual: vLLM and speculators embed a draft's tokens with the table alone
    table = load_oracle("falcon_h1", falcon).get_input_embeddings().weight
    assert torch.equal(draft.embed_weight, table)
    assert text_tensors(falcon).logit_scale == MULTIPLIERS["lm_head_multiplier"]


def test_other_architectures_are_read_as_before(tmp_path: Path) -> None:
    # Scales are looked up by model_type: a field of that name elsewhere is not one, and
    # a verifier without one keeps its stored gain as it is (dtype and bits).
    path = build("qwen3", tmp_path / "qwen3")
    cfg = json.loads((path / "config.json").read_text())
    cfg["lm_head_multiplier"] = 0.5
    (path / "config.json").write_text(json.dumps(cfg))
    names = text_tensors(path)
    assert names.logit_scale == 1.0
    _, _, norm = read_text_tensors(path)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        stored = f.get_tensor(names.norm)
    assert norm.dtype == stored.dtype and torch.equal(norm, stored)


@pytest.mark.parametrize("bad", [0, -0.5, "big", float("inf")])
def test_a_multiplier_that_is_not_a_positive_number_is_refused(
    falcon: Path, tmp_path: Path, bad: Any
) -> None:
    d = Path(shutil.copytree(falcon, tmp_path / "v"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["lm_head_multiplier"] = bad
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        text_tensors(d)
    msg = str(e.value)
    assert "\n" not in msg and "lm_head_multiplier" in msg and str(d) in msg
