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

from fanout.model.local_attention import swapped_attention
from fanout.ops.varlen_scan import SegmentLayout

NAME = "fanout_packed"  # the attention implementation's name in transformers' registry
BLOCK = 128  # queries per block


@dataclass(frozen=True, slots=True)
class _Blocks:
    """The query blocks of [B, T] rows and their keys' mask, shared by every layer."""

    t: int
    n: int  # blocks per row
    back: int  # keys before a block's first query that it may see
    mask: torch.Tensor  # [B·n, 1, BLOCK, back + BLOCK] bool

    @classmethod
    def of(cls, layout: SegmentLayout) -> _Blocks:
        seg = layout.segment  # [B, T]
        b, t = seg.shape
        n = math.ceil(t / BLOCK)
        back = int(layout.host_offset[:, ::BLOCK].max())  # the host copy: no device sync
        span = back + BLOCK
        # segment ids ≥ 0; −2 left of the row (seen by no query), −1 right of it (the
        # queries past the end see each other: no empty softmax row)
        keys = F.pad(F.pad(seg, (back, 0), value=-2), (0, n * BLOCK - t), value=-1)
        ks = keys.unfold(1, span, BLOCK).flatten(0, 1)  # [B·n, span]: block j's keys
        qs = F.pad(seg, (0, n * BLOCK - t), value=-1).view(b * n, BLOCK)  # [B·n, Q]
        a = torch.arange(BLOCK, device=seg.device)[:, None]  # [Q, 1] query in its block
        c = torch.arange(span, device=seg.device)[None, :]  # [1, span] key in the window
        causal = c - back <= a  # [Q, span]
        mask = (qs[:, :, None] == ks[:, None, :]) & causal  # [B·n, Q, span]
        return cls(t, n, back, mask[:, None])


_BLOCKS: ContextVar[_Blocks | None] = ContextVar("fanout_packed_blocks", default=None)


@contextmanager
def packed_attention(config: Any, layout: SegmentLayout) -> Iterator[None]:
    """While in this block, the attention layers reading `config` (a text model's
    config) run `attend` over rows of `layout`, with no mask built."""
    with swapped_attention(config, NAME, attend, _BLOCKS, _Blocks.of(layout)):
        yield


def attend(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **_kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, T, D], key [B, Hkv, T, D],
    value [B, Hkv, T, Dv], no cache; returns ([B, T, H, Dv], None)."""
    blocks = _BLOCKS.get()
    if blocks is None:
        raise RuntimeError(f"{NAME} attention runs only inside fanout's packed_attention block")
    if attention_mask is not None or query.shape[2] != key.shape[2] or query.shape[2] != blocks.t:
        raise RuntimeError(f"{NAME} attention takes the packed rows whole: no mask, no cache")
    if sliding_window is not None or softcap is not None or s_aux is not None:
        raise RuntimeError(f"{NAME} attention is causal full attention only (layer {module})")
    if module.training and dropout > 0:
        raise RuntimeError(f"{NAME} attention is for inference (no dropout)")
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    out = document_blocks(query, key, value, blocks, scale)  # [B, H, T, Dv]
    return out.transpose(1, 2).contiguous(), None


def document_blocks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: _Blocks, scale: float
) -> torch.Tensor:
    """[B, H, T, D] queries, [B, Hkv, T, D] keys, [B, Hkv, T, Dv] values → [B, H, T, Dv]:
    each query attends to the earlier keys of its own segment."""
    b, h, t, _d = q.shape
    n, back = blocks.n, blocks.back
    span = back + BLOCK
    qb = F.pad(q, (0, 0, 0, n * BLOCK - t))  # [B, H, n·Q, D]
    qb = qb.unflatten(2, (n, BLOCK)).transpose(1, 2).flatten(0, 1)  # [B·n, H, Q, D]
    kb, vb = (
        F.pad(x, (0, 0, back, n * BLOCK - t))  # [B, Hkv, back + n·Q, d]
        .unfold(2, span, BLOCK)  # [B, Hkv, n, d, span]: block j's keys
        .permute(0, 2, 1, 4, 3)  # [B, n, Hkv, span, d]
        .flatten(0, 1)  # [B·n, Hkv, span, d] (a copy)
        for x in (k, v)
    )
    out = F.scaled_dot_product_attention(
        qb, kb, vb, attn_mask=blocks.mask, scale=scale, enable_gqa=h != k.shape[1]
    )  # [B·n, H, Q, Dv]
    out = out.unflatten(0, (b, n)).transpose(1, 2).flatten(2, 3)  # [B, H, n·Q, Dv]
    return out[:, :, :t]
