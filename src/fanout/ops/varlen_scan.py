"""Recurrences over packed rows whose state restarts at every document: the varlen scans.

    from fanout.ops.varlen_scan import SegmentLayout, causal_conv1d_varlen, gated_delta_rule_varlen
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
  which is the left zero padding a sequence alone gets);
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
documents.

Why hand-written: transformers' torch fallbacks (the only path on CPU, and on CUDA
without flash-linear-attention / causal-conv1d / mamba-ssm) take `cu_seq_lens_q` only
into `**kwargs` and ignore it (transformers 5.25: qwen3_next / qwen3_5
`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`; nemotron_h / falcon_h1
`mamba2_chunk_scan` has no boundary input at all), so they cannot reset at a document
start. On CUDA with
flash-linear-attention installed (`pip install fanout[hybrid]`) the gated delta rule
runs fla's varlen kernel instead (`cu_seqlens` over the flattened rows); without it,
this torch path runs there too; the convolutions and Mamba-2 always run here (no
mamba-ssm / causal-conv1d varlen path yet). The math per chunk is transformers'
`torch_chunk_gated_delta_rule` and `mamba2_chunk_scan` (Apache-2.0), with the resets
added.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CHUNK = 64  # transformers' chunk_size for the gated delta rule


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
) -> torch.Tensor:
    """Depthwise causal conv1d of [B, C, T] rows, each segment zero-padded on its left:
    out[t] = Σ_j weight[:, j] · x[t − (K − 1 − j)] over sources in t's segment
    (weight [C, K], bias [C] or None); then `activation` (silu or None)."""
    k = weight.shape[-1]
    t = x.shape[-1]
    w = weight.to(x.dtype)
    out = x * w[:, k - 1, None]  # [B, C, T] the tap on the token itself
    for s in range(1, k):  # tap reaching s tokens back
        if s >= t:
            break
        keep = (layout.offset[:, None, s:] >= s).to(x.dtype)  # [B, 1, T − s]
        out[..., s:] += x[..., :-s] * w[:, k - 1 - s, None] * keep
    if bias is not None:
        out = out + bias.to(x.dtype)[:, None]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"causal_conv1d_varlen: activation {activation!r} (silu or None)")
    return out


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' (and fla's) l2norm: x · rsqrt(Σ x² + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _fla_kernel() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None:
    """fla's varlen chunked gated delta rule, where flash-linear-attention is installed."""
    if importlib.util.find_spec("fla") is None:
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:  # an fla without it (or without triton): the torch path
        return None
    return chunk_gated_delta_rule


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
        return _gated_delta_rule_fla(fla, q, k, v, g, beta, layout, use_qk_l2norm)
    dtype = v.dtype
    b, t, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    if hk != hv:
        q, k = (x.repeat_interleave(hv // hk, dim=2) for x in (q, k))
    # [B, H, T, d] float32, as transformers' torch path computes
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    beta, g = (x.transpose(1, 2).float() for x in (beta, g))  # [B, H, T]
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * dk**-0.5
    c = chunk
    pad = (c - t % c) % c
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (t + pad) // c
    same, cont, last, carry = _chunk_segments(layout, c)  # [B, 1, n, (C, )C], [B, 1, n]
    ar = torch.arange(c, device=q.device)
    q, k, v = (x.unflatten(2, (n, c)) for x in (q, k, v))  # [B, H, n, C, d]
    beta, g = beta.unflatten(2, (n, c)), g.unflatten(2, (n, c))  # [B, H, n, C]
    v_beta = v * beta[..., None]
    k_beta = k * beta[..., None]
    upper = ar[None, :] > ar[:, None]  # [C, C] strictly upper: a later key
    cum = g.cumsum(dim=-1)  # [B, H, n, C] log decay from the chunk start
    # decay from key j to query i; only within a segment (its g alone is summed there)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    pair = pair * same
    ut = (k_beta @ k.transpose(-1, -2)) * pair  # [B, H, n, C, C], block-diagonal
    intra = (q @ k.transpose(-1, -2)) * pair  # [B, H, n, C, C]
    decay_in = cum.exp() * cont  # [B, H, n, C]: decay of the carried state at each token
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(
        ut, k_beta * decay_in[..., None], upper=False, unitriangular=True
    )
    q = q * decay_in[..., None]
    k = k * ((cum[..., -1:] - cum).exp() * last)[..., None]  # what the chunk's end keeps
    chunk_decay = (cum[..., -1].exp() * carry)[..., None, None]  # [B, H, n, 1, 1]
    state = q.new_zeros((b, hv, dk, dv))  # [B, H, dk, dv]
    out = torch.empty_like(new_v)  # [B, H, n, C, dv]
    for i in range(n):
        v_new = new_v[:, :, i] - k_cum[:, :, i] @ state  # [B, H, C, dv]
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.flatten(2, 3)[:, :, :t]  # [B, H, T, dv]
    return out.transpose(1, 2).to(dtype)  # [B, T, H, dv]


def _chunk_segments(
    layout: SegmentLayout, c: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """How the segments of [B, T] rows fall into chunks of `c` tokens (T padded to n·c,
    each padded slot a segment of its own). Returns, with a broadcast head axis:
    same [B, 1, n, C, C] bool (tokens i, j of a chunk in one segment); cont [B, 1, n, C]
    float (token of the segment the chunk opens with, begun in an earlier chunk: it
    reads the state carried in); last [B, 1, n, C] float (token of the segment the chunk
    ends in: it writes the state carried out); carry [B, 1, n] float (the chunk
    continues one segment throughout: the state carried in survives it)."""
    b, t = layout.segment.shape
    pad = (c - t % c) % c
    n = (t + pad) // c
    seg = F.pad(layout.segment, (0, pad), value=-1)  # [B, T']
    if pad:  # ids past any real one (those are < T)
        seg[:, t:] = t + torch.arange(pad, device=seg.device)
    off = F.pad(layout.offset, (0, pad))  # [B, T']
    seg, off = seg.view(b, 1, n, c), off.view(b, 1, n, c)  # [B, 1, n, C]
    same = seg[..., :, None] == seg[..., None, :]  # [B, 1, n, C, C]
    cont = ((seg == seg[..., :1]) & (off[..., :1] > 0)).float()  # [B, 1, n, C]
    last = (seg == seg[..., -1:]).float()  # [B, 1, n, C]
    return same, cont, last, cont[..., -1]


def ssd_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b_in: torch.Tensor,
    c_in: torch.Tensor,
    layout: SegmentLayout,
    *,
    chunk: int,
) -> torch.Tensor:
    """Mamba-2's selective state space (SSD) over packed rows, its state zero at every
    segment start: h_t = exp(dt_t·A) h_{t−1} + dt_t·x_t ⊗ B_t, y_t = C_t · h_t.

    x [B, T, H, P]; dt [B, T, H] (after dt_bias, softplus and the clamp: what the scan
    multiplies by); a [H] (A, < 0); b_in, c_in [B, T, G, N] (G groups, each shared by
    H / G heads). Returns y [B, T, H, P] float32 without the D skip term (the caller adds
    it, as transformers' `mamba2_chunk_scan` does). Chunked as that function is, with
    the pair decays summed per segment as its `segment_sum` does (a cumulative sum of
    the masked log decays, not a difference of two long sums), and the same
    segment handling as `gated_delta_rule_varlen`."""
    bsz, t, h, p = x.shape
    g = b_in.shape[2]
    x = x.float() * dt[..., None].float()  # [B, T, H, P] discretised input
    log_a = a.float() * dt.float()  # [B, T, H] log decay per token
    bb, cc = (y.float().repeat_interleave(h // g, dim=2) for y in (b_in, c_in))  # [B, T, H, N]
    pad = (chunk - t % chunk) % chunk
    n = (t + pad) // chunk
    same, cont, last, carry = _chunk_segments(layout, chunk)
    # [B, H, n, C, d] and [B, H, n, C]
    x, bb, cc = (F.pad(y, (0, 0, 0, 0, 0, pad)).permute(0, 2, 1, 3).unflatten(2, (n, chunk))
                 for y in (x, bb, cc))  # fmt: skip
    log_a = F.pad(log_a, (0, 0, 0, pad)).transpose(1, 2).unflatten(2, (n, chunk))
    cum = log_a.cumsum(-1)  # [B, H, n, C] log decay from the chunk start
    # segment_sum: L[i, j] = Σ_{j < s ≤ i} log_a[s] (−inf above the diagonal)
    tri = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device)
    seg_sum = log_a[..., :, None].expand(*log_a.shape, chunk)  # [.., s, j] = a[s]
    seg_sum = seg_sum.masked_fill(~tri.tril(-1), 0).cumsum(dim=-2)  # [.., i, j]
    seg_sum = seg_sum.masked_fill(~tri.tril(0), float("-inf"))
    pair = seg_sum.exp() * same  # [B, H, n, C, C]
    scores = (cc @ bb.transpose(-1, -2)) * pair  # [B, H, n, C, C]
    y = scores @ x  # [B, H, n, C, P] the intra-chunk terms
    decay_in = cum.exp() * cont  # [B, H, n, C]
    decay_out = (cum[..., -1:] - cum).exp() * last  # [B, H, n, C]
    writes = (bb * decay_out[..., None]).transpose(-1, -2) @ x  # [B, H, n, N, P]
    chunk_decay = (cum[..., -1].exp() * carry)[..., None, None]  # [B, H, n, 1, 1]
    state = x.new_zeros((bsz, h, bb.shape[-1], p))  # [B, H, N, P]
    reads = torch.empty_like(y)
    for i in range(n):
        reads[:, :, i] = cc[:, :, i] @ state  # [B, H, C, P]
        state = state * chunk_decay[:, :, i] + writes[:, :, i]
    y = y + reads * decay_in[..., None]
    return y.flatten(2, 3)[:, :, :t].transpose(1, 2)  # [B, T, H, P]


def _gated_delta_rule_fla(
    fla: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    layout: SegmentLayout,
    use_qk_l2norm: bool,
) -> torch.Tensor:
    """fla's chunk_gated_delta_rule on the rows flattened to one sequence of B·T tokens,
    one varlen sequence per segment (`cu_seqlens`): its state restarts at each."""
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
