"""DFlash draft: anchors, the attention mask (by perturbation), loss/metrics, learning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fanout.bench.assets import tiny_qwen3_verifier
from fanout.errors import ConfigError
from fanout.families.dflash.model import DFlashDraft
from fanout.model.anchors import select_anchors, slot_supervision
from fanout.model.draft_config import DraftConfig, default_gamma
from fanout.ops.adamw import make_optimizer
from tiny_run import tiny_dflash

N_CTX = 2  # captured layers


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3_verifier(
        tmp_path_factory.mktemp("verifier"), 512, num_layers=4, intermediate_size=128
    )


@pytest.fixture(scope="module")
def tied_verifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A verifier whose lm_head is its embedding: hidden states that carry token
    embeddings then map straight onto the head, so a 1-layer draft learns in 50 steps."""
    return tiny_qwen3_verifier(
        tmp_path_factory.mktemp("tied"),
        512,
        num_layers=4,
        intermediate_size=128,
        tie_word_embeddings=True,
    )


def _draft(verifier_dir: Path, **kw: Any) -> DFlashDraft:
    return tiny_dflash(verifier_dir, **({"mask_token_id": 511} | kw))  # the 512-token verifier


def _batch(b: int = 1, t: int = 48, seed: int = 0, docs: tuple[int, ...] = (24,)) -> dict:
    g = torch.Generator().manual_seed(seed)
    doc = torch.zeros(t, dtype=torch.int32)
    pos = torch.arange(t, dtype=torch.int32)
    for cut in docs:  # document boundaries; positions restart per document
        doc[cut:] += 1
        pos[cut:] = torch.arange(t - cut, dtype=torch.int32)
    ids = torch.randint(0, 500, (b, t), generator=g)
    return {
        "hidden_states": torch.randn(b, t, N_CTX * 64, generator=g),
        "input_ids": ids.int(),
        "target_ids": torch.roll(ids, -1, dims=1).int(),
        "loss_mask": torch.ones(b, t, dtype=torch.uint8),
        "document_ids": doc.expand(b, t).clone(),
        "position_ids": pos.expand(b, t).clone(),
    }


def test_from_verifier_reads_shapes_and_frozen_tensors(verifier_dir: Path) -> None:
    d = _draft(verifier_dir)
    assert d.cfg.hidden_size == 64 and d.cfg.head_dim == 16 and d.cfg.rope_theta == 10000.0
    from safetensors.torch import load_file

    ref = load_file(str(verifier_dir / "model.safetensors"))
    assert torch.equal(d.embed_weight, ref["model.embed_tokens.weight"])
    assert torch.equal(d.lm_head_weight, ref["lm_head.weight"])
    names = {n for n, p in d.named_parameters() if p.requires_grad}
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in d.state_dict())


def test_config_validation_names_field() -> None:
    with pytest.raises(ValueError, match="num_key_value_heads"):
        DraftConfig(
            hidden_size=64,
            intermediate_size=8,
            num_attention_heads=4,
            num_key_value_heads=3,
            head_dim=16,
            vocab_size=10,
            mask_token_id=1,
            target_layer_ids=[1],
        )
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7, 5, 4)


def test_anchors_respect_mask_documents_and_tail() -> None:
    g = torch.Generator().manual_seed(3)
    b, t, bs = 4, 80, 6
    lm = (torch.rand(b, t, generator=g) < 0.6).to(torch.uint8)
    doc = torch.cumsum(torch.rand(b, t, generator=g) < 0.05, dim=1)
    anchors, valid = select_anchors(lm, doc, 10, bs, g)
    assert valid.any()
    for r in range(b):
        a = anchors[r][valid[r]]
        assert torch.all(a[1:] > a[:-1])  # sorted, distinct
        assert torch.all(a < t - bs)  # never in the last block_size positions
        assert torch.all(lm[r, a] == 1) and torch.all(lm[r, a + 1] == 1)
        assert torch.all(doc[r, a + 1] == doc[r, a])
    sup = slot_supervision(lm, doc, anchors, valid, bs)
    assert not sup[:, :, 0].any()
    assert torch.equal(sup[:, :, 1], valid)  # slot 1 always supervised for a real anchor


