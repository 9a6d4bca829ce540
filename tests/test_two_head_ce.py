"""The two-head linear CE / KL (fanout.ops.two_head_ce) against materialised logits + autograd.

Reference: `logits = x @ a^T + e @ b^T` in fp32, `F.cross_entropy` (ignore_index -100) or
KL(softmax(teacher @ a^T) || softmax(logits)) or the compound `0.3 CE + 0.7 TV` (cetv:
speculators' `{"ce": .., "tv": ..}`, TV = 1 - sum_v min(q_v, p_v), an ignored row
neither term), autograd for x, e and b (a frozen), the acceptance `sum_v min(q_v, p_v)`
from the two softmaxes. Both modes: `row_weight` given
(forward folds every gradient, loss = sum_i w_i l_i) and per-row (backward recomputes,
output gradient any `[N]` vector). Shapes cross chunk boundaries (chunks of 1, a ragged
last chunk, one chunk bigger than N, N = 1, no rows) and drop the second head.
fp32 tolerances: values rtol 1e-5 / atol 1e-6, gradients rtol 1e-4 / atol 1e-6 (chunked
fp32 sums in another order than autograd's), argmax exact.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fanout.ops.two_head_ce import (
    TwoHeadOut,
    TwoHeadTerms,
    two_head_ce_tv_and_argmax,
    two_head_cross_entropy_and_argmax,
    two_head_kl_div_and_argmax,
)
from tiny_run import one_thread  # noqa: F401 (autouse: one intra-op thread)

VALUE_TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOL: dict[str, Any] = {"rtol": 1e-4, "atol": 1e-6}
CE_TV = (0.3, 0.7)  # the compound's weights (cetv)


def _inputs(seed: int, n: int, h: int = 12, r: int = 5, v: int = 97) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.2] = -100  # some ignored rows
    return {
        "x": torch.randn(n, h, generator=g),
        "e": torch.randn(n, r, generator=g),
        "a": 0.7 * torch.randn(v, h, generator=g),  # frozen
        "b": 0.7 * torch.randn(v, r, generator=g),
        "target": t,
        "teacher": 1.5 * torch.randn(n, h, generator=g),
        "w": torch.rand(n, generator=g) + 0.1,  # row weights / output gradient
    }


def _leaves(d: dict[str, torch.Tensor], two: bool) -> list[torch.Tensor]:
    names = ["x", "e", "b"] if two else ["x"]
    return [d[k].clone().requires_grad_(True) for k in names]


def _reference(
    d: dict[str, torch.Tensor], kind: str, two: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Per-row values, argmax, accept and grads of sum_i w_i l_i, the plain way."""
    leaves = _leaves(d, two)
    logits = leaves[0] @ d["a"].t()  # [N, V]
    if two:
        logits = logits + leaves[1] @ leaves[2].t()
    log_p = F.log_softmax(d["teacher"] @ d["a"].t(), -1)
    overlap = torch.minimum(logits.softmax(-1), log_p.exp()).sum(-1)  # [N]
    if kind != "kl":
        rows = F.cross_entropy(logits, d["target"], reduction="none", ignore_index=-100)
        if kind == "cetv":
            rows = (CE_TV[0] * rows + CE_TV[1] * (1 - overlap)) * (d["target"] != -100)
    else:
        rows = (log_p.exp() * (log_p - F.log_softmax(logits, -1))).sum(-1)
    (rows * d["w"]).sum().backward()
    accept = overlap.detach()
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
    return rows.detach(), logits.detach().argmax(-1), accept, grads


