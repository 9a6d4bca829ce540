"""Sliding-window and chunked attention in O(T·w) memory, for documents run alone.

    from fanout.model.local_attention import local_attention
    with local_attention(text_model.config, rule):  # rule: fanout.model.layer_types.PackingRule
        out = text_model(input_ids=ids, position_ids=pos, use_cache=False)  # [k, L] documents

Inside the block every attention layer of that text model runs `attend` (registered
in transformers' AttentionInterface as `fanout_local`), and transformers builds no
mask at all: its mask builders return None for an implementation the
AttentionMaskInterface does not know (masking_utils._preprocess_mask_arguments,
transformers 5.25; "custom attention without equivalent mask creation"). Without it,
a document of L tokens gets a [k, 1, L, L] mask for every sliding / chunked layer
type (256 MiB of booleans at L = 16k, a float one 4× that under eager), and attention
computes every masked-out pair.

What each layer computes, its type read from the packing rule by the module's
`layer_idx` (the same conventions as transformers' masks for a sequence alone:
sliding `k > q − w`, chunked `k // C == q // C` on the sequence index):

| layer type          | query blocks                 | keys of a block               | memory      |
|---------------------|------------------------------|-------------------------------|-------------|
| `full_attention`    | the whole sequence           | SDPA `is_causal`              | SDPA's own  |
| `sliding_attention` | w tokens (the first: causal) | [start − w, end): a [w, 2w] mask, shared by every block | O(L·w) |
| `chunked_attention` | C tokens, one per chunk      | its own chunk, `is_causal`    | O(L) + SDPA |

The blocks of a layer are batched into one SDPA call (GQA through `enable_gqa`).
Where transformers passes a `sliding_window` for a layer, it must agree with the rule
(else a RuntimeError names the layer): one source of truth, checked against the other.

Soft-capping (Gemma-2: `softcap`) and attention sinks (gpt-oss: `s_aux`) have no SDPA
form; such layers run eager's own math (their modeling files' `eager_attention_forward`:
scores, tanh cap, mask, the sink logit appended, softmax, the sink dropped) on query
blocks against only the keys a block may see, at most `SCORE_BUDGET` scores at a time:
O(L·w) for local layers, O(L) per block for full ones.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fanout.model.layer_types import CHUNKED, FULL, SLIDING, PackingRule

NAME = "fanout_local"  # the attention implementation's name in transformers' registry
SCORE_BUDGET = 1 << 24  # scores per eager-math block (64 MiB in fp32)

_RULE: ContextVar[PackingRule | None] = ContextVar("fanout_local_rule", default=None)


@contextmanager
def local_attention(config: Any, rule: PackingRule, *, on: bool = True) -> Iterator[None]:
    """While in this block, the attention layers reading `config` (a text model's
    config, whose `layer_types` `rule` describes) run `attend`, with no mask built.
    on=False: a block that changes nothing (transformers' own attention and masks)."""
    if not on:
        yield
        return
    with swapped_attention(config, NAME, attend, _RULE, rule):
        yield


@contextmanager
def swapped_attention(
    config: Any, name: str, fn: Any, var: ContextVar[Any], value: Any
) -> Iterator[None]:
    """While in this block, the attention layers reading `config` run `fn` (registered
    in transformers' AttentionInterface as `name`, once), with `var` set to `value`
    for `fn` to read. The one swap fanout's attention implementations share."""
    from transformers import AttentionInterface

    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, fn)
    old = config._attn_implementation
    token = var.set(value)
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = old
        var.reset(token)


@dataclass(frozen=True, slots=True)
class AttentionCall:
    """One layer's call of a fanout attention function, checked (`attention_function`):
    query [B, H, L, D], key [B, Hkv, L, D], value [B, Hkv, L, Dv], no mask, no cache."""

    module: Any  # the attention layer (its `layer_idx`)
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    sliding_window: int | None  # what transformers passes for the layer
    softcap: float | None  # Gemma-2's logit soft-capping
    sinks: torch.Tensor | None  # gpt-oss's attention sinks (`s_aux`), one logit per head


