"""The DSpark family (fanout.families.dspark) against speculators 0.9.0's DSpark, and its
drafting step against plain greedy decoding.

speculators' `DSparkDraftModel` is the oracle where it is installed (those tests skip
without it; the rest never need it):

(a) (its `PARITY` case of tests/test_speculators_parity.py)
    a fanout checkpoint (`save_checkpoint`) loads with `DSparkDraftModel.from_pretrained`
    with no missing/unexpected keys, no warning from any channel, every tensor the file's
    and the draft's, every config field speculators' DSpark declares beyond DFlash's
    (and those whose default it changes) present in `config.json` with fanout's meaning,
    and the config equal to the one speculators writes itself (`save_pretrained`);
(b) with the same weights (Markov and confidence heads perturbed far from their init so
    they matter), rows and anchors (both `select_anchors` patched), fanout's loss, per-slot
    accuracy counts, EAL, accept_len, confidence loss / abs error and every parameter
    gradient equal speculators' `forward` (CE with exp decay, CE with D-PACE, KL). fp32
    on CPU, eager attention; tolerances: loss rtol 2e-6 (after undoing speculators' 1e-5
    and 1e-8 denominators), accept_len / abs error rtol 1e-5 (TV sums of fp32 softmaxes
    in another order), EAL exact up to rtol 1e-6, gradients rtol 1e-4 with atol 1e-5 of
    the largest entry (fused linear CE/KL backward vs plain autograd);
(c) the drafting step at T = 0 is lossless against `Decoder.greedy`, drafts block_size
    tokens a step, gives the same tokens cached and uncached, and its Markov head changes
    picks (recomputed here from the block states, so ignoring the head or the chosen
    previous token fails);
(d) bad configurations are refused in one line each.

Semantic differences from speculators (fanout's choice; the model's docstring says why),
pinned in `test_supervision_differences`:
- Supervised slots. Slot k of the block at anchor a predicts token a+k+1. fanout
  supervises it on the predicted token: `loss_mask[a+k+1]` and the same document as the
  anchor; speculators on `loss_mask[a+k]`. The equality rows keep every block and the
  token after it inside one supervised span, where the two agree; the pinned rows show
  the extra and the missing slots exactly, and that with fanout's mask speculators' loss
  is fanout's.
- Anchor candidates: fanout's rule (DFlash's `select_anchors`) is a subset of
  speculators' (`loss_mask[a]`, a < T - bs): it also needs slot 0 to predict a supervised
  token of the anchor's document. A block speculators draws at a response's last token
  trains slot 0 on the following unsupervised token (its slot 0 is in the pinned rows).
  Speculators counts a block in EAL / accept_len when any slot is supervised, fanout when
  slot 0 is; with fanout's anchors these agree.
- Reduced draft vocabulary (as DFlash): a slot whose verifier token is outside the draft
  vocabulary carries no CE/BCE in fanout; speculators trains it toward the draft-vocab
  argmax. The confidence target p is the verifier's distribution over the draft
  vocabulary on both sides.
- Last hidden states: fanout's are after the verifier's final norm, speculators' before
  it (it applies `verifier_norm`); the tests feed speculators the pre-norm states and
  fanout their normed version (`tests/test_speculators.py`).
- Loss normalisation: fanout divides both terms by the supervised-slot count n;
  speculators by n + 1e-5 (CE) and n + 1e-8 (BCE), undone in the comparison.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import block_parity as block
from fanout.decode.spec_decode import Decoder, first_mismatch
from fanout.errors import ConfigError
from fanout.families.dflash.model import DFlashDraft
from fanout.families.dspark.config import DSparkConfig
from fanout.families.dspark.model import (
    DSparkDraft,
    acceptance_rate,
    markov_kl_div_and_argmax,
)
from fanout.families.dspark.propose import DSparkContext, confident_length
from fanout.families.registry import family, family_of_draft
from fanout.model import block_draft
from fanout.model.draft_cache import DraftCache, UncachedDraft, head_logits
from fanout.model.verifier import load_verifier
from greedy_training import fit, greedy_batch
from speculators_parity import (
    Drafts,
    Loaded,
    Parity,
    perturbed,
    save_drafts,
    speculators_verifier,
    with_fields,
)

# the parity fixtures (drafts, loaded, spec: they read PARITY and SPECULATORS)
from speculators_parity import drafts as drafts
from speculators_parity import loaded as loaded
from speculators_parity import spec as spec
from tiny_run import one_thread  # noqa: F401 (autouse: one intra-op thread)

VOCAB, H, V_LAYERS, BS, MASK, RANK = 256, 32, 4, 4, 255, 16
TARGET_LAYERS = [1, 2]
ROPE_THETA, RMS_EPS = 1e6, 1e-5
T = 40


# ---- fixtures ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3 speculators loads without a warning (`speculators_verifier`)."""
    return _verifier(tmp_path_factory.mktemp("dspark"))


