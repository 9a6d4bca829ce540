"""The trainer's optimizer and learning-rate schedule: AdamW (`fanout.ops.adamw`) with
warm-up then constant, linear or cosine decay (`LRCurve`).

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

The schedule's total may be learned during the run (an on-policy stream's length is
known once its regeneration is done): `LRCurve.retarget` decays from the factor of the
step it is at, so the learning rate never jumps, and the curve's attributes travel in
the schedule's `state_dict` (as `LambdaLR` saves a callable object's), so `--resume`
continues the same curve.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterable
from typing import Any, Literal, Protocol

import torch

from fanout.ops.adamw import AdamWBackend, ClippedAdamW, make_optimizer

SchedulerType = Literal["constant", "linear", "cosine"]


class HasParamGroups(Protocol):
    param_groups: list[dict[str, Any]]


# Warm-up steps where the total is not known at start (a stream whose length nothing
# says yet): a ratio of an unknown total is no length, and a schedule must not wait.
WARMUP_STEPS_WITHOUT_TOTAL = 100


class LRCurve:
    """The LR factor of step `k` (0-based), a callable as `LambdaLR` takes: linear
    warm-up over `warmup` steps (cut short where `decay_start` comes first), then
    `kind` decay from `decay_from` at step `decay_start` to 0 at step `total`;
    constant for kind "constant", and until a total is known. `settled`: the total
    is final (not an estimate, not unknown).

    Its attributes are its whole state: `LambdaLR.state_dict()` (and LRSchedule's)
    saves a callable object's `__dict__` under "lr_lambdas", and loading restores it.
    """

    def __init__(
        self, kind: SchedulerType, warmup: int, total: int | None, *, settled: bool = True
    ) -> None:
        self.kind = kind
        self.warmup = warmup
        self.total = total
        self.decay_start = warmup
        self.decay_from = 1.0
        self.settled = settled

    def __call__(self, step: int) -> float:
        if step < min(self.warmup, self.decay_start):  # a decay may cut warm-up short
            return (step + 1) / self.warmup
        if self.kind == "constant" or not self.total:
            return 1.0
        start = self.decay_start
        if step < start:
            return self.decay_from
        frac = min(1.0, (step - start) / max(1, self.total - start))
        if self.kind == "linear":
            return self.decay_from * max(0.0, 1.0 - frac)
        return self.decay_from * 0.5 * (1.0 + math.cos(math.pi * frac))

    def retarget(self, total: int, step: int, *, settled: bool) -> None:
        """A total learned at `step` (the step whose factor is in use now): decay from
        that factor to 0 at `total`, so the curve is continuous. During warm-up the
        warm-up finishes first, unless `total` comes before its end: then it stops now.
        The factors of the steps before `step` stay as they were."""
        if self.kind != "constant" and total != self.total:
            if step < min(self.warmup, self.decay_start) and self.warmup < total:
                self.decay_start, self.decay_from = self.warmup, 1.0
            else:
                self.decay_from = self(step)
                self.decay_start = step
        self.total, self.settled = total, settled

    def describe(self) -> str:
        """The log's words for this curve: kind, warm-up, where it ends."""
        warm = f"{min(self.warmup, self.decay_start)} warm-up steps"
        if self.kind == "constant":
            return f"constant after {warm}"
        if self.total is None:
            return f"{self.kind}, {warm}, total unknown: constant until the stream end is recorded"
        est = "" if self.settled else " (not final: corrected once the stream's length is recorded)"
        return f"{self.kind}, {warm}, decaying to 0 at step {self.total}{est}"


def lr_lambda(
    warmup_ratio: float, scheduler_type: SchedulerType, total: int | None, *, settled: bool = True
) -> LRCurve:
    """The curve of a known `total`: linear warm-up over `warmup_ratio × total` steps,
    then `scheduler_type` decay to 0 at `total` (`settled` False: an estimate). Without
    a total (None), warm-up over WARMUP_STEPS_WITHOUT_TOTAL steps (none at ratio 0),
    then constant until `retarget`."""
    if total:
        return LRCurve(scheduler_type, int(warmup_ratio * total), total, settled=settled)
    warm = WARMUP_STEPS_WITHOUT_TOTAL if warmup_ratio > 0 else 0
    return LRCurve(scheduler_type, warm, None, settled=False)


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
        """`LambdaLR.state_dict()`'s keys and values: `lr_lambdas` holds the factor's
        attributes (an LRCurve's), None for a plain function."""
        f = self.factor
        curve = None if isinstance(f, types.FunctionType) else dict(vars(f))
        return {
            "base_lrs": list(self.base_lrs),
            "last_epoch": self.last_epoch,
            "_step_count": self._step_count,
            "_is_initial": False,
            "_get_lr_called_within_step": False,
            "_last_lr": list(self._last_lr),
            "lr_lambdas": [curve] * len(self.base_lrs),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()` of this class or of `LambdaLR`, the factor's
        attributes too where it saved them (a checkpoint written before LRCurve saved
        None: the factor stays as built). As `LambdaLR`, the groups' current `lr` is
        the optimizer's to restore (its state_dict has it)."""
        self.base_lrs = list(state["base_lrs"])
        self.last_epoch = int(state["last_epoch"])
        self._step_count = int(state.get("_step_count", self.last_epoch + 1))
        self._last_lr = list(state.get("_last_lr", self._last_lr))
        saved = (state.get("lr_lambdas") or [None])[0]
        if saved is not None and not isinstance(self.factor, types.FunctionType):
            vars(self.factor).update(saved)

    def set_factor(self, factor: Callable[[int], float]) -> None:
        """Follow `factor` from the current step on (a schedule planned anew at a
        resume), setting each group's `lr` for it now."""
        self.factor = factor
        self.last_epoch -= 1
        self._step_count -= 1
        self.step()


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
    settled: bool = True,
) -> tuple[ClippedAdamW, str, LRSchedule]:
    """AdamW over `params` (`fanout.ops.adamw.make_optimizer`) and its LR schedule.

    Returns:
        `(optimizer, chosen_backend, schedule)`; the schedule's factor is an LRCurve
        (`lr_lambda`): `total_steps` None: no decay until it is `retarget`ed;
        `settled` False: `total_steps` is an estimate.
    """
    opt, chosen = make_optimizer(
        params, lr=lr, weight_decay=weight_decay, backend=backend, max_grad_norm=max_grad_norm
    )
    curve = lr_lambda(warmup_ratio, scheduler_type, total_steps, settled=settled)
    return opt, chosen, LRSchedule(opt, curve)
