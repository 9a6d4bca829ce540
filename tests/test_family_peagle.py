"""The P-EAGLE family (fanout.families.peagle) against speculators 0.9.0's P-EAGLE, and
its parallel drafting against plain greedy decoding.

speculators' `PEagleDraftModel` is the oracle where it is installed (those tests skip
without it):

(a) (its `PARITY` case of tests/test_speculators_parity.py)
    a fanout checkpoint loads with `PEagleDraftModel.from_pretrained` with no
    missing/unexpected keys, no warning, every tensor the file's and the draft's
    (the trained embedding and `mask_hidden` included), and every field speculators'
    P-EAGLE config declares beyond its base written with fanout's meaning;
(b) the same COD samples from the same generator state, and with the same weights and
    rows, fanout's logits at every sampled position, loss, per-depth accuracy and every
    parameter gradient equal speculators' `forward` (eager attention and losses, fp32
    on CPU; Qwen3 and Llama layers, KL and CE, full and reduced vocabulary).
    Tolerances as tests/test_family_eagle3.py's (logits atol 2e-5, losses rtol 2e-5
    after undoing speculators' 1e-5 denominator, gradients rtol 1e-4 with atol 1e-5
    of the largest entry);
(c) a draft trained a few steps lowers its loss, its checkpoint loads in speculators,
    and decoding it as `fanout eval` does (parallel drafting, every depth in one
    forward) is lossless at T = 0 against `Decoder.greedy`, the cache giving the
    reference's tokens and rows;
(d) bad configurations and a resume as another family are refused in one line.

Rows given to speculators (its data pipeline shifts each sample, `shift_batch`):
fanout's draft rows of one packed window, its step-0 supervision as the loss mask (so
both read the same mask; the module docstring says how fanout's differs), the boundary
row a document of its own (speculators' padding rows see nothing and give NaN in eager
attention; fanout's see themselves), and every document's first tokens unsupervised so
no chain hangs from a boundary.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fanout.checkpoints.load import load_draft
from fanout.checkpoints.resume import load_checkpoint
from fanout.decode.spec_decode import Decoder
from fanout.errors import CheckpointError, ConfigError
from fanout.families.peagle.model import PEagleDraft, cod_sample
from fanout.families.peagle.propose import PEagleContext
from fanout.families.registry import family, family_of_draft
from greedy_training import fit, greedy_batch
from speculators_parity import Drafts, Parity, load, perturbed, save_draft, saved_and_loaded

# the parity fixtures (drafts, spec: they read PARITY and SPECULATORS)
from speculators_parity import drafts as drafts
from speculators_parity import spec as spec
from test_family_eagle3 import (
    EPS_DEN,
    TARGET_LAYERS,
    VOCAB,
    H,
    _rows,
    assert_cached_equals_uncached,
    assert_greedy_lossless,
    assert_refused_in_one_line,
    eagle_verifier,
)
from test_family_eagle3 import decoder as decoder  # fixture: eagle_decoder
from test_family_eagle3 import verifier_dir as verifier_dir  # fixture: eagle_verifier
from tiny_run import one_thread  # noqa: F401 (autouse: one intra-op thread)

DEPTHS = 4


def _draft(vdir: Path, ids: torch.Tensor | None = None, **kw: Any) -> PEagleDraft:
    """A two-layer P-EAGLE draft, every weight moved off its init, rounded to bf16."""
    torch.manual_seed(1)
    fields: dict[str, Any] = {
        "target_layer_ids": TARGET_LAYERS, "num_layers": 2, "num_depths": DEPTHS,
        "max_anchors": 12, **kw,
    }  # fmt: skip
    if ids is not None:
        fields["draft_vocab_size"] = int(ids.numel())
    d = family("peagle").build(vdir, draft_vocab_ids=ids, **fields)
    assert isinstance(d, PEagleDraft)
    # the embedding is the verifier's (bf16), trained from there
    return perturbed(d, 0.1, skip=frozenset({"embed_tokens.weight"}))


CASES: dict[str, dict[str, Any]] = {
    "qwen3-kl": {},
    "qwen3-ce": {"loss_type": "ce"},
    "llama-kl": {"draft_arch": "llama", "norm_before_fc": True},
    "reduced-kl": {},
}


def _saved(vdir: Path, tmp: pytest.TempPathFactory) -> Drafts:
    """One draft per case, each saved with save_checkpoint."""
    g = torch.Generator().manual_seed(5)
    reduced = torch.randperm(VOCAB, generator=g)[:200].sort().values
    out: Drafts = {}
    for name, kw in CASES.items():
        d = _draft(vdir, reduced if name.startswith("reduced") else None, **kw)
        out[name] = save_draft(d, vdir, tmp.mktemp(f"peagle-{name}"))
    return out


# speculators' P-EAGLE, its data helpers, eager losses and config base (the `spec`
# fixture's modules); the saved drafts (one a case) are PARITY's
SPECULATORS = {
    "peagle": "speculators.models.peagle", "data": "speculators.models.peagle.data",
    "eager": "speculators.losses.eager", "base": "speculators.config",
}  # fmt: skip


def _load(spec: SimpleNamespace, path: Path) -> tuple[Any, dict[str, Any], list[str]]:
    """speculators' model from a fanout checkpoint (eager attention, fp32), its loading
    report and every warning said while loading (`spec`: skipped without speculators)."""
    return load(PARITY, path)


# ---- (a) speculators loads a fanout checkpoint: P-EAGLE's case of
# tests/test_speculators_parity.py


def _check_loaded(name: str, draft: PEagleDraft, model: Any, path: Path, vdir: Path) -> None:
    # the checkpoint's (trained) embedding is kept by load_verifier_weights
    assert torch.equal(model.embed_tokens.weight, draft.embed_tokens.weight)
    trainable = {k for k, p in model.named_parameters() if p.requires_grad}
    assert trainable == {k for k, p in draft.named_parameters() if p.requires_grad}
    assert {"mask_hidden", "embed_tokens.weight"} <= trainable
    assert ("layers.0.self_attn.q_norm.weight" in trainable) == (name != "llama-kl")


def _meant(draft: PEagleDraft) -> dict[str, Any]:
    """speculators' trainer recipe for --speculator-type peagle: the fields its config
    declares beyond its base, or whose default it changes."""
    return {
        "transformer_layer_config": None,  # checked in _check_config
        "draft_vocab_size": VOCAB,
        "norm_before_residual": True,
        "target_hidden_size": H,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in TARGET_LAYERS],
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": True,
        "mask_token_id": draft.cfg.mask_token_id,
        "speculators_model_type": "peagle",
        "architectures": ["PEagleDraftModel"],
    }


def _check_config(draft: PEagleDraft, model: Any, raw: dict[str, Any], vdir: Path) -> None:
    tl = model.config.transformer_layer_config
    assert (tl.model_type, tl.num_hidden_layers, tl.hidden_size) == ("qwen3", 2, H)
    assert model.config.speculators_config.proposal_methods[0].speculative_tokens == DEPTHS
    assert draft.cfg.block_size == DEPTHS + 1
    assert family("peagle").serving_method == "eagle3"


PARITY = Parity(
    family="peagle", module="speculators.models.peagle", config_class="PEagleSpeculatorConfig",
    model_class="PEagleDraftModel", verifier=eagle_verifier, drafts=_saved,
    loads=("qwen3-kl", "reduced-kl", "llama-kl"), info_past=2,  # past both overrides
    check_loaded=_check_loaded, config_base="speculators.config:SpeculatorModelConfig",
    config_draft="qwen3-kl", meant=_meant, check_config=_check_config,
)  # fmt: skip


# ---- (b) the same samples, logits, loss and gradients ------------------------------------


def _one_row(draft: PEagleDraft, norm: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Row 1 of test_family_eagle3's rows (two documents, the second from 13) alone."""
    batch, pre = _rows(11, draft, norm)
    return {k: v[1:] for k, v in batch.items()}, pre[1:]


