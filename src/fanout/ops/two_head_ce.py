"""Linear CE / KL over two heads, one frozen: logits `x @ A^T + e @ B^T`, chunked over rows.

    from fanout.ops.two_head_ce import two_head_cross_entropy_and_argmax, two_head_kl_div_and_argmax
    out = two_head_cross_entropy_and_argmax(x, e, head, w2, target, row_weight=w, teacher=t)
    (out.loss / n).backward()       # out.loss = sum_i w_i CE_i; grads to x, e and w2 only
    out.rows, out.pred, out.accept  # [N] per-row CE, argmax, sum_v min(q_v, p_v)
    kl = two_head_kl_div_and_argmax(x, e, head, w2, t, row_weight=w)  # KL(p || q) instead

DSpark's Markov-corrected logits are `h @ head^T + W1[prev] @ W2^T` with the verifier's
head frozen. Why hand-written instead of the fused linear CE (`fanout.ops.linear_ce`) on
the concatenated `[x ; e] @ [A ; B]^T`: that needs a `[V, H + r]` copy of the weights
every step (1.3 GB in bf16 for a 152k x 4096 head), and since B is trainable it computes
the whole `grad_W` `[V, H + r]` and throws the `[V, H]` part away; with per-row losses it
also cannot fold any gradient into forward, so the head matmuls all run again in
backward. Here A (`a`) never gets a gradient, and:

- `row_weight` given (the caller's loss is `sum_i w_i l_i` with w known before backward,
  e.g. DSpark's exp slot decay): `loss` is that scalar, and forward computes every
  gradient chunk by chunk (`dz = w_i (softmax - onehot)` or `w_i (q - p)`, then
  `dz @ A`, `dz @ B`, `dz^T @ e`); backward only scales them. Five `[N, V]`-sized
  matmuls in all (two for the logits, three for the gradients) and one for the teacher.
- `row_weight=None`: `loss` is the `[N]` per-row value; backward recomputes the logits
  chunk by chunk (the per-row output gradients are unknown in forward).
- `teacher` `[N, H]`: p = softmax(teacher @ A^T) (the frozen head; Gemma-2's capped by
  `softcap`: fanout.ops.linear_kl.teacher_logits). The KL needs it; the CE uses it only
  for `accept` = `sum_v min(q_v, p_v)` = 1 - TV(q, p), computed from the same chunk's
  logits instead of a second pass (DSpark's confidence target).

- `two_head_ce_tv_and_argmax`: the compound `ce_weight * CE + tv_weight * TV(q, p)` per
  row (speculators' `{"ce": .., "tv": ..}` loss, XPress's), TV = 1 - sum_v min(q_v, p_v)
  with `dTV/dz = q (S - 1[q < p])`, S = sum of q where q < p; one pass gives both terms.
- `TwoHeadTerms`: several such compound terms over the same rows, head and teacher,
  each with its own second-head features (XPress's teacher-forced pass, backbone and
  Jacobi rounds): `x @ A^T` and p made once for all, x's gradient one matmul.

`e` and `b` may both be None (one frozen head only: the op is then the DFlash linear CE
plus the teacher agreement). No `[N, V]` logits exist at once: chunks of about 256 MiB
of fp32 per live `[chunk, V]` block. Logits, log-sum-exp, softmaxes and gradient
accumulation are fp32 whatever the input dtype (`mm_fp32`, as the linear CE). Rows whose
target is `ignore_index` have CE 0 and no gradient. Tested against materialised logits +
autograd in tests/test_two_head_ce.py.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import torch

from fanout.ops.argmax import row_argmax
from fanout.ops.linear_ce import _own_precision, mm_fp32, rows_per_chunk
from fanout.ops.linear_kl import teacher_logits

Kind = Literal["ce", "kl", "cetv"]


class TwoHeadOut(NamedTuple):
    """`loss`: differentiable, the scalar `sum_i row_weight_i * rows_i` when `row_weight`
    was given, else the `[N]` per-row values; `rows`: `[N]` fp32 per-row CE / KL,
    detached; `pred`: `[N]` argmax of the logits; `accept`: `[N]` fp32
    `sum_v min(q_v, p_v)` when a teacher was given (else None), detached."""

    loss: torch.Tensor
    rows: torch.Tensor
    pred: torch.Tensor
    accept: torch.Tensor | None


def _logits(
    x: torch.Tensor, e: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor | None
) -> torch.Tensor:
    """fp32 `x @ a^T (+ e @ b^T)` `[c, V]` of one chunk."""
    z = mm_fp32(x, a.t())  # [c, V]
    if e is not None and b is not None:
        if z.dtype == e.dtype == b.dtype:
            z.addmm_(e, b.t())  # fp32: accumulate in place, no second [c, V] block
        else:
            z += mm_fp32(e, b.t())
    return z


def _softmax_(z: torch.Tensor) -> torch.Tensor:
    """Row softmax of fp32 `[c, V]` in place (no second block)."""
    z.sub_(z.amax(dim=1, keepdim=True)).exp_()
    return z.div_(z.sum(dim=1, keepdim=True))


def _chunk(
    kind: str,
    z: torch.Tensor,  # [c, V] fp32 logits, overwritten with the gradient
    target: torch.Tensor | None,  # [c] int64 (ce)
    ignore_index: int,
    tz: torch.Tensor | None,  # [c, V] fp32 teacher logits, overwritten (or None)
    scale: torch.Tensor | None,  # [c] fp32 d(loss)/d(value_row), or None: 1
    mix: tuple[float, float] = (1.0, 0.0),  # ce / cetv: (CE weight, TV weight)
    shared_p: tuple[torch.Tensor, torch.Tensor] | None = None,  # ce / cetv, tz None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Row values `[c]`, argmax `[c]`, accept `[c]` (None without a teacher) and
    `scale_row * d(value_row)/d(logits)` `[c, V]` (in z's storage) of one chunk.
    `shared_p`: the teacher's softmax, already made and left as it is, and a `[c, V]`
    scratch block for what tz's storage holds otherwise (`TwoHeadTerms`)."""
    pred = row_argmax(z)  # [c], the first maximum, as argmax
    if kind != "kl":  # ce: CE; cetv: mix[0] CE + mix[1] TV
        assert target is not None and (kind == "ce" or tz is not None or shared_p is not None)
        ce_w, tv_w = mix
        keep = target != ignore_index  # [c]
        safe_t = torch.where(keep, target, torch.zeros_like(target))
        z_t = z.gather(1, safe_t[:, None]).squeeze(1)  # [c] target logit
        m = z.amax(dim=1)  # [c]
        z.sub_(m[:, None]).exp_()  # [c, V] exp(z - m), in place
        s = z.sum(dim=1)  # [c]
        val = ce_w * (m + s.log() - z_t)  # [c]
        q = z.div_(s[:, None])  # [c, V] softmax
        accept = q_below = None
        if tz is not None or shared_p is not None:
            # p's own storage is the scratch block unless p is shared (kept for later terms)
            if shared_p is None:
                assert tz is not None
                p = buf = _softmax_(tz)  # [c, V]
            else:
                p, buf = shared_p  # [c, V] each
            below = q < p if tv_w else None  # [c, V] where the draft's mass is the smaller
            accept = torch.minimum(p, q, out=buf).sum(dim=1)  # [c] sum_v min(q_v, p_v)
            if below is not None:
                q_below = torch.mul(q, below, out=buf)  # [c, V] q where q < p, 0 elsewhere
                val += tv_w * (1.0 - accept)
        # d/dz = w_ce (q - onehot) + w_tv q (S - 1[q < p]), S = sum of q where q < p
        if q_below is not None:
            q.mul_((ce_w + tv_w * q_below.sum(dim=1))[:, None]).sub_(q_below, alpha=tv_w)
        elif ce_w != 1.0:
            q.mul_(ce_w)
        q.scatter_add_(1, safe_t[:, None], torch.full_like(m, -ce_w)[:, None])  # - onehot
        q.mul_((keep if scale is None else keep * scale)[:, None])  # ignored rows: no grad
        return val * keep, pred, accept, q
    assert tz is not None
    # One exp per side: log p - log q = (tz - m_p) - (z - m_q) - log s_p + log s_q
    z.sub_(z.amax(dim=1, keepdim=True))  # [c, V] z - m_q
    tz.sub_(tz.amax(dim=1, keepdim=True))  # [c, V] tz - m_p
    p = tz.exp()  # [c, V]
    s_p = p.sum(dim=1)  # [c]
    p.div_(s_p[:, None])  # softmax p
    tz.sub_(z)  # [c, V] (tz - m_p) - (z - m_q)
    q = z.exp_()  # [c, V]
    s_q = q.sum(dim=1)  # [c]
    q.div_(s_q[:, None])  # softmax q
    val = tz.mul_(p).sum(dim=1) - s_p.log() + s_q.log()  # KL(p || q) (sum_v p_v = 1)
    accept = torch.minimum(p, q, out=tz).sum(dim=1)
    q.sub_(p)  # dKL/dlogits = q - p
    return val, pred, accept, q if scale is None else q.mul_(scale[:, None])