def _verifier(root: Path) -> Path:
    return speculators_verifier(root, VOCAB, H, V_LAYERS, ROPE_THETA, RMS_EPS)


def _draft(vdir: Path, draft_vocab_ids: torch.Tensor | None = None, **kw: Any) -> DSparkDraft:
    """A DSpark draft with every weight moved off its init (the Markov and confidence
    heads far enough that their bias and logits matter), rounded to bf16."""
    torch.manual_seed(1)
    fields: dict[str, Any] = {
        "target_layer_ids": TARGET_LAYERS,
        "block_size": BS,
        "max_anchors": 8,
        "mask_token_id": MASK,
        "num_layers": 2,
        "markov_rank": RANK,
        **kw,
    }
    if draft_vocab_ids is not None:
        fields["draft_vocab_size"] = int(draft_vocab_ids.numel())
    d = DSparkDraft.from_verifier(vdir, draft_vocab_ids=draft_vocab_ids, **fields)
    scales = {"markov": 0.6, "confidence": 0.3}  # far enough that the heads matter
    return perturbed(
        d, lambda n: next((v for k, v in scales.items() if k in n), 0.05),
        norm=lambda n: "confidence" not in n,
    )  # fmt: skip


# speculators' DSpark and what its tests use of DFlash's (the `spec` fixture's modules);
# the saved drafts ('full' and 'reduced': 200 of 256 tokens) are PARITY's
SPECULATORS = {
    "dspark": "speculators.models.dspark", "dflash": "speculators.models.dflash",
    "core": "speculators.models.dflash.core", "eager": "speculators.losses.eager",
    "metrics": "speculators.models.dspark.metrics",
}  # fmt: skip


# ---- (a) speculators loads a fanout checkpoint: DSpark's case of
# tests/test_speculators_parity.py


