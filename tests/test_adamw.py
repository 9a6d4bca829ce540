"""make_optimizer: backend choice and updates identical to torch.optim.AdamW + clip_grad_norm_
(bitwise for the same backend), without importing torch._dynamo (tests/test_optim.py)."""

from __future__ import annotations

from typing import Literal

import pytest
import torch

from fanout.errors import ConfigError
from fanout.ops.adamw import make_optimizer


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(7, 5), (5,), (3, 2, 4)]]


@pytest.mark.parametrize("backend", ["fused", "foreach"])
@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_updates_match_reference(
    backend: Literal["fused", "foreach"], max_grad_norm: float | None
) -> None:
    mine, ref = _params(0), _params(0)
    opt, chosen = make_optimizer(
        mine,
        lr=0.05,
        weight_decay=0.1,
        betas=(0.9, 0.95),
        backend=backend,
        max_grad_norm=max_grad_norm,
    )
    assert chosen == backend
    ref_opt = torch.optim.AdamW(ref, lr=0.05, weight_decay=0.1, betas=(0.9, 0.95), foreach=False)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        scale = 5.0 if step % 2 else 0.01  # some steps clip, some do not
        for a, b in zip(mine, ref):
            grad = torch.randn(a.shape, generator=g) * scale
            a.grad, b.grad = grad.clone(), grad.clone()
        opt.step()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref, max_grad_norm)
        ref_opt.step()
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    if max_grad_norm is not None:
        assert opt.last_grad_norm > max_grad_norm  # the last step's grads were clipped


def test_auto_picks_fused_on_cpu() -> None:
    _, chosen = make_optimizer(_params(0), lr=1e-3)
    assert chosen == "fused"  # PyTorch >= 2.13 runs fused AdamW on CPU


def test_unsupported_device_falls_back_and_fused_refuses() -> None:
    # The "meta" device has no fused AdamW kernel: auto must pick foreach, fused must refuse.
    p = torch.nn.Parameter(torch.randn(3, device="meta"))
    _, chosen = make_optimizer([p], lr=1e-3)
    assert chosen == "foreach"
    with pytest.raises(ConfigError, match="fused"):
        make_optimizer([p], lr=1e-3, backend="fused")


@pytest.mark.parametrize("backend", ["fused", "foreach"])
def test_nonfinite_grad_skips_step(backend: Literal["fused", "foreach"]) -> None:
    ps = _params(2)
    opt, _ = make_optimizer(ps, lr=0.1, backend=backend, max_grad_norm=1.0)
    before = [p.detach().clone() for p in ps]
    for p in ps:
        p.grad = torch.full_like(p, float("nan"))
    opt.step()
    assert opt.skipped_steps == 1
    for a, b in zip(ps, before):
        assert torch.equal(a.detach(), b)


def test_bad_config_raises() -> None:
    with pytest.raises(ConfigError, match="max_grad_norm"):
        make_optimizer(_params(0), lr=1e-3, max_grad_norm=0.0)
    with pytest.raises(ConfigError, match="no trainable"):
        make_optimizer([torch.zeros(3)], lr=1e-3)


@pytest.mark.parametrize("backend", ["fused", "foreach"])
def test_clipped_steps_bitwise_equal_torch_same_backend(
    backend: Literal["fused", "foreach"],
) -> None:
    """ClippedAdamW runs torch.optim.AdamW's kernels without torch.optim: the same
    backend, clipped the same way (fused: the clip factor as the kernel's grad_scale,
    a non-finite norm as found_inf), gives the same bits, non-finite steps included."""
    mine, ref = _params(0), _params(0)
    opt, _ = make_optimizer(mine, lr=0.05, weight_decay=0.1, backend=backend, max_grad_norm=0.5)
    ref_opt = torch.optim.AdamW(
        ref, lr=0.05, weight_decay=0.1, fused=backend == "fused", foreach=backend == "foreach"
    )
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        scale = float("inf") if step == 3 else 5.0 if step % 2 else 0.01
        for a, b in zip(mine, ref):
            grad = torch.randn(a.shape, generator=g) * scale
            a.grad, b.grad = grad.clone(), grad.clone()
        opt.step()
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in ref if p.grad is not None], foreach=True
        )
        finite = bool(torch.isfinite(norm))
        if backend == "fused":
            coef = torch.clamp(0.5 / (norm + 1e-6), max=1.0)
            ref_opt.grad_scale = (1.0 / coef).float()  # type: ignore[attr-defined]
            ref_opt.found_inf = torch.tensor(0.0 if finite else 1.0)  # type: ignore[attr-defined]
            ref_opt.step()
        elif finite:
            torch.nn.utils.clip_grads_with_norm_(ref, 0.5, norm, foreach=True)
            ref_opt.step()
        for a, b in zip(mine, ref):
            assert torch.equal(a, b), step
    assert opt.skipped_steps == 1
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sd["param_groups"] == ref_sd["param_groups"]
    for k, st in sd["state"].items():
        for name, v in st.items():
            assert torch.equal(v, ref_sd["state"][k][name]), (k, name)