def test_anchor_draw_is_seeded_and_capped() -> None:
    lm, doc = torch.ones(2, 100), torch.zeros(2, 100)
    a1, v1 = select_anchors(lm, doc, 7, 4, torch.Generator().manual_seed(5))
    a2, _ = select_anchors(lm, doc, 7, 4, torch.Generator().manual_seed(5))
    a3, _ = select_anchors(lm, doc, 7, 4, torch.Generator().manual_seed(6))
    assert torch.equal(a1, a2) and not torch.equal(a1, a3) and v1.sum() == 14


def _blocks(d: DFlashDraft, batch: dict, anchors: list[int]) -> torch.Tensor:
    a = torch.tensor([anchors])
    with torch.no_grad():
        return d.block_hidden(batch, a, torch.ones_like(a, dtype=torch.bool))[0]  # [A, bs, H]


def _changed(x: torch.Tensor, y: torch.Tensor) -> list[bool]:
    return [not torch.allclose(x[j], y[j], atol=1e-6) for j in range(x.shape[0])]


def test_mask_context_after_anchor_is_invisible(verifier_dir: Path) -> None:
    d, batch = _draft(verifier_dir, num_layers=2), _batch()
    base = _blocks(d, batch, [5, 10, 30])
    batch["hidden_states"][:, 10:] += 3.0  # context at and after anchor 10
    # blocks 5 and 10 see only t < anchor; block 30 sees doc-1 positions 24..29
    assert _changed(base, _blocks(d, batch, [5, 10, 30])) == [False, False, True]


def test_mask_other_blocks_tokens_are_invisible(verifier_dir: Path) -> None:
    d, batch = _draft(verifier_dir, num_layers=2), _batch()
    base = _blocks(d, batch, [5, 10, 30])
    batch["input_ids"][0, 10] = 7  # the anchor token of block 10 only
    assert _changed(base, _blocks(d, batch, [5, 10, 30])) == [False, True, False]


def test_mask_other_documents_are_invisible(verifier_dir: Path) -> None:
    d, batch = _draft(verifier_dir, num_layers=2), _batch()
    base = _blocks(d, batch, [5, 10, 30])
    b2 = {k: v.clone() for k, v in batch.items()}
    b2["hidden_states"][:, :10] += 3.0  # doc 0, before anchor 10: allowed for block 10
    assert _changed(base, _blocks(d, b2, [5, 10, 30])) == [True, True, False]
    b3 = {k: v.clone() for k, v in batch.items()}
    b3["hidden_states"][:, 24:30] += 3.0  # doc 1 before anchor 30
    assert _changed(base, _blocks(d, b3, [5, 10, 30])) == [False, False, True]


def test_block_uses_document_positions(verifier_dir: Path) -> None:
    d, batch = _draft(verifier_dir), _batch()
    base = _blocks(d, batch, [30])
    batch["position_ids"][:, 24:] += 5  # shift RoPE of doc 1 uniformly: relative positions same
    torch.testing.assert_close(_blocks(d, batch, [30]), base, atol=1e-4, rtol=1e-4)


