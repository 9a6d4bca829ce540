"""The shared draft attention computes what the dense masked SDPA computes, for every mask.

.venv/bin/pytest tests/test_draft_attention.py -q   # ~10 s

For each family's mask kind (`PrefixMask.blocks`: DFlash, DFlash2, DSpark, XPress;
`causal`: MTP and EAGLE-3's training-time-test steps; `chains`: P-EAGLE) the mask it
stands for (`dense`) equals the mask the family built before it existed (anchors'
`block_attention_mask`, EAGLE-3's step mask, P-EAGLE's `chain_mask`), and the chunked
attention (`prefix_attention`) gives the dense SDPA's output and q/k/v gradients in
fp32, with GQA, several documents and padding, random anchors with duplicates and the
edge positions, and chunks small enough that every case spans many of them; and
every family's loss and gradients are those it gets under its dense mask. The chunk
plan is made once per mask however often it is used, bounds each group's context as
its dense mask does, and holds each key once a chunk (P-EAGLE's chains share theirs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fanout.model.draft_attention as draft_attention
from fanout.bench.assets import tiny_qwen3_verifier
from fanout.families.peagle.model import Samples, chain_mask, cod_sample
from fanout.families.registry import FAMILIES
from fanout.model.anchors import block_attention_mask
from fanout.model.draft_attention import (
    PrefixMask,
    attention,
    dense_reference,
    prefix_attention,
)
from fanout.rows import (
    DOCUMENT_IDS,
    HIDDEN_STATES,
    INPUT_IDS,
    LAST_HIDDEN_STATES,
    LOSS_MASK,
    POSITION_IDS,
    TARGET_IDS,
)

NH, NKV, HD = 4, 2, 8  # GQA


def _docs(b: int, t: int, g: torch.Generator) -> torch.Tensor:
    """[B, T] document ids: a few documents per row and some padding (-1)."""
    cuts = torch.randint(0, 4, (b, t), generator=g) == 0
    doc = cuts.long().cumsum(1) // 3  # runs of a few tokens each
    doc[torch.rand(b, t, generator=g) < 0.05] = -1
    return doc


def _compare(mask: PrefixMask, q_len: int, k_len: int, chunk: int, seed: int = 0) -> None:
    """prefix_attention vs the dense SDPA under `mask.dense`: outputs and gradients."""
    g = torch.Generator().manual_seed(seed)
    b = mask.limit.shape[0]
    q = torch.randn(b, NH, q_len, HD, generator=g)
    k = torch.randn(b, NKV, k_len, HD, generator=g)
    v = torch.randn(b, NKV, k_len, HD, generator=g)
    w = torch.randn(b, NH, q_len, HD, generator=g)  # a loss that weighs every output

    def run(fn):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = fn(*xs)
        (out * w).sum().backward()
        return out.detach(), [x.grad for x in xs]

    dense = mask.dense(k_len)
    ref, ref_g = run(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dense, enable_gqa=True)
    )
    out, out_g = run(lambda q, k, v: prefix_attention(q, k, v, mask, chunk))
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(out_g, ref_g):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 16, 40, 4096])
def test_blocks_match_the_dense_dflash_mask(chunk: int) -> None:
    g = torch.Generator().manual_seed(1)
    b, t, a, bs = 2, 96, 12, 4
    doc = _docs(b, t, g)
    anchors = torch.randint(0, t - bs, (b, a), generator=g)
    anchors[0, :4] = torch.tensor([0, 0, t - bs - 1, t - bs - 1])  # edges, duplicated
    anchors[1, :3] = 5  # three blocks at one anchor
    anchors = anchors.sort(1).values
    valid = torch.rand(b, a, generator=g) < 0.8
    valid[0, :4] = True
    m = PrefixMask.blocks(doc, anchors, valid, bs)
    assert torch.equal(m.dense(t + a * bs), block_attention_mask(doc, anchors, valid, bs))
    _compare(m, a * bs, t + a * bs, chunk)


def test_blocks_unsorted_anchors_and_one_document() -> None:
    """The plan sorts groups itself: unsorted anchors (padding at 0 among them) too."""
    g = torch.Generator().manual_seed(2)
    b, t, a, bs = 1, 200, 20, 8
    doc = torch.zeros(b, t, dtype=torch.long)
    anchors = torch.randint(0, t - bs, (b, a), generator=g)
    valid = torch.ones(b, a, dtype=torch.bool)
    valid[0, 3] = False
    m = PrefixMask.blocks(doc, anchors, valid, bs)
    assert torch.equal(m.dense(t + a * bs), block_attention_mask(doc, anchors, valid, bs))
    _compare(m, a * bs, t + a * bs, 24)


def _eagle3_step_mask(row_doc: torch.Tensor, steps: int) -> torch.Tensor:
    """EAGLE-3's step mask as it was built before the shared attention (and as
    speculators' diagonal mask): step 0 document-causal with the diagonal, then the
    diagonal once per later step."""
    r = row_doc.shape[1]
    eye = torch.eye(r, dtype=torch.bool)
    causal = torch.ones(r, r, dtype=torch.bool).tril()
    same = (row_doc[:, :, None] == row_doc[:, None, :]) & (row_doc[:, :, None] >= 0)
    mask0 = ((same & causal) | eye)[:, None]
    return torch.cat([mask0] + [eye.expand_as(mask0)] * (steps - 1), dim=-1)


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_causal_matches_mtp_and_eagle3_masks(steps: int) -> None:
    g = torch.Generator().manual_seed(3)
    b, r = 2, 70
    row_doc = _docs(b, r, g)
    m = PrefixMask.causal(row_doc, steps)
    assert torch.equal(m.dense(steps * r), _eagle3_step_mask(row_doc, steps))
    _compare(m, r, steps * r, 16)


@pytest.mark.parametrize("seed", [0, 1])
def test_chains_match_peagle_chain_mask(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    b, r, depths = 2, 60, 4
    row_doc = _docs(b, r, g)
    rows = []
    for i in range(b):
        sup = (torch.rand(r, generator=g) < 0.7) & (row_doc[i] >= 0)
        rows.append(cod_sample(sup, depths, 0.8, 0.2, 12 + 8 * i, g))
    s = Samples.stack(rows, "cpu")  # the second row has more positions: padding in the first
    assert not bool(s.valid.all())
    m = PrefixMask.chains(s.anchor, s.depth, s.valid, row_doc, depths)
    n = s.anchor.shape[1]
    assert torch.equal(m.dense(n), chain_mask(s, row_doc))
    _compare(m, n, n, 16, seed)


def test_bounds_are_the_first_and_last_allowed_context_key() -> None:
    """`bounds` (sorted keys, no [B, G, C] mask) = the first and last + 1 of each group's
    `context_ok` row, with documents scattered over the keys (not runs), any ids,
    limits past the keys, groups of a document no key has, and groups that see none."""
    g = torch.Generator().manual_seed(5)
    b, c, n_groups = 3, 50, 40
    key_doc = torch.tensor([-7, 0, 3, 1_000_000])[torch.randint(0, 4, (b, c), generator=g)]
    doc = torch.tensor([-7, 0, 3, 1_000_000, 5])[torch.randint(0, 5, (b, n_groups), generator=g)]
    limit = torch.randint(0, c + 5, (b, n_groups), generator=g)
    sees = torch.rand(b, n_groups, generator=g) < 0.8
    own = torch.zeros(b, n_groups, 1, dtype=torch.long)
    m = PrefixMask(limit, doc, key_doc, sees, own, None, 1)
    ok = m.context_ok()  # [B, G, C]
    t = torch.arange(c)
    want_lo = torch.where(ok, t, c).amin(2)
    want_hi = torch.where(ok, t + 1, 0).amax(2)
    lo, hi = m.bounds()
    assert ok.any(2).any() and not ok.any(2).all()
    assert torch.equal(lo, want_lo) and torch.equal(hi, want_hi)


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, ...]]:
    """The arguments of every chunk plan made while the test runs, in order."""
    made: list[tuple[object, ...]] = []
    make = draft_attention._make_plan

    def counted(*args: object) -> object:
        made.append(args)
        return make(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(draft_attention, "_make_plan", counted)
    return made


def test_the_plan_is_made_once_per_mask(made: list[tuple[object, ...]]) -> None:
    """Every layer's attention of a forward, and the backward, use the mask's one plan
    (and its one set of SDPA masks); a new mask makes its own."""
    g = torch.Generator().manual_seed(6)
    row_doc = _docs(1, 40, g)
    m = PrefixMask.causal(row_doc, steps=2)
    q = torch.randn(1, NH, 40, HD, generator=g, requires_grad=True)
    k, v = torch.randn(2, 1, NKV, 80, HD, generator=g)
    outs = [attention(q, k, v, m, chunk=16) for _ in range(3)]  # three layers
    torch.stack(outs).sum().backward()
    assert len(made) == 1
    p = m.plan(16, 80)
    assert p.sdpa_masks(NH // NKV, q.dtype) is p.sdpa_masks(NH // NKV, q.dtype)
    attention(q, k, v, PrefixMask.causal(row_doc, steps=2), chunk=16)
    assert len(made) == 2


@pytest.mark.parametrize("chunk", [16, 256])
def test_a_chunk_holds_each_key_once(chunk: int) -> None:
    """The plan's keys are distinct in every chunk: P-EAGLE's depths of a chain see the
    same own keys (taken once, not once a position), a causal row's step-0 own key is
    a context key of its chunk (one column, not two); each later step adds one key a
    row. The chunks still give the dense answer."""
    g = torch.Generator().manual_seed(7)
    r, depths = 120, 6
    row_doc = _docs(1, r, g)
    sup = (torch.rand(r, generator=g) < 0.9) & (row_doc[0] >= 0)
    s = Samples.stack([cod_sample(sup, depths, 0.9, 0.5, 40, g)], "cpu")
    n = s.anchor.shape[1]
    m = PrefixMask.chains(s.anchor, s.depth, s.valid, row_doc, depths)
    p = m.plan(chunk, n)
    for keys in p.k_index.split(p.k_sizes):
        assert keys.unique().numel() == keys.numel()
    causal = PrefixMask.causal(row_doc, steps=3)
    pc = causal.plan(chunk, 3 * r)
    for keys, rows in zip(pc.k_index.split(pc.k_sizes), pc.q_sizes):
        ctx = int((keys < r).sum())
        assert keys.numel() == ctx + 2 * rows  # steps 1 and 2: one key a row each
        assert keys.unique().numel() == keys.numel()
    _compare(m, n, n, chunk)


def test_attention_dispatch_and_dense_reference() -> None:
    """`attention` takes a PrefixMask, a dense mask or None; `dense_reference` runs the
    PrefixMask as its dense mask (the same numbers), and a wrong mask is caught."""
    g = torch.Generator().manual_seed(4)
    row_doc = torch.zeros(1, 30, dtype=torch.long)
    m = PrefixMask.causal(row_doc)
    q = torch.randn(1, NH, 30, HD, generator=g)
    k, v = torch.randn(2, 1, NKV, 30, HD, generator=g)
    sparse = attention(q, k, v, m)
    with dense_reference():
        dense = attention(q, k, v, m)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attention(q, k, v, m.dense(30)), dense, rtol=1e-5, atol=1e-5)
    full = attention(q, k, v, None)  # every key: not the causal answer
    assert not torch.allclose(full, dense, atol=1e-3)


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3_verifier(tmp_path_factory.mktemp("v"), 96, hidden_size=32, num_layers=6,
                               num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48)  # fmt: skip


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_trains_the_same_as_under_the_dense_mask(
    name: str, verifier_dir: Path
) -> None:
    """Each family's loss and every parameter's gradient, block-sparse vs dense, on rows
    of three documents and a padding tail (the draft's own masks, anchors, chains)."""
    h, t = 32, 64
    layers = [5] if name == "mtp" else [1, 2, 3]
    torch.manual_seed(0)
    depth = 1 if name == "mtp" else 2  # MTP: one layer
    draft = FAMILIES[name].build(verifier_dir, target_layer_ids=layers, num_layers=depth,
                                 block_size=FAMILIES[name].block_size_for(4), max_anchors=12,
                                 loss_type="ce")  # fmt: skip
    g = torch.Generator().manual_seed(1)
    doc = torch.tensor([0] * 20 + [1] * 25 + [2] * 15 + [-1] * 4)[None].repeat(2, 1)  # [2, T]
    starts = {0: 0, 1: 20, 2: 45, -1: 60}
    pos = torch.arange(t) - torch.tensor([starts[int(d)] for d in doc[0]])
    batch = {
        HIDDEN_STATES: torch.randn(2, t, len(layers) * h, generator=g),
        INPUT_IDS: torch.randint(0, 95, (2, t), generator=g),
        TARGET_IDS: torch.randint(0, 95, (2, t), generator=g),
        LOSS_MASK: (doc >= 0).long(),
        DOCUMENT_IDS: doc,
        POSITION_IDS: pos[None].repeat(2, 1),
        LAST_HIDDEN_STATES: torch.randn(2, t, h, generator=g),
    }

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        draft.zero_grad(set_to_none=True)
        loss = draft.loss(batch, torch.Generator().manual_seed(0)).loss
        loss.backward()
        grads = {k: p.grad.clone() for k, p in draft.named_parameters() if p.grad is not None}
        return loss.detach(), grads

    loss, grads = step()
    with dense_reference():
        ref_loss, ref_grads = step()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and grads
    for k, want in ref_grads.items():
        torch.testing.assert_close(grads[k], want, rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("chunk", [16, 256])
def test_a_causal_mask_of_more_steps_serves_the_first_ones(chunk: int) -> None:
    """A `causal` mask of S steps used with the keys of s < S steps is the s-step mask:
    the same dense mask, the same plan (cut from the S-step one: `first_keys`, no new
    plan) and the dense answer."""
    g = torch.Generator().manual_seed(8)
    b, r, steps = 2, 70, 4
    row_doc = _docs(b, r, g)
    m = PrefixMask.causal(row_doc, steps)
    for s in range(1, steps + 1):
        own = PrefixMask.causal(row_doc, s)
        assert torch.equal(m.dense(s * r), own.dense(s * r))
        cut, fresh = m.plan(chunk, s * r), own.plan(chunk, s * r)
        assert torch.equal(cut.q_index, fresh.q_index) and torch.equal(cut.k_index, fresh.k_index)
        assert (cut.q_sizes, cut.k_sizes) == (fresh.q_sizes, fresh.k_sizes)
        for got, want in zip(cut.masks, fresh.masks):
            assert torch.equal(got, want)
        for got, want in zip(cut.sdpa_masks(2, torch.float32), fresh.sdpa_masks(2, torch.float32)):
            assert torch.equal(got, want)
        _compare(m, r, s * r, chunk, seed=s)
    with pytest.raises(ValueError, match="context keys"):
        m.plan(chunk, r - 1)


def test_eagle3_makes_one_plan_a_batch_for_all_its_steps(
    verifier_dir: Path, made: list[tuple[object, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """EAGLE-3's TTT steps share one mask and one chunk plan a batch (its unroll's,
    `ChainDraft.start(.., steps)`), not one a step, and train exactly as when each step
    made its own (issue #56: ≈ 0.15-0.3 s a step on CPU at T 3072)."""
    from fanout.model.chain_draft import ChainDraft

    torch.manual_seed(0)
    draft = FAMILIES["eagle3"].build(verifier_dir, target_layer_ids=[1, 2, 3], num_layers=2,
                                     block_size=4, loss_type="ce")  # fmt: skip
    steps = draft.cfg.ttt_steps  # type: ignore[attr-defined]  # an Eagle3Config
    assert steps >= 3
    g = torch.Generator().manual_seed(1)
    t, h = 50, 32
    doc = torch.tensor([0] * 30 + [1] * 20)[None]
    batch = {
        HIDDEN_STATES: torch.randn(1, t, 3 * h, generator=g),
        INPUT_IDS: torch.randint(0, 95, (1, t), generator=g),
        TARGET_IDS: torch.randint(0, 95, (1, t), generator=g),
        LOSS_MASK: torch.ones(1, t, dtype=torch.long),
        DOCUMENT_IDS: doc,
        POSITION_IDS: torch.arange(t)[None],
        LAST_HIDDEN_STATES: torch.randn(1, t, h, generator=g),
    }

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        draft.zero_grad(set_to_none=True)
        loss = draft.loss(batch, None).loss
        loss.backward()
        return loss.detach(), {k: p.grad.clone() for k, p in draft.named_parameters()
                               if p.grad is not None}  # fmt: skip

    loss, grads = step()
    assert len(made) == 1  # every step, every layer, forward and backward
    start = ChainDraft.start
    monkeypatch.setattr(
        ChainDraft, "start", lambda self, hs, pos, doc, steps=1: start(self, hs, pos, doc)
    )
    made.clear()
    ref_loss, ref_grads = step()  # a mask and a plan a step, as before
    assert len(made) == steps
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    assert grads.keys() == ref_grads.keys() and grads
    for k, want in ref_grads.items():
        torch.testing.assert_close(grads[k], want, rtol=1e-5, atol=1e-7, msg=k)
