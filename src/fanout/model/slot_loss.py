"""The loss parts every family's loss is made of, once each: the head's loss on
supervised rows (CE against labels or KL against the verifier, through the fused paths
of fanout.ops), the slot weights (exp decay, D-PACE), and the acceptance metrics
(per-slot accuracy, expected acceptance length).

    from fanout.model.slot_loss import acceptance, head_loss, slot_index, slot_weights
    ce, pred = head_loss(rows, head, labels=label[sup])        # [M], [M]; no [M, V] logits
    w = slot_weights(cfg, ce.detach(), sup, slot_index(sup))   # [M]
    acc, cnt, eal = acceptance(correct[..., 1:], sup[..., 1:], has)

Shapes: a family lays its drafted tokens out as `[.., S]` (blocks `[B, A, bs]`, chains
`[B, R, steps]`); `sup` marks the supervised ones, `slot` is each supervised row's index
along S. A family with a loss of its own (DSpark's two heads, XPress's TV term, DFlash2's
selector) adds its term beside these and reports it in `LossOutput.extra`.
"""

from __future__ import annotations

import torch

from fanout.model.draft_config import DraftConfig
from fanout.ops.linear_ce import linear_cross_entropy_and_argmax
from fanout.ops.linear_kl import linear_kl_div_and_argmax


def head_loss(
    rows: torch.Tensor,  # [M, H] final-normed draft states of supervised slots
    head: torch.Tensor,  # [V, H] the verifier's head (its draft-vocabulary rows)
    *,
    labels: torch.Tensor | None = None,  # [M] draft-vocab labels (CE)
    teacher: torch.Tensor | None = None,  # [M, H] the verifier's final states (KL)
    softcap: float | None = None,  # the verifier's logit soft cap (`Draft.teacher_softcap`)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss `[M]` (fp32) and the draft's argmax `[M]`: KL(verifier || draft) over
    the head when `teacher` is given (its logits soft-capped by `softcap`), CE against
    `labels` otherwise. Never forms the `[M, V]` logits (fanout.ops' chunked paths)."""
    if teacher is not None:
        return linear_kl_div_and_argmax(rows, teacher, head, softcap=softcap)
    if labels is None:
        raise ValueError("head_loss needs labels (CE) or teacher (KL)")
    return linear_cross_entropy_and_argmax(rows, head, labels)


def slot_index(sup: torch.Tensor) -> torch.Tensor:
    """Each supervised row's slot index k along S `[M]` (`sup` `[.., S]`), in the order
    `x[sup]` gives the rows."""
    return torch.arange(sup.shape[-1], device=sup.device).expand_as(sup)[sup]


def exp_decay(slot: torch.Tensor, gamma: float, *, first: int = 1) -> torch.Tensor:
    """DFlash's slot weights `exp(-(k - first) / gamma)` `[M]` (weight 1 up to the first
    drafted slot `first`: 1 for a block whose slot 0 is the anchor, 0 for DSpark's)."""
    return torch.exp(-(slot - first).clamp(min=0).float() / gamma)


def dpace_weights(ce: torch.Tensor, sup: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE slot weights `[M]` (speculators' `dpace_loss_decay`): confidence
    q = exp(-CE) of each supervised row `ce` `[M]`, smoothed (1 - α)q + α (1 off
    supervision), prefix products along S, weight of slot k = the sum over supervised
    slots m >= k of prefix_m. `sup` `[.., S]`."""
    q = torch.ones(sup.shape, dtype=torch.float32, device=sup.device)  # [.., S]
    q[sup] = (1 - alpha) * torch.exp(-ce.float()) + alpha
    prefix = torch.cumprod(q, dim=-1) * sup
    return prefix.flip(-1).cumsum(-1).flip(-1)[sup]


def slot_weights(
    cfg: DraftConfig, ce: torch.Tensor, sup: torch.Tensor, slot: torch.Tensor, *, first: int = 1
) -> torch.Tensor:
    """The recipe's slot weights `[M]` (`cfg.loss_weighting`): `exp_decay` or
    `dpace_weights` of the detached per-row loss `ce` `[M]`."""
    if cfg.loss_weighting == "exp":
        return exp_decay(slot, cfg.resolved_gamma, first=first)
    return dpace_weights(ce, sup, cfg.dpace_alpha)


@torch.no_grad()
def acceptance(
    correct: torch.Tensor,  # [.., S] drafted token right (supervised ones only)
    sup: torch.Tensor,  # [.., S] supervised
    has: torch.Tensor,  # [..] chains / blocks that count in EAL
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-slot accuracy `[S]` over supervised slots, their count `[S]`, and the
    expected acceptance length under greedy verification `[]`: 1 (the verifier's own
    token) + the run of right slots from the first (stopping at the first wrong *or
    unsupervised* one), averaged over `has` (1 where none) — the empirical form of
    `1 + sum_k prod_{j<=k} acc_j`."""
    correct = correct & sup
    lead = tuple(range(correct.dim() - 1))
    cnt = sup.sum(dim=lead)  # [S]
    acc = (correct.sum(dim=lead) / cnt.clamp(min=1)).float()
    run = torch.cumprod(correct.long(), dim=-1).sum(dim=-1)  # [..]
    eal = (1.0 + run[has].float()).mean() if has.any() else torch.tensor(1.0)
    return acc, cnt, eal


__all__ = [
    "acceptance",
    "dpace_weights",
    "exp_decay",
    "head_loss",
    "slot_index",
    "slot_weights",
]
