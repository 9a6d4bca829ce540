"""Work the train step shares instead of redoing (issue #56) gives what redoing it gave.

    .venv/bin/python -m pytest tests/test_shared_head_work.py -q

- XPress's loss on shared head logits (`fanout.ops.two_head_ce.TwoHeadTerms`) against
  the path it replaced, one `two_head_ce_tv_and_argmax` call a term with autograd
  summing them (`_one_call_a_term`, XPressDraft's loss body before #56), which computed
  the head's and the teacher's `[N·bs, V]` logits again for each of its five terms
  (teacher-forced, backbone, three Jacobi rounds) and x's gradient once a term. The
  consistency rounds and the base anchor on (speculators' parity test,
  tests/test_family_xpress.py, runs with the rounds off), both base-anchor weightings,
  one chunk of blocks and several (chunks of 1 and of 3 blocks: the rounds run chunk
  by chunk): the loss, every metric and every parameter's gradient.
- EAGLE-3's CE labels (the verifier's argmax) made once a batch for every TTT step
  against once a step (`teacher_head` making them itself), and P-EAGLE's once per
  distinct predicted position against once a sample.
fp32 on CPU, one thread; tolerances of fp32 summation order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fanout.bench.assets import tiny_qwen3_verifier
from fanout.families.registry import family
from fanout.families.xpress import model as xpress_model
from fanout.families.xpress.model import XPressDraft
from fanout.model.draft import LossOutput
from fanout.model.slot_loss import acceptance, exp_decay
from fanout.model.verifier_dir import read_verifier_tensors
from fanout.ops.two_head_ce import TwoHeadOut, two_head_ce_tv_and_argmax
from tiny_run import one_thread  # noqa: F401 (autouse: one intra-op thread)

VOCAB, H, T, BS = 128, 32, 48, 4
VALUE_TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOL: dict[str, Any] = {"rtol": 1e-4, "atol": 1e-6}


@pytest.fixture(scope="module")
def vdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shared-head") / "verifier"
    return tiny_qwen3_verifier(out, VOCAB, hidden_size=H, num_layers=4, num_heads=2,
                               num_kv_heads=1, head_dim=16, intermediate_size=64)  # fmt: skip


def _draft(vdir: Path, **kw: Any) -> XPressDraft:
    torch.manual_seed(0)
    d = family("xpress").build(vdir, target_layer_ids=[1, 3], block_size=BS, max_anchors=9,
                               num_layers=1, xpress_rank=8, consistency_weight=0.3,
                               consistency_passes=3, **kw)  # fmt: skip
    assert isinstance(d, XPressDraft)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the refiner (its mixer zero at init) far enough to matter
        for name, p in d.named_parameters():
            if "refiner" in name:
                p.add_((1.0 if "token_embed" in name else 0.3) * torch.randn(p.shape, generator=g))
    return d


def _batch(vdir: Path) -> dict[str, torch.Tensor]:
    vt = read_verifier_tensors(vdir, ["lm_head.weight"])
    g = torch.Generator().manual_seed(2)
    last = 2.0 * torch.randn(1, T, H, generator=g)
    doc = torch.zeros(1, T, dtype=torch.long)
    doc[:, 30:] = 1  # two documents: blocks across the boundary lose slots
    mask = torch.ones(1, T, dtype=torch.long)
    mask[:, 5:9] = 0  # a hole in the supervision
    return {
        "hidden_states": torch.randn(1, T, 2 * H, generator=g),
        "input_ids": torch.randint(0, VOCAB - 1, (1, T), generator=g),
        "target_ids": (last @ vt["lm_head.weight"].t()).argmax(-1),
        "loss_mask": mask,
        "document_ids": doc,
        "position_ids": torch.arange(T)[None],
        "last_hidden_states": last,
    }


def _one_call_a_term(self: XPressDraft, batch: dict[str, torch.Tensor],
                     generator: torch.Generator | None) -> LossOutput:  # fmt: skip
    """XPressDraft.loss as it was before TwoHeadTerms (one op call a term)."""
    cfg, bs = self.cfg, self.cfg.block_size
    b = self.blocks(batch, generator)
    v = b.valid
    sup, label = b.sup[v], b.label[v]
    hid = b.hid[v]
    n_blk, h = hid.shape[0], hid.shape[-1]
    tok, before = (t[v] for t in self.block_tokens(batch, b.anchors))
    rows = hid.reshape(-1, h)
    teacher = self.verifier_rows(batch, b.anchors)[v].reshape(-1, h)
    target = torch.where(sup, label, -100).reshape(-1)
    slot = torch.arange(bs, device=sup.device).expand_as(sup)
    decay = exp_decay(slot, cfg.resolved_gamma, first=self.first_drafted_slot)
    decayed = (decay * sup).reshape(-1)
    n_tok = int(sup.sum())
    denom = max(n_tok, 1)
    head = self.lm_head_weight
    ref = self.refiner_head
    readout = ref.readout.weight.to(head.dtype)
    hcache = ref.hidden_cache(hid)
    ce_w, tv_w = cfg.xpress_ce_weight, cfg.xpress_tv_weight

    def refined(prev: torch.Tensor) -> TwoHeadOut:
        e = ref.features(prev, hcache).reshape(n_blk * bs, -1).to(rows.dtype)
        return two_head_ce_tv_and_argmax(rows, e, head, readout, target, teacher,
                                         ce_weight=ce_w, tv_weight=tv_w, row_weight=decayed)  # fmt: skip

    tf = refined(torch.cat([before[:, None], tok[:, :-1]], dim=1))
    loss = tf.loss / denom
    extra = {"tf_loss": float(tf.loss.detach()) / denom}
    rounds = cfg.consistency_passes if cfg.consistency_weight > 0 else 0
    base = None
    if cfg.base_anchor_weight > 0 or rounds:
        with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.base_anchor_weight > 0):
            w = sup.reshape(-1).float() if cfg.base_anchor_full_weight else decayed
            base = two_head_ce_tv_and_argmax(rows, None, head, None, target, teacher,
                                             ce_weight=ce_w, tv_weight=tv_w, row_weight=w)  # fmt: skip
        if cfg.base_anchor_weight > 0:
            loss = loss + cfg.base_anchor_weight * base.loss / denom
            extra["base_anchor_loss"] = float(base.loss.detach()) / denom
    last = None
    if rounds:
        assert base is not None
        pred = self.to_verifier_ids(base.pred).view(n_blk, bs)
        terms = []
        for _ in range(rounds):
            last = refined(self.jacobi_prev(pred, tok[:, 0], before))
            terms.append(last.loss / denom)
            pred = self.to_verifier_ids(last.pred).view(n_blk, bs)
        consistency = torch.stack(terms).mean()
        loss = loss + cfg.consistency_weight * consistency
        extra["consistency_loss"] = float(consistency.detach())
    has = b.has[v]

    def greedy(out: TwoHeadOut) -> Any:
        return acceptance((out.pred.view(n_blk, bs) == label)[:, 1:], sup[:, 1:], has)

    def accept(out: TwoHeadOut) -> float:
        assert out.accept is not None
        return float(out.accept[sup.reshape(-1)].mean()) if n_tok else 0.0

    acc, cnt, eal = greedy(tf)
    extra["accept_rate"] = accept(tf)
    if base is not None:
        extra["base_eal"] = float(greedy(base)[2])
        extra["base_accept_rate"] = accept(base)
    if last is not None:
        extra["jacobi_eal"] = float(greedy(last)[2])
    return LossOutput(loss, acc, cnt, eal, n_tok, int(v.sum()), extra)


def _run(
    draft: torch.nn.Module, batch: dict[str, torch.Tensor], fn: Any
) -> tuple[LossOutput, dict[str, torch.Tensor]]:
    draft.zero_grad(set_to_none=True)
    out = fn(draft, batch, torch.Generator().manual_seed(3))
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("full_weight", [False, True], ids=["decayed_base", "full_base"])
@pytest.mark.parametrize(
    "chunk_blocks", [None, 1, 3], ids=["one_chunk", "chunks_of_1", "chunks_of_3"]
)
def test_loss_and_grads_equal_one_op_call_a_term(
    vdir: Path, monkeypatch: pytest.MonkeyPatch, full_weight: bool, chunk_blocks: int | None
) -> None:
    draft = _draft(vdir, base_anchor_full_weight=full_weight)
    batch = _batch(vdir)
    want, want_g = _run(draft, batch, _one_call_a_term)
    if chunk_blocks is not None:
        monkeypatch.setattr(xpress_model, "chunk_rows_for_terms", lambda n, v: chunk_blocks * BS)
    got, got_g = _run(draft, batch, XPressDraft.loss)
    torch.testing.assert_close(got.loss.detach(), want.loss.detach(), **VALUE_TOL)
    assert got.extra.keys() == want.extra.keys()
    for k, x in want.extra.items():
        assert got.extra[k] == pytest.approx(x, rel=1e-5, abs=1e-6), k
    assert torch.equal(got.per_slot_acc, want.per_slot_acc) and float(got.eal) == float(want.eal)
    assert (got.n_tokens, got.n_blocks) == (want.n_tokens, want.n_blocks)
    assert got_g.keys() == want_g.keys() and any(k.startswith("refiner_head.") for k in got_g)
    for k, g in want_g.items():
        torch.testing.assert_close(got_g[k], g, **GRAD_TOL, msg=k)
    assert (
        want.extra["consistency_loss"] > 0 and float(want_g["refiner_head.mix_l"].abs().max()) > 0
    )


def _labels_once(
    module: Any, draft: Any, batch: dict[str, torch.Tensor], mp: pytest.MonkeyPatch
) -> tuple[list[int], LossOutput, dict[str, torch.Tensor]]:
    """Run the draft's loss with the family `module`'s shared labels (the rows each
    `teacher_argmax` call labelled), then with `teacher_head` labelling on its own; assert
    both give the same loss, metrics and gradients. Returns (rows per call, the output
    and gradients of the shared-label run)."""
    made: list[int] = []
    argmax, head = module.teacher_argmax, module.teacher_head

    def counted(*args: Any, **kw: Any) -> torch.Tensor:
        made.append(args[0].shape[0])
        return argmax(*args, **kw)

    mp.setattr(module, "teacher_argmax", counted)
    got, got_g = _run(draft, batch, type(draft).loss)
    shared = list(made)  # the calls of the shared-label run alone
    mp.setattr(module, "teacher_head", lambda *a, label=None, **kw: head(*a, **kw))
    want, want_g = _run(draft, batch, type(draft).loss)  # teacher_head's own labels
    torch.testing.assert_close(got.loss.detach(), want.loss.detach(), **VALUE_TOL)
    assert got.extra == pytest.approx(want.extra, rel=1e-5, abs=1e-6)
    assert torch.equal(got.per_slot_acc, want.per_slot_acc) and float(got.eal) == float(want.eal)
    assert got_g.keys() == want_g.keys() and got_g
    for k, g in want_g.items():
        torch.testing.assert_close(got_g[k], g, **GRAD_TOL, msg=k)
    return shared, got, got_g


def _chain_batch(vdir: Path) -> dict[str, torch.Tensor]:
    batch = _batch(vdir)
    batch["hidden_states"] = torch.randn(1, T, 3 * H, generator=torch.Generator().manual_seed(4))
    return batch


def test_eagle3_labels_once_a_batch_equal_labels_once_a_step(
    vdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fanout.families.eagle3 import model as eagle3_model

    torch.manual_seed(0)
    draft = family("eagle3").build(vdir, target_layer_ids=[1, 2, 3], num_layers=1,
                                   block_size=4, loss_type="ce")  # fmt: skip
    made, _, _ = _labels_once(eagle3_model, draft, _chain_batch(vdir), monkeypatch)
    assert made == [T]  # every position once


def test_peagle_labels_once_a_position_equal_labels_once_a_sample(
    vdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P-EAGLE's CE labels: the verifier's argmax once per distinct position its samples
    predict (depth d of a chain and depth d-1 of the next share one), not once a sample."""
    from fanout.families.peagle import model as peagle_model

    torch.manual_seed(0)
    draft = family("peagle").build(vdir, target_layer_ids=[1, 2, 3], num_layers=1,
                                   block_size=9, max_anchors=12, loss_type="ce")  # fmt: skip
    made, got, _ = _labels_once(peagle_model, draft, _chain_batch(vdir), monkeypatch)
    assert len(made) == 1 and made[0] < got.n_tokens  # fewer rows than supervised samples
