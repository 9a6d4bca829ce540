"""Draft attention: every family's queries over its keys, computing only what its mask allows.

    from fanout.model.draft_attention import DraftAttention, PrefixMask
    attn = DraftAttention(cfg, qk_norm=True)            # q/k/v/o projections (+ q/k norm)
    mask = PrefixMask.blocks(document_ids, anchors, valid, block_size=16)   # DFlash's
    k, v = attn.kv(torch.cat([ctx, x], dim=1), rope_k)  # [B, nkv, T + A·bs, hd] each
    out = attn.attend(x, k, v, rope_q, mask)            # [B, A·bs, H]
    .venv/bin/python benchmarks/draft_attention.py   # every family's step: dense vs this vs speculators

One mask shape serves every family (`PrefixMask`): the keys are C *context* keys
followed by others; queries come in G groups of `group` consecutive queries, and a
query of group g sees
- the context keys t < `limit[g]` whose document `key_doc[t]` is the group's `doc[g]`
  (none when `sees_context[g]` is off), and
- its group's *own* keys `own[g, :]` (key indices; `own_ok[g, i, :]` says which of them
  query i sees; all when `own_ok` is None).
Its constructors, one per family's mask:
- DFlash, DFlash2, DSpark, XPress (`blocks`): context = the T row positions, limit the
  block's anchor, own = the block's bs slots (bidirectional); fanout.model.anchors.
- MTP and EAGLE-3's training-time test (`causal`): context = the R rows, limit the row
  itself (strict), own = the row at every step so far (the row's step-0 key and its
  steps 1..s: speculators' diagonal mask).
- P-EAGLE (`chains`): context = the R depth-0 rows, limit the chain's anchor, own = the
  chain's positions at depths <= the query's.
Every query sees at least one own key (itself or its block), so no softmax row is empty.

How it computes (`prefix_attention`): groups sorted by the end of their allowed context,
taken `chunk` queries at a time; each chunk runs one SDPA over the context range its
groups need, `[first allowed, last allowed]` over the chunk, followed by the own keys
its queries see that lie outside that range, each once (the positions of a chain are
the own keys of all of them; a causal row's step-0 key is a context key), under the
chunk's slice of the mask. A softmax over a superset of the allowed keys, the rest
masked, is the same softmax, so it matches the dense masked SDPA (the reference:
`PrefixMask.dense`, `dense_reference`; tests/test_draft_attention.py, fp32, gradients
too) while computing about the allowed scores. The chunk plan (`PrefixMask.plan`) is
made once per mask, on first use, and shared by every layer and both passes; its
masks are handed to SDPA additive (0 / -inf) and GQA-repeated, made once per plan
(SDPA would convert a boolean mask at every call, forward and backward). Scores
computed over the allowed ones at the benchmark shape (benchmarks/draft_attention.py:
T = 3072, 512 anchors, block 16), dense / chunks of `CHUNK_QUERIES` = 256:
DFlash's blocks 7.3× / 1.19× (chunks of 128: 1.09×, 512: 1.39×); EAGLE-3's third TTT
step (R = 3071) 6.0× / 1.41×; P-EAGLE's chains (4275 positions, 8 depths) 2.7× /
1.10× (2.35× before the own keys were taken once a chunk: every position's chain,
depths × the chunk's queries). Why this and not the alternatives (measured on
the shared 2-vCPU machine, torch 2.13, that DFlash shape at h 256, 4 heads of 64, 2 KV
heads: one attention's forward + backward):
- chunked SDPA 0.6-1.0 s against 3.0 s for the dense masked SDPA, the peak process
  memory 520 MB against 800 MB; chunks of 64 to 512 queries within the noise, 256 kept
  (fewer SDPA calls than 64 or 128, fewer wasted scores than 512). Each chunk is one
  4-D SDPA, which keeps torch's fused kernels (CPU flash, CUDA memory-efficient) and no
  `[Q, K]` score matrix for the backward; the queries and keys of all chunks are
  gathered once (one scatter each in the backward; a first version sliced q/k/v per
  chunk, a full-size zero gradient per slice, and passed 3-D tensors, which SDPA sends
  to its unfused math path: 3.3-4.0 s);
- a split into a context part and a block part merged by log-sum-exp needs the
  log-sum-exp's gradient, which torch's fused kernels do not give: it would keep the
  scores (memory O(Q·K));
- a plan per EAGLE-3 TTT step: each step is the same rows with one more step's keys, a
  row's later-step keys come last in its chunk, so the `causal` mask of all S steps is
  made once a batch (`ChainDraft.start`) and step s runs its plan cut to the first
  (s+1)·R keys (`PrefixMask.plan` -> `_Plan.first_keys`: the same chunks, each a
  prefix of its keys and mask columns, the SDPA masks views of the full ones). Made
  anew every step it cost 5-7 ms a step at R = 511 and 80-100 ms at R = 3071 (one
  thread, the shared 2-vCPU EPYC under load; 0.15-0.3 s a step in issue #56);
- `flex_attention` (speculators' choice on CUDA): in torch 2.13 it has no backward on
  the CPU ("FlexAttention does not support backward on CPU"); on CUDA the GPU check
  (benchmarks/gpu/checks.sh) runs this module against speculators' flex attention.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# queries per SDPA call of `prefix_attention` (the module docstring says why 256)
CHUNK_QUERIES = 256
_DENSE = [False]  # `dense_reference()` on: every PrefixMask runs as its dense mask


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rope(nn.Module):
    """Qwen3/Llama "rotate half" RoPE from explicit positions."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def forward(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        f = pos.float()[..., None] * self.inv_freq  # [B, L, hd/2]
        emb = torch.cat((f, f), dim=-1)  # [B, L, hd]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` `[B, h, L, hd]` rotated by `cos`/`sin` `[B, L, hd]`."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