def attention_function(
    name: str, var: ContextVar[Any], body: Callable[[AttentionCall, Any], torch.Tensor]
) -> Callable[..., tuple[torch.Tensor, None]]:
    """transformers' attention function registered as `name` (`swapped_attention`): the
    contract every fanout implementation shares (its signature, no mask, no cache, no
    dropout, the default scale, the output layout) in one place, around `body(call,
    state)` → [B, H, L, Dv], `state` the value `var` holds inside the implementation's
    block."""

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
        """transformers' attention-function signature: query [B, H, L, D], key [B, Hkv,
        L, D], value [B, Hkv, L, Dv], no cache; returns ([B, L, H, Dv], None)."""
        state = var.get()
        if state is None:
            raise RuntimeError(f"{name} attention runs only inside {body.__module__}'s block")
        if attention_mask is not None or query.shape[2] != key.shape[2]:
            raise RuntimeError(f"{name} attention takes no mask and no cache (whole rows)")
        if module.training and dropout > 0:
            raise RuntimeError(f"{name} attention is for inference (no dropout)")
        scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        call = AttentionCall(module, query, key, value, scale, sliding_window, softcap, s_aux)
        return body(call, state).transpose(1, 2).contiguous(), None  # [B, L, H, Dv]

    return attend


def _layer_blocks(call: AttentionCall, rule: PackingRule) -> torch.Tensor:
    """One layer of a document run alone, its type read from `rule` by `layer_idx`."""
    i = int(call.module.layer_idx)
    kind = rule.layer_types[i]
    size = {SLIDING: rule.sliding_window, CHUNKED: rule.chunk_size}.get(kind)
    if call.sliding_window is not None and (kind != SLIDING or call.sliding_window != size):
        raise RuntimeError(
            f"layer {i}: transformers passes sliding_window={call.sliding_window}, the "
            f"packing rule has {kind} with window {size}"
        )
    if call.softcap is not None or call.sinks is not None:
        return eager_blocks(call, kind, size)
    return sdpa_blocks(call, kind, size)


attend = attention_function(NAME, _RULE, _layer_blocks)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def _blocks(x: torch.Tensor, n: int, size: int) -> torch.Tensor:
    """[B, h, L, d] (L ≤ n·size), zero-padded at the end to n·size tokens, as
    [B·n, h, size, d]: each block of `size` tokens its own batch entry (a copy)."""
    x = F.pad(x, (0, 0, 0, n * size - x.shape[2]))  # [B, h, n·size, d]
    return x.unflatten(2, (n, size)).transpose(1, 2).flatten(0, 1)  # [B·n, h, size, d]


def _unblocks(x: torch.Tensor, b: int, length: int) -> torch.Tensor:
    """The inverse of `_blocks`: [B·n, h, size, d] → [B, h, length, d]."""
    return x.unflatten(0, (b, -1)).transpose(1, 2).flatten(2, 3)[:, :, :length]


