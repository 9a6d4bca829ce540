"""Fused linear CE vs the naive linear + cross_entropy reference, values and gradients."""

from __future__ import annotations

from typing import Literal

import pytest
import torch
import torch.nn.functional as F

from fanout.ops.linear_ce import linear_cross_entropy, linear_cross_entropy_and_argmax


def _inputs(seed: int, n: int = 67, h: int = 24, v: int = 501, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) * 0.5).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.2] = -100  # some ignored rows
    rw = torch.rand(n, generator=g)  # per-row position weights
    return x, w, t, rw


def _run(fn, x, w, t, rw, reduction: str, train_head: bool):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(train_head)
    loss = fn(x, w, t, reduction)
    out = (loss.float() * rw).sum() if reduction == "none" else loss.float()
    out.backward()
    return loss.detach().float(), x.grad.float(), (w.grad.float() if train_head else None)


def _naive(x, w, t, red):
    return F.cross_entropy((x.float() @ w.float().T), t, reduction=red, ignore_index=-100)


@pytest.mark.parametrize("backend", ["chunked", "torch"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("train_head", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_fp32_matches_naive(
    backend: Literal["chunked", "torch"], reduction: str, train_head: bool, seed: int
) -> None:
    x, w, t, rw = _inputs(seed)

    def fused(x, w, t, red):
        return linear_cross_entropy(x, w, t, reduction=red, backend=backend, chunk_rows=16)

    got = _run(fused, x, w, t, rw, reduction, train_head)
    ref = _run(_naive, x, w, t, rw, reduction, train_head)
    for a, b in zip(got, ref):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("train_head", [False, True])
def test_bf16_within_stated_tolerance(reduction: str, train_head: bool) -> None:
    """bf16 inputs: fp32 softmax, CPU matmul output rounded to bf16 -> ~1e-2 relative."""
    x, w, t, rw = _inputs(3, dtype=torch.bfloat16)

    def fused(x, w, t, red):
        return linear_cross_entropy(x, w, t, reduction=red, backend="chunked", chunk_rows=10)

    got = _run(fused, x, w, t, rw, reduction, train_head)
    ref = _run(_naive, x, w, t, rw, reduction, train_head)  # fp32 math on the bf16 values
    assert got[0].dtype == torch.float32
    for a, b in zip(got, ref):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_argmax_and_ignored_rows() -> None:
    x, w, t, _ = _inputs(5)
    loss, pred = linear_cross_entropy_and_argmax(x, w, t, chunk_rows=9)
    logits = x @ w.T
    assert torch.equal(pred, logits.argmax(dim=1))
    ignored = t == -100
    assert ignored.any() and torch.all(loss[ignored] == 0)


def test_frozen_head_gets_no_grad_and_default_chunking() -> None:
    x, w, t, _ = _inputs(7, n=300, v=2000)
    x.requires_grad_(True)
    loss = linear_cross_entropy(x, w, t)  # default chunk size, auto backend
    loss.backward()
    assert w.grad is None
    torch.testing.assert_close(loss, _naive(x.detach(), w, t, "mean"), rtol=1e-5, atol=1e-5)


def test_bad_shapes_raise() -> None:
    x, w, t, _ = _inputs(0)
    with pytest.raises(ValueError, match="expected x"):
        linear_cross_entropy(x, w[:, :5], t)
    with pytest.raises(ValueError, match="expected target"):
        linear_cross_entropy(x, w, t[:3])


@pytest.mark.gpu
def test_cuda_bf16_fp32_accumulation() -> None:  # pragma: no cover - needs CUDA
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x, w, t, rw = (a.cuda() for a in _inputs(2, dtype=torch.bfloat16))
    got = _run(lambda *a: linear_cross_entropy(*a[:3], reduction=a[3]), x, w, t, rw, "mean", True)
    ref = _run(_naive, x, w, t, rw, "mean", True)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