def _learn_batch(seed: int, embed: torch.Tensor | None = None) -> dict:
    """Tokens follow a fixed permutation of 40 ids (the anchor token decides the block);
    with `embed`, hidden_states[t] carries the embeddings of tokens t+1 and t+2."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(99)) + 100
    b, t = 4, 48
    ids = torch.empty(b, t, dtype=torch.long)
    ids[:, 0] = torch.randint(100, 140, (b,), generator=g)
    for i in range(1, t):
        ids[:, i] = perm[ids[:, i - 1] - 100]
    batch = _batch(b=b, t=t, seed=seed, docs=())
    batch["input_ids"] = ids.int()
    batch["target_ids"] = torch.roll(ids, -1, dims=1).int()  # a perfect verifier
    if embed is not None:
        nxt = [embed[torch.roll(ids, -s, dims=1)] for s in (1, 2)]
        batch["hidden_states"] = torch.cat(nxt, dim=-1) * 50  # [B, T, 2·H]
    return batch


@pytest.mark.parametrize("weighting", ["exp", "dpace"])
def test_loss_decreases_and_eal_rises(tied_verifier_dir: Path, weighting: str) -> None:
    d = _draft(tied_verifier_dir, loss_weighting=weighting)
    e = d.embed_weight
    opt, _ = make_optimizer(d.parameters(), lr=1e-2, max_grad_norm=1.0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        first = d.loss(_learn_batch(0, e), gen)
    assert first.eal.item() == pytest.approx(1.0, abs=0.2)
    for step in range(50):
        out = d.loss(_learn_batch(step, e), gen)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    with torch.no_grad():
        last = d.loss(_learn_batch(1000, e), gen)
    assert last.loss.item() < 0.85 * first.loss.item()
    assert last.eal.item() > 2.0
    assert last.per_slot_acc.shape == (3,) and last.per_slot_acc[0] > 0.5


def _loss_and_block_logits(d: DFlashDraft, batch: dict, seed: int) -> tuple:
    """`d.loss` under anchor seed `seed`, plus the same anchors and every block slot's
    full logits `[B, A, bs, V]` for a slow per-block recomputation."""
    out = d.loss(batch, torch.Generator().manual_seed(seed))
    anchors, valid = select_anchors(
        batch["loss_mask"], batch["document_ids"], 8, 4, torch.Generator().manual_seed(seed)
    )
    with torch.no_grad():
        logits = d.block_hidden(batch, anchors, valid) @ d.lm_head_weight.T
    return out, anchors, valid, logits


def test_metrics_match_slow_reference(verifier_dir: Path) -> None:
    """EAL and per-slot accuracy recomputed by a per-block loop over full logits."""
    d = _draft(verifier_dir, label_source="input_ids")
    batch = _learn_batch(3)
    batch["loss_mask"][:, 20:26] = 0
    out, anchors, valid, logits = _loss_and_block_logits(d, batch, 4)
    ids, lm = batch["input_ids"].long(), batch["loss_mask"]
    hits, cnt, eal, ce_sum, n = [0] * 3, [0] * 3, [], 0.0, 0
    for r in range(anchors.shape[0]):
        for j in range(anchors.shape[1]):
            if not valid[r, j]:
                continue
            a, run, alive = int(anchors[r, j]), 0, True
            for k in range(1, 4):
                sup = bool(lm[r, a + k])
                ok = sup and int(logits[r, j, k].argmax()) == int(ids[r, a + k])
                if sup:
                    cnt[k - 1] += 1
                    hits[k - 1] += ok
                    ce = torch.nn.functional.cross_entropy(logits[r, j, k], ids[r, a + k])
                    ce_sum += float(ce) * float(torch.exp(torch.tensor(-(k - 1) / 2.0)))
                    n += 1
                alive = alive and ok
                run += alive
            eal.append(1 + run)
    assert out.per_slot_count.tolist() == cnt
    torch.testing.assert_close(out.per_slot_acc, torch.tensor(hits) / torch.tensor(cnt))
    assert out.eal.item() == pytest.approx(sum(eal) / len(eal))
    assert out.loss.item() == pytest.approx(ce_sum / n, rel=1e-4)


def test_draft_vocab_maps_labels(verifier_dir: Path) -> None:
    ids = torch.arange(100, 200)
    d = _draft(verifier_dir, draft_vocab_size=100, draft_vocab_ids=ids)
    assert d.lm_head_weight.shape == (100, 64)
    assert d.d2t is not None and torch.equal(d.d2t + torch.arange(100), ids)
    out = d.loss(_learn_batch(0), torch.Generator().manual_seed(0))
    assert out.n_tokens > 0 and torch.isfinite(out.loss)
    with pytest.raises(ConfigError, match="draft_vocab_ids"):
        _draft(verifier_dir, draft_vocab_size=100)


def test_batch_shape_mismatch_is_named(verifier_dir: Path) -> None:
    d = _draft(verifier_dir)
    batch = _batch()
    batch["hidden_states"] = batch["hidden_states"][:, :, :64]
    with pytest.raises(ConfigError, match="hidden_states"):
        d.loss(batch, torch.Generator())


def test_kl_loss_matches_slow_reference(verifier_dir: Path) -> None:
    """loss_type='kl': each supervised slot's KL from the verifier's distribution at the
    position before it (last_hidden_states[p-1] through the same head), weighted and
    averaged like the CE; recomputed here per block with full logits."""
    d = _draft(verifier_dir, loss_type="kl")
    batch = _learn_batch(5)
    g = torch.Generator().manual_seed(8)
    batch["last_hidden_states"] = torch.randn(4, 48, 64, generator=g) * 3
    batch["loss_mask"][:, 30:33] = 0
    out, anchors, valid, logits = _loss_and_block_logits(d, batch, 6)
    w_head, last, lm = d.lm_head_weight, batch["last_hidden_states"], batch["loss_mask"]
    total, n = 0.0, 0
    for r in range(anchors.shape[0]):
        for j in range(anchors.shape[1]):
            if not valid[r, j]:
                continue
            a = int(anchors[r, j])
            for k in range(1, 4):
                if not lm[r, a + k]:
                    continue
                log_pt = torch.log_softmax(last[r, a + k - 1] @ w_head.T, -1)
                log_pd = torch.log_softmax(logits[r, j, k], -1)
                kl = float((log_pt.exp() * (log_pt - log_pd)).sum())
                total += kl * float(torch.exp(torch.tensor(-(k - 1) / 2.0)))
                n += 1
    assert n > 0 and out.loss.item() == pytest.approx(total / n, rel=1e-4)
    out.loss.backward()  # reaches the trainable layers
    assert d.fc.weight.grad is not None and d.fc.weight.grad.abs().sum() > 0


def test_kl_loss_decreases(tied_verifier_dir: Path) -> None:
    d = _draft(tied_verifier_dir, loss_type="kl")
    e = d.embed_weight
    opt, _ = make_optimizer(d.parameters(), lr=1e-2, max_grad_norm=1.0)
    gen = torch.Generator().manual_seed(0)

    def batch(seed: int) -> dict:
        b = _learn_batch(seed, e)
        # a confident verifier: its state before token p points at token p
        b["last_hidden_states"] = e[b["target_ids"].long()] * 20  # [B, T, H]
        return b

    with torch.no_grad():
        first = d.loss(batch(0), gen)
    for step in range(40):
        out = d.loss(batch(step), gen)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    with torch.no_grad():
        last = d.loss(batch(1000), gen)
    assert last.loss.item() < 0.7 * first.loss.item()
    assert last.eal.item() > first.eal.item()


def test_kl_needs_last_hidden_states_and_excludes_dpace(verifier_dir: Path) -> None:
    d = _draft(verifier_dir, loss_type="kl")
    with pytest.raises(ConfigError, match="--store-last-hidden-states"):
        d.loss(_batch(), torch.Generator())
    with pytest.raises(ConfigError, match="dpace"):
        _draft(verifier_dir, loss_type="kl", loss_weighting="dpace")


def test_one_layer_rule_for_producer_and_trainer(tmp_path: Path) -> None:
    """The producer's default capture layers and a draft built without explicit layers
    come from the same function (they once disagreed: [18] vs [1] for 36 layers, 1 draft
    layer)."""
    from fanout.bench.assets import tiny_qwen3_verifier
    from fanout.model.capture_layers import resolve_capture_layer_ids
    from fanout.model.draft_config import default_target_layer_ids

    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    vdir = tiny_qwen3_verifier(tmp_path, 64, hidden_size=16, num_layers=8, head_dim=8)
    for n in (1, 2, 3):
        d = DFlashDraft.from_verifier(vdir, num_layers=n)
        assert d.cfg.target_layer_ids == resolve_capture_layer_ids(8, None, n)