def sdpa_blocks(call: AttentionCall, kind: str, size: int | None) -> torch.Tensor:
    """Causal attention of one layer type through SDPA: the call's [B, H, L, D] queries,
    [B, Hkv, L, D] keys, [B, Hkv, L, Dv] values → [B, H, L, Dv]. `size`: the window /
    chunk."""
    q, k, v, scale = call.q, call.k, call.v, call.scale
    b, _h, n_tok, _d = q.shape
    if kind == FULL or size is None or n_tok <= size:
        return _sdpa(q, k, v, scale, causal=True)  # a window or chunk this long never binds
    if kind == CHUNKED:
        n = math.ceil(n_tok / size)
        qb, kb, vb = (_blocks(x, n, size) for x in (q, k, v))  # [B·n, h, C, d] each
        return _unblocks(_sdpa(qb, kb, vb, scale, causal=True), b, n_tok)
    assert kind == SLIDING
    w = size
    # The first w queries see every earlier key (q − k < w): plain causal.
    first = _sdpa(q[:, :, :w], k[:, :, :w], v[:, :, :w], scale, causal=True)  # [B, H, w, Dv]
    # Block j ≥ 1 (queries [j·w, j·w + w)) sees keys [j·w − w, j·w + w): key c of the
    # block may be seen by query a iff a < c ≤ a + w (q − k < w, and causal).
    n = math.ceil((n_tok - w) / w)  # blocks after the first
    qb = _blocks(q[:, :, w:], n, w)  # [B·n, H, w, D]
    kb, vb = (
        F.pad(x, (0, 0, 0, (n + 1) * w - n_tok))  # [B, Hkv, (n+1)·w, d]
        .unfold(2, 2 * w, w)  # [B, Hkv, n, d, 2w]: window j = tokens [j·w, j·w + 2w)
        .permute(0, 2, 1, 4, 3)  # [B, n, Hkv, 2w, d]
        .flatten(0, 1)  # [B·n, Hkv, 2w, d] (a copy)
        for x in (k, v)
    )
    a = torch.arange(w, device=q.device)[:, None]  # [w, 1] query within its block
    c = torch.arange(2 * w, device=q.device)[None, :]  # [1, 2w] key within the window
    mask = (c > a) & (c <= a + w)  # [w, 2w], the same for every block
    # Queries past the end (padding) see themselves (c = a + w): no empty softmax row.
    rest = _unblocks(_sdpa(qb, kb, vb, scale, mask=mask), b, n_tok - w)  # [B, H, L − w, Dv]
    return torch.cat([first, rest], dim=2)  # [B, H, L, Dv]


def eager_blocks(call: AttentionCall, kind: str, size: int | None) -> torch.Tensor:
    """Causal attention of one layer type in eager's math, with the call's logit
    soft-capping (Gemma-2) and / or attention sinks (gpt-oss, one logit per head):
    shapes as `sdpa_blocks`. Query blocks never cross a chunk start; each sees only the
    keys its layer type may (full: every earlier one)."""
    q, k, v, scale, softcap, sinks = call.q, call.k, call.v, call.scale, call.softcap, call.sinks
    b, h, n_tok, _d = q.shape
    rep = h // k.shape[1]
    span = n_tok if kind == FULL or size is None else min(n_tok, size)  # keys a query may see
    step = max(1, min(span, SCORE_BUDGET // (b * h * 2 * span)))  # queries per block
    starts = set(range(0, n_tok, step))
    if kind == CHUNKED and size is not None:
        starts |= set(range(0, n_tok, size))  # blocks end at chunk ends
    bounds = [*sorted(starts), n_tok]
    out = q.new_empty((b, h, n_tok, v.shape[-1]))  # [B, H, L, Dv]
    for s, e in itertools.pairwise(bounds):
        lo = 0
        if kind == SLIDING and size is not None:
            lo = max(0, s - size + 1)
        elif kind == CHUNKED and size is not None:
            lo = s // size * size
        kk = k[:, :, lo:e].repeat_interleave(rep, dim=1)  # [B, H, n, D]
        vv = v[:, :, lo:e].repeat_interleave(rep, dim=1)  # [B, H, n, Dv]
        scores = torch.matmul(q[:, :, s:e], kk.transpose(2, 3)) * scale  # [B, H, m, n]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        qi = torch.arange(s, e, device=q.device)[:, None]  # [m, 1]
        ki = torch.arange(lo, e, device=q.device)[None, :]  # [1, n]
        allowed = qi >= ki  # [m, n]
        if kind == SLIDING and size is not None:
            allowed &= qi - ki < size
        elif kind == CHUNKED and size is not None:
            allowed &= qi // size == ki // size
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        if sinks is not None:
            sink = sinks.reshape(1, -1, 1, 1).expand(b, -1, e - s, 1).to(scores.dtype)
            logits = torch.cat([scores, sink], dim=-1)  # [B, H, m, n + 1]
            logits = logits - logits.max(dim=-1, keepdim=True).values
            probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]  # sink dropped
        else:
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[:, :, s:e] = torch.matmul(probs.to(v.dtype), vv)  # [B, H, m, Dv]
    return out
