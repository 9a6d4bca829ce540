"""Fused linear + cross-entropy: CE of `x @ W.T` without materialising `[rows, vocab]` logits.

    from fanout.ops.linear_ce import linear_cross_entropy, linear_cross_entropy_and_argmax
    loss = linear_cross_entropy(x, head_weight, target)                    # mean over kept rows
    rows, pred = linear_cross_entropy_and_argmax(x, w, t)                  # per-row + argmax
    (rows * position_weight).sum().backward()
    .venv/bin/python benchmarks/trainer.py --only ce      # memory / time vs naive

Backends (`backend=`):
- ``"chunked"`` (our own `autograd.Function`): walks the rows in chunks; per chunk it
  computes the logits in fp32, the row losses, the argmax, and — during forward — the
  softmax gradient's contribution to `grad_x` (and `grad_W` when the head is trainable
  and the reduction is a scalar). Backward only rescales what forward stored, so the
  head matmul runs twice (forward + input grad) just like the naive path, and the peak
  extra memory is one `[chunk, vocab]` fp32 block instead of ~3 `[rows, vocab]` ones.
  With `reduction="none"` *and* a trainable head, the per-row output gradient is not
  known during forward and cannot be folded into `grad_W`, so backward recomputes.
- ``"torch"``: `torch.nn.functional.linear_cross_entropy` with `LinearCrossEntropyOptions`
  (PyTorch >= 2.13). Its `reduction="none"` path always recomputes in backward (three
  head matmuls instead of two), which is the DFlash case (frozen head, per-row losses
  for position weights); see benchmarks/trainer.py for the numbers that decided `auto`.
- ``"liger"``: Liger-Kernel's fused linear CE on CUDA when the package is installed.
- ``"naive"``: `F.linear` + `F.cross_entropy` (the reference; materialises logits).

`auto` = liger on CUDA when installed and the reduction is scalar, otherwise chunked.

Precision: logits, log-sum-exp and softmax are fp32 whatever the input dtype. On CUDA the
bf16/fp16 matmuls write fp32 directly (`out_dtype`); on CPU, where `mm` has no
`out_dtype`, the bf16 matmul accumulates in fp32 inside oneDNN and rounds its output to
bf16 before the fp32 softmax (tests state the resulting tolerance).

Semantics match `F.cross_entropy`: rows whose target equals `ignore_index` have loss 0
and no gradient; `"mean"` divides by the number of kept rows (NaN when none, as torch).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

import torch
import torch.nn.functional as F

Reduction = Literal["mean", "sum", "none"]
Backend = Literal["auto", "chunked", "torch", "liger", "naive"]

# A [chunk, vocab] fp32 block of about this size bounds the op's extra memory; big
# enough that each chunk's matmul runs near peak speed (hundreds of rows at 152k vocab).
DEFAULT_CHUNK_BYTES = 256 * 2**20


def rows_per_chunk(n_rows: int, vocab: int, chunk_rows: int | None) -> int:
    """Rows per chunk of a fused op over `n_rows` rows and a `vocab`-wide head: the
    caller's `chunk_rows` when given, else as many as keep one `[chunk, vocab]` fp32
    block near DEFAULT_CHUNK_BYTES."""
    if chunk_rows is not None:
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        return min(chunk_rows, max(n_rows, 1))
    return max(1, min(max(n_rows, 1), DEFAULT_CHUNK_BYTES // (4 * vocab)))


def _own_precision(dev: torch.device) -> torch.autocast:
    """Autocast off inside the fused ops: they pick every matmul's precision themselves
    (fp32 logits and accumulators, `mm_fp32`). Under a caller's bf16 autocast an fp32
    matmul would come back bf16 — bf16 logits, and a dtype error where it meets an fp32
    accumulator (`addmm_`)."""
    return torch.autocast(dev.type, enabled=False)


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` with an fp32 result (fp32 accumulation on every backend)."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return a @ b
    if a.dtype != b.dtype:
        a = a.to(b.dtype)  # fp32 softmax grads meet a bf16 head: round them, keep fp32 acc
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()  # CPU: oneDNN accumulates bf16 in fp32, rounds the output


def _softmax_grad_chunk(
    xc: torch.Tensor,  # [c, H]
    weight: torch.Tensor,  # [V, H]
    tc: torch.Tensor,  # [c] int64
    keep: torch.Tensor,  # [c] bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row losses, argmax and d(loss_row)/d(logits) for one chunk, in place on one block."""
    z = mm_fp32(xc, weight.t())  # [c, V] fp32 logits
    safe_t = torch.where(keep, tc, torch.zeros_like(tc))
    z_t = z.gather(1, safe_t[:, None]).squeeze(1)  # [c]
    m, pred = z.max(dim=1)  # [c], [c]; the max doubles as the argmax
    z.sub_(m[:, None]).exp_()  # [c, V] exp(z - m), in place: no second block
    s = z.sum(dim=1)  # [c]
    loss = (m + s.log() - z_t) * keep  # [c]
    z.div_(s[:, None])  # softmax p
    z.scatter_add_(1, safe_t[:, None], -torch.ones_like(m)[:, None])  # p - onehot
    z.mul_(keep[:, None])  # ignored rows: no gradient
    return loss, pred, z


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,  # [N, H]
        weight: torch.Tensor,  # [V, H]
        target: torch.Tensor,  # [N]
        ignore_index: int,
        reduction: str,
        chunk_rows: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, h = x.shape
        vocab = weight.shape[0]
        c = rows_per_chunk(n, vocab, chunk_rows)
        need_gx, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # Per-row output grads are unknown until backward, so with a trainable head and
        # reduction="none" grad_W cannot be accumulated now: recompute in backward.
        defer = need_gw and reduction == "none"
        keep = target != ignore_index  # [N]
        losses = torch.empty(n, dtype=torch.float32, device=x.device)
        preds = torch.empty(n, dtype=torch.long, device=x.device)
        gx = (
            torch.empty(n, h, dtype=torch.float32, device=x.device)
            if need_gx and not defer
            else None
        )
        gw = (
            torch.zeros(vocab, h, dtype=torch.float32, device=x.device)
            if need_gw and not defer
            else None
        )
        with torch.no_grad(), _own_precision(x.device):
            for s in range(0, n, c):
                e = min(s + c, n)
                loss, pred, p = _softmax_grad_chunk(x[s:e], weight, target[s:e], keep[s:e])
                losses[s:e] = loss
                preds[s:e] = pred
                if gx is not None:
                    gx[s:e] = mm_fp32(p, weight)  # [c, H]
                if gw is not None:
                    gw += mm_fp32(p.t(), x[s:e])  # [V, H]
                del p
        n_keep = keep.sum()
        ctx.reduction = reduction
        ctx.defer = defer
        ctx.chunk = c
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        if defer:
            ctx.save_for_backward(x, weight, target, keep, n_keep)
        else:
            ctx.save_for_backward(gx, gw, n_keep)
        ctx.mark_non_differentiable(preds)
        if reduction == "none":
            out = losses
        elif reduction == "sum":
            out = losses.sum()
        else:
            out = losses.sum() / n_keep
        return out, preds

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, _g_pred: Any) -> tuple[Any, ...]:
        if ctx.defer:
            return _ChunkedLinearCE._recompute_backward(ctx, g)
        gx, gw, n_keep = ctx.saved_tensors
        g = g.float()
        if ctx.reduction == "mean":
            g = g / n_keep
        grad_x = grad_w = None
        if gx is not None:
            grad_x = (gx * (g[:, None] if g.dim() == 1 else g)).to(ctx.x_dtype)  # [N, H]
        if gw is not None:
            grad_w = (gw * g).to(ctx.w_dtype)  # [V, H]; scalar g here
        return grad_x, grad_w, None, None, None, None

    @staticmethod
    def _recompute_backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        x, weight, target, keep, _ = ctx.saved_tensors
        g = g.float()  # [N]; only reduction="none" defers
        n, h = x.shape
        grad_x = torch.empty(n, h, dtype=torch.float32, device=x.device)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
        with torch.no_grad(), _own_precision(x.device):
            for s in range(0, n, ctx.chunk):
                e = min(s + ctx.chunk, n)
                _, _, p = _softmax_grad_chunk(x[s:e], weight, target[s:e], keep[s:e])
                p.mul_(g[s:e, None])  # [c, V] scaled by each row's output grad
                grad_x[s:e] = mm_fp32(p, weight)
                grad_w += mm_fp32(p.t(), x[s:e])
                del p
        gx_out = grad_x.to(x.dtype) if ctx.needs_input_grad[0] else None
        return gx_out, grad_w.to(weight.dtype), None, None, None, None