def _packed(draft: PEagleDraft, batch: dict[str, torch.Tensor], pre: torch.Tensor) -> Any:
    rows = draft.rows(batch)
    _, row_mask, _ = draft.step_inputs(batch, rows["document_ids"], 0)
    doc = rows["document_ids"].clone()
    doc[doc < 0] = 99  # the boundary row: a document of its own (module docstring)
    return row_mask, {
        "hidden_states": rows["hidden_states"],
        "input_ids": batch["input_ids"][:, 1:],
        "document_ids": doc,
        "position_ids": rows["position_ids"],
        "loss_mask": row_mask.float(),
        "verifier_last_hidden_states": pre[:, 1:],
    }


def test_cod_samples_equal_speculators(spec: SimpleNamespace) -> None:
    g = torch.Generator().manual_seed(3)
    for seed in range(6):
        mask = torch.rand(40, generator=g) < 0.7
        mask[0] = False  # speculators hangs row 0 from row -1 (fanout drops it)
        torch.manual_seed(seed)
        theirs = spec.data.generate_cod_sample_indices(
            40, mask[None].float(), num_depths=6, max_anchors=20 if seed % 2 else None
        )
        ours = cod_sample(mask, 6, 0.7, 0.2, 20 if seed % 2 else None,
                          torch.Generator().manual_seed(seed))  # fmt: skip
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1]), seed


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_loss_and_grads_equal_speculators(
    case: str, spec: SimpleNamespace, drafts: dict[str, tuple[PEagleDraft, Path]]
) -> None:
    draft, path = drafts[case]
    model, _, _ = _load(spec, path)
    model.load_verifier_weights()
    model.float()
    batch, pre = _one_row(draft, model.verifier_norm)
    row_mask, packed = _packed(draft, batch, pre)
    c = draft.cfg
    samples = draft.sample(row_mask, torch.Generator().manual_seed(4))
    assert int(samples.depth.max()) == DEPTHS - 1  # every depth sampled
    draft.zero_grad()
    out = draft.sampled_loss(batch, samples)
    out.loss.backward()
    with torch.no_grad():
        rows = draft.rows(batch)
        tok, _, _ = draft.step_inputs(batch, rows["document_ids"], 0)
        states = draft.draft_states(
            rows["hidden_states"], rows["position_ids"], rows["document_ids"], tok, samples
        )
        ours = states[0] @ draft.lm_head_weight.t()  # [S, Vd]
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _a, o: logits.append(o.detach()))
    fn = spec.eager.kl_div_loss if c.loss_type == "kl" else spec.eager.ce_loss
    model.zero_grad()
    torch.manual_seed(4)  # speculators draws its samples from the global generator
    with warnings.catch_warnings():
        # transformers' deprecation of the `past_key_values` keyword speculators' layer passes
        warnings.simplefilter("ignore", FutureWarning)
        _, loss, metrics = model(
            **packed, loss_config={c.loss_type: (fn, 1.0)}, max_anchors=c.max_anchors,
            num_depths=c.num_depths, down_sample_ratio=c.down_sample_ratio,
            down_sample_ratio_min=c.down_sample_ratio_min,
        )  # fmt: skip
        loss.backward()
    hook.remove()
    torch.testing.assert_close(ours, logits[0][0], atol=2e-5, rtol=0)
    n = out.n_tokens
    assert n == int(out.per_slot_count.sum()) > 0
    assert float(out.loss.detach()) == pytest.approx(
        float(loss.detach()) * (n + EPS_DEN) / n, rel=2e-5
    )
    for d in range(DEPTHS):
        assert float(metrics[f"position_{d}_acc_total"]) == int(out.per_slot_count[d]), d
        hits = float(out.per_slot_acc[d]) * int(out.per_slot_count[d])
        assert hits == pytest.approx(float(metrics[f"position_{d}_acc_sum"]), abs=1e-4), d
    theirs = dict(model.named_parameters())
    for k, p in draft.named_parameters():
        if p.requires_grad:
            g = theirs[k].grad
            assert p.grad is not None and g is not None, k
            scale = float(g.abs().max())
            torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5 * max(scale, 1e-6), msg=k)


