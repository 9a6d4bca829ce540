"""Recurrences over packed rows whose state restarts at every document: the varlen scans.

    from fanout.ops.varlen_scan import (SegmentLayout, causal_conv1d_varlen,
                                        gated_delta_rule_varlen, ssd_varlen)
    lay = SegmentLayout.from_document_ids(document_ids)   # [B, T] rows, −1 = padding
    y = causal_conv1d_varlen(x, weight, bias, lay, activation="silu")   # x [B, C, T], weight [C, K]
    o = gated_delta_rule_varlen(q, k, v, g, beta, lay)   # q, k [B, T, Hk, dk]; v [B, T, Hv, dv]
    y = ssd_varlen(x, dt, a, b_in, c_in, lay, chunk=64)  # Mamba-2: x [B, T, H, P]

A packed row holds several documents; a recurrent layer (a gated delta rule's state,
a short causal convolution's window, a Mamba-2 state) run over the row as one sequence
would carry each document's state into the next. Here every segment (a document; each
padding token alone) starts from the state it has alone, zero:
- the causal conv1d sums its K taps only over sources in the token's own segment
  (`SegmentLayout.offset`: a tap reaching back past the segment start reads zero,
  which is the left zero padding a sequence alone gets): one conv1d over the rows,
  then the tokens fewer than K − 1 into their segment computed again from their own
  taps (a gather: ~K tokens per document);
- the chunked gated delta rule (and Mamba-2's chunked SSD scan, the same without the
  delta rule's UT system) runs on the rows as they are, in chunks of 64 tokens
  that may hold several segments. Within a chunk, the pair terms (the UT system and
  the intra-chunk attention) are kept to pairs of one segment (block-diagonal, so the
  triangular solve never mixes two); only the chunk's first segment, where it began
  in an earlier chunk, reads the state carried in; only its last segment writes the
  state carried out, which keeps the old state only where one segment spans the whole
  chunk. Each decay factor sums the log decays of one segment's tokens alone, so none
  underflows for crossing another document. Per document this is the recurrence
  transformers computes alone, only chunked at other token offsets (float order).
No token is added or moved: one sequential step per 64 tokens of a row, whatever its
documents, batched over rows and heads.

How it is laid out (the CPU cost is the pair terms: T × chunk per head, a few passes
each): chunk-major [n, B, H, C, ...] tensors, so the sequential loop reads contiguous
slices and every other step is one batched op over all chunks; the loop only carries
the state (the gated delta rule's 2 baddbmm per chunk, Mamba-2's 1 addcmul), and the
state reads of all chunks are one bmm after it; q/k heads (and Mamba-2's groups) stay
unrepeated, broadcast to their value heads; the pair decays are masked and
exponentiated in place, and the intra-chunk scores reuse their memory; one triangular
solve takes both right-hand sides.

Why hand-written: transformers' torch fallbacks (the only path on CPU, and on CUDA
without flash-linear-attention / causal-conv1d / mamba-ssm) take `cu_seq_lens_q` only
into `**kwargs` and ignore it (transformers 5.25: qwen3_next / qwen3_5
`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`; nemotron_h / falcon_h1
`mamba2_chunk_scan` has no boundary input at all), so they cannot reset at a document
start. On CUDA with
flash-linear-attention installed (`pip install fanout[hybrid]`) the gated delta rule
runs fla's varlen kernel instead (`cu_seqlens` over the flattened rows); without it,
this torch path runs there too. Likewise with causal-conv1d and mamba-ssm installed
(`pip install fanout[mamba]`: both build CUDA extensions) the convolutions and Mamba-2's
scan run their kernels, the segments handed over as `seq_idx` (a token's segment index:
a tap or a state crosses no change of it), else this torch path. The math per chunk is transformers'
`torch_chunk_gated_delta_rule` and `mamba2_chunk_scan` (Apache-2.0), with the resets
added.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

CHUNK = 64  # transformers' chunk_size for the gated delta rule
# CPU: a group of chunks' pair terms, 1 MiB (measured, benchmarks/verifiers.py part 4:
# 256 KiB groups of heads of 16 ran 2 chunks a group, 3-4% slower in Python overhead)
GROUP_FLOATS = 1 << 18
# the log of float32's smallest normal number (1.18e-38 = e^-87.3): every decay factor
# (≤ 1) is exponentiated from its log clamped here, so none comes out subnormal. A decay
# below it weighs nothing at float32's precision, but a subnormal result costs the CPU's
# exp ~30× (measured: 262k exps of [8, 2, 4, 64, 64] pair decays 0.3 ms, 9.9 ms where they
# land in (e^-103.9, e^-87.3); decays of random or trained gated-delta heads fall there
# often: a head's log decay of −5 a token crosses it 18 tokens back)
LOG_TINY = -87.0


@dataclass(frozen=True, slots=True)
class SegmentLayout:
    """Where each token of [B, T] packed rows sits among its row's segments (tensors on
    the rows' device). A segment is a maximal run of one document id ≥ 0; each padding
    token (id −1) is a segment of its own, as it attends only to itself under the
    attention layers' masks (fanout.model.layer_types) and runs alone in
    fanout.model.documents."""

    segment: torch.Tensor  # [B, T] long: segment index within its row, from 0
    offset: torch.Tensor  # [B, T] long: tokens before this one in its segment
    cu_seqlens: torch.Tensor  # [S + 1] long: segment starts over the flattened [B·T] rows
    host_offset: torch.Tensor  # [B, T] long: `offset` on the host, read without a sync

    @classmethod
    def from_document_ids(cls, document_ids: torch.Tensor) -> SegmentLayout:
        """The layout of [B, T] rows (document id per token, −1 on padding). Computed on
        the host (one copy of the ids), then moved to their device."""
        d = document_ids.detach().cpu()  # [B, T]
        b, t = d.shape
        start = torch.ones(b, t, dtype=torch.bool)  # [B, T]: a segment starts here
        start[:, 1:] = (d[:, 1:] != d[:, :-1]) | (d[:, 1:] < 0)
        seg = start.long().cumsum(1) - 1  # [B, T]
        pos = torch.arange(t).expand(b, t)  # [B, T]
        first = torch.zeros(b, t, dtype=torch.long)  # [B, S_max]: where each segment starts
        first.scatter_reduce_(1, seg, pos, reduce="amin", include_self=False)
        offset = pos - first.gather(1, seg)  # [B, T]
        flat = start.flatten().nonzero().squeeze(1)  # [S] segment starts in [B·T]
        cu = torch.cat([flat, torch.tensor([b * t])])  # [S + 1]
        return cls(seg, offset, cu, offset).to(document_ids.device)

    def to(self, device: torch.device) -> SegmentLayout:
        """This layout on `device` (through pinned memory to CUDA: no host sync)."""

        def move(x: torch.Tensor) -> torch.Tensor:
            if device.type != "cuda" or x.device.type == "cuda":
                return x.to(device)
            return x.pin_memory().to(device, non_blocking=True)

        return SegmentLayout(
            move(self.segment), move(self.offset), move(self.cu_seqlens), self.host_offset
        )


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    layout: SegmentLayout,
    activation: str | None = None,
    *,
    kernel: bool = True,
) -> torch.Tensor:
    """Depthwise causal conv1d of [B, C, T] rows, each segment zero-padded on its left:
    out[t] = Σ_j weight[:, j] · x[t − (K − 1 − j)] over sources in t's segment
    (weight [C, K], bias [C] or None); then `activation` (silu or None).

    The K taps summed over the rows as they are (K fused multiply-adds over the row,
    half the CPU time of a depthwise conv1d; transformers' torch path is that conv1d,
    the same sum in another float order), then the few tokens nearer their segment's
    start than K − 1, whose taps crossed into the segment before, computed again from
    their own segment's taps alone (a gather of [P, K, C]). On CUDA with causal-conv1d
    installed (K of 2-4 and C a multiple of 8, its kernel's limits), its kernel instead
    (`kernel=False`: this path even there, its reference in tests)."""
    k = weight.shape[-1]
    # the kernel's limits: widths 2-4; channel-last (what seq_idx needs) with C % 8 == 0
    fits = 2 <= k <= 4 and x.shape[1] % 8 == 0
    conv = _conv_kernel() if kernel and x.is_cuda and fits else None
    if conv is not None:
        return _causal_conv1d_kernel(conv, x, weight, bias, layout, activation)
    t = x.shape[-1]
    w = weight.to(x.dtype)
    b_ = None if bias is None else bias.to(x.dtype)
    out = x * w[:, k - 1, None]  # [B, C, T] the tap on the token itself
    for s in range(1, min(k, t)):  # the tap reaching s tokens back
        out[..., s:].addcmul_(x[..., :-s], w[:, k - 1 - s, None])
    if b_ is not None:
        out += b_[:, None]
    near = (layout.host_offset < k - 1).nonzero()  # [P, 2] (row, column), on the host
    if k > 1 and near.numel():
        rows, cols = host_to_device(near, x.device).unbind(1)  # [P] each
        taps = torch.arange(k, device=x.device)  # tap s reads s tokens back
        inside = taps <= layout.offset[rows, cols][:, None]  # [P, K]: within the segment
        src = (cols[:, None] - taps).clamp(min=0)  # [P, K]
        xs = x[rows[:, None], :, src] * inside[..., None]  # [P, K, C]
        fixed = (xs * w.flip(-1).T).sum(1)  # [P, C]: weight[:, K − 1 − s] on tap s
        out[rows, :, cols] = fixed if b_ is None else fixed + b_
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"causal_conv1d_varlen: activation {activation!r} (silu or None)")
    return out


def _causal_conv1d_kernel(
    conv: Callable[..., torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    layout: SegmentLayout,
    activation: str | None,
) -> torch.Tensor:
    """causal-conv1d's kernel on [B, C, T] rows, a tap read only where its token's
    `seq_idx` is the output token's. It takes `seq_idx` (int32, contiguous) in the
    channel-last layout only (stride 1 along C: what the mixers' transposed projections
    already are)."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d_varlen: activation {activation!r} (silu or None)")
    if x.stride(1) != 1:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    b_ = None if bias is None else bias.to(x.dtype)
    return conv(x, weight.to(x.dtype), b_, seq_idx=_seq_idx(layout), activation=activation)


