"""The trainer's optimizer and learning-rate schedule: AdamW (`fanout.ops.adamw`) with
warm-up then constant, linear or cosine decay.

    from fanout.train.optim import build_optimizer
    opt, backend, sched = build_optimizer(draft.parameters(), lr=3e-4, weight_decay=0.0,
        backend="auto", max_grad_norm=1.0, warmup_ratio=0.05, scheduler_type="cosine",
        total_steps=200)
    loss.backward(); opt.step(); sched.step(); opt.zero_grad()

`LRSchedule` is `torch.optim.lr_scheduler.LambdaLR` without `torch.optim`: the same
arithmetic (`lr = base_lr * factor(step)`, set on every param group at construction and
after each `step()`) and the same `state_dict` keys, so checkpoints written with
`LambdaLR` resume unchanged. It exists because anything from `torch.optim` imports
`torch._dynamo` on first use, ~0.8 s of start-up (docs/operations.md, "Trainer
start-up"); tests/test_optim.py checks both against `torch.optim.AdamW` + `LambdaLR`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Literal, Protocol

import torch

from fanout.ops.adamw import AdamWBackend, ClippedAdamW, make_optimizer

SchedulerType = Literal["constant", "linear", "cosine"]


class HasParamGroups(Protocol):
    param_groups: list[dict[str, Any]]


def lr_lambda(
    warmup_ratio: float, scheduler_type: SchedulerType, total: int | None
) -> Callable[[int], float]:
    """The LR factor of step `k` (0-based): linear warm-up over `warmup_ratio × total`
    steps, then `scheduler_type` decay to 0 at `total` (constant without a total)."""
    warm = int(warmup_ratio * total) if total else 0

    def f(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if scheduler_type == "constant" or not total:
            return 1.0
        frac = min(1.0, (step - warm) / max(1, total - warm))
        if scheduler_type == "linear":
            return max(0.0, 1.0 - frac)
        return 0.5 * (1.0 + math.cos(math.pi * frac))

    return f


class LRSchedule:
    """Sets each param group's `lr` to its base LR × `factor(last_epoch)`: at construction
    (step 0), then after every `step()`. `LambdaLR`'s behaviour and `state_dict`."""

    def __init__(self, optimizer: HasParamGroups, factor: Callable[[int], float]) -> None:
        self.optimizer = optimizer
        self.factor = factor
        for g in optimizer.param_groups:
            g.setdefault("initial_lr", g["lr"])
        self.base_lrs: list[float] = [g["initial_lr"] for g in optimizer.param_groups]
        self.last_epoch = -1
        self._step_count = 0
        self._last_lr: list[float] = []
        self.step()

    def step(self) -> None:
        self._step_count += 1
        self.last_epoch += 1
        for g, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            lr = base * self.factor(self.last_epoch)
            if isinstance(g["lr"], torch.Tensor):
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        """The LR of each group as of the last `step()` (the next update's)."""
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        """`LambdaLR.state_dict()`'s keys and values (a plain function: `lr_lambdas` None)."""
        return {
            "base_lrs": list(self.base_lrs),
            "last_epoch": self.last_epoch,
            "_step_count": self._step_count,
            "_is_initial": False,
            "_get_lr_called_within_step": False,
            "_last_lr": list(self._last_lr),
            "lr_lambdas": [None] * len(self.base_lrs),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()` of this class or of `LambdaLR`. As `LambdaLR`, the
        groups' current `lr` is the optimizer's to restore (its state_dict has it)."""
        self.base_lrs = list(state["base_lrs"])
        self.last_epoch = int(state["last_epoch"])
        self._step_count = int(state.get("_step_count", self.last_epoch + 1))
        self._last_lr = list(state.get("_last_lr", self._last_lr))


def build_optimizer(
    params: Iterable[torch.Tensor],
    *,
    lr: float,
    weight_decay: float,
    backend: AdamWBackend,
    max_grad_norm: float | None,
    warmup_ratio: float,
    scheduler_type: SchedulerType,
    total_steps: int | None,
) -> tuple[ClippedAdamW, str, LRSchedule]:
    """AdamW over `params` (`fanout.ops.adamw.make_optimizer`) and its LR schedule.

    Returns:
        `(optimizer, chosen_backend, schedule)`; `total_steps` None: no decay.
    """
    opt, chosen = make_optimizer(
        params, lr=lr, weight_decay=weight_decay, backend=backend, max_grad_norm=max_grad_norm
    )
    return opt, chosen, LRSchedule(opt, lr_lambda(warmup_ratio, scheduler_type, total_steps))