# ---- (c) training, and decoding as fanout eval does ---------------------------------------


@pytest.fixture(scope="module")
def trained(verifier_dir: Path, decoder: Decoder) -> tuple[PEagleDraft, list[float]]:
    """A P-EAGLE draft (reference recipe, 4 depths) trained on the verifier's own greedy
    continuations; the loss of every step."""
    torch.manual_seed(0)
    draft = family("peagle").build(verifier_dir, target_layer_ids=TARGET_LAYERS, num_depths=4)
    assert isinstance(draft, PEagleDraft) and draft.cfg.num_layers == 1
    gen = torch.Generator().manual_seed(0)
    return draft, fit(draft, greedy_batch(decoder), lr=3e-3, steps=60, generator=gen)


def test_training_lowers_the_loss_and_speculators_loads_it(
    trained: tuple[PEagleDraft, list[float]], spec: SimpleNamespace, verifier_dir: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    draft, losses = trained
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses
    path, _ = saved_and_loaded(PARITY, draft, verifier_dir, tmp_path)
    back = load_draft(path, verifier_dir)
    assert type(back) is PEagleDraft and back.cfg == draft.cfg


@pytest.mark.parametrize("k", [None, 2])
def test_greedy_lossless_all_depths_in_one_forward(
    k: int | None, trained: tuple[PEagleDraft, list[float]], decoder: Decoder
) -> None:
    draft = trained[0]
    assert family_of_draft(draft).name == "peagle"
    taus = assert_greedy_lossless(draft, decoder, k, k or draft.cfg.num_depths)
    assert sum(taus[:2]) / 2 > 1.2  # trained prompts: drafts are accepted


def test_cached_equals_uncached(trained: tuple[PEagleDraft, list[float]], decoder: Decoder) -> None:
    assert_cached_equals_uncached("peagle", trained[0], decoder, PEagleContext)


# ---- (d) bad input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"block_size": 8}, r"--num-depths \+ 1 = 9"),
        ({"gamma": 4.0}, "--gamma 4.0: P-EAGLE weighs"),
        ({"label_source": "input_ids"}, "--label-source input_ids"),
        ({"num_depths": 0}, "num_depths"),
        ({"down_sample_ratio": 1.5}, "down_sample_ratio"),
    ],
)
def test_bad_config_is_refused_in_one_line(
    fields: dict[str, Any], match: str, verifier_dir: Path
) -> None:
    assert_refused_in_one_line(
        "peagle", verifier_dir, match, target_layer_ids=TARGET_LAYERS, **fields
    )


