"""Causal attention over packed rows in query blocks: each document's keys only, no T × T mask.

    from fanout.model.packed_attention import packed_attention
    with packed_attention(text_model.config, layout):  # layout: fanout.ops.varlen_scan.SegmentLayout
        out = text_model(input_ids=ids, position_ids=pos, use_cache=False)  # [B, T] packed rows

A packed row under dense masks (fanout.model.layer_types) costs every attention layer
T² scores and the masks T² bytes per row, of which a row of D documents uses about T²/D:
at 4k-token rows of ~300-token documents, 13× more than the documents need. Inside the
block every attention layer reading `config` runs `attend` (registered in transformers'
AttentionInterface as `fanout_packed`; transformers then builds no mask, as for
fanout.model.local_attention): the row is cut into query blocks of `BLOCK` tokens, and
a block sees the keys from the start of its first query's document to its own end
(`back + BLOCK` keys, `back` = the furthest any block's first query reaches into its
document), under one [BLOCK, back + BLOCK] mask per block: same segment, causal. Each
padding token is a segment of its own and sees only itself, as under the dense masks.
Cost O(T·(back + BLOCK)) per row; a row that is one long document costs what the dense
mask did.

Full (causal) attention only: the verifier uses it for packed rows whose attention
layers are all `full_attention` and whose recurrent layers reset per document
(PackingRule.varlen: the hybrids); other models keep their dense masks. Soft-capping
and attention sinks are refused (no hybrid fanout packs has them).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fanout.model.local_attention import AttentionCall, attention_function, swapped_attention
from fanout.ops.varlen_scan import SegmentLayout, host_to_device

NAME = "fanout_packed"  # the attention implementation's name in transformers' registry
# queries per block: 64 measured ~5% faster captures than 128 (benchmarks/verifiers.py
# part 4, documents of ~300 tokens: blocks read fewer keys before their own document)
BLOCK = 64


@dataclass(frozen=True, slots=True)
class _Bucket:
    """The query blocks that see `back` keys before their first query (a multiple of
    BLOCK), and their mask."""

    back: int
    rows: torch.Tensor  # [P] long: each block's row
    cols: torch.Tensor  # [P] long: its index within the row
    flat: torch.Tensor  # [P] long: row · n + index, into the [B·n] blocks
    mask: torch.Tensor  # [P, 1, BLOCK, back + BLOCK] bool


@dataclass(frozen=True, slots=True)
class _Blocks:
    """The query blocks of [B, T] rows and their keys' masks, shared by every layer:
    blocks bucketed by how far back their first query's document began (rounded up to
    BLOCK), so a block after a document start reads few keys, not the row's furthest."""

    t: int
    n: int  # blocks per row
    back: int  # the most keys before a block's first query any block may see
    buckets: tuple[_Bucket, ...]

    @classmethod
    def of(cls, layout: SegmentLayout) -> _Blocks:
        seg = layout.segment  # [B, T]
        b, t = seg.shape
        n = math.ceil(t / BLOCK)
        # per block, its first query's offset rounded up to BLOCK: on the host copy (no sync)
        need = (layout.host_offset[:, ::BLOCK] + BLOCK - 1) // BLOCK * BLOCK  # [B, n]
        back = int(need.max())
        # segment ids ≥ 0; −2 left of the row (seen by no query), −1 right of it (the
        # queries past the end see each other: no empty softmax row)
        keys = F.pad(F.pad(seg, (back, 0), value=-2), (0, n * BLOCK - t), value=-1)
        qs = F.pad(seg, (0, n * BLOCK - t), value=-1).view(b, n, BLOCK)  # [B, n, Q]
        a = torch.arange(BLOCK, device=seg.device)[:, None]  # [Q, 1] query in its block
        buckets = []
        for w in need.unique().tolist():
            rows, cols = (need == w).nonzero().unbind(1)  # [P] each, host
            flat = rows * n + cols
            rows, cols, flat = (host_to_device(x, seg.device) for x in (rows, cols, flat))
            span = w + BLOCK
            ks = keys[:, back - w :].unfold(1, span, BLOCK)[rows, cols]  # [P, span]
            c = torch.arange(span, device=seg.device)[None, :]  # [1, span] key in the window
            mask = (qs[rows, cols][:, :, None] == ks[:, None, :]) & (c - w <= a)  # [P, Q, span]
            buckets.append(_Bucket(w, rows, cols, flat, mask[:, None]))
        return cls(t, n, back, tuple(buckets))


_BLOCKS: ContextVar[_Blocks | None] = ContextVar("fanout_packed_blocks", default=None)


@contextmanager
def packed_attention(config: Any, layout: SegmentLayout) -> Iterator[None]:
    """While in this block, the attention layers reading `config` (a text model's
    config) run `attend` over rows of `layout`, with no mask built."""
    with swapped_attention(config, NAME, attend, _BLOCKS, _Blocks.of(layout)):
        yield


def _document_blocks(call: AttentionCall, blocks: _Blocks) -> torch.Tensor:
    """One layer over the packed rows of `blocks` (`document_blocks`), full attention."""
    if call.q.shape[2] != blocks.t:
        raise RuntimeError(f"{NAME} attention takes the packed rows whole ({blocks.t} tokens)")
    if call.sliding_window is not None or call.softcap is not None or call.sinks is not None:
        layer = getattr(call.module, "layer_idx", "?")
        raise RuntimeError(f"{NAME} attention is causal full attention only (layer {layer})")
    return document_blocks(call.q, call.k, call.v, blocks, call.scale)  # [B, H, T, Dv]


attend = attention_function(NAME, _BLOCKS, _document_blocks)


def document_blocks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: _Blocks, scale: float
) -> torch.Tensor:
    """[B, H, T, D] queries, [B, Hkv, T, D] keys, [B, Hkv, T, Dv] values → [B, H, T, Dv]:
    each query attends to the earlier keys of its own segment (one SDPA per bucket)."""
    b, h, t, _d = q.shape
    n, back = blocks.n, blocks.back
    qb = F.pad(q, (0, 0, 0, n * BLOCK - t))  # [B, H, n·Q, D]
    qb = qb.unflatten(2, (n, BLOCK)).transpose(1, 2).flatten(0, 1)  # [B·n, H, Q, D]
    kp, vp = (F.pad(x, (0, 0, back, n * BLOCK - t)) for x in (k, v))  # [B, Hkv, back + n·Q, d]
    out = q.new_empty((b * n, h, BLOCK, v.shape[-1]))  # [B·n, H, Q, Dv]
    for bk in blocks.buckets:
        span = bk.back + BLOCK
        kb, vb = (
            x[:, :, back - bk.back :]
            .unfold(2, span, BLOCK)  # [B, Hkv, n, d, span]: block j's keys (a view)
            .permute(0, 2, 1, 4, 3)[bk.rows, bk.cols]  # [P, Hkv, span, d] (a copy)
            for x in (kp, vp)
        )
        o = F.scaled_dot_product_attention(
            qb.index_select(0, bk.flat), kb, vb, attn_mask=bk.mask, scale=scale,
            enable_gqa=h != k.shape[1],
        )  # fmt: skip
        out.index_copy_(0, bk.flat, o)  # [P, H, Q, Dv] back to their blocks
    out = out.unflatten(0, (b, n)).transpose(1, 2).flatten(2, 3)  # [B, H, n·Q, Dv]
    return out[:, :, :t]