class _TwoHeadLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,  # [N, H]
        e: torch.Tensor | None,  # [N, r]
        a: torch.Tensor,  # [V, H] frozen
        b: torch.Tensor | None,  # [V, r]
        target: torch.Tensor | None,  # [N] int64 (ce)
        teacher: torch.Tensor | None,  # [N, H] (kl; ce: for accept)
        row_weight: torch.Tensor | None,  # [N]
        kind: str,
        ignore_index: int,
        chunk_rows: int | None,
        grad_on: bool,
        mix: tuple[float, float],
        softcap: float | None,  # the teacher's logit soft cap (Gemma-2), or None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        n, vocab = x.shape[0], a.shape[0]
        need = ctx.needs_input_grad
        need_x = grad_on and need[0]
        need_e = grad_on and e is not None and need[1]
        need_b = grad_on and b is not None and need[3]
        fold = row_weight is not None  # the caller's loss is sum_i w_i l_i: fold grads now
        blocks = 1 + (teacher is not None) + (kind == "kl")  # live [c, V] fp32 blocks
        c = rows_per_chunk(n, blocks * vocab, chunk_rows)
        dev = x.device
        vals = torch.empty(n, dtype=torch.float32, device=dev)
        preds = torch.empty(n, dtype=torch.long, device=dev)
        accept = torch.empty(n, dtype=torch.float32, device=dev) if teacher is not None else None
        f32 = torch.float32
        gx = torch.empty(x.shape, dtype=f32, device=dev) if fold and need_x else None
        ge = (
            torch.empty(e.shape, dtype=f32, device=dev)
            if fold and need_e and e is not None
            else None
        )
        gb = (
            torch.zeros(b.shape, dtype=f32, device=dev)
            if fold and need_b and b is not None
            else None
        )
        w = row_weight.float() if row_weight is not None else None
        with torch.no_grad(), _own_precision(dev):
            for s in range(0, n, c):
                t = min(s + c, n)
                ec = None if e is None else e[s:t]
                z = _logits(x[s:t], ec, a, b)  # [c, V]
                tz = None if teacher is None else teacher_logits(teacher[s:t], a, softcap)
                tc = None if target is None else target[s:t]
                grads = gx is not None or ge is not None or gb is not None
                scale = w[s:t] if w is not None and grads else None  # d(sum_i w_i l_i)/d(l_i)
                val, pred, acc, dz = _chunk(kind, z, tc, ignore_index, tz, scale, mix)
                del tz
                vals[s:t], preds[s:t] = val, pred
                if accept is not None and acc is not None:
                    accept[s:t] = acc
                if grads:
                    _grads(dz, ec, a, b, gx, ge, gb, s, t)
                del z, dz
        ctx.kind, ctx.ignore_index, ctx.chunk, ctx.fold = kind, ignore_index, c, fold
        ctx.mix, ctx.softcap = mix, softcap
        ctx.dtypes = (x.dtype, None if e is None else e.dtype, None if b is None else b.dtype)
        if fold:
            ctx.save_for_backward(gx, ge, gb)
        else:
            ctx.save_for_backward(x, e, a, b, target, teacher)
        out_rows = None
        if row_weight is not None:
            assert w is not None
            loss = (vals * w).sum()
            out_rows = vals
        else:
            loss = vals
        ctx.mark_non_differentiable(*(o for o in (out_rows, preds, accept) if o is not None))
        return loss, out_rows, preds, accept

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        x_dt, e_dt, b_dt = ctx.dtypes
        if ctx.fold:
            gx, ge, gb = ctx.saved_tensors
            g = g.float()  # scalar
            out = [
                None if t is None else (t * g).to(dt)
                for t, dt in ((gx, x_dt), (ge, e_dt), (gb, b_dt))
            ]
            return out[0], out[1], None, out[2], *[None] * 9
        return _TwoHeadLinear._recompute(ctx, g)

    @staticmethod
    def _recompute(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        x, e, a, b, target, teacher = ctx.saved_tensors
        need = ctx.needs_input_grad
        n, dev, f32 = x.shape[0], x.device, torch.float32
        gx = torch.empty(x.shape, dtype=f32, device=dev) if need[0] else None
        ge = torch.empty(e.shape, dtype=f32, device=dev) if e is not None and need[1] else None
        gb = torch.zeros(b.shape, dtype=f32, device=dev) if b is not None and need[3] else None
        g = g.float()  # [N]
        with torch.no_grad(), _own_precision(dev):
            for s in range(0, n, ctx.chunk):
                t = min(s + ctx.chunk, n)
                ec = None if e is None else e[s:t]
                z = _logits(x[s:t], ec, a, b)
                no_p = teacher is None or ctx.kind == "ce"
                tz = None if no_p else teacher_logits(teacher[s:t], a, ctx.softcap)
                tc = None if target is None else target[s:t]
                # [c, V] d(loss)/d(logits): scaled by each row's output gradient
                _, _, _, dz = _chunk(ctx.kind, z, tc, ctx.ignore_index, tz, g[s:t], ctx.mix)
                del tz
                _grads(dz, ec, a, b, gx, ge, gb, s, t)
                del z, dz
        x_dt, e_dt, b_dt = ctx.dtypes
        out = [None if t is None else t.to(dt) for t, dt in ((gx, x_dt), (ge, e_dt), (gb, b_dt))]
        return out[0], out[1], None, out[2], *[None] * 9


def _grads(
    dz: torch.Tensor,  # [c, V] fp32 d(loss)/d(logits) of rows s:t
    ec: torch.Tensor | None,  # [c, r]
    a: torch.Tensor,  # [V, H]
    b: torch.Tensor | None,  # [V, r]
    gx: torch.Tensor | None,  # [N, H] fp32, rows s:t written
    ge: torch.Tensor | None,  # [N, r] fp32, rows s:t written
    gb: torch.Tensor | None,  # [V, r] fp32, accumulated
    s: int,
    t: int,
) -> None:
    """The chunk's input gradients `dz @ A`, `dz @ B` and its share `dz^T @ e` of B's
    (no `dz^T @ x`: A is frozen)."""
    if gx is not None:
        gx[s:t] = mm_fp32(dz, a)
    if ge is not None and b is not None:
        ge[s:t] = mm_fp32(dz, b)
    if gb is not None and ec is not None:
        if ec.dtype == torch.float32:
            gb.addmm_(dz.t(), ec)  # in place, no [V, r] temporary
        else:
            gb += mm_fp32(dz.t(), ec)


def _check(
    x: torch.Tensor,
    e: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor | None,
    target: torch.Tensor | None,
    teacher: torch.Tensor | None,
    row_weight: torch.Tensor | None,
) -> None:
    n = x.shape[0]
    if target is not None and target.shape != (n,):
        raise ValueError(f"expected target [{n}], got {tuple(target.shape)}")
    if x.dim() != 2 or a.dim() != 2 or x.shape[1] != a.shape[1]:
        raise ValueError(
            f"expected x [N, H] and a [V, H], got {tuple(x.shape)} and {tuple(a.shape)}"
        )
    if (e is None) != (b is None):
        raise ValueError("give e and b together (the second head), or neither")
    if (
        e is not None
        and b is not None
        and (e.dim() != 2 or b.dim() != 2 or e.shape[0] != n or b.shape != (a.shape[0], e.shape[1]))
    ):
        raise ValueError(
            f"expected e [N, r] and b [V, r] with N = {n}, V = {a.shape[0]}, got "
            f"{tuple(e.shape)} and {tuple(b.shape)}"
        )
    if a.requires_grad:
        raise ValueError("the first head (a) is frozen here: pass it detached")
    if teacher is not None and teacher.shape != x.shape:
        raise ValueError(f"expected teacher {tuple(x.shape)}, got {tuple(teacher.shape)}")
    if row_weight is not None and row_weight.shape != (n,):
        raise ValueError(f"expected row_weight [{n}], got {tuple(row_weight.shape)}")


def _apply(
    x: torch.Tensor,
    e: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor | None,
    target: torch.Tensor | None,
    teacher: torch.Tensor | None,
    row_weight: torch.Tensor | None,
    kind: Kind,
    ignore_index: int,
    chunk_rows: int | None,
    mix: tuple[float, float] = (1.0, 0.0),
    softcap: float | None = None,
) -> TwoHeadOut:
    _check(x, e, a, b, target, teacher, row_weight)
    t = None if teacher is None else teacher.detach()
    w = None if row_weight is None else row_weight.detach()
    on = torch.is_grad_enabled()
    loss, rows, pred, accept = _TwoHeadLinear.apply(
        x, e, a, b, target, t, w, kind, ignore_index, chunk_rows, on, mix, softcap
    )
    return TwoHeadOut(loss, loss.detach() if rows is None else rows, pred, accept)


def two_head_cross_entropy_and_argmax(
    x: torch.Tensor,
    e: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor | None,
    target: torch.Tensor,
    *,
    teacher: torch.Tensor | None = None,
    row_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
    softcap: float | None = None,
) -> TwoHeadOut:
    """Cross-entropy of the logits `x @ a^T + e @ b^T` against `target`, without `[N, V]`
    logits (module docstring).

    Args:
        x: `[N, H]` rows; e: `[N, r]` second-head features (None: one head only).
        a: `[V, H]` frozen head (no gradient; refused if it requires one).
        b: `[V, r]` second head (trainable or not), None with e.
        target: `[N]` int64 class ids; `ignore_index` rows have CE 0 and no gradient.
        teacher: `[N, H]` rows whose softmax through `a` is p: also return
            `accept = sum_v min(softmax(logits)_v, p_v)`; `softcap` caps its logits.
        row_weight: `[N]` loss weights known now (treated as constants): `loss` is then
            the scalar `sum_i row_weight_i CE_i` and backward costs no matmul.
        chunk_rows: rows per chunk (default: about 256 MiB per live fp32 block).
    Returns:
        `TwoHeadOut(loss, rows, pred, accept)`; without row_weight, `loss` is the `[N]`
        per-row CE (fp32) and backward recomputes the logits.
    Example:
        >>> x, e = torch.randn(8, 4, requires_grad=True), torch.randn(8, 2)
        >>> b = torch.randn(10, 2, requires_grad=True)
        >>> out = two_head_cross_entropy_and_argmax(x, e, torch.randn(10, 4), b,
        ...     torch.randint(0, 10, (8,)), row_weight=torch.ones(8))
        >>> out.loss.backward()
    """
    t = target.long()
    return _apply(
        x, e, a, b, t, teacher, row_weight, "ce", ignore_index, chunk_rows, softcap=softcap
    )


def two_head_kl_div_and_argmax(
    x: torch.Tensor,
    e: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor | None,
    teacher: torch.Tensor,
    *,
    row_weight: torch.Tensor | None = None,
    chunk_rows: int | None = None,
    softcap: float | None = None,
) -> TwoHeadOut:
    """Per-row KL(p || q), p = softmax(teacher @ a^T), q = softmax(x @ a^T + e @ b^T),
    without `[N, V]` logits; arguments and `TwoHeadOut` as
    `two_head_cross_entropy_and_argmax` (`accept` always given here)."""
    return _apply(x, e, a, b, None, teacher, row_weight, "kl", -100, chunk_rows, softcap=softcap)


def two_head_ce_tv_and_argmax(
    x: torch.Tensor,
    e: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor | None,
    target: torch.Tensor,
    teacher: torch.Tensor,
    *,
    ce_weight: float,
    tv_weight: float,
    row_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
    softcap: float | None = None,
) -> TwoHeadOut:
    """Per-row `ce_weight * CE(target) + tv_weight * TV(q, p)`, q = softmax(x @ a^T +
    e @ b^T), p = softmax(teacher @ a^T), TV = 1 - sum_v min(q_v, p_v) (speculators'
    `tv_loss`), without `[N, V]` logits; arguments and `TwoHeadOut` as
    `two_head_cross_entropy_and_argmax` (`accept` = 1 - TV always given; an
    `ignore_index` row has neither term).

    Example:
        >>> x, a, t = torch.randn(8, 4, requires_grad=True), torch.randn(10, 4), torch.randn(8, 4)
        >>> out = two_head_ce_tv_and_argmax(x, None, a, None, torch.randint(0, 10, (8,)), t,
        ...     ce_weight=0.1, tv_weight=0.9, row_weight=torch.ones(8))
        >>> out.loss.backward()
    """
    mix = (float(ce_weight), float(tv_weight))
    t = target.long()
    return _apply(
        x, e, a, b, t, teacher, row_weight, "cetv", ignore_index, chunk_rows, mix, softcap
    )


class TwoHeadTerms:
    """Several compound CE + TV terms (`two_head_ce_tv_and_argmax`'s) over the same rows
    `x`, frozen head `a`, targets and teacher, each with its own second-head features
    `e_j` `[n, r]` through the same `b` (or none): XPress's teacher-forced pass, its
    backbone's own logits and its Jacobi rounds, where a round's `e_j` depends on the
    previous term's argmax, so the terms come one at a time.

        terms = TwoHeadTerms(x, a, b, target, teacher, ce_weight=0.1, tv_weight=0.9)
        base = terms.add(None, row_weight=w, weight=0.6)   # TwoHeadOut, loss detached
        tf = terms.add(e_tf, row_weight=w)                 # e_tf from the refiner (autograd)
        loss = terms.loss()   # sum_j weight_j sum_i w_ji l_ji: grads to x, b and every e_j

    Term by term through `two_head_ce_tv_and_argmax` each term costs six `[n, V]`-sized
    matmuls (`x @ a^T`, `teacher @ a^T`, `e @ b^T`, `dz @ a`, `dz @ b`, `dz^T @ e`).
    Here the head's logits `x @ a^T` and the teacher's softmax are made once for all
    terms, and x's gradient is one `(sum_j weight_j dz_j) @ a` in `loss()`: 2 + 3 per
    term with features + 1 (XPress's five terms: 15 instead of 27), the same values
    and gradients up to fp32 summation order (tests/test_two_head_ce.py). The gradients
    are folded in forward, as the op's with `row_weight`: backward only scales them.

    One chunk of rows, held whole: about five live `[n, V]` fp32 blocks (the head's
    logits, p, the x-gradient sum, a term's logits, a scratch block), so the caller
    splits its rows (`chunk_rows_for_terms`; XPress by whole blocks, which its rounds need).
    `add(e, row_weight=None)`: values, argmax and accept only (no loss, no gradient).
    Outside autograd (`torch.no_grad`, or nothing requires grad) no gradient is made.
    """

    def __init__(
        self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
        teacher: torch.Tensor, *, ce_weight: float, tv_weight: float, ignore_index: int = -100,
        softcap: float | None = None,
    ) -> None:  # fmt: skip
        _check(x, None, a, None, target, teacher, None)
        if b is not None and (b.dim() != 2 or b.shape[0] != a.shape[0]):
            raise ValueError(f"expected b [{a.shape[0]}, r], got {tuple(b.shape)}")
        self.x, self.a, self.b = x, a, b
        self.target, self.ignore_index = target.long(), ignore_index
        self.mix = (float(ce_weight), float(tv_weight))
        self.grad_on = torch.is_grad_enabled()
        self.need_x = self.grad_on and x.requires_grad
        self.need_b = self.grad_on and b is not None and b.requires_grad
        dev, f32 = x.device, torch.float32
        with torch.no_grad(), _own_precision(dev):
            self.za = mm_fp32(x.detach(), a.t())  # [n, V] the head's logits, every term's
            self.p = _softmax_(teacher_logits(teacher.detach(), a, softcap))  # [n, V] p
        self.scratch = torch.empty_like(self.za)
        self.dz_sum = torch.zeros_like(self.za) if self.need_x else None  # sum_j w_j dz_j
        self.gb = (
            torch.zeros(b.shape, dtype=f32, device=dev) if self.need_b and b is not None else None
        )
        self.es: list[torch.Tensor] = []  # features of the terms with a loss
        self.ges: list[torch.Tensor | None] = []  # their gradients (fp32)
        self.total = torch.zeros((), dtype=f32, device=dev)  # sum_j weight_j loss_j

    def add(
        self, e: torch.Tensor | None, *, row_weight: torch.Tensor | None = None,
        weight: float = 1.0,
    ) -> TwoHeadOut:  # fmt: skip
        """One term: logits `x @ a^T (+ e @ b^T)`. With `row_weight` `[n]` it joins
        `loss()` as `weight * sum_i row_weight_i l_i`; `TwoHeadOut.loss` is that sum
        (before `weight`), detached, `rows` the per-row values, `accept` always given."""
        n, b = self.x.shape[0], self.b
        if e is not None and (b is None or e.dim() != 2 or e.shape != (n, b.shape[1])):
            raise ValueError(
                f"expected e [{n}, {None if b is None else b.shape[1]}], got {tuple(e.shape)}"
            )
        if row_weight is not None and row_weight.shape != (n,):
            raise ValueError(f"expected row_weight [{n}], got {tuple(row_weight.shape)}")
        w = None if row_weight is None else row_weight.detach().float()
        need_e = self.grad_on and w is not None and e is not None and e.requires_grad
        grads = w is not None and (self.need_x or self.need_b or need_e)
        ed = None if e is None else e.detach()
        with torch.no_grad(), _own_precision(self.x.device):
            if ed is None or b is None:
                z = self.za.clone()
            elif self.za.dtype == ed.dtype == b.dtype:
                z = torch.addmm(self.za, ed, b.t())  # [n, V] fp32, no second block
            else:
                z = self.za + mm_fp32(ed, b.t())
            scale = w * weight if grads and w is not None else None
            val, pred, accept, dz = _chunk(
                "cetv", z, self.target, self.ignore_index, None, scale, self.mix,
                shared_p=(self.p, self.scratch),
            )  # fmt: skip
            if grads:
                if self.dz_sum is not None:
                    self.dz_sum += dz
                ge = mm_fp32(dz, b) if need_e and b is not None else None
                if self.gb is not None and ed is not None:
                    _grads(dz, ed, self.a, b, None, None, self.gb, 0, n)
            del z, dz
        loss = val.sum() if w is None else (val * w).sum()
        if w is not None:
            self.total += weight * loss
            if need_e and e is not None:
                self.es.append(e)
                self.ges.append(ge)
        assert accept is not None
        return TwoHeadOut(loss, val, pred, accept)

    def loss(self) -> torch.Tensor:
        """The scalar `sum_j weight_j sum_i w_ji l_ji` of the terms added with a
        `row_weight`, differentiable in x, b and their features (backward only scales
        the gradients made in forward). Call it once, after the last `add`."""
        gx = None
        if self.dz_sum is not None:
            with torch.no_grad(), _own_precision(self.x.device):
                gx = mm_fp32(self.dz_sum, self.a)  # [n, H] one matmul for every term
            self.dz_sum = None
        self.za = self.p = self.scratch = None  # type: ignore[assignment]  # freed
        if gx is None and self.gb is None and not self.es:
            return self.total
        x = self.x if gx is not None else self.x.detach()
        b = self.b if self.gb is not None else None
        out: torch.Tensor = _TermsLoss.apply(self.total, gx, self.gb, self.ges, x, b, *self.es)
        return out


class _TermsLoss(torch.autograd.Function):
    """`TwoHeadTerms.loss`: the folded gradients, scaled by the output gradient."""

    @staticmethod
    def forward(
        ctx: Any, total: torch.Tensor, gx: torch.Tensor | None, gb: torch.Tensor | None,
        ges: list[torch.Tensor | None], x: torch.Tensor, b: torch.Tensor | None,
        *es: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        ctx.grads = (gx, gb, ges)
        ctx.dtypes = (x.dtype, None if b is None else b.dtype, [e.dtype for e in es])
        return total.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        (gx, gb, ges), (x_dt, b_dt, e_dts) = ctx.grads, ctx.dtypes
        g = g.float()
        out_x = None if gx is None else (gx * g).to(x_dt)
        out_b = None if gb is None else (gb * g).to(b_dt)
        out_e = [None if ge is None else (ge * g).to(dt) for ge, dt in zip(ges, e_dts)]
        return (None, None, None, None, out_x, out_b, *out_e)


def chunk_rows_for_terms(n_rows: int, vocab: int, chunk_rows: int | None = None) -> int:
    """Rows a `TwoHeadTerms` chunk may hold: its five live `[rows, V]` fp32 blocks near
    the fused ops' chunk size (`rows_per_chunk`), or the caller's `chunk_rows`."""
    return rows_per_chunk(n_rows, 5 * vocab, chunk_rows)


__all__ = [
    "TwoHeadOut",
    "TwoHeadTerms",
    "chunk_rows_for_terms",
    "two_head_ce_tv_and_argmax",
    "two_head_cross_entropy_and_argmax",
    "two_head_kl_div_and_argmax",
]