def _fused(
    d: dict[str, torch.Tensor], kind: str, two: bool, fold: bool, chunk: int | None
) -> tuple[TwoHeadOut, list[torch.Tensor]]:
    leaves = _leaves(d, two)
    x = leaves[0]
    e, b = (leaves[1], leaves[2]) if two else (None, None)
    w = d["w"] if fold else None
    if kind == "ce":
        out = two_head_cross_entropy_and_argmax(
            x, e, d["a"], b, d["target"], teacher=d["teacher"], row_weight=w, chunk_rows=chunk
        )
    elif kind == "cetv":
        out = two_head_ce_tv_and_argmax(
            x, e, d["a"], b, d["target"], d["teacher"], ce_weight=CE_TV[0],
            tv_weight=CE_TV[1], row_weight=w, chunk_rows=chunk,
        )  # fmt: skip
    else:
        out = two_head_kl_div_and_argmax(
            x, e, d["a"], b, d["teacher"], row_weight=w, chunk_rows=chunk
        )
    total = out.loss if fold else (out.loss * d["w"]).sum()
    if total.requires_grad:
        total.backward()
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
    return out, grads


SHAPES = [(37, 8), (37, 1), (16, 16), (5, 64), (1, None), (64, None), (0, 4)]


@pytest.mark.parametrize("kind", ["ce", "kl", "cetv"])
@pytest.mark.parametrize("fold", [True, False], ids=["row_weight", "per_row"])
@pytest.mark.parametrize("two", [True, False], ids=["two_heads", "one_head"])
@pytest.mark.parametrize(("n", "chunk"), SHAPES)
def test_matches_materialised_logits(
    kind: str, fold: bool, two: bool, n: int, chunk: int | None
) -> None:
    d = _inputs(n + (chunk or 0), n)
    rows, pred, accept, want = _reference(d, kind, two)
    out, got = _fused(d, kind, two, fold, chunk)
    torch.testing.assert_close(out.rows, rows, **VALUE_TOL)
    if fold:
        assert out.loss.dim() == 0
        torch.testing.assert_close(out.loss, (rows * d["w"]).sum(), **VALUE_TOL)
    else:
        torch.testing.assert_close(out.loss.detach(), rows, **VALUE_TOL)
    assert out.accept is not None
    torch.testing.assert_close(out.accept, accept, **VALUE_TOL)
    assert torch.equal(out.pred, pred)
    if kind != "kl":  # ignored rows: CE (and TV) 0
        assert bool((out.rows[d["target"] == -100] == 0).all())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **GRAD_TOL)
    if n:  # the test sees the gradients it compares
        assert float(got[0].abs().max()) > 0


def test_folded_backward_scales_with_the_output_gradient() -> None:
    """row_weight mode: backward only rescales what forward computed."""
    d = _inputs(3, 29)
    x, e, b = _leaves(d, True)
    out = two_head_cross_entropy_and_argmax(
        x, e, d["a"], b, d["target"], row_weight=d["w"], chunk_rows=7
    )
    (2.5 * out.loss).backward()
    _, _, _, want = _reference(d, "ce", True)
    for g, w in zip((x.grad, e.grad, b.grad), want):
        assert g is not None
        torch.testing.assert_close(g, 2.5 * w, **GRAD_TOL)
    assert out.accept is None  # no teacher given


def test_frozen_second_head_and_no_grad() -> None:
    d = _inputs(4, 20)
    x = d["x"].clone().requires_grad_(True)
    b = d["b"].clone()  # frozen too
    out = two_head_cross_entropy_and_argmax(x, d["e"], d["a"], b, d["target"], row_weight=d["w"])
    out.loss.backward()
    assert x.grad is not None and b.grad is None
    with torch.no_grad():
        again = two_head_cross_entropy_and_argmax(
            x, d["e"], d["a"], b, d["target"], row_weight=d["w"]
        )
    torch.testing.assert_close(again.rows, out.rows, rtol=0, atol=0)
    assert not again.loss.requires_grad