def _check_loaded(name: str, draft: DSparkDraft, model: Any, path: Path, vdir: Path) -> None:
    mine = draft.trainable_state()
    heads = {
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
        "confidence_head.proj.bias",
    }
    assert heads <= set(mine)
    trainable = {k for k, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(mine)
    assert model.markov_head.markov_w1.weight.shape == (VOCAB, RANK)
    vd = draft.cfg.draft_vocab_size or VOCAB
    assert model.markov_head.markov_w2.weight.shape == (vd, RANK)


def _meant(draft: DSparkDraft) -> dict[str, Any]:
    """The fields speculators' DSpark config declares beyond DFlash's, or whose default
    it changes, as fanout means them."""
    c = draft.cfg
    return {
        "markov_rank": c.markov_rank,
        "markov_head_type": c.markov_head_type,
        "enable_confidence_head": c.enable_confidence_head,
        "confidence_head_with_markov": c.confidence_head_with_markov,
        "sample_from_anchor": True,
        "speculators_model_type": "dspark",
        # save_pretrained writes the model class (the config's default says DSparkSpeculator)
        "architectures": ["DSparkDraftModel"],
    }


def _check_config(draft: DSparkDraft, model: Any, raw: dict[str, Any], vdir: Path) -> None:
    assert raw["fanout"]["draft_config"]["confidence_head_alpha"] == draft.cfg.confidence_head_alpha
    assert model.config.speculators_config.proposal_methods[0].speculative_tokens == BS
    assert model.markov_head.head_type == "vanilla"
    assert model.confidence_head.proj.in_features == H + RANK


PARITY = Parity(
    family="dspark", module="speculators.models.dspark", config_class="DSparkSpeculatorConfig",
    model_class="DSparkDraftModel", verifier=_verifier,
    drafts=lambda vdir, tmp: save_drafts(_draft, vdir, tmp, "dspark-ckpt"),
    loads=("full", "reduced"),
    # the verifier-owned tensors (embedding, head, final norm) are not in the file:
    # speculators reloads them from the verifier, as it does before training (every
    # test reads the model whole, whichever runs first)
    after_load=lambda model: model.load_verifier_weights(),
    check_loaded=_check_loaded, resaves=("full", "reduced"),
    config_base="speculators.models.dflash:DFlashSpeculatorConfig", meant=_meant,
    own_are_serving_fields=True, check_config=_check_config,
)  # fmt: skip


# ---- (b) the same loss on the same rows ------------------------------------------------


def _corrected_argmax(
    draft: DSparkDraft, batch: dict[str, torch.Tensor], anchors: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """The draft's Markov-corrected greedy token of every slot `[1, A, bs]` (verifier ids)."""
    assert draft.markov_head is not None
    hid = draft.block_hidden(batch, anchors, valid)  # [1, A, bs, H]
    prev = draft.prev_tokens(batch, anchors)  # [1, A, bs]
    z = hid @ draft.lm_head_weight.t() + draft.markov_head.markov_w2(
        draft.markov_head.markov_w1(prev)
    )
    pred = z.argmax(-1)
    return pred if draft.d2t is None else pred + draft.d2t[pred]


def _rows(
    draft: DSparkDraft, vdir: Path, layout: block.Row, anchors: torch.Tensor, valid: torch.Tensor,
    seed: int,
) -> block.Rows:  # fmt: skip
    """A fanout batch row and the matching pre-norm verifier states for speculators
    (`block.rows`): about half the slots get a verifier state along the head row of
    the draft's corrected greedy token (so the verifier's greedy token is the draft's)."""

    def plant(batch: block.Row, pre: torch.Tensor, head: Any, w: Any, g: Any) -> None:
        pred = _corrected_argmax(draft, batch, anchors, valid)  # [1, A, bs]
        for j in range(anchors.shape[1]):
            for k in range(BS):
                if valid[0, j] and torch.rand((), generator=g) < 0.5:
                    # norm(head[t] / w) ∝ head[t]: its greedy token is t for these heads
                    pre[0, int(anchors[0, j]) + k] = 3.0 * head[pred[0, j, k]] / w

    return block.rows(vdir, layout, seed, len(TARGET_LAYERS) * H, plant, MASK, RMS_EPS)


def _compare(
    fan: Any, spec_loss: torch.Tensor, m: dict[str, torch.Tensor], alpha: float, blocks: bool = True
) -> None:
    """fanout's LossOutput against speculators' loss and metrics dict."""
    n = fan.n_tokens
    assert n > 0
    assert int(m["full_acc_total"]) == n
    eps_ce, eps_bce = 1e-5, 1e-8  # speculators' denominators: n + eps
    conf_spec = m["confidence_loss_sum"].detach()
    conf_fan = fan.extra["confidence_loss"]
    torch.testing.assert_close(float(conf_spec) * (n + eps_bce) / n, conf_fan, rtol=2e-6, atol=1e-7)
    ce_spec = (spec_loss.detach() - alpha * conf_spec) * (n + eps_ce) / n
    ce_fan = fan.loss.detach() - alpha * conf_fan
    torch.testing.assert_close(ce_spec, ce_fan, rtol=2e-6, atol=1e-7)
    block.assert_slot_counts(fan, m, BS, first=0)
    err = float(m["confidence_abs_error_sum"] / m["confidence_abs_error_total"])
    torch.testing.assert_close(err, fan.extra["confidence_abs_error"], rtol=1e-5, atol=1e-7)
    if blocks:
        eal = float(m["eal_sum"] / m["eal_total"])
        torch.testing.assert_close(eal, float(fan.eal), rtol=1e-6, atol=0)
        accept = float(m["accept_len_sum"] / m["accept_len_total"])
        torch.testing.assert_close(accept, fan.extra["accept_len"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("case", sorted(block.LOSS_CASES))
def test_loss_metrics_and_grads_equal_speculators(
    case: str, spec: SimpleNamespace, drafts: Drafts, loaded: Loaded,
    verifier_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    update, spec_kw = block.loss_case(case, spec.eager)
    alpha = 0.7
    draft = with_fields(
        drafts["full"][0], gamma=2.5, dpace_alpha=0.3, confidence_head_alpha=alpha, **update
    )
    model, _, _ = loaded["full"]
    model.zero_grad(set_to_none=True)
    layout = block.packed_row()
    # every block and the token after it inside one supervised span of one document
    # (3..9, 11..21, 25..39), where fanout's and speculators' slot masks agree; the
    # block at 35 is the last the row allows (a < T - bs); one padding block
    anchors, valid = block.anchor_rows(3, 5, 11, 14, 17, 25, 29, 35)
    rows = _rows(draft, verifier_dir, layout, anchors, valid, seed=11)
    fan, spec_loss, metrics = block.losses(
        draft, model, rows, anchors, valid, monkeypatch, **spec_kw,
        tv_loss_fn=spec.eager.tv_loss,  # the fused default is a Triton kernel
        gamma=2.5, dpace_alpha=0.3, confidence_head_alpha=alpha,
    )  # fmt: skip

    assert fan.n_tokens == int(valid.sum()) * BS  # every slot of every real block
    assert float(fan.per_slot_acc.min()) > 0 and float(fan.per_slot_acc.max()) < 1
    assert 1 < float(fan.eal) < 1 + BS
    _compare(fan, spec_loss, metrics, alpha)
    block.assert_grads_equal(draft, model, (fan.n_tokens + 1e-5) / fan.n_tokens)
    for k in (
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
    ):
        grad = dict(draft.named_parameters())[k].grad
        assert grad is not None and float(grad.abs().max()) > 0, k
    model.zero_grad(set_to_none=True)


def test_logits_and_confidence_equal_speculators(
    spec: SimpleNamespace, drafts: Drafts, loaded: Loaded,
    verifier_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The distribution itself, not only the loss: on the same rows and anchors, fanout's
    Markov-corrected logits (head + W1[prev] W2^T, the chunked op's fp32 product) and its
    confidence logits equal speculators' `_backbone_forward` + Markov bias + confidence
    head, every slot of every real block (fp32: atol 2e-5, observed ~1e-6)."""
    from fanout.families.dspark.model import _corrected_logits

    draft = drafts["full"][0]
    model, _, _ = loaded["full"]
    anchors, valid = block.anchor_rows(3, 5, 11, 14, 17, 25, 29, 35)
    batch, pre = _rows(draft, verifier_dir, block.packed_row(), anchors, valid, seed=11)
    block.patch_anchors(monkeypatch, anchors, valid)
    with torch.no_grad():
        theirs = _spec_pieces(model, batch, pre, anchors.shape[1])
        b = draft.blocks(batch, None)
        hid = b.hid[b.valid].reshape(-1, b.hid.shape[-1])  # [A·bs, H] real blocks only
        prev = draft.prev_tokens(batch, b.anchors)[b.valid].reshape(-1)  # [A·bs]
        emb, w2 = draft.markov_inputs(prev, hid.dtype)
        ours = _corrected_logits(hid, emb, draft.lm_head_weight, w2)  # [A·bs, V]
        conf = draft.confidence_logits(hid, emb)  # [A·bs]
    v = ours.shape[-1]
    keep = valid[0]
    their_logits = theirs["logits"][0].view(-1, BS, v)[keep].reshape(-1, v)
    their_conf = theirs["conf"][0].view(-1, BS)[keep].reshape(-1)
    assert ours.shape == their_logits.shape and float(ours.std()) > 0.1
    torch.testing.assert_close(ours, their_logits.float(), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(conf.float(), their_conf.float(), rtol=1e-5, atol=2e-5)
    assert (ours.argmax(-1) == their_logits.argmax(-1)).all()


# ---- (b) the differences, pinned ------------------------------------------------------


def _spec_pieces(
    model: Any, batch: dict[str, torch.Tensor], pre: torch.Tensor, n_anchors: int
) -> dict[str, Any]:
    """speculators' DSpark forward up to its loss: the backbone, then its own Markov and
    confidence heads on the slots, as `DSparkDraftModel.forward` applies them."""
    hidden, logits, targets, mask, idx = block.backbone(model, batch, pre, n_anchors)
    prev = batch["input_ids"][0, idx].view(n_anchors, BS)  # sample_from_anchor: token at a+k
    blocks = hidden.view(n_anchors, BS, -1)
    emb = model.markov_head.prev_embeddings(prev)
    bias = model.markov_head.block_bias(prev_token_ids=prev, hidden_states=blocks, prev_emb=emb)
    logits = (logits.view(n_anchors, BS, -1) + bias).view(1, n_anchors * BS, -1)
    conf = model.confidence_head(torch.cat([blocks, emb], dim=-1)).reshape(1, n_anchors * BS)
    return {"logits": logits, "targets": targets, "conf": conf, "mask": mask, "idx": idx}


def test_supervision_differences(
    spec: SimpleNamespace, drafts: Drafts, loaded: Loaded,
    verifier_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """speculators gates slot k on loss_mask[a+k], fanout on the predicted token
    (loss_mask[a+k+1], same document): the extra and missing slots, exactly; given
    fanout's slot mask, speculators' loss and per-slot accuracies are fanout's."""
    draft = copy.deepcopy(drafts["full"][0])
    model, _, _ = loaded["full"]
    layout = block.packed_row()  # doc 0 = [0, 22) supervised from 3 but 10; doc 1 from 25
    lm, doc = layout["loss_mask"], layout["document_ids"]
    # 6: slot 3 predicts the hole; 8, 9: around it (9 is no fanout anchor: its slot 0
    # predicts the hole); 19, 20: cross into doc 1's prompt; 21: doc 0's last token (no
    # fanout anchor: speculators trains its slot 0 on doc 1's first token); 30: agrees
    anchors, valid = block.anchor_rows(6, 8, 9, 19, 20, 21, 30)
    batch, pre = _rows(draft, verifier_dir, layout, anchors, valid, seed=31)
    block.patch_anchors(monkeypatch, anchors, valid)
    fan = draft.loss(batch, None)
    with torch.no_grad():
        r = _spec_pieces(model, batch, pre, anchors.shape[1])
    pos = r["idx"].view(1, -1, BS)  # [1, A, bs] = a + k
    spec_sup = r["mask"].bool().view(1, -1, BS)
    fan_sup = draft.supervision(batch, anchors, valid)
    # the two rules, as stated
    v = valid[:, :, None]
    assert torch.equal(spec_sup, lm[0, pos].bool() & v)
    same = doc[0, pos + 1] == doc[0, anchors][:, :, None]
    assert torch.equal(fan_sup, lm[0, pos + 1].bool() & same & v)

    def slots(m: torch.Tensor) -> set[tuple[int, int]]:
        return {(int(anchors[0, j]), k) for j, k in torch.nonzero(m[0]).tolist()}

    assert slots(spec_sup & ~fan_sup) == {(6, 3), (8, 1), (9, 0), (19, 2), (20, 1), (21, 0)}
    assert slots(fan_sup & ~spec_sup) == {(8, 2), (9, 1)}
    assert fan.n_tokens == int(fan_sup.sum())

    flat = fan_sup.flatten()[None].to(r["mask"].dtype)  # fanout's mask into speculators
    alpha = draft.cfg.confidence_head_alpha
    spec_loss, metrics = spec.metrics.compute_metrics(
        r["logits"], r["targets"], r["conf"], flat, BS,
        loss_config={"ce": (spec.eager.ce_loss, 1.0)}, tv_loss_fn=spec.eager.tv_loss,
        gamma=draft.cfg.resolved_gamma, confidence_head_alpha=alpha,
    )  # fmt: skip
    # EAL / accept_len: speculators counts block 9 (slots 1-3 supervised), fanout only
    # blocks whose slot 0 is (the blocks its anchor rule draws)
    _compare(fan, spec_loss, metrics, alpha, blocks=False)


def test_anchor_candidates_predict_a_supervised_token(verifier_dir: Path) -> None:
    """Every anchor DSpark draws has its slot 0 supervised (fanout's DFlash rule), and
    every supervised token a candidate's slot 0 could predict is drawn."""
    draft = _draft(verifier_dir, max_anchors=T)
    layout = block.packed_row()
    anchors, valid = block_draft.select_anchors(
        layout["loss_mask"], layout["document_ids"], T, BS, None
    )
    sup = draft.supervision(layout, anchors, valid)
    assert bool(sup[:, :, 0][valid].all())
    drawn = set(anchors[valid].tolist())
    lm, doc = layout["loss_mask"][0], layout["document_ids"][0]
    want = {a for a in range(T - BS) if lm[a] and lm[a + 1] and doc[a + 1] == doc[a]}
    assert drawn == want and {9, 21}.isdisjoint(drawn)


# ---- fused pieces vs plain autograd (no speculators needed) ----------------------------


def test_fused_kl_and_acceptance_rate_equal_plain_autograd(verifier_dir: Path) -> None:
    draft = _draft(verifier_dir)
    assert draft.markov_head is not None
    g = torch.Generator().manual_seed(3)
    n = 37
    rows = torch.randn(n, H, generator=g, requires_grad=True)
    prev = torch.randint(0, VOCAB, (n,), generator=g)
    teacher = 2 * torch.randn(n, H, generator=g)
    out_g = torch.randn(n, generator=g)
    w1, w2, head = draft.markov_head.markov_w1, draft.markov_head.markov_w2, draft.lm_head_weight

    emb = w1(prev)
    kl, pred = markov_kl_div_and_argmax(rows, emb, head, w2.weight, teacher, chunk_rows=8)
    (kl * out_g).sum().backward()
    mine = [t.grad.clone() for t in (rows, w1.weight, w2.weight)]  # type: ignore[union-attr]
    for t in (rows, w1.weight, w2.weight):
        t.grad = None
    logits = rows @ head.t() + w2(w1(prev))  # [n, V] the plain way
    log_p = F.log_softmax(teacher @ head.t(), -1)
    ref = (log_p.exp() * (log_p - F.log_softmax(logits, -1))).sum(-1)
    (ref * out_g).sum().backward()
    torch.testing.assert_close(kl, ref.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(pred, logits.argmax(-1))
    for got, t in zip(mine, (rows, w1.weight, w2.weight)):
        torch.testing.assert_close(got, t.grad, rtol=1e-4, atol=1e-6)

    with torch.no_grad():
        rate = acceptance_rate(rows, w1(prev), draft, teacher, chunk_rows=5)
        want = torch.minimum(logits.softmax(-1), log_p.exp()).sum(-1)
    torch.testing.assert_close(rate, want, rtol=1e-5, atol=1e-6)
    assert float(rate.min()) > 0 and float(rate.max()) < 1


def test_loss_without_markov_head_and_supervised_slot_counts(
    verifier_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """markov_rank 0 (no confidence head fed by it): the loss runs, its CE is DFlash's
    fused CE on the slot states alone, and slot k is counted on the predicted token."""
    draft = _draft(verifier_dir, markov_rank=0, confidence_head_with_markov=False)
    assert draft.markov_head is None and draft.confidence_head is not None
    layout = block.packed_row()
    anchors, valid = block.anchor_rows(6, 19, 30)
    batch = _rows_plain(layout, seed=4)
    monkeypatch.setattr(block_draft, "select_anchors", lambda *a, **k: (anchors, valid))
    out = draft.loss(batch, None)
    # 6: slot 3 predicts the hole; 19: slots 2, 3 predict doc 1's prompt; 30: all four
    assert out.per_slot_count.tolist() == [3, 3, 2, 1]
    assert out.n_tokens == 9
    assert {"accept_len", "confidence_loss", "confidence_abs_error"} <= set(out.extra)
    out.loss.backward()
    assert draft.confidence_head.proj.weight.grad is not None


def _rows_plain(layout: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Random rows with `layout` (no speculators counterpart needed)."""
    g = torch.Generator().manual_seed(seed)
    batch = {
        "hidden_states": torch.randn(1, T, len(TARGET_LAYERS) * H, generator=g),
        "input_ids": torch.randint(0, MASK, (1, T), generator=g),
        "target_ids": torch.randint(0, MASK, (1, T), generator=g),
        "last_hidden_states": torch.randn(1, T, H, generator=g),
        **layout,
    }
    return batch


# ---- (c) the drafting step -------------------------------------------------------------


@pytest.fixture(scope="module")
def decoder(verifier_dir: Path) -> Decoder:
    v = load_verifier(
        verifier_dir, device="cpu", capture_layer_ids=TARGET_LAYERS, num_draft_layers=None,
        store_last_hidden_states=True,
    )  # fmt: skip
    return Decoder(v, {MASK})


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def trained(verifier_dir: Path, decoder: Decoder) -> DSparkDraft:
    """A DSpark draft trained briefly on the verifier's own greedy continuations, so
    decoding accepts drafts (and rolls back rejected ones)."""
    torch.manual_seed(0)
    draft = DSparkDraft.from_verifier(
        verifier_dir, target_layer_ids=TARGET_LAYERS, block_size=BS, mask_token_id=MASK,
        max_anchors=32, num_layers=1, markov_rank=RANK,
    )  # fmt: skip
    fit(draft, greedy_batch(decoder), lr=3e-3, steps=40, generator=torch.Generator().manual_seed(0))
    return draft


class _Recording:
    """A DraftContext that records how many tokens each drafting step proposed."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    def extend(self, hidden: torch.Tensor) -> None:
        self.inner.extend(hidden)

    @property
    def proposed_length(self) -> int:  # what the decoder reports beside τ
        return int(self.inner.proposed_length)

    def propose(self, seq: list[int], choose: Any) -> tuple[list[int], torch.Tensor]:
        tokens, rows = self.inner.propose(seq, choose)
        self.sizes.append(len(tokens))
        assert rows.shape == (len(tokens), VOCAB)
        return tokens, rows


@pytest.mark.parametrize("which", ["trained", "perturbed"])
def test_greedy_lossless_and_bs_tokens_a_step(
    which: str, trained: DSparkDraft, decoder: Decoder, verifier_dir: Path
) -> None:
    draft = trained if which == "trained" else _draft(verifier_dir).eval()
    assert family_of_draft(draft).name == "dspark"

    def check(rec: _Recording, s: Any) -> None:
        assert s.drafted == BS and max(s.accepted) <= BS and len(rec.sizes) == len(s.accepted)
        ctx = rec.inner
        assert isinstance(ctx, DSparkContext)
        assert s.proposed == ctx.proposed_lengths and len(s.proposed) == len(rec.sizes)
        assert len(ctx.confidence) == BS and all(0 < c < 1 for c in ctx.confidence)
        assert ctx.proposed_length == confident_length(ctx.confidence)

    assert_block_lossless(draft, decoder, which == "trained", BS, check)  # slot 0 drafts too


def assert_block_lossless(
    draft: Any, decoder: Decoder, trained: bool, size: int, check: Callable[[Any, Any], None]
) -> None:
    """A block family's cached drafting step decodes what greedy decoding does on three
    prompts, drafting `size` tokens every step; `check(recording, result)`: the family's
    own checks of each. A `trained` draft decodes prompts it trained on, and its drafts
    must be accepted; another any prompts. XPress's tests use it too."""
    fam = family_of_draft(draft)
    taus = []
    prompts = ((6, 100), (6, 101), (6, 102)) if trained else ((3, 0), (17, 1), (30, 2))
    for n, seed in prompts:
        prompt = _prompt(n, seed)
        g = decoder.greedy(prompt, 30)
        rec = _Recording(fam.context(draft, cached=True))
        s = decoder.speculative(prompt, draft, 30, context=rec)
        assert first_mismatch(g.tokens, s.tokens) is None, (n, g.tokens, s.tokens)
        assert rec.sizes and set(rec.sizes) == {size}
        check(rec, s)
        taus.append(s.acceptance_length)
    if trained:
        assert sum(taus) / len(taus) > 2  # drafts are accepted, rejected ones rolled back


def test_cached_equals_uncached(trained: DSparkDraft, decoder: Decoder) -> None:
    for n, seed in ((5, 3), (21, 4)):
        prompt = _prompt(n, seed)
        a = decoder.speculative(prompt, trained, 30, cache_draft=True)
        b = decoder.speculative(prompt, trained, 30, cache_draft=False)
        assert a.tokens == b.tokens and a.accepted == b.accepted
    # one step, side by side: same tokens, rows and confidences
    prompt = _prompt(12, 5)
    v = decoder.verifier
    seq = prompt + Decoder(v, set()).greedy(prompt, 1).tokens
    _, hid = decoder._forward(prompt, 0, decoder._new_cache(), TARGET_LAYERS)
    assert hid is not None
    cached = DSparkContext(trained, DraftCache(trained))
    plain = DSparkContext(trained, UncachedDraft(trained))
    for ctx in (cached, plain):
        ctx.extend(hid)
    ta, ra = cached.propose(seq, lambda row: int(row.argmax()))
    tb, rb = plain.propose(seq, lambda row: int(row.argmax()))
    assert ta == tb
    torch.testing.assert_close(ra, rb, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cached.confidence, plain.confidence, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def _manual_chain(
    draft: DSparkDraft, states: torch.Tensor, anchor: int, follow_choice: bool = True
) -> tuple[list[int], list[float]]:
    """The DSpark step recomputed from the block states: slot k's row = head logits +
    W2(W1[prev]) over the verifier vocabulary, prev = the token chosen for slot k-1
    (or the anchor for every slot when not `follow_choice`)."""
    assert draft.markov_head is not None and draft.confidence_head is not None
    base = head_logits(draft, states)  # [bs, V], -inf outside a reduced vocabulary
    ids = torch.arange(draft.lm_head_weight.shape[0])
    if draft.d2t is not None:
        ids = ids + draft.d2t
    tokens, conf, prev = [], [], anchor
    for k in range(BS):
        e = draft.markov_head.markov_w1.weight[prev]  # [r]
        bias = torch.zeros(VOCAB)
        bias[ids] = draft.markov_head.markov_w2.weight @ e
        tok = int((base[k] + bias).argmax())
        z = draft.confidence_head.proj.weight[0] @ torch.cat([states[k], e])
        conf.append(float(torch.sigmoid(z + draft.confidence_head.proj.bias[0])))
        tokens.append(tok)
        prev = tok if follow_choice else anchor
    return tokens, conf


@pytest.mark.parametrize("vocab", ["full", "reduced"])
def test_markov_head_changes_picks(vocab: str, verifier_dir: Path, decoder: Decoder) -> None:
    ids = None
    if vocab == "reduced":
        ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[:200].sort().values
    draft = _draft(verifier_dir, ids).eval()
    changed = followed = 0
    for seed in range(6):
        prompt = _prompt(9 + seed, 10 + seed)
        _, hid = decoder._forward(prompt, 0, decoder._new_cache(), TARGET_LAYERS)
        assert hid is not None
        ctx = DSparkContext(draft, DraftCache(draft))
        ctx.extend(hid)
        seq = [*prompt, int(_prompt(1, 50 + seed)[0])]  # any anchor token
        tokens, rows = ctx.propose(seq, lambda row: int(row.argmax()))
        states = UncachedDraft(draft)
        states.extend(hid)
        st = states.block_states(seq)  # [bs, H]
        want, conf = _manual_chain(draft, st, seq[-1])
        assert tokens == want
        torch.testing.assert_close(ctx.confidence, conf, rtol=1e-4, atol=1e-5)
        assert ctx.proposed_length == confident_length(conf)
        plain = head_logits(draft, st).argmax(-1).tolist()  # the head alone (DFlash-style)
        changed += sum(a != b for a, b in zip(tokens, plain))
        followed += sum(a != b for a, b in zip(tokens, _manual_chain(draft, st, seq[-1], False)[0]))
        if ids is not None:
            assert set(tokens) <= set(ids.tolist())
            assert bool(
                torch.isinf(rows[:, [i for i in range(VOCAB) if i not in set(ids.tolist())]]).all()
            )
    assert changed > 0  # ignoring the Markov head gives other tokens
    assert followed > 0  # conditioning every slot on the anchor gives other tokens


def test_confident_length() -> None:
    assert confident_length([0.9, 0.8, 0.6, 0.99]) == 2  # 0.9, 0.72, then 0.43 < 0.5
    assert confident_length([0.4, 0.99]) == 0
    assert confident_length([1.0] * 4) == 4
    assert confident_length([0.9, 0.9], threshold=0.85) == 1


# ---- (d) bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"markov_head_type": "gated"}, "markov_head_type 'gated' is not implemented"),
        ({"markov_head_type": "rnn"}, "markov_head_type 'rnn' is not implemented"),
        ({"markov_rank": 0}, "confidence_head_with_markov needs markov_rank > 0"),
        ({"markov_rank": -1}, "markov_rank"),
        ({"confidence_head_alpha": -0.5}, "confidence_head_alpha"),
        ({"markov_heads": 2}, "markov_heads"),
        ({"loss_type": "kl", "loss_weighting": "dpace"}, "dpace' needs loss_type 'ce'"),
    ],
)
def test_bad_config_refused(overrides: dict[str, Any], match: str, verifier_dir: Path) -> None:
    with pytest.raises(ConfigError, match=match):
        DSparkDraft.from_verifier(
            verifier_dir, target_layer_ids=TARGET_LAYERS, block_size=BS, mask_token_id=MASK,
            num_layers=1, **overrides,
        )  # fmt: skip


def test_good_variants_build(verifier_dir: Path) -> None:
    """The boundaries of the rules above: rank 0 without the Markov-fed confidence head,
    rank 0 with no confidence head at all, and the head's presence follows the flags."""
    kw: dict[str, Any] = {
        "target_layer_ids": TARGET_LAYERS, "block_size": BS, "mask_token_id": MASK,
        "num_layers": 1,
    }  # fmt: skip
    a = DSparkDraft.from_verifier(
        verifier_dir, markov_rank=0, confidence_head_with_markov=False, **kw
    )
    assert a.markov_head is None and a.confidence_head is not None
    assert a.confidence_head.proj.in_features == H
    b = DSparkDraft.from_verifier(verifier_dir, markov_rank=0, enable_confidence_head=False, **kw)
    assert b.markov_head is None and b.confidence_head is None
    fam = family("dspark")
    assert fam.needs_last_hidden_states(a.cfg.model_dump())
    assert not fam.needs_last_hidden_states(b.cfg.model_dump())
    assert fam.needs_last_hidden_states(b.cfg.model_dump() | {"loss_type": "kl"})
    assert fam.needs_last_hidden_states({})  # the recipe's default: the confidence head on
    assert fam.recipe_defaults == {"block_size": 8}  # 512 anchors, speculators' CLI default
    assert DSparkConfig.model_fields["markov_rank"].default == 256


def test_missing_last_hidden_states_and_wrong_config(verifier_dir: Path) -> None:
    draft = _draft(verifier_dir)
    batch = _rows_plain(block.packed_row(), seed=1)
    del batch["last_hidden_states"]
    with pytest.raises(ConfigError, match="--store-last-hidden-states"):
        draft.loss(batch, torch.Generator().manual_seed(0))
    dflash = DFlashDraft.from_verifier(
        verifier_dir,
        target_layer_ids=TARGET_LAYERS,
        block_size=BS,
        mask_token_id=MASK,
        num_layers=1,
    )
    with pytest.raises(ConfigError, match="DSparkDraft needs a DSparkConfig"):
        DSparkDraft(
            dflash.cfg, dflash.embed_weight, dflash.embed_weight, dflash.verifier_norm_weight
        )
    with pytest.raises(ConfigError, match="the dspark family drafts with DSparkDraft"):
        family("dspark").context(dflash)
