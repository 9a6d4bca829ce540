"""Fused linear KL against the naive full-logits KL on random inputs: values and grads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fanout.ops.linear_kl import linear_kl_div_and_argmax


def _naive(x: torch.Tensor, t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    log_pd = F.log_softmax(x.float() @ w.float().t(), dim=-1)
    log_pt = F.log_softmax(t.float() @ w.float().t(), dim=-1)
    return F.kl_div(log_pd, log_pt, log_target=True, reduction="none").sum(-1)  # [N]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    h=st.integers(1, 24),
    v=st.integers(2, 300),
    chunk=st.sampled_from([None, 1, 3, 16]),
    scale=st.floats(0.1, 8.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_values_and_gradients_match_the_naive_kl(
    n: int, h: int, v: int, chunk: int | None, scale: float, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, h, generator=g) * scale).requires_grad_(True)
    t = torch.randn(n, h, generator=g) * scale
    w = torch.randn(v, h, generator=g)
    row_w = torch.rand(n, generator=g)  # per-row weights, as DFlash's position weights
    kl, pred = linear_kl_div_and_argmax(x, t, w, chunk_rows=chunk)
    (kl * row_w).sum().backward()
    assert x.grad is not None
    got_grad = x.grad.clone()
    x.grad = None
    ref = _naive(x, t, w)
    (ref * row_w).sum().backward()
    torch.testing.assert_close(kl, ref.detach(), rtol=1e-4, atol=1e-5)
    # fp32 sums of softmax differences: an element near 0 carries the rounding of the
    # row's largest terms, so the absolute bound scales with the gradient's size
    # (hypothesis found n 36, h 23, v 103, chunk 1: one element 1.3e-5 off)
    atol = 1e-5 * max(1.0, float(got_grad.abs().max()))
    torch.testing.assert_close(got_grad, x.grad, rtol=1e-4, atol=atol)
    assert torch.equal(pred, (x.detach() @ w.t()).argmax(-1))
    assert (kl >= -1e-5).all()


def test_same_rows_have_zero_kl_and_zero_gradient() -> None:
    x = torch.randn(7, 16, requires_grad=True)
    w = torch.randn(50, 16)
    kl, _ = linear_kl_div_and_argmax(x, x.detach().clone(), w)
    kl.sum().backward()
    assert x.grad is not None
    assert kl.abs().max() < 1e-5 and x.grad.abs().max() < 1e-5


def test_bad_shapes_and_a_trainable_head_are_refused() -> None:
    with pytest.raises(ValueError, match="expected x and teacher"):
        linear_kl_div_and_argmax(torch.randn(3, 4), torch.randn(2, 4), torch.randn(5, 4))
    with pytest.raises(ValueError, match="hidden sizes differ"):
        linear_kl_div_and_argmax(torch.randn(3, 4), torch.randn(3, 4), torch.randn(5, 3))
    with pytest.raises(ValueError, match="frozen"):
        linear_kl_div_and_argmax(
            torch.randn(3, 4), torch.randn(3, 4), torch.randn(5, 4, requires_grad=True)
        )


def test_the_chain_head_loss_is_this_op_and_keeps_its_precision_under_autocast() -> None:
    """`teacher_head`'s KL (EAGLE-3's and P-EAGLE's loss) is this op with the verifier's
    argmax beside it: the same loss and draft argmax, the label the teacher logits'
    argmax, and fp32 inside a trainer's bf16 autocast as outside it (before, its own
    copy of the op ran its matmuls under the caller's autocast)."""
    from fanout.ops.teacher_head import teacher_head

    g = torch.Generator().manual_seed(0)
    x0, t, w = (
        torch.randn(24, 16, generator=g),
        torch.randn(24, 16, generator=g),
        torch.randn(200, 16, generator=g),
    )

    def run(autocast: bool) -> list[torch.Tensor]:
        x = x0.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, pred, label = teacher_head(x, t, w, kl=True)
        loss.sum().backward()
        assert x.grad is not None
        return [loss, pred, label, x.grad]

    kl, pred = linear_kl_div_and_argmax(x0, t, w)
    plain = run(False)
    torch.testing.assert_close(plain[0], kl)
    assert torch.equal(plain[1], pred) and torch.equal(plain[2], (t @ w.t()).argmax(-1))
    for got, want in zip(run(True), plain):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