def test_bf16_within_stated_tolerance() -> None:
    """bf16 inputs against the fp32 reference of the same (bf16) numbers: fp32 softmax
    and accumulation, but on CPU the bf16 matmul output is rounded to bf16 -> ~2e-2."""
    d = _inputs(5, 33, h=16, r=8, v=211)
    for k in ("x", "e", "a", "b", "teacher"):
        d[k] = d[k].bfloat16().float()
    rows, _, accept, want = _reference(d, "ce", True)
    bf = {k: (v.bfloat16() if v.is_floating_point() and k != "w" else v) for k, v in d.items()}
    out, got = _fused(bf, "ce", True, True, 8)
    torch.testing.assert_close(out.rows, rows, rtol=2e-2, atol=2e-2)
    assert out.accept is not None
    torch.testing.assert_close(out.accept, accept, rtol=2e-2, atol=2e-2)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), w, rtol=5e-2, atol=2e-2 * float(w.abs().max()))


@pytest.mark.parametrize(
    ("change", "msg"),
    [
        ({"a": "grad"}, "frozen"),
        ({"e": None}, "together"),
        ({"b": "short"}, "expected e"),
        ({"w": "short"}, "row_weight"),
        ({"teacher": "short"}, "teacher"),
        ({"target": "short"}, "expected target"),
    ],
)
def test_bad_inputs_are_refused(change: dict[str, Any], msg: str) -> None:
    d: dict[str, Any] = dict(_inputs(6, 10))
    for k, how in change.items():
        if how == "grad":
            d[k] = d[k].clone().requires_grad_(True)
        elif how == "short":
            d[k] = d[k][:-1]
        else:
            d[k] = how
    with pytest.raises(ValueError, match=msg):
        two_head_cross_entropy_and_argmax(
            d["x"], d["e"], d["a"], d["b"], d["target"], teacher=d["teacher"], row_weight=d["w"]
        )


def test_fused_ops_keep_their_precision_under_a_bf16_autocast() -> None:
    """A trainer runs the draft under `torch.autocast(bf16)`; the fused CE / KL ops pick
    their own precision (fp32 logits), so inside an autocast they give what they give
    outside it — before, an fp32 matmul came back bf16 there (bf16 logits, and a dtype
    error in the two-head op's B gradient)."""
    from fanout.ops.linear_ce import linear_cross_entropy_and_argmax
    from fanout.ops.linear_kl import linear_kl_div_and_argmax
    from fanout.ops.two_head_ce import two_head_cross_entropy_and_argmax

    g = torch.Generator().manual_seed(0)
    n, h, r, v = 24, 16, 4, 200
    x0, e0 = torch.randn(n, h, generator=g), torch.randn(n, r, generator=g)
    a, b0 = torch.randn(v, h, generator=g), torch.randn(v, r, generator=g)
    teacher, target = torch.randn(n, h, generator=g), torch.randint(0, v, (n,), generator=g)

    def run(autocast: bool) -> list[torch.Tensor]:
        x, e, b = (t.clone().requires_grad_(True) for t in (x0, e0, b0))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            two = two_head_cross_entropy_and_argmax(
                x, e, a, b, target, teacher=teacher, row_weight=torch.ones(n)
            )
            ce, _ = linear_cross_entropy_and_argmax(x, a, target)  # [n]
            kl, _ = linear_kl_div_and_argmax(x, teacher, a)
        (two.loss + ce.sum() + kl.sum()).backward()
        assert x.grad is not None and e.grad is not None and b.grad is not None
        return [two.loss, ce, kl, x.grad, e.grad, b.grad]

    for got, want in zip(run(True), run(False)):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# ---- TwoHeadTerms: several CE + TV terms sharing rows, head and teacher (XPress's)


def _terms_inputs(seed: int, n: int) -> dict[str, torch.Tensor]:
    d = _inputs(seed, n)
    g = torch.Generator().manual_seed(seed + 100)
    d["e2"] = torch.randn(n, d["e"].shape[1], generator=g)
    d["w2"] = torch.rand(n, generator=g)
    return d


# (features, row weight, term weight) of each term: the backbone alone, two with the
# second head, one without a loss (values only), as XPress's base / rounds / seed
TERMS = [(None, "w", 0.6), ("e", "w", 1.0), ("e2", "w2", 0.1), ("e", None, 1.0)]