def host_to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` (through pinned memory to CUDA: no host sync)."""
    if device.type != "cuda" or x.device.type == "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' (and fla's) l2norm: x · rsqrt(Σ x² + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


@functools.cache
def _installed(module: str, name: str) -> Callable[..., Any] | None:
    """`module.name` where its package is installed and imports (its CUDA extension or
    triton present), else None: the torch path then."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return None
    try:
        found: Callable[..., Any] | None = getattr(importlib.import_module(module), name, None)
    except (ImportError, OSError):  # built for another torch or CUDA: the torch path
        return None
    return found


def _fla_kernel() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None:
    """fla's varlen chunked gated delta rule, where flash-linear-attention is installed."""
    return _installed("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")


def _conv_kernel() -> Callable[..., torch.Tensor] | None:
    """causal-conv1d's `causal_conv1d_fn` (its `seq_idx` keeps taps within a segment),
    where it is installed (`pip install fanout[mamba]`)."""
    return _installed("causal_conv1d", "causal_conv1d_fn")


def _ssd_kernel() -> Callable[..., torch.Tensor] | None:
    """mamba-ssm's `mamba_chunk_scan_combined` (its `seq_idx` restarts the state at each
    segment), where it is installed (`pip install fanout[mamba]`)."""
    return _installed("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")


def _seq_idx(layout: SegmentLayout) -> torch.Tensor:
    """The kernels' `seq_idx` [B, T] int32: each token's segment index in its row (a new
    value at every document start and at each padding token)."""
    return layout.segment.to(torch.int32).contiguous()


def gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    layout: SegmentLayout,
    *,
    chunk: int = CHUNK,
    use_qk_l2norm: bool = True,
    kernel: bool = True,
) -> torch.Tensor:
    """The gated delta rule over packed rows, its state zero at every segment start.

    q, k [B, T, Hk, dk]; v [B, T, Hv, dv] (Hv a multiple of Hk: each q/k head serves
    Hv / Hk consecutive value heads); g [B, T, Hv] log decay (≤ 0); beta [B, T, Hv].
    Returns [B, T, Hv, dv] in v's dtype. kernel=False: the torch path even where fla
    is installed (its reference in tests)."""
    fla = _fla_kernel() if kernel and q.is_cuda else None
    if fla is not None:
        return _gated_delta_rule_fla(fla, (q, k, v, g, beta), layout, use_qk_l2norm)
    dtype = v.dtype
    b, t, _hk, dk = k.shape
    hv, dv = v.shape[-2:]
    c = chunk
    n = -(-t // c)  # chunks per row
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * dk**-0.5
    # chunk-major, float32 as transformers' torch path computes: [n, B, H, C, d], [n, B, Hv, C];
    # the q/k heads stay Hk (each value head h reads key head h // r through a broadcast)
    q, k, v, g, beta = (_chunks(x, n, c) for x in (q, k, v, g, beta))
    drop, cont, last, carry = _chunk_segments(layout, n, c)  # [n, B, C, C], [n, B, C] ×2, [n, B]
    cum = g.cumsum(dim=-1)  # [n, B, Hv, C] log decay from the chunk start
    m = b * hv  # (row, value head) pairs, the sequential loop's batch
    out = q.new_empty((n, m, c, dv))
    state = q.new_zeros((m, dk, dv))  # carried from group to group
    for s, e in _groups(n, m * c * c, q.is_cuda):
        state = _gated_delta_chunks(
            q[s:e], k[s:e], v[s:e], cum[s:e], beta[s:e], drop[s:e], cont[s:e], last[s:e],
            carry[s:e], state, out[s:e],
        )  # fmt: skip
    out = out.view(n, b, hv, c, dv).permute(1, 0, 3, 2, 4).reshape(b, n * c, hv, dv)
    return out[:, :t].to(dtype)  # [B, T, Hv, dv]


def _groups(n: int, floats_per_chunk: int, cuda: bool) -> list[tuple[int, int]]:
    """The chunks [s, e) taken at a time: all at once on CUDA; on the CPU as many as keep
    one group's [.., C, C] pair terms within GROUP_FLOATS, so the few passes over them
    stay in cache rather than streaming the whole row's through memory."""
    step = n if cuda else max(1, GROUP_FLOATS // floats_per_chunk)
    return [(s, min(n, s + step)) for s in range(0, n, step)]


def _gated_delta_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cum: torch.Tensor,
    beta: torch.Tensor,
    drop: torch.Tensor,
    cont: torch.Tensor,
    last: torch.Tensor,
    carry: torch.Tensor,
    state: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """n consecutive chunks of `gated_delta_rule_varlen` (chunk-major: q, k [n, B, Hk, C, dk],
    v [n, B, Hv, C, dv], cum and beta [n, B, Hv, C], the masks of `_chunk_segments`),
    from `state` [B·Hv, dk, dv] carried in; writes out [n, B·Hv, C, dv], returns the
    state carried out."""
    n, b, hk, c, dk = k.shape
    hv, dv = v.shape[2], v.shape[-1]
    r, m = hv // hk, b * hv
    # decay from key j to query i, only within a segment (its g alone is summed there)
    pair = _decay_(cum[..., :, None] - cum[..., None, :]).masked_fill_(drop[:, :, None], 0.0)
    pair = pair.view(n, b, hk, r, c, c)  # [n, B, Hk, r, C, C]
    k6 = k[:, :, :, None]  # [n, B, Hk, 1, C, dk]
    kt = k6.transpose(-1, -2)  # [n, B, Hk, 1, dk, C]
    beta = beta.view(n, b, hk, r, c, 1)
    ut = ((k6 * beta) @ kt).mul_(pair)  # [n, B, Hk, r, C, C] block-diagonal: one segment's pairs
    intra = pair.mul_(q[:, :, :, None] @ kt)  # [n, B, Hk, r, C, C] (pair's memory)
    # decay of the carried state at each token: only the chunk's first segment reads it
    decay_in = _decay_(cum.clone()).mul_(cont[:, :, None]).view(n, b, hk, r, c, 1)
    rhs = torch.cat([v.view(n, b, hk, r, c, dv) * beta, k6 * (beta * decay_in)], dim=-1)
    sol = torch.linalg.solve_triangular(ut, rhs, upper=False, unitriangular=True)
    del ut, rhs
    new_v = sol[..., :dv].reshape(n, m, c, dv)
    k_cum = sol[..., dv:].reshape(n, m, c, dk)
    q_in = (q[:, :, :, None] * decay_in).reshape(n * m, c, dk)
    # what the chunk's end keeps of each key: only the chunk's last segment writes
    keep = (_decay_(cum[..., -1:] - cum) * last[:, :, None]).view(n, b, hk, r, c, 1)
    k_out = (k6 * keep).reshape(n, m, c, dk).transpose(-1, -2)  # [n, m, dk, C]
    chunk_decay = (_decay_(cum[..., -1].clone()) * carry[:, :, None]).reshape(n, m, 1, 1)
    # the sequential part: the state before each chunk, and each chunk's new values
    states = q.new_empty((n, m, dk, dv))
    states[0] = state
    v_new = torch.empty_like(new_v)  # [n, m, C, dv]
    for i in range(n):
        torch.baddbmm(new_v[i], k_cum[i], states[i], alpha=-1, out=v_new[i])
        state = torch.baddbmm(states[i] * chunk_decay[i], k_out[i], v_new[i])
        if i + 1 < n:
            states[i + 1] = state
    flat = out.view(n * m, c, dv)
    torch.bmm(q_in, states.view(n * m, dk, dv), out=flat)  # the state read
    flat.baddbmm_(intra.reshape(n * m, c, c), v_new.view(n * m, c, dv))  # + within the chunk
    return state


def _decay_(log_decay: torch.Tensor) -> torch.Tensor:
    """exp of log decays in place, each clamped to [LOG_TINY, 0] (a decay factor is ≤ 1;
    entries above 0 are pairs the caller masks out): never a subnormal (LOG_TINY says why)."""
    return log_decay.clamp_(LOG_TINY, 0.0).exp_()


def _chunks(x: torch.Tensor, n: int, c: int) -> torch.Tensor:
    """[B, T, H, ...] → [n, B, H, C, ...] float32, contiguous, T zero-padded to n·c."""
    b, t = x.shape[:2]
    x = x.float()
    if n * c > t:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, n * c - t))
    x = x.view(b, n, c, *x.shape[2:])  # [B, n, C, H, ...]
    return x.permute(1, 0, 3, 2, *range(4, x.dim())).contiguous()


def _chunk_segments(
    layout: SegmentLayout, n: int, c: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """How the segments of [B, T] rows fall into n chunks of `c` tokens (T padded to n·c,
    each padded slot a segment of its own), chunk-major. Returns
    drop [n, B, C, C] bool (token j is not an earlier token of i's segment: the pair
    terms skip it); cont [n, B, C] float (token of the segment the chunk opens with,
    begun in an earlier chunk: it reads the state carried in); last [n, B, C] float
    (token of the segment the chunk ends in: it writes the state carried out); carry
    [n, B] float (the chunk continues one segment throughout: the state carried in
    survives it)."""
    b, t = layout.segment.shape
    seg, off = layout.segment, layout.offset
    if n * c > t:  # ids past any real one (those are < T)
        extra = t + torch.arange(n * c - t, device=seg.device)
        seg = torch.cat([seg, extra.expand(b, -1)], dim=1)  # [B, n·C]
        off = F.pad(off, (0, n * c - t))
    seg, off = seg.view(b, n, c).transpose(0, 1), off.view(b, n, c).transpose(0, 1)  # [n, B, C]
    ar = torch.arange(c, device=seg.device)
    drop = (seg[..., :, None] != seg[..., None, :]) | (ar[None, :] > ar[:, None])
    cont = ((seg == seg[..., :1]) & (off[..., :1] > 0)).float()
    last = (seg == seg[..., -1:]).float()
    return drop, cont, last, cont[..., -1]


def ssd_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b_in: torch.Tensor,
    c_in: torch.Tensor,
    layout: SegmentLayout,
    *,
    chunk: int,
    kernel: bool = True,
) -> torch.Tensor:
    """Mamba-2's selective state space (SSD) over packed rows, its state zero at every
    segment start: h_t = exp(dt_t·A) h_{t−1} + dt_t·x_t ⊗ B_t, y_t = C_t · h_t.

    x [B, T, H, P]; dt [B, T, H] (after dt_bias, softplus and the clamp: what the scan
    multiplies by); a [H] (A, < 0); b_in, c_in [B, T, G, N] (G groups, each shared by
    H / G consecutive heads). Returns y [B, T, H, P] float32 without the D skip term (the
    caller adds it, as transformers' `mamba2_chunk_scan` does). Chunked as that function
    is, with the pair decays summed per segment as its `segment_sum` does (a cumulative
    sum of the masked log decays, not a difference of two long sums), and the same
    segment handling as `gated_delta_rule_varlen`. On CUDA with mamba-ssm installed, its
    `mamba_chunk_scan_combined` with the segments as `seq_idx` instead (`kernel=False`:
    this path even there, its reference in tests)."""
    ssd = _ssd_kernel() if kernel and x.is_cuda else None
    if ssd is not None:
        # dt as the scan multiplies by it: no bias, softplus or clamp left to the kernel
        return ssd(x, dt, a.float(), b_in, c_in, chunk, seq_idx=_seq_idx(layout)).float()
    bsz, t, h, p = x.shape
    g = b_in.shape[2]
    r, c = h // g, chunk
    n = -(-t // c)
    x = x.float() * dt[..., None].float()  # [B, T, H, P] discretised input
    log_a = a.float() * dt.float()  # [B, T, H] log decay per token
    x, log_a = _chunks(x, n, c), _chunks(log_a, n, c)  # [n, B, H, C, P], [n, B, H, C]
    bb, cc = _chunks(b_in, n, c), _chunks(c_in, n, c)  # [n, B, G, C, N]: heads share them
    drop, cont, last, carry = _chunk_segments(layout, n, c)
    cum = log_a.cumsum(-1)  # [n, B, H, C] log decay from the chunk start
    # segment_sum: L[i, j] = Σ_{j < s ≤ i} log_a[s]; its exp, then 0 off the segment's pairs
    below = torch.ones(c, c, dtype=torch.bool, device=x.device).tril(-1)  # [s, j]: s > j
    pair = torch.where(below, log_a[..., :, None], 0.0).cumsum_(dim=-2)  # [n, B, H, C, C]
    pair = _decay_(pair).masked_fill_(drop[:, :, None], 0.0).view(n, bsz, g, r, c, c)
    scores = pair.mul_((cc @ bb.transpose(-1, -2))[:, :, :, None])  # [n, B, G, r, C, C]
    x = x.view(n, bsz, g, r, c, p)
    y = scores @ x  # [n, B, G, r, C, P] the intra-chunk terms
    keep = (_decay_(cum[..., -1:] - cum) * last[:, :, None]).view(n, bsz, g, r, c, 1)
    writes = (bb[:, :, :, None] * keep).transpose(-1, -2) @ x  # [n, B, G, r, N, P]
    chunk_decay = (_decay_(cum[..., -1].clone()) * carry[:, :, None]).view(n, bsz, g, r, 1, 1)
    states = torch.empty_like(writes)  # the state before each chunk
    states[0].zero_()
    for i in range(n - 1):
        torch.addcmul(writes[i], states[i], chunk_decay[i], out=states[i + 1])
    decay_in = (_decay_(cum.clone()) * cont[:, :, None]).view(n, bsz, g, r, c, 1)
    y.addcmul_(cc[:, :, :, None] @ states, decay_in)  # + the state read
    y = y.view(n, bsz, h, c, p).permute(1, 0, 3, 2, 4).reshape(bsz, n * c, h, p)
    return y[:, :t]  # [B, T, H, P]


def _gated_delta_rule_fla(
    fla: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    qkvgb: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    layout: SegmentLayout,
    use_qk_l2norm: bool,
) -> torch.Tensor:
    """fla's chunk_gated_delta_rule on the rows flattened to one sequence of B·T tokens,
    one varlen sequence per segment (`cu_seqlens`): its state restarts at each.
    `qkvgb`: `gated_delta_rule_varlen`'s q, k, v, g, beta."""
    q, k, v, g, beta = qkvgb
    b, t = q.shape[:2]
    hk, hv = k.shape[2], v.shape[2]
    if hk != hv:
        q, k = (x.repeat_interleave(hv // hk, dim=2) for x in (q, k))
    flat = [x.reshape(1, b * t, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o, _ = fla(
        *flat[:3],
        g=flat[3].float(),
        beta=flat[4],
        cu_seqlens=layout.cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        output_final_state=False,
    )
    return o.reshape(b, t, *o.shape[2:]).to(v.dtype)