@dataclass(eq=False)
class PrefixMask:
    """Which keys each query sees (module docstring); `dense()` is the boolean SDPA mask
    it stands for. Built by `blocks`, `causal` or `chains`."""

    limit: torch.Tensor  # [B, G] long: context keys t < limit
    doc: torch.Tensor  # [B, G] long: ... whose key_doc is this
    key_doc: torch.Tensor  # [B, C] long: each context key's document
    sees_context: torch.Tensor  # [B, G] bool
    own: torch.Tensor  # [B, G, n] long: key indices of the group's own keys
    own_ok: torch.Tensor | None  # [B, G, group, n] bool, None: every own key
    group: int  # queries per group
    _plans: dict[tuple[int, int], _Plan] = field(default_factory=dict, repr=False)
    _reach: int | None = field(default=None, repr=False)  # key_count(), once known

    @classmethod
    def blocks(
        cls,
        document_ids: torch.Tensor,  # [B, T]
        anchors: torch.Tensor,  # [B, A]
        valid: torch.Tensor,  # [B, A]
        block_size: int,
    ) -> PrefixMask:
        """DFlash's mask (fanout.model.anchors): keys = T context positions, then the
        A·bs block slots; block j sees context t < anchor_j of its anchor's document and
        its whole block; a padding block only itself."""
        b, t = document_ids.shape
        a = anchors.shape[1]
        own = t + torch.arange(a * block_size, device=anchors.device).view(1, a, block_size)
        return cls(
            anchors, document_ids.gather(1, anchors), document_ids, valid.bool(),
            own.expand(b, -1, -1), None, block_size,
        )  # fmt: skip

    @classmethod
    def causal(cls, row_doc: torch.Tensor, steps: int = 1) -> PrefixMask:
        """MTP's and EAGLE-3's: `steps` blocks of R keys (step 0, 1, ...); row r sees
        the step-0 rows <= r of its document and itself at every step; a row of
        document -1 only itself."""
        b, r = row_doc.shape
        ar = torch.arange(r, device=row_doc.device)
        own = ar[:, None] + r * torch.arange(steps, device=row_doc.device)  # [R, steps]
        return cls(
            ar.expand(b, -1), row_doc, row_doc, row_doc >= 0,
            own.expand(b, -1, -1), None, 1,
        )  # fmt: skip

    @classmethod
    def chains(
        cls,
        anchor: torch.Tensor,  # [B, S] each position's chain (its depth-0 row)
        depth: torch.Tensor,  # [B, S]
        valid: torch.Tensor,  # [B, S]
        row_doc: torch.Tensor,  # [B, R] (the first R positions are the rows, depth 0)
        depths: int,
    ) -> PrefixMask:
        """P-EAGLE's (fanout.families.peagle.model): position (a, d) sees the depth-0
        rows <= a of its document and its chain's depths <= d; padding only itself."""
        b, s = anchor.shape
        r = row_doc.shape[1]
        dev = anchor.device
        doc = row_doc.gather(1, anchor)  # [B, S]
        ok = valid & (doc >= 0)
        idx = torch.arange(s, device=dev).expand(b, -1)  # [B, S]
        pos_of = torch.full((b, r * depths), -1, dtype=torch.long, device=dev)
        slot = torch.where(valid, anchor * depths + depth, r * depths)  # padding: dropped
        pos_of = torch.cat([pos_of, pos_of[:, :1]], 1).scatter(1, slot, idx)[:, :-1]
        chain = pos_of.view(b, r, depths).gather(1, anchor[:, :, None].expand(-1, -1, depths))
        alone = torch.full_like(chain, -1)
        alone[:, :, 0] = idx
        own = torch.where(ok[:, :, None], chain, alone)  # [B, S, depths]
        k = torch.arange(depths, device=dev)
        own_ok = (own >= 0) & ((k <= depth[:, :, None]) | ~ok[:, :, None])  # [B, S, depths]
        return cls(anchor, doc, row_doc, ok, own.clamp(min=0), own_ok[:, :, None], 1)

    def context_ok(self) -> torch.Tensor:
        """`[B, G, C]` bool: the context keys each group sees."""
        c = self.key_doc.shape[1]
        t = torch.arange(c, device=self.limit.device)
        return (
            (t < self.limit[:, :, None])
            & (self.key_doc[:, None, :] == self.doc[:, :, None])
            & self.sees_context[:, :, None]
        )

    def own_visible(self) -> torch.Tensor:
        """`[B, G, group, n]` bool: the own keys each query sees."""
        b, g, n = self.own.shape
        if self.own_ok is None:
            return torch.ones(b, g, self.group, n, dtype=torch.bool, device=self.own.device)
        return self.own_ok.expand(b, g, self.group, n)

    def dense(self, num_keys: int) -> torch.Tensor:
        """The boolean SDPA mask `[B, 1, G·group, num_keys]` this stands for (own keys
        at or past `num_keys` left out: `plan`)."""
        b, g, n = self.own.shape
        ctx = self.context_ok().repeat_interleave(self.group, dim=1)  # [B, Q, C]
        m = torch.zeros(b, g * self.group, num_keys, dtype=torch.bool, device=ctx.device)
        m[:, :, : ctx.shape[2]] = ctx
        own = self.own[:, :, None, :].expand(b, g, self.group, n).reshape(b, -1, n)
        seen = self.own_visible().reshape(b, -1, n) & (own < num_keys)
        m.scatter_reduce_(2, own.clamp(max=num_keys - 1), seen, "amax")
        return m[:, None]

    def key_count(self) -> int:
        """Keys the mask reaches: its context keys and every own key (one sync, once)."""
        if self._reach is None:
            own = int(self.own.max()) + 1 if self.own.numel() else 0
            self._reach = max(self.key_doc.shape[1], own)
        return self._reach

    def bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`[B, G]` long each: a group's first allowed context key and its last + 1 (C
        and 0 where it sees none), in O((C + G) log C): the keys sorted by (document,
        position), a group's allowed keys are its document's run up to its limit (no
        `[B, G, C]` mask; `context_ok` is what they bound)."""
        b, c = self.key_doc.shape
        g = self.doc.shape[1]
        dev = self.key_doc.device
        if c == 0:
            return torch.zeros(b, g, dtype=torch.long, device=dev), self.limit.new_zeros(b, g)
        # documents as ranks shared by keys and groups: (rank, position) -> one int64
        _, rank = torch.unique(torch.cat([self.key_doc, self.doc], 1), return_inverse=True)
        t = torch.arange(c, device=dev)
        code = (rank[:, :c] * (c + 1) + t).sort(dim=1).values  # [B, C]
        pos = code % (c + 1)  # [B, C] key positions, by document then position
        base = rank[:, c:] * (c + 1)  # [B, G] the group's document's first code
        first = torch.searchsorted(code, base)  # [B, G] its document's first key
        past = torch.searchsorted(code, base + self.limit.clamp(0, c))  # first at/after limit
        seen = (past > first) & self.sees_context
        lo = torch.where(seen, pos.gather(1, first.clamp(max=c - 1)), c)
        hi = torch.where(seen, pos.gather(1, (past - 1).clamp(min=0)) + 1, 0)
        return lo, hi

    def plan(self, chunk: int, num_keys: int) -> _Plan:
        """The chunks of `prefix_attention` (module docstring): groups ordered by their
        allowed context's end, `chunk` queries a chunk, each with its query and key
        indices and its slice of the mask. Computed once per mask, on first use (every
        layer of a forward, and both passes, share it). Fewer keys than the mask reaches
        (`key_count`; at least its context keys): the own keys past them are left out,
        and the plan is the full one's, each chunk's keys cut to those below `num_keys`
        (`_Plan.first_keys`, no new plan): a `causal` mask of S steps serves every TTT
        step s < S (`num_keys` (s+1)·R), built once a batch (issue #56)."""
        key = (chunk, num_keys)
        if key not in self._plans:
            full = self.key_count()
            if num_keys >= full:
                self._plans[key] = _make_plan(self, chunk, num_keys)
            elif num_keys < self.key_doc.shape[1]:
                raise ValueError(
                    f"{num_keys} keys, fewer than the mask's {self.key_doc.shape[1]} context keys"
                )
            else:
                self._plans[key] = self.plan(chunk, full).first_keys(num_keys)
        return self._plans[key]


@dataclass
class _Plan:
    """Every chunk of every batch row, flattened: gather `q_index` from the `[B·Q]`
    queries and `k_index` from the `[B·K]` keys, split them by `q_sizes` / `k_sizes`,
    run one SDPA per chunk under `masks[i]`, and put the outputs back with `inverse`."""

    q_index: torch.Tensor  # [B·Q] long
    k_index: torch.Tensor  # [N] long
    q_sizes: list[int]
    k_sizes: list[int]
    masks: list[torch.Tensor]  # [q_sizes[i], k_sizes[i]] bool each
    inverse: torch.Tensor  # [B·Q] long: position of each query's output row
    num_keys: int  # K: the keys of each batch row (k_index = row·K + key)
    _sdpa: dict[tuple[int, torch.dtype], list[torch.Tensor]] = field(default_factory=dict)
    _parent: _Plan | None = None  # first_keys' source: its SDPA masks, cut

    def first_keys(self, num_keys: int) -> _Plan:
        """This plan over the first `num_keys` keys only (at least every chunk's context
        range): in each chunk the own keys past them are the last columns (its context
        range comes first, then the own keys outside it in key order), so every chunk
        keeps a prefix of its keys and its mask's first columns; the SDPA masks are
        views of this plan's (`sdpa_masks`)."""
        full = self.num_keys
        key = self.k_index % full
        keep = key < num_keys
        chunk_of = torch.repeat_interleave(
            torch.arange(len(self.k_sizes), device=key.device),
            torch.tensor(self.k_sizes, device=key.device),
        )  # [N] each key's chunk
        sizes = torch.bincount(chunk_of[keep], minlength=len(self.k_sizes)).tolist()
        k_index = ((self.k_index // full) * num_keys + key)[keep]
        masks = [m[:, :w] for m, w in zip(self.masks, sizes)]
        return _Plan(self.q_index, k_index, self.q_sizes, sizes, masks, self.inverse,
                     num_keys, _parent=self)  # fmt: skip

    def sdpa_masks(self, rep: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """`masks` as SDPA takes them with `rep` query heads a KV head folded into the
        queries: additive (0 / -inf) `[rep·q_sizes[i], k_sizes[i]]` of `dtype`, made once
        per plan. SDPA would turn a boolean mask into this itself at every call, forward
        and backward (~20% of a CPU chunk's time), and save it for the backward anyway."""
        key = (rep, dtype)
        if key not in self._sdpa and self._parent is not None:  # the first columns of its
            full = self._parent.sdpa_masks(rep, dtype)  # (SDPA takes the strided view)
            self._sdpa[key] = [m[:, :w] for m, w in zip(full, self.k_sizes)]
        if key not in self._sdpa:
            self._sdpa[key] = [
                torch.zeros(m.shape, dtype=dtype, device=m.device)
                .masked_fill_(~m, float("-inf"))
                .repeat(rep, 1)
                for m in self.masks
            ]
        return self._sdpa[key]


def _make_plan(m: PrefixMask, chunk: int, num_keys: int) -> _Plan:
    """`PrefixMask.plan`. A chunk's keys are its context range `[start, end)` and, after
    it, the own keys its queries see that lie outside it, each once: every depth of a
    chain sees the chain's positions (P-EAGLE: up to `depths` times fewer keys than one
    set a position), and a causal row's step-0 key is already a context key. The indices are built on
    the CPU from the bounds and the own keys (one device-to-host copy of each, a few
    ops per batch row) and moved once; the masks are built on the mask's device in one
    buffer (each chunk's context slice, then one scatter of every chunk's own keys)."""
    b, n_groups, _ = m.own.shape
    g, c, dev = m.group, m.key_doc.shape[1], m.own.device
    lo, hi = (x.cpu() for x in m.bounds())  # [B, G] each
    own, sees = m.own.cpu(), m.own_visible().cpu()  # [B, G, n], [B, G, g, n]
    per = max(1, chunk // g)  # groups a chunk
    n_ch = -(-n_groups // per)  # chunks a batch row
    pad = n_ch * per - n_groups
    row = torch.arange(n_groups * g).view(n_groups, g, 1) % (per * g)  # a query's chunk row
    ch = torch.arange(n_groups) // per  # [G] a sorted group's chunk
    q_idx, k_idx, on, chunks = [], [], [], []
    size = 0  # bool cells of the masks so far
    for r in range(b):
        order = torch.argsort(hi[r], stable=True)  # [G] groups by their context's end
        end = F.pad(hi[r, order], (0, pad)).view(n_ch, per).amax(1)  # [n_ch]
        start = torch.minimum(F.pad(lo[r, order], (0, pad), value=c).view(n_ch, per).amin(1), end)
        vis = sees[r, order]  # [G, g, n] which own keys each query sees
        keys = own[r, order]  # [G, n]
        inside = (keys >= start[ch, None]) & (keys < end[ch, None])  # a context column already
        code = ch[:, None] * num_keys + keys  # [G, n] (chunk, key) as one int64
        extra = torch.unique(code[vis.any(1) & ~inside])  # [E] each chunk's outside keys, once
        n_extra = torch.bincount(extra // num_keys, minlength=n_ch)  # [n_ch]
        first = n_extra.cumsum(0) - n_extra  # [n_ch] a chunk's first in `extra`
        span = end - start  # [n_ch]
        col = torch.where(  # [G, n] each own key's column in its chunk
            inside, keys - start[ch, None],
            (span - first)[ch, None] + torch.searchsorted(extra, code),
        )  # fmt: skip
        width = span + n_extra  # [n_ch] keys a chunk
        rows_n = torch.full((n_ch,), per * g)
        rows_n[-1] = (n_groups - (n_ch - 1) * per) * g
        cells = rows_n * width
        off = size + cells.cumsum(0) - cells  # [n_ch] a chunk's first cell
        at = (off[ch, None] + col)[:, None, :] + row * width[ch, None, None]  # [G, g, n]
        on.append(at[vis])
        size += int(cells.sum())
        q_idx.append(r * n_groups * g + (order[:, None] * g + torch.arange(g)).flatten())
        extra = extra % num_keys
        order_dev = order.to(dev)
        for i, (s, e, f, ne, w, qn) in enumerate(
            zip(*(x.tolist() for x in (start, end, first, n_extra, width, rows_n)))
        ):
            k_idx.append(r * num_keys + torch.cat([torch.arange(s, e), extra[f : f + ne]]))
            chunks.append((r, order_dev[i * per : (i + 1) * per], s, e, qn, w))
    flat = torch.zeros(size, dtype=torch.bool, device=dev)
    lim = torch.where(m.sees_context, m.limit, 0)  # [B, G] none seen: limit 0
    t = torch.arange(c, device=dev)
    masks, off_ = [], 0
    for r, gs, s, e, qn, w in chunks:
        mask = flat[off_ : off_ + qn * w].view(qn, w)
        ctx = (t[s:e] < lim[r, gs, None]) & (m.key_doc[r, None, s:e] == m.doc[r, gs, None])
        mask[:, : e - s].view(qn // g, g, e - s).copy_(ctx[:, None])  # [cg, L] -> [cg·g, L]
        masks.append(mask)
        off_ += qn * w
    flat[torch.cat(on).to(dev)] = True  # every chunk's own keys, one scatter
    q_index = torch.cat(q_idx)
    inverse = torch.empty_like(q_index)
    inverse[q_index] = torch.arange(q_index.numel())
    q_sizes = [x[4] for x in chunks]
    k_sizes = [x[5] for x in chunks]
    return _Plan(
        q_index.to(dev), torch.cat(k_idx).to(dev), q_sizes, k_sizes, masks, inverse.to(dev),
        num_keys,
    )  # fmt: skip


@contextlib.contextmanager
def dense_reference() -> Iterator[None]:
    """Run every PrefixMask attention as the one dense masked SDPA over all keys (the
    reference the tests compare with; the benchmark's old path)."""
    before = _DENSE[0]
    _DENSE[0] = True
    try:
        yield
    finally:
        _DENSE[0] = before


def attention(
    q: torch.Tensor,  # [B, nh, Q, hd]
    k: torch.Tensor,  # [B, nkv, K, hd]
    v: torch.Tensor,  # [B, nkv, K, hd]
    mask: PrefixMask | torch.Tensor | None,
    *,
    chunk: int | None = None,
) -> torch.Tensor:
    """Attention of `q` over `k`, `v` under `mask` (a PrefixMask, a boolean
    `[B, 1, Q, K]` SDPA mask, or None: every key) -> `[B, nh, Q, hd]`. GQA: nh a
    multiple of nkv."""
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, PrefixMask):
        if _DENSE[0]:
            mask = mask.dense(k.shape[2])
        else:
            return prefix_attention(q, k, v, mask, chunk or CHUNK_QUERIES)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def prefix_attention(
    q: torch.Tensor,  # [B, nh, Q, hd]
    k: torch.Tensor,  # [B, nkv, K, hd]
    v: torch.Tensor,  # [B, nkv, K, hd]
    mask: PrefixMask,
    chunk: int,
) -> torch.Tensor:
    """`attention` under a PrefixMask, chunk by chunk (module docstring). One gather of
    the queries and one of the keys/values for all chunks (one scatter each in the
    backward, not one per chunk), then one 4-D SDPA per chunk (torch's fused kernel)."""
    b, nh, q_len, hd = q.shape
    nkv, k_len = k.shape[1], k.shape[2]
    if q_len != mask.own.shape[1] * mask.group:
        raise ValueError(
            f"{q_len} queries, but the mask has {mask.own.shape[1]} groups of {mask.group}"
        )
    p = mask.plan(chunk, k_len)
    rep = nh // nkv
    qs = q.transpose(1, 2).reshape(b * q_len, nh, hd).index_select(0, p.q_index)
    ks = k.transpose(1, 2).reshape(b * k_len, nkv, hd).index_select(0, p.k_index)
    vs = v.transpose(1, 2).reshape(b * k_len, nkv, hd).index_select(0, p.k_index)
    outs = []
    masks = p.sdpa_masks(rep, q.dtype)  # [rep·c, L] each
    for qc, kc, vc, mf in zip(qs.split(p.q_sizes), ks.split(p.k_sizes), vs.split(p.k_sizes), masks):
        # GQA folded into the sequence: the rep query heads of a KV head one after the
        # other ([nkv, rep·c, hd]), the mask repeated, so no kernel needs enable_gqa
        # (CUDA's memory-efficient kernel, the one that takes a mask, has none)
        c = qc.shape[0]
        qf = qc.view(c, nkv, rep, hd).permute(1, 2, 0, 3).reshape(1, nkv, rep * c, hd)
        o = F.scaled_dot_product_attention(
            qf, kc.transpose(0, 1)[None], vc.transpose(0, 1)[None], attn_mask=mf
        )  # [1, nkv, rep·c, hd]
        outs.append(o.view(nh, c, hd))  # head h = kv head h // rep, as enable_gqa
    o = torch.cat(outs, 1).index_select(1, p.inverse)  # [nh, B·Q, hd]
    return o.view(nh, b, q_len, hd).transpose(0, 1)


class DraftAttention(nn.Module):
    """A draft layer's attention: q/k/v/o projections from `in_features` (default H),
    with `qk_norm` Qwen3's per-head q/k RMSNorm before RoPE. Parameter names are
    speculators' / HF's (`q_proj`, ..., `q_norm`, `k_norm`)."""

    def __init__(self, cfg: Any, in_features: int | None = None, *, qk_norm: bool = True) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        n_in = h if in_features is None else in_features
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(n_in, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(n_in, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(n_in, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, h, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps) if qk_norm else None

    def kv(self, x: torch.Tensor, rope: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k-normed, rotated) and values of `x` `[B, L, in]`: `[B, nkv, L, hd]` each."""
        b, n, _ = x.shape
        k = self.k_proj(x).view(b, n, self.nkv, self.hd)
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = self.v_proj(x).view(b, n, self.nkv, self.hd).transpose(1, 2)
        return apply_rope(k.transpose(1, 2), *rope), v

    def attend(
        self,
        x: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: Any,
        mask: PrefixMask | torch.Tensor | None,
    ) -> torch.Tensor:
        """Queries of `x` `[B, Q, in]` over `k`, `v` `[B, nkv, K, hd]` -> `[B, Q, H]`."""
        b, q_len, _ = x.shape
        q = self.q_proj(x).view(b, q_len, self.nh, self.hd)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rope(q.transpose(1, 2), *rope)  # [B, nh, Q, hd]
        o = attention(q, k, v, mask)  # [B, nh, Q, hd]
        return self.o_proj(o.transpose(1, 2).reshape(b, q_len, self.nh * self.hd))


__all__ = [
    "CHUNK_QUERIES",
    "DraftAttention",
    "PrefixMask",
    "Rope",
    "apply_rope",
    "attention",
    "dense_reference",
    "prefix_attention",
]
