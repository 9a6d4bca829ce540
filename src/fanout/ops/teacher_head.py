"""The chain drafters' head loss against the verifier's distribution, chunked: per row,
KL(verifier ‖ draft) through one frozen head (or CE against the verifier's argmax),
with both argmaxes.

    from fanout.ops.teacher_head import teacher_head
    loss, pred, label = teacher_head(draft_rows, verifier_rows, head_weight, kl=True)
    (loss * step_weight).sum().backward()   # gradient reaches draft_rows only
    right = pred == label                   # the draft's greedy token is the verifier's

EAGLE-3's and P-EAGLE's targets are the verifier's distribution over the draft
vocabulary (speculators' `kl_div`, or `ce` against its argmax), so besides the loss
they need the verifier's argmax over the same head rows (the label the accuracy is
measured against). The KL is `fanout.ops.linear_kl`'s op, which returns both argmaxes;
CE against the argmax is the linear CE on `teacher_argmax`'s labels. The `[N, vocab]`
logits never exist at once, the head and the verifier rows get no gradient, and logits
and softmaxes are fp32. A verifier that soft-caps its logits (Gemma-2) has its
distribution capped (`softcap`, fanout.ops.linear_kl.teacher_logits); its argmax, a
monotonic cap's, is the uncapped one's.
"""

from __future__ import annotations

import torch

from fanout.ops.argmax import row_argmax
from fanout.ops.linear_ce import linear_cross_entropy_and_argmax, mm_fp32, rows_per_chunk
from fanout.ops.linear_kl import ChunkedLinearKL


def teacher_head(
    x: torch.Tensor,
    teacher: torch.Tensor,
    weight: torch.Tensor,
    *,
    kl: bool = True,
    chunk_rows: int | None = None,
    label: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row loss `[N]` fp32 (KL from the verifier's distribution, or CE against its
    argmax), the draft's argmax `[N]` and the verifier's `[N]` (head-row ids: the draft
    vocabulary's), without `[N, V]` logits at once; differentiable in `x` only. CE:
    `label` `[N]`, when given, is `teacher_argmax(teacher, weight)` made once by the
    caller (EAGLE-3's steps share their verifier rows), and `teacher` is not read.
    `softcap`: the verifier's logit soft cap (KL; None: none)."""
    if not kl:
        # CE needs only the verifier's argmax (of its raw logits, as speculators takes
        # it): one argmax pass, then the fused linear CE — no teacher softmax, no one-hot
        # (0.7x the step of the KL-shaped path for P-EAGLE / EAGLE-3 on CPU).
        if label is None:
            label = teacher_argmax(teacher, weight, chunk_rows)
        ce, pred = linear_cross_entropy_and_argmax(x, weight, label, chunk_rows=chunk_rows)
        return ce.float(), pred, label
    loss, pred, label = ChunkedLinearKL.apply(
        x, teacher.detach(), weight.detach(), chunk_rows, True, softcap
    )
    return loss, pred, label


@torch.no_grad()
def teacher_argmax(
    teacher: torch.Tensor, weight: torch.Tensor, chunk_rows: int | None = None
) -> torch.Tensor:
    """The verifier's greedy head row `[N]` of each of its states `teacher` `[N, H]`
    (fp32 logits, one `[c, V]` block at a time)."""
    n = teacher.shape[0]
    c = rows_per_chunk(n, weight.shape[0], chunk_rows)
    out = torch.empty(n, dtype=torch.long, device=teacher.device)
    for s in range(0, n, c):
        out[s : s + c] = row_argmax(mm_fp32(teacher[s : s + c], weight.t()))
    return out


__all__ = ["teacher_argmax", "teacher_head"]