def test_too_many_speculative_tokens_are_refused(trained: tuple[PEagleDraft, list[float]]) -> None:
    with pytest.raises(ConfigError, match="trained 4 depths"):
        family("peagle").drafting_context(trained[0], num_speculative_tokens=5)


def test_a_checkpoint_of_another_family_is_refused(
    drafts: dict[str, tuple[PEagleDraft, Path]], verifier_dir: Path
) -> None:
    _, path = drafts["qwen3-kl"]
    e3 = family("eagle3").build(verifier_dir, target_layer_ids=TARGET_LAYERS)
    with pytest.raises(CheckpointError, match=r"a peagle draft's checkpoint.*eagle3") as e:
        load_checkpoint(path, e3, None)
    assert "\n" not in str(e.value)


def test_its_flags_are_refused_for_another_family_and_theirs_for_it() -> None:
    from test_families import _train_cfg

    with pytest.raises(ConfigError, match=r"--num-depths: peagle option.*--draft-family is eagle3"):
        _train_cfg("--draft-family", "eagle3", "--num-depths", "4")
    with pytest.raises(ConfigError, match=r"--ttt-steps: eagle3 option.*is peagle") as e:
        _train_cfg("--draft-family", "peagle", "--ttt-steps", "4")
    assert "\n" not in str(e.value) and "--num-depths" in str(e.value)  # its own, named
    with pytest.raises(ConfigError, match=r"--block-size 4: P-EAGLE drafts a chain"):
        _train_cfg("--draft-family", "peagle", "--block-size", "4")
    r = _train_cfg("--draft-family", "peagle", "--num-depths", "6").draft_recipe()
    assert (r["num_depths"], r["num_layers"], r["loss_type"]) == (6, 1, "kl")
    assert family("peagle").verify_width(r) == 7 and "ttt_steps" not in r
