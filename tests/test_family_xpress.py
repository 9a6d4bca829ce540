"""The XPress family (fanout.families.xpress) against speculators 0.9.0's XPress, and its
Jacobi drafting against plain greedy decoding.

speculators' `XPressDraftModel` is the oracle where it is installed (those tests skip
without it; the rest never need it):

(a) (its `PARITY` case of tests/test_speculators_parity.py)
    a fanout checkpoint loads with `XPressDraftModel.from_pretrained` with no
    missing/unexpected keys, no warning, every tensor the file's and the draft's (the
    `refiner_head.*` ones included), every config field speculators' XPress declares
    beyond DFlash's written with fanout's meaning, and the config equal to the one
    speculators writes itself (`save_pretrained`);
(b) with the same weights (the refiner, its mixer included, far from its init), rows
    and anchors (both `select_anchors` patched, as tests/test_family_dspark.py does),
    fanout's teacher-forced refined logits and base logits equal speculators'
    `_backbone_forward` + `refiner_head.block_bias`, and its loss, each term of it,
    the accept rates and every parameter gradient equal speculators' `forward` (eager
    CE 0.1 + TV 0.9; default knobs, the undecayed base anchor with data-token CE, the
    rounds off). fp32 on CPU, eager attention; tolerances as DSpark's (losses rtol 2e-6
    after undoing speculators' 1e-5 denominator, logits atol 2e-5, gradients rtol 1e-4
    with atol 1e-5 of the largest entry);
(c) a draft trained a few steps lowers its loss and its checkpoint loads in speculators
    and in fanout; decoding it as `fanout eval` does (the Jacobi passes) is lossless at
    T = 0 against `Decoder.greedy`, cached equals uncached, 0 passes is the backbone's
    own proposal, bs - 1 passes the sequential greedy chain, and the refiner changes
    picks;
(d) its flags given to another family, another family's to it, a shared flag it does
    not take and a checkpoint of it resumed as another family are refused in one line.

The rows keep every block inside one document's supervised span or its prompt, where
fanout's slot mask (the predicted token's mask, same document) and speculators'
(`loss_mask[a+k]`) agree: tests/test_speculators.py pins how they differ, as for DFlash.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import block_parity as block
from fanout.checkpoints.load import load_draft
from fanout.checkpoints.resume import load_checkpoint
from fanout.decode.spec_decode import Decoder
from fanout.errors import CheckpointError, ConfigError
from fanout.families.registry import family, family_of_draft
from fanout.families.xpress.model import XPressDraft
from fanout.families.xpress.propose import XPressContext
from fanout.model.draft_cache import DraftCache, UncachedDraft, head_logits
from greedy_training import fit, greedy_batch
from speculators_parity import (
    Drafts,
    Loaded,
    Parity,
    perturbed,
    save_drafts,
    saved_and_loaded,
    with_fields,
)

# the parity fixtures (drafts, loaded, spec: they read PARITY and SPECULATORS)
from speculators_parity import drafts as drafts
from speculators_parity import loaded as loaded
from speculators_parity import spec as spec
from test_family_dspark import (
    BS,
    MASK,
    RMS_EPS,
    TARGET_LAYERS,
    VOCAB,
    H,
    _prompt,
    _verifier,
    assert_block_lossless,
    decoder,  # noqa: F401 (fixture)
    verifier_dir,  # noqa: F401 (fixture)
)
from tiny_run import one_thread  # noqa: F401 (autouse: one intra-op thread)

RANK = 8
EPS_DEN = 1e-5  # speculators' loss denominator: n + 1e-5
# blocks inside a document: 0 and 22 open one (the refiner's slot-0 token is the anchor
# itself), slot 2 of the block at 8 is the hole at 10, the block at 35 is the last a row
# allows (a < T - bs); one padding block
ANCHORS = (0, 3, 8, 13, 17, 22, 25, 30, 35)


def _draft(vdir: Path, ids: torch.Tensor | None = None, **kw: Any) -> XPressDraft:
    """A two-layer XPress draft, every weight moved off its init (the refiner and its
    mixer far enough that the bias matters), rounded to bf16."""
    torch.manual_seed(1)
    fields: dict[str, Any] = {
        "target_layer_ids": TARGET_LAYERS, "block_size": BS, "max_anchors": 8,
        "mask_token_id": MASK, "num_layers": 2, "xpress_rank": RANK, **kw,
    }  # fmt: skip
    if ids is not None:
        fields["draft_vocab_size"] = int(ids.numel())
    d = family("xpress").build(vdir, draft_vocab_ids=ids, **fields)
    assert isinstance(d, XPressDraft)
    return perturbed(  # the refiner far enough that its bias matters
        d, lambda n: (1.0 if "token_embed" in n else 0.25) if "refiner" in n else 0.05
    )


# speculators' XPress and what its tests use of DFlash's (the `spec` fixture's modules);
# the saved drafts ('full' and 'reduced': 200 of 256 tokens) are PARITY's
SPECULATORS = {
    "xpress": "speculators.models.xpress", "dflash": "speculators.models.dflash",
    "core": "speculators.models.dflash.core", "eager": "speculators.losses.eager",
}  # fmt: skip


def _restore_tril(model: Any) -> None:
    """speculators' own loading path, then the verifier-owned tensors it reloads itself
    before training. speculators 0.9.0 defect: `from_pretrained` builds the model on the
    meta device and never re-creates the refiner's non-persistent `causal_tril` buffer
    (it holds whatever memory it got; `from_training_args` builds it right). Restored
    here, as its own constructor makes it, so the oracle computes the model its source
    describes."""
    model.load_verifier_weights()
    tril = model.refiner_head.causal_tril
    tril.copy_(torch.tril(torch.ones_like(tril)))


# ---- (a) speculators loads a fanout checkpoint: XPress's case of
# tests/test_speculators_parity.py


def _check_loaded(name: str, draft: XPressDraft, model: Any, path: Path, vdir: Path) -> None:
    mine = draft.trainable_state()
    refiner = {k for k in mine if k.startswith("refiner_head.")}
    assert len(refiner) == 9 and "refiner_head.mix_l" in refiner
    trainable = {k for k, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(mine)
    head = model.refiner_head
    vd = draft.cfg.draft_vocab_size or VOCAB
    assert head.readout.weight.shape == (vd, RANK)
    assert head.token_embed.weight.shape == (VOCAB, RANK)
    assert head.mlp_gate.weight.shape == (2 * RANK, RANK) and head.mix_l.shape == (RANK, BS, BS)


def _meant(draft: XPressDraft) -> dict[str, Any]:
    """The fields speculators' XPress config declares beyond DFlash's, or whose default
    it changes, as fanout means them."""
    c = draft.cfg
    return {
        "xpress_rank": c.xpress_rank,
        "xpress_mlp_ratio": c.xpress_mlp_ratio,
        "num_jacobi_passes": c.num_jacobi_passes,
        "speculators_model_type": "xpress",
        # save_pretrained writes the model class (the config's default says XPressSpeculator)
        "architectures": ["XPressDraftModel"],
    }


def _check_config(draft: XPressDraft, model: Any, raw: dict[str, Any], vdir: Path) -> None:
    assert raw["sample_from_anchor"] is False and model.config.sample_from_anchor is False
    assert raw["fanout"]["draft_config"]["consistency_weight"] == draft.cfg.consistency_weight
    assert model.config.speculators_config.proposal_methods[0].speculative_tokens == BS - 1


PARITY = Parity(
    family="xpress", module="speculators.models.xpress", config_class="XPressSpeculatorConfig",
    model_class="XPressDraftModel", verifier=_verifier,
    drafts=lambda vdir, tmp: save_drafts(_draft, vdir, tmp, "xpress-ckpt"),
    loads=("full", "reduced"), after_load=_restore_tril, check_loaded=_check_loaded,
    resaves=("full", "reduced"), config_base="speculators.models.dflash:DFlashSpeculatorConfig",
    meant=_meant, own_are_serving_fields=True, check_config=_check_config,
)  # fmt: skip


# ---- (b) the same logits and loss on the same rows ------------------------------------


def _tf_pieces(
    draft: XPressDraft, batch: dict[str, torch.Tensor], anchors: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fanout's base and teacher-forced refined logits `[N, bs, Vd]` of the real blocks."""
    hid = draft.block_hidden(batch, anchors, valid)[valid]  # [N, bs, H]
    tok, before = (t[valid] for t in draft.block_tokens(batch, anchors))
    prev = torch.cat([before[:, None], tok[:, :-1]], dim=1)  # [N, bs]
    base = hid @ draft.lm_head_weight.t()
    return base, base + draft.refiner_head(prev, draft.refiner_head.hidden_cache(hid))


