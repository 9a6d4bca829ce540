"""AdamW with the backend picked per device and gradient clipping folded into the step.

    from fanout.ops.adamw import make_optimizer
    opt, backend = make_optimizer(model.parameters(), lr=3e-4, weight_decay=0.01,
                                  betas=(0.9, 0.95), max_grad_norm=1.0)  # backend: "fused"
    loss.backward(); opt.step(); opt.zero_grad()   # step() clips, then updates
    .venv/bin/python benchmarks/trainer.py --only adamw   # fused vs foreach

`auto` picks `torch.optim.AdamW(fused=True)` when every parameter lives on a device the
fused kernel supports (PyTorch 2.13: CPU, CUDA, MPS, XPU, ...) and is floating point,
`foreach=True` otherwise; the choice is returned so the trainer can log it.

Clipping by global norm: the total gradient norm is computed with one foreach reduction.
On the fused backend the clip factor is handed to the fused kernel as its `grad_scale`
(the kernel divides each gradient by it while it reads it), so clipping costs no extra
pass over the gradients; a non-finite norm sets the kernel's `found_inf`, which skips
the update (and the step count). On the foreach backend `clip_grad_norm_(foreach=True)`
scales the gradients in place first, and a non-finite norm skips `step()` likewise.
The optimizer is a plain `torch.optim.AdamW` subclass: its `state_dict` is the stock
format and LR schedulers work unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch

from fanout.errors import ConfigError

AdamWBackend = Literal["auto", "fused", "foreach"]


def _fused_devices() -> set[str]:
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        return set(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - older torch
        return {"cuda"}


def fused_supported(params: list[torch.Tensor]) -> bool:
    """True when the fused AdamW kernel can update every parameter in `params`."""
    devices = _fused_devices()
    return all(p.device.type in devices and torch.is_floating_point(p) for p in params)


class ClippedAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` whose `step()` first clips gradients to `max_grad_norm`.

    After each step, `last_grad_norm` holds the pre-clip global norm (a float) and
    `skipped_steps` counts updates skipped because that norm was not finite.
    """

    def __init__(self, params: Any, *, max_grad_norm: float | None = None, **kw: Any) -> None:
        super().__init__(params, **kw)
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: float = float("nan")
        self.skipped_steps = 0
        self.backend = "fused" if kw.get("fused") else "foreach"

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        grads = self._grads()
        if self.max_grad_norm is None or not grads:
            return super().step(closure)
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)  # [] fp32
        self.last_grad_norm = float(norm)
        finite = math.isfinite(self.last_grad_norm)
        if self.backend == "fused":
            # Same clip coefficient as clip_grad_norm_: max_norm / (norm + 1e-6), at most 1.
            coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            self.grad_scale = (1.0 / coef).float()  # the fused kernel divides grads by it
            self.found_inf = torch.tensor(0.0 if finite else 1.0, device=norm.device)
            try:
                out = super().step(closure)
            finally:
                del self.grad_scale, self.found_inf
            self.skipped_steps += not finite
            return out
        if not finite:
            self.skipped_steps += 1
            return None
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm, foreach=True)
        return super().step(closure)


def make_optimizer(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    backend: AdamWBackend = "auto",
    *,
    eps: float = 1e-8,
    max_grad_norm: float | None = None,
) -> tuple[ClippedAdamW, str]:
    """Build AdamW on the fastest backend the parameters allow.

    Args:
        params: parameters (or param-group dicts) to optimise; frozen ones are dropped.
        lr, weight_decay, betas, eps: as `torch.optim.AdamW` (decoupled weight decay).
        backend: `"auto"` (fused where supported, else foreach), `"fused"` (error if
            unsupported), or `"foreach"`.
        max_grad_norm: clip gradients to this global L2 norm in every `step()`; None = off.
    Returns:
        `(optimizer, chosen_backend)` with chosen_backend `"fused"` or `"foreach"`.
    Example:
        >>> opt, chosen = make_optimizer(torch.nn.Linear(4, 4).parameters(), lr=1e-3)
    """
    if lr <= 0 or weight_decay < 0 or eps <= 0:
        raise ConfigError(
            f"AdamW: lr must be > 0, weight_decay >= 0, eps > 0 (got {lr}, {weight_decay}, {eps})"
        )
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ConfigError(f"AdamW: betas must lie in [0, 1), got {betas}")
    if max_grad_norm is not None and max_grad_norm <= 0:
        raise ConfigError(f"AdamW: max_grad_norm must be > 0 or None, got {max_grad_norm}")
    items: list[Any] = list(params)
    if items and isinstance(items[0], dict):
        groups: list[Any] = [
            {**g, "params": [p for p in g["params"] if p.requires_grad]} for g in items
        ]
        flat = [p for g in groups for p in g["params"]]
    else:
        flat = [p for p in items if isinstance(p, torch.Tensor) and p.requires_grad]
        groups = flat
    if not flat:
        raise ConfigError("AdamW: no trainable parameters")
    if backend == "auto":
        chosen = "fused" if fused_supported(flat) else "foreach"
    elif backend == "fused":
        if not fused_supported(flat):
            devs = sorted({p.device.type for p in flat})
            raise ConfigError(
                f"--adamw-backend fused: the fused AdamW kernel does not support devices {devs} "
                f"(supported: {sorted(_fused_devices())}); use auto or foreach"
            )
        chosen = "fused"
    elif backend == "foreach":
        chosen = "foreach"
    else:
        raise ConfigError(f"--adamw-backend must be auto|fused|foreach, got {backend!r}")
    opt = ClippedAdamW(
        groups,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        max_grad_norm=max_grad_norm,
        fused=chosen == "fused",
        foreach=chosen == "foreach",
    )
    return opt, chosen