@pytest.mark.parametrize("n", [37, 1, 0])
def test_terms_equal_one_op_call_a_term(n: int) -> None:
    """`TwoHeadTerms` (head logits and teacher softmax once, x's gradient one matmul) gives
    each term's values, argmax and accept and the weighted sum's gradients to x, b and
    every term's features as `two_head_ce_tv_and_argmax` a term with autograd does."""
    d = _terms_inputs(7, n)

    def leaves() -> dict[str, torch.Tensor]:
        return {k: d[k].clone().requires_grad_(True) for k in ("x", "b", "e", "e2")}

    old, new = leaves(), leaves()
    want, total = [], torch.zeros(())
    for e, w, k in TERMS:
        out = two_head_ce_tv_and_argmax(
            old["x"], None if e is None else old[e], d["a"], None if e is None else old["b"],
            d["target"], d["teacher"], ce_weight=CE_TV[0], tv_weight=CE_TV[1],
            row_weight=None if w is None else d[w],
        )  # fmt: skip
        want.append(out)
        if w is not None:
            total = total + k * out.loss
    total.backward()
    terms = TwoHeadTerms(
        new["x"], d["a"], new["b"], d["target"], d["teacher"], ce_weight=CE_TV[0],
        tv_weight=CE_TV[1],
    )  # fmt: skip
    got = [
        terms.add(None if e is None else new[e], row_weight=None if w is None else d[w], weight=k)
        for e, w, k in TERMS
    ]
    loss = terms.loss()
    torch.testing.assert_close(loss, total.detach(), **VALUE_TOL)
    loss.backward()
    for g, w_out, (_, w, _) in zip(got, want, TERMS):
        torch.testing.assert_close(g.rows, w_out.rows, **VALUE_TOL)
        assert torch.equal(g.pred, w_out.pred)
        assert g.accept is not None and w_out.accept is not None
        torch.testing.assert_close(g.accept, w_out.accept, **VALUE_TOL)
        if w is not None:
            torch.testing.assert_close(g.loss, w_out.loss.detach(), **VALUE_TOL)
    for key in ("x", "b", "e", "e2"):
        a, b = new[key].grad, old[key].grad
        assert a is not None and b is not None, key
        torch.testing.assert_close(a, b, **GRAD_TOL)
    if n > 1:  # the test sees the gradients it compares (n = 1: its row is ignored)
        gx, ge2 = new["x"].grad, new["e2"].grad
        assert gx is not None and ge2 is not None
        assert float(gx.abs().max()) > 0 and float(ge2.abs().max()) > 0


def test_terms_scale_with_the_output_gradient_and_skip_grads_without_autograd() -> None:
    d = _terms_inputs(8, 19)
    x, b, e = (d[k].clone().requires_grad_(True) for k in ("x", "b", "e"))
    terms = TwoHeadTerms(x, d["a"], b, d["target"], d["teacher"], ce_weight=0.1, tv_weight=0.9)
    terms.add(e, row_weight=d["w"])
    (3.0 * terms.loss()).backward()
    ref = [t.detach().clone().requires_grad_(True) for t in (x, b, e)]
    out = two_head_ce_tv_and_argmax(
        ref[0], ref[2], d["a"], ref[1], d["target"], d["teacher"], ce_weight=0.1,
        tv_weight=0.9, row_weight=d["w"],
    )  # fmt: skip
    (3.0 * out.loss).backward()
    for got, want in zip((x, b, e), ref):
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad, want.grad, **GRAD_TOL)
    with torch.no_grad():
        terms = TwoHeadTerms(x, d["a"], b, d["target"], d["teacher"], ce_weight=0.1, tv_weight=0.9)
        again = terms.add(e, row_weight=d["w"])
        assert terms.dz_sum is None and terms.gb is None and not terms.es
        loss = terms.loss()
    assert not loss.requires_grad
    torch.testing.assert_close(loss, out.loss.detach(), **VALUE_TOL)
    torch.testing.assert_close(again.rows, out.rows, **VALUE_TOL)