def _rows(
    draft: XPressDraft, vdir: Path, anchors: torch.Tensor, valid: torch.Tensor, seed: int
) -> block.Rows:
    """A fanout batch row (`block.packed_row`) and the matching pre-norm verifier states
    for speculators (`block.rows`): about half the slots get a verifier state along the
    head row of the draft's teacher-forced refined greedy token."""

    def plant(batch: block.Row, pre: torch.Tensor, head: Any, w: Any, g: Any) -> None:
        pred = draft.to_verifier_ids(_tf_pieces(draft, batch, anchors, valid)[1].argmax(-1))
        for j, a in enumerate(anchors[valid].tolist()):
            for k in range(1, BS):
                if torch.rand((), generator=g) < 0.5:
                    pre[0, a + k - 1] = 3.0 * head[pred[j, k]] / w  # its greedy token: pred

    return block.rows(vdir, block.packed_row(), seed, len(TARGET_LAYERS) * H, plant, MASK, RMS_EPS)


def test_logits_equal_speculators(
    spec: SimpleNamespace, drafts: Drafts, loaded: Loaded,
    verifier_dir: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:  # fmt: skip
    """The distributions, not only the loss: the backbone's and the teacher-forced
    refined logits equal speculators' `_backbone_forward` + `refiner_head.block_bias`
    (with the previous tokens its forward builds), every slot of every real block."""
    draft = drafts["full"][0]
    model, _, _ = loaded["full"]
    anchors, valid = block.anchor_rows(*ANCHORS)
    batch, pre = _rows(draft, verifier_dir, anchors, valid, seed=11)
    block.patch_anchors(monkeypatch, anchors, valid)
    n = anchors.shape[1]
    with torch.no_grad():
        hidden, logits, _, _, idx = block.backbone(model, batch, pre, n)
        ids, doc = batch["input_ids"][0], batch["document_ids"][0]
        tok = ids[idx].view(n, BS)
        a = idx.view(n, BS)[:, 0]
        b4 = (a - 1).clamp(min=0)  # the token before each anchor, where in its document
        am1 = torch.where((a > 0) & (doc[b4] == doc[a]), ids[b4], tok[:, 0])
        prev = torch.cat([am1[:, None], tok[:, :-1]], dim=1)
        head = model.refiner_head
        bias = head.block_bias(prev, hcache=head.hidden_cache(hidden.view(n, BS, -1)))
        theirs_base = logits.view(n, BS, -1)[valid[0]]
        theirs_tf = (logits.view(n, BS, -1) + bias)[valid[0]]
        base, tf = _tf_pieces(draft, batch, anchors, valid)
    assert float(bias.std()) > 0.1 and not torch.equal(tf.argmax(-1), base.argmax(-1))
    torch.testing.assert_close(base, theirs_base, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(tf, theirs_tf, rtol=1e-5, atol=2e-5)


CASES: dict[str, dict[str, Any]] = {
    "reference": {},
    "full-anchor-data-ce": {"base_anchor_full_weight": True, "label_source": "input_ids"},
    "no-rounds": {"consistency_weight": 0.0, "xpress_ce_weight": 0.4, "xpress_tv_weight": 0.5},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_terms_and_grads_equal_speculators(
    case: str, spec: SimpleNamespace, drafts: Drafts, loaded: Loaded,
    verifier_dir: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:  # fmt: skip
    draft = with_fields(drafts["full"][0], gamma=2.5, **CASES[case])
    c = draft.cfg
    model, _, _ = loaded["full"]
    model.zero_grad(set_to_none=True)
    anchors, valid = block.anchor_rows(*ANCHORS)
    rows = _rows(draft, verifier_dir, anchors, valid, seed=11)
    eager = spec.eager
    fan, loss, m = block.losses(
        draft, model, rows, anchors, valid, monkeypatch,
        loss_config={"ce": (eager.ce_loss, c.xpress_ce_weight),
                     "tv": (eager.tv_loss, c.xpress_tv_weight)},
        gamma=2.5, consistency_weight=c.consistency_weight,
        consistency_passes=c.consistency_passes, base_anchor_weight=c.base_anchor_weight,
        base_anchor_full_weight=c.base_anchor_full_weight,
        ce_from_data=c.label_source == "input_ids",
    )  # fmt: skip

    n = fan.n_tokens
    assert n == int(m["accept_rate_total"]) > 0
    if c.label_source == "target_ids":  # the rows' verifier agrees with half the slots
        assert float(fan.per_slot_acc.min()) > 0 and float(fan.per_slot_acc.max()) < 1
    scale = (n + EPS_DEN) / n
    close: dict[str, Any] = {"rtol": 2e-6, "atol": 1e-7}
    torch.testing.assert_close(float(loss.detach()) * scale, float(fan.loss.detach()), **close)
    torch.testing.assert_close(float(m["tf_loss_sum"]) * scale, fan.extra["tf_loss"], **close)
    torch.testing.assert_close(
        float(m["base_anchor_loss_sum"]) * scale, fan.extra["base_anchor_loss"], **close
    )
    if c.consistency_weight:
        cons = float(m["consistency_loss_sum"]) * scale
        torch.testing.assert_close(cons, fan.extra["consistency_loss"], **close)
        assert m["consistency_round2_loss_sum"] is not None
    else:
        assert "consistency_loss_sum" not in m and "consistency_loss" not in fan.extra
    for k in ("accept_rate", "base_accept_rate"):
        theirs = float(m[f"{k}_sum"] / m[f"{k}_total"])
        torch.testing.assert_close(theirs, fan.extra[k], rtol=1e-5, atol=1e-7)
    block.assert_grads_equal(draft, model, scale)
    grad = draft.refiner_head.mix_l.grad
    assert grad is not None and float(grad.abs().max()) > 0
    model.zero_grad(set_to_none=True)


# ---- (c) training, and decoding as fanout eval does ---------------------------------------


@pytest.fixture(scope="module")
def trained(
    verifier_dir: Path,  # noqa: F811
    decoder: Decoder,  # noqa: F811
) -> tuple[XPressDraft, list[float]]:
    """An XPress draft (reference recipe but for its size) trained on the verifier's own
    greedy continuations; the loss of every step."""
    torch.manual_seed(0)
    draft = family("xpress").build(
        verifier_dir, target_layer_ids=TARGET_LAYERS, block_size=BS, mask_token_id=MASK,
        max_anchors=32, num_layers=1, xpress_rank=16,
    )  # fmt: skip
    assert isinstance(draft, XPressDraft)
    gen = torch.Generator().manual_seed(0)
    return draft, fit(draft, greedy_batch(decoder), lr=1e-2, steps=60, generator=gen)


def test_training_lowers_the_loss_and_speculators_loads_it(
    trained: tuple[XPressDraft, list[float]], spec: SimpleNamespace,
    verifier_dir: Path, tmp_path: Path,  # noqa: F811
) -> None:  # fmt: skip
    draft, losses = trained
    assert sum(losses[-5:]) / 5 < 0.85 * sum(losses[:5]) / 5, losses
    path, model = saved_and_loaded(PARITY, draft, verifier_dir, tmp_path)
    assert torch.equal(model.refiner_head.mix_l, draft.refiner_head.mix_l.bfloat16().float())
    back = load_draft(path, verifier_dir)
    assert type(back) is XPressDraft and back.cfg == draft.cfg


@pytest.mark.parametrize("which", ["trained", "perturbed"])
def test_greedy_lossless_with_jacobi_passes(
    which: str, trained: tuple[XPressDraft, list[float]], decoder: Decoder,  # noqa: F811
    verifier_dir: Path,  # noqa: F811
) -> None:  # fmt: skip
    draft = trained[0] if which == "trained" else _draft(verifier_dir).eval()
    assert family_of_draft(draft).name == "xpress"

    def check(rec: Any, s: Any) -> None:
        assert isinstance(rec.inner, XPressContext) and 1 <= rec.inner.passes <= 6

    assert_block_lossless(draft, decoder, which == "trained", BS - 1, check)


def test_cached_equals_uncached(
    trained: tuple[XPressDraft, list[float]],
    decoder: Decoder,  # noqa: F811
) -> None:
    draft = trained[0]
    for n, seed in ((5, 3), (21, 4)):
        prompt = _prompt(n, seed)
        a = decoder.speculative(prompt, draft, 30, cache_draft=True)
        b = decoder.speculative(prompt, draft, 30, cache_draft=False)
        assert a.tokens == b.tokens and a.accepted == b.accepted


@torch.no_grad()
def _sequential(draft: XPressDraft, states: torch.Tensor, seq: list[int]) -> list[int]:
    """The greedy chain slot by slot: slot k's refined argmax given the tokens chosen for
    slots 1..k-1, every later slot's previous token an arbitrary 0 (the refiner is causal)."""
    ref = draft.refiner_head
    hcache = ref.hidden_cache(states[None])
    base = states @ draft.lm_head_weight.t()  # [bs, Vd]
    chosen: list[int] = []
    for k in range(1, BS):
        prev = [seq[-2], seq[-1], *chosen] + [0] * (BS - 2 - len(chosen))
        row = base[k] + ref(torch.tensor([prev[:BS]]), hcache)[0, k]
        chosen.append(int(draft.to_verifier_ids(row.argmax())))
    return chosen


@pytest.mark.parametrize("vocab", ["full", "reduced"])
def test_jacobi_passes(vocab: str, verifier_dir: Path, decoder: Decoder) -> None:  # noqa: F811
    """0 passes is the backbone's own proposal (DFlash's), bs - 1 passes the sequential
    greedy chain, and the refiner changes picks."""
    ids = None
    if vocab == "reduced":
        ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[:200].sort().values
    draft = _draft(verifier_dir, ids).eval()
    changed = 0
    for seed in range(6):
        prompt = _prompt(9 + seed, 10 + seed)
        _, hid = decoder._forward(prompt, 0, decoder._new_cache(), TARGET_LAYERS)
        assert hid is not None
        seq = [*prompt, int(_prompt(1, 50 + seed)[0])]  # any anchor token
        states = UncachedDraft(draft)
        states.extend(hid)
        st = states.block_states(seq)  # [bs, H]
        got = {}
        for k in (0, 1, BS - 1, 6):
            ctx = XPressContext(draft, DraftCache(draft), passes=k)
            ctx.extend(hid)
            got[k], rows = ctx.propose(seq, lambda row: int(row.argmax()))
            assert rows.shape == (BS - 1, VOCAB) and ctx.passes <= k
        assert got[0] == head_logits(draft, st[1:]).argmax(-1).tolist()
        assert got[BS - 1] == got[6] == _sequential(draft, st, seq)
        changed += sum(a != b for a, b in zip(got[0], got[6]))
        if ids is not None:
            assert set(got[6]) <= set(ids.tolist())
    assert changed > 0  # the refiner's bias changes picks


# ---- (d) bad input -----------------------------------------------------------------------


def test_its_flags_are_refused_for_another_family_and_theirs_for_it() -> None:
    from test_families import _train_cfg

    with pytest.raises(
        ConfigError, match=r"--xpress-rank: xpress option.*--draft-family is dspark"
    ):
        _train_cfg("--draft-family", "dspark", "--xpress-rank", "8")
    with pytest.raises(ConfigError, match=r"--markov-rank: dspark option.*is xpress") as e:
        _train_cfg("--draft-family", "xpress", "--markov-rank", "8")
    assert "\n" not in str(e.value) and "--xpress-rank" in str(e.value)  # its own, named
    for flags, match in (
        (("--loss-type", "kl"), "--loss-type kl: XPress's loss is its own CE"),
        (("--per-position-loss-weight", "dpace"), "dpace: XPress's loss is its own CE"),
    ):
        with pytest.raises(ConfigError, match=match) as e:
            _train_cfg("--draft-family", "xpress", *flags)
        assert "\n" not in str(e.value)
    r = _train_cfg("--draft-family", "xpress", "--consistency-passes", "2").draft_recipe()
    got = [r[k] for k in ("consistency_passes", "gamma", "block_size", "num_layers")]
    assert got == [2, 4.0, 16, 5]
    got = [r[k] for k in ("xpress_ce_weight", "xpress_tv_weight", "base_anchor_weight")]
    assert got == [0.1, 0.9, 0.6]
    assert family("xpress").needs_last_hidden_states(r)


def test_a_checkpoint_of_it_resumed_as_another_family_is_refused(
    drafts: dict[str, tuple[XPressDraft, Path]],
    verifier_dir: Path,  # noqa: F811
) -> None:
    _, path = drafts["full"]
    other = family("dflash").build(
        verifier_dir, target_layer_ids=TARGET_LAYERS, block_size=BS, mask_token_id=MASK,
        num_layers=2,
    )  # fmt: skip
    with pytest.raises(CheckpointError, match=r"a xpress draft's checkpoint.*dflash") as e:
        load_checkpoint(path, other, None)
    assert "\n" not in str(e.value)


def test_missing_last_hidden_states_and_wrong_config(verifier_dir: Path) -> None:  # noqa: F811
    draft = _draft(verifier_dir)
    anchors, valid = block.anchor_rows(*ANCHORS)
    batch, _ = _rows(draft, verifier_dir, anchors, valid, seed=1)
    del batch["last_hidden_states"]
    with pytest.raises(ConfigError, match="--store-last-hidden-states"):
        draft.loss(batch, torch.Generator().manual_seed(0))
    other = family("dflash").build(
        verifier_dir, target_layer_ids=TARGET_LAYERS, block_size=BS, mask_token_id=MASK,
        num_layers=1,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="XPressDraft needs an XPressConfig"):
        XPressDraft(other.cfg, other.embed_weight, other.embed_weight, other.verifier_norm_weight)
    with pytest.raises(ConfigError, match="the xpress family drafts with XPressDraft"):
        family("xpress").context(other)
    with pytest.raises(ConfigError, match="both 0"):
        _draft(verifier_dir, xpress_ce_weight=0.0, xpress_tv_weight=0.0)
