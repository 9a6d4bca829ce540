"""Fused linear KL divergence: KL(verifier ‖ draft) through one frozen head, chunked.

    from fanout.ops.linear_kl import linear_kl_div_and_argmax
    kl, pred = linear_kl_div_and_argmax(draft_rows, verifier_rows, head_weight)  # [N], [N]
    (kl * position_weight).sum().backward()     # gradient reaches draft_rows only

For distillation from the verifier's full next-token distribution instead of its
greedy token: both sides share the (frozen) LM head, so row i's KL is
`Σ_v p_t(v) (log p_t(v) − log p_d(v))` with `p = softmax(rows @ W.T)`. Like the
chunked linear CE (`fanout.ops.linear_ce`), the `[N, vocab]` logits never exist at
once: forward walks the rows in chunks of about 256 MiB of fp32 logits per side,
computes each row's KL and both argmaxes (the draft's, and the verifier's that the chain
drafters' accuracy is measured against: fanout.ops.teacher_head), and stores the input
gradient `(p_d − p_t) @ W` of every row (`[N, H]` fp32); backward only scales it by
each row's output gradient. The head and the verifier rows get no gradient. Logits and
softmaxes are fp32.

A verifier whose forward soft-caps its logits (Gemma-2's `final_logit_softcapping`:
`tanh(z / cap) · cap`, fanout.model.verifier_dir.logit_softcap) has its side capped
(`softcap`): `teacher_logits` is the verifier's own output, every fused op's teacher
(here, fanout.ops.teacher_head, fanout.ops.two_head_ce). The draft's side is not: a
draft's logits are its own, uncapped in serving as in training. The cap is monotonic,
so the verifier's argmax (its labels, `target_ids`) does not move, but for ties where
tanh rounds to 1 in fp32 (logits past about 9 caps).
"""

from __future__ import annotations

from typing import Any

import torch

from fanout.ops.linear_ce import _own_precision, mm_fp32, rows_per_chunk


def soft_cap_(z: torch.Tensor, cap: float | None) -> torch.Tensor:
    """`z` capped in place, `tanh(z / cap) · cap` (transformers' Gemma-2 order of
    operations), or `z` as it is when `cap` is None."""
    return z if cap is None else z.div_(cap).tanh_().mul_(cap)


def teacher_logits(
    teacher: torch.Tensor, weight: torch.Tensor, softcap: float | None = None
) -> torch.Tensor:
    """The verifier's logits `[N, V]` fp32 from its states `teacher` `[N, H]` through the
    head `weight` `[V, H]`: `teacher · Wᵀ`, soft-capped by `softcap` (None: not)."""
    return soft_cap_(mm_fp32(teacher, weight.t()), softcap)


class ChunkedLinearKL(torch.autograd.Function):
    """Per row: KL(p_t ‖ p_d), the draft's argmax and, with `labels`, the verifier's
    (else an empty tensor: no argmax pass); p_d = softmax(x @ W^T), p_t = softmax of
    `teacher_logits(teacher, W, softcap)`. Forward stores the input gradient per row,
    backward scales it."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,  # [N, H] draft rows
        teacher: torch.Tensor,  # [N, H] verifier rows (final-normed)
        weight: torch.Tensor,  # [V, H] frozen head
        chunk_rows: int | None,
        labels_too: bool,
        softcap: float | None = None,  # the verifier's logit soft cap (Gemma-2)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, h = x.shape
        c = rows_per_chunk(n, 2 * weight.shape[0], chunk_rows)  # two [c, V] blocks live
        kl = torch.empty(n, dtype=torch.float32, device=x.device)
        preds = torch.empty(n, dtype=torch.long, device=x.device)
        labels = torch.empty(n if labels_too else 0, dtype=torch.long, device=x.device)
        gx = torch.empty(n, h, dtype=torch.float32, device=x.device)
        with torch.no_grad(), _own_precision(x.device):
            for s in range(0, n, c):
                e = min(s + c, n)
                log_pd = torch.log_softmax(mm_fp32(x[s:e], weight.t()), dim=-1)  # [c, V]
                log_pt = torch.log_softmax(teacher_logits(teacher[s:e], weight, softcap), -1)
                pt = log_pt.exp()
                kl[s:e] = (pt * (log_pt - log_pd)).sum(dim=-1)
                preds[s:e] = log_pd.argmax(dim=-1)
                if labels_too:
                    labels[s:e] = log_pt.argmax(dim=-1)
                gx[s:e] = mm_fp32(log_pd.exp_().sub_(pt), weight)  # (p_d − p_t) @ W
                del log_pd, log_pt, pt
        ctx.save_for_backward(gx)
        ctx.x_dtype = x.dtype
        ctx.mark_non_differentiable(preds, labels)
        return kl, preds, labels

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        (gx,) = ctx.saved_tensors
        return (gx * g.float()[:, None]).to(ctx.x_dtype), None, None, None, None, None


def linear_kl_div_and_argmax(
    x: torch.Tensor,
    teacher: torch.Tensor,
    weight: torch.Tensor,
    *,
    chunk_rows: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL(softmax(teacher @ W.T) ‖ softmax(x @ W.T)) [N] fp32, and argmax of the
    draft logits [N]; the teacher's logits soft-capped by `softcap` when given (the
    verifier's, Gemma-2). Differentiable in `x` only (the head is frozen in DFlash)."""
    if x.dim() != 2 or x.shape != teacher.shape or weight.dim() != 2:
        raise ValueError(
            f"expected x and teacher [N, H] and weight [V, H], got {tuple(x.shape)}, "
            f"{tuple(teacher.shape)} and {tuple(weight.shape)}"
        )
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden sizes differ: x {x.shape[1]}, weight {weight.shape[1]}")
    if weight.requires_grad:
        raise ValueError("linear_kl_div_and_argmax keeps the head frozen; detach the weight")
    kl, pred, _ = ChunkedLinearKL.apply(x, teacher.detach(), weight, chunk_rows, False, softcap)
    return kl, pred


__all__ = ["ChunkedLinearKL", "linear_kl_div_and_argmax", "soft_cap_", "teacher_logits"]