def _check(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, reduction: str) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected x [N, H] and weight [V, H], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if target.shape != (x.shape[0],):
        raise ValueError(f"expected target [{x.shape[0]}], got {tuple(target.shape)}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be mean|sum|none, got {reduction!r}")


def liger_available() -> bool:
    """True when Liger-Kernel is installed and a CUDA device exists."""
    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None


def resolve_backend(backend: Backend, x: torch.Tensor, reduction: str) -> str:
    """The backend `auto` picks for these inputs (see module docstring)."""
    if backend != "auto":
        return backend
    if x.is_cuda and reduction != "none" and liger_available():
        return "liger"
    return "chunked"


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    reduction: Reduction = "mean",
    ignore_index: int = -100,
    backend: Backend = "auto",
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of `x @ weight.T` against `target`, logits never fully materialised.

    Args:
        x: `[N, H]` inputs (fp32 / bf16 / fp16).
        weight: `[V, H]` head; frozen (`requires_grad=False`) or trainable.
        target: `[N]` int64 class ids; `ignore_index` rows are skipped.
        reduction: `"mean"` (over kept rows), `"sum"`, or `"none"` (`[N]` fp32 losses).
        backend: see module docstring.
        chunk_rows: rows per chunk (default: a 256 MiB fp32 logits block).
    Returns:
        Scalar loss, or `[N]` per-row losses for `reduction="none"` (fp32 for low-precision inputs).
    Example:
        >>> x = torch.randn(8, 4, requires_grad=True); w = torch.randn(10, 4)
        >>> linear_cross_entropy(x, w, torch.randint(0, 10, (8,))).backward()
    """
    _check(x, weight, target, reduction)
    chosen = resolve_backend(backend, x, reduction)
    if chosen == "chunked":
        loss, _ = _ChunkedLinearCE.apply(x, weight, target, ignore_index, reduction, chunk_rows)
        return loss
    if chosen == "torch":
        opts = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_rows)
        return F.linear_cross_entropy(
            x, weight, target, reduction=reduction, ignore_index=ignore_index, options=opts
        )
    if chosen == "liger":  # pragma: no cover - CUDA + liger only
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return liger_fused_linear_cross_entropy(
            x, weight, target, ignore_index=ignore_index, reduction=reduction
        )
    if chosen == "naive":
        logits = F.linear(x, weight).float()  # [N, V]
        return F.cross_entropy(logits, target, reduction=reduction, ignore_index=ignore_index)
    raise ValueError(f"unknown linear CE backend {backend!r}")


def linear_cross_entropy_and_argmax(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `[N]` per-row losses of `linear_cross_entropy(..., reduction="none")`
    (chunked backend) and the `[N]` argmax of the logits, found in the same pass
    (accuracy metrics for free). Per row only: the caller weighs the rows (slot weights)
    before it sums them.
    """
    _check(x, weight, target, "none")
    loss, pred = _ChunkedLinearCE.apply(x, weight, target, ignore_index, "none", chunk_rows)
    return loss, pred
