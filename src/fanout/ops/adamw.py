"""AdamW with the backend picked per device and gradient clipping folded into the step.

    from fanout.ops.adamw import make_optimizer
    opt, backend = make_optimizer(model.parameters(), lr=3e-4, weight_decay=0.01,
                                  betas=(0.9, 0.95), max_grad_norm=1.0)  # backend: "fused"
    loss.backward(); opt.step(); opt.zero_grad()   # step() clips, then updates
    .venv/bin/python benchmarks/trainer.py --only adamw   # fused vs foreach

`auto` picks the fused AdamW kernel (`torch._fused_adamw_`, what
`torch.optim.AdamW(fused=True)` runs) when every parameter lives on a device it supports
(PyTorch 2.13: CPU, CUDA, MPS, XPU, ...) and is floating point, the foreach ops
(`torch.optim.AdamW(foreach=True)`'s) otherwise; the choice is returned so the trainer
can log it.

Clipping by global norm: the total gradient norm is computed with one foreach reduction.
On the fused backend the clip factor is handed to the fused kernel as its `grad_scale`
(the kernel divides each gradient by it while it reads it), so clipping costs no extra
pass over the gradients; a non-finite norm sets the kernel's `found_inf`, which skips
the update (and the step count). On the foreach backend `clip_grads_with_norm_` scales
the gradients in place first, and a non-finite norm skips the step likewise.

Why not a `torch.optim.AdamW` subclass: every entry point of `torch.optim.Optimizer`
(`add_param_group`, which its constructor calls; `step`; `zero_grad`; `state_dict`;
`load_state_dict`) imports `torch._dynamo` (and sympy, most of torch.fx) at its first
call: 0.75-1 s of a trainer's start-up on an idle 2-core machine, 1.5-2.6 s on a loaded
one (docs/operations.md, "Trainer start-up"). `ClippedAdamW` calls the same kernels the
same way, so its updates are bitwise those of `torch.optim.AdamW` with the same
backend (tests/test_adamw.py), and its `state_dict` is the stock format, so
checkpoints written by either load into the other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal, cast

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

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


class ClippedAdamW:
    """AdamW (decoupled weight decay) whose `step()` first clips gradients to
    `max_grad_norm`: `torch.optim.AdamW(fused=True)` or `(foreach=True)` without the
    `torch.optim.Optimizer` machinery (no hooks, closures, amsgrad, maximize, capturable).

    `param_groups` and `state` are laid out as `torch.optim.AdamW`'s, so an LR schedule
    sets `group["lr"]` between steps. After each step, `last_grad_norm` holds the
    pre-clip global norm (a float; nan without clipping) and `skipped_steps` counts
    updates skipped because that norm was not finite.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        fused: bool,
        max_grad_norm: float | None = None,
    ) -> None:
        self.backend = "fused" if fused else "foreach"
        # torch.optim.AdamW's group keys, so state_dict() is the stock format
        self.defaults: dict[str, Any] = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=False,
            maximize=False,
            foreach=not fused,
            capturable=False,
            differentiable=False,
            fused=fused,
            decoupled_weight_decay=True,
        )
        items: list[Any] = list(params)
        if not items:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(items[0], dict):
            items = [{"params": items}]
        self.param_groups: list[dict[str, Any]] = []
        for g in items:
            group = {**self.defaults, **g, "params": list(g["params"])}
            group.update(foreach=not fused, fused=fused)
            self.param_groups.append(group)
        self.state: dict[torch.Tensor, dict[str, Any]] = {}
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: float = float("nan")
        self.skipped_steps = 0

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self) -> None:
        """Clip (when `max_grad_norm` is set), then one AdamW update of every parameter
        that has a gradient."""
        grads = [p.grad for p in self._params() if p.grad is not None]
        grad_scale = found_inf = None
        if self.max_grad_norm is not None and grads:
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)  # [] fp32
            self.last_grad_norm = float(norm)
            finite = math.isfinite(self.last_grad_norm)
            if not finite:
                self.skipped_steps += 1
            if self.backend == "fused":
                # clip_grad_norm_'s coefficient: max_norm / (norm + 1e-6), at most 1
                coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
                grad_scale = (1.0 / coef).float()  # the fused kernel divides grads by it
                found_inf = torch.tensor(0.0 if finite else 1.0, device=norm.device)
            elif not finite:
                return
            else:
                params = [p for p in self._params() if p.grad is not None]
                torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm, foreach=True)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            steps = [self._state(p)["step"] for p in params]
            lists: list[list[torch.Tensor]] = [
                params,
                [p.grad for p in params if p.grad is not None],
                [self.state[p]["exp_avg"] for p in params],
                [self.state[p]["exp_avg_sq"] for p in params],
                steps,
            ]
            if self.backend == "fused":
                _fused_adamw(group, lists, grad_scale, found_inf)
            else:
                _foreach_adamw(group, lists)

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        """`p`'s state, created at its first update as torch.optim.AdamW does: `step` a
        float32 scalar on `p`'s device (fused) or on the CPU (foreach)."""
        st = self.state.get(p)
        if st is None:
            fused = self.backend == "fused"
            st = self.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device)
                if fused
                else torch.tensor(0.0, dtype=_scalar_dtype()),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
        return st

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    def state_dict(self) -> dict[str, Any]:
        """`torch.optim.Optimizer.state_dict()`'s format: parameters by index, state
        tensors by reference (not copies)."""
        index: dict[int, int] = {}
        groups = []
        for g in self.param_groups:
            for p in g["params"]:
                index.setdefault(id(p), len(index))
            groups.append(
                {k: v for k, v in g.items() if k != "params"}
                | {"params": [index[id(p)] for p in g["params"]]}
            )
        return {
            "state": {index[id(p)]: st for p, st in self.state.items()},
            "param_groups": groups,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `state_dict()` of this class or of `torch.optim.AdamW` (same layout).

        As `torch.optim.Optimizer.load_state_dict`: the saved groups' hyperparameters
        (lr, betas, ..., a scheduler's `initial_lr`) replace the current ones, and state
        tensors move to their parameter's device (and dtype; `step` stays float32).
        Unlike it, the backend stays this optimizer's: `step` is placed for it, and the
        groups keep its `fused`/`foreach` flags.
        """
        saved = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in self.param_groups]
        if [len(g["params"]) for g in saved] != sizes:
            raise ValueError(
                f"optimizer state has parameter groups of sizes "
                f"{[len(g['params']) for g in saved]}, this optimizer {sizes}"
            )
        by_id = dict(
            zip(
                (i for g in saved for i in g["params"]),
                self._params(),
                strict=True,
            )
        )
        fused = self.backend == "fused"
        self.state = {}
        for pid, st in state_dict["state"].items():
            p = by_id[pid]
            new: dict[str, Any] = {}
            for k, v in st.items():
                if k == "step":
                    step = (
                        v
                        if isinstance(v, torch.Tensor)
                        else torch.tensor(float(v), dtype=_scalar_dtype())
                    )
                    new[k] = step.to(
                        dtype=torch.float32 if fused else step.dtype,
                        device=p.device if fused else step.device,
                    )
                elif isinstance(v, torch.Tensor):
                    dtype = p.dtype if p.is_floating_point() else v.dtype
                    new[k] = v.to(dtype=dtype, device=p.device)
                else:
                    new[k] = v
            self.state[p] = new
        for g, s in zip(self.param_groups, saved, strict=True):
            hyper = {k: v for k, v in s.items() if k != "params"}
            hyper["betas"] = tuple(hyper.get("betas", g["betas"]))
            g.update(hyper, foreach=not fused, fused=fused)


def _by_device(
    lists: list[list[torch.Tensor]],
) -> list[tuple[torch.device, list[list[torch.Tensor]]]]:
    """`lists` (parallel lists: params, grads, ...) split by the params' device and dtype,
    as torch.optim groups them for its multi-tensor kernels."""
    grouped = _group_tensors_by_device_and_dtype(lists)  # type: ignore[arg-type]
    return [(dev, cast(list[list[torch.Tensor]], ls)) for (dev, _), (ls, _) in grouped.items()]


def _scalar_dtype() -> torch.dtype:
    """torch.optim's dtype for a CPU `step`: float64 under a float64 default dtype."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _fused_adamw(
    group: dict[str, Any],
    lists: list[list[torch.Tensor]],
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    """torch.optim.adam._fused_adam with decoupled weight decay."""
    beta1, beta2 = group["betas"]
    scales: dict[torch.device, torch.Tensor] = {}
    infs: dict[torch.device, torch.Tensor] = {}
    for device, (params, grads, exp_avgs, exp_avg_sqs, steps) in _by_device(lists):
        dev_scale = dev_inf = None
        if grad_scale is not None:
            dev_scale = scales.setdefault(device, grad_scale.to(device, non_blocking=True))
        if found_inf is not None:
            dev_inf = infs.setdefault(device, found_inf.to(device, non_blocking=True))
        torch._foreach_add_(steps, 1)
        torch._fused_adamw_(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            amsgrad=False,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
            grad_scale=dev_scale,
            found_inf=dev_inf,
        )
        if dev_inf is not None:
            torch._foreach_sub_(steps, [dev_inf] * len(steps))


def _foreach_adamw(group: dict[str, Any], lists: list[list[torch.Tensor]]) -> None:
    """torch.optim.adam._multi_tensor_adam with decoupled weight decay, real
    parameters, `step` on the CPU (capturable=False)."""
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    beta1, beta2 = group["betas"]
    for _, (params, grads, exp_avgs, exp_avg_sqs, steps) in _by_device(lists):
        if steps[0].is_cpu:  # one wrapped scalar, as torch.optim does
            torch._foreach_add_(steps, torch.tensor(1.0, device="cpu"), alpha=1.0)
        else:
            torch._foreach_add_(steps, 1)
        if wd != 0:
            torch._foreach_mul_(params, 1 - lr * wd)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        bias1 = [1 - beta1 ** s.item() for s in steps]
        bias2_sqrt = [(1 - beta2 ** s.item()) ** 0.5 for s in steps]
        step_size = [(lr / bc) * -1 for bc in bias1]
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)


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
    )
    return opt, chosen
