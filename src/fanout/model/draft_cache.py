"""The draft's side of speculative decoding: its context, cached as an engine caches it.

    from fanout.model.draft_cache import DraftCache, UncachedDraft
    ctx = DraftCache(draft)            # or UncachedDraft(draft): the slow reference
    ctx.extend(hidden)                 # [n, k·H] verifier states of the next n positions
    logits = ctx.logits(seq)           # [bs-1, V] verifier-vocab logits after seq[-1]

The draft's context at position t is `hidden_norm(fc(h_t))` injected as keys/values into
every layer through that layer's k/v projections, k-norm and RoPE at position t. None of
that depends on the block being drafted, so `DraftCache` computes each layer's k/v of a
position once, when the verifier accepts it (`extend`: append, never roll back — only
accepted positions are ever appended), and a block forward costs O(bs · p) attention
instead of recomputing fc + k/v over all p positions (O(p) matmuls) every block.

`UncachedDraft` recomputes the whole context every block through `block_hidden`, the
training forward with one anchor — the reference `DraftCache` is tested against (same
tokens, same τ). Both return logits over the verifier's vocabulary (a reduced draft
vocabulary is scattered back to verifier ids, -inf elsewhere: probability 0 there).
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
import torch.nn.functional as F

from fanout.model.dflash import DecoderLayer, DFlashDraft


def _layers(draft: DFlashDraft) -> list[DecoderLayer]:
    return cast("list[DecoderLayer]", list(draft.layers))


class DraftContext(Protocol):
    """What the decoder needs of a draft: grow the context, propose a block's logits."""

    def extend(self, hidden: torch.Tensor) -> None: ...

    def logits(self, seq: list[int]) -> torch.Tensor: ...


def head_logits(draft: DFlashDraft, hid: torch.Tensor) -> torch.Tensor:
    """Final-norm states `[n, H]` -> logits `[n, V]` over the verifier's vocabulary."""
    logits = hid.to(draft.lm_head_weight.dtype) @ draft.lm_head_weight.t()  # [n, V or Vd]
    if draft.d2t is None:
        return logits.float()
    full = logits.new_full((hid.shape[0], draft.cfg.vocab_size), float("-inf")).float()
    ids = torch.arange(logits.shape[1], device=logits.device) + draft.d2t  # verifier ids
    full[:, ids] = logits.float()
    return full


class UncachedDraft:
    """The reference: the whole context re-projected for every block (`block_hidden`)."""

    def __init__(self, draft: DFlashDraft) -> None:
        self.draft = draft
        self.ctx: list[torch.Tensor] = []  # [n, k·H] pieces, positions 0..p-1

    def extend(self, hidden: torch.Tensor) -> None:
        self.ctx.append(hidden.to(self.draft.fc.weight.dtype))

    @torch.no_grad()
    def logits(self, seq: list[int]) -> torch.Tensor:
        context = torch.cat(self.ctx)  # [p, k·H]
        p = context.shape[0]
        assert p == len(seq) - 1, (p, len(seq))  # the anchor seq[-1] sits at position p
        dev = context.device
        hs = torch.cat([context, context.new_zeros(1, context.shape[1])])[None]  # [1, p+1, n·H]
        ids = torch.zeros(1, p + 1, dtype=torch.long, device=dev)  # only ids[anchor] is read
        ids[0, p] = seq[-1]
        batch = {
            "hidden_states": hs,  # row p is masked out: the block sees context t < p
            "input_ids": ids,
            "position_ids": torch.arange(p + 1, device=dev)[None],  # [1, p+1]
            "document_ids": torch.zeros(1, p + 1, dtype=torch.long, device=dev),
        }
        anchors = torch.tensor([[p]], device=dev)  # [1, 1]
        valid = torch.ones(1, 1, dtype=torch.bool, device=dev)
        hid = self.draft.block_hidden(batch, anchors, valid)[0, 0, 1:]  # [bs-1, H]
        return head_logits(self.draft, hid)


class DraftCache:
    """Per-layer context keys/values `[1, nkv, p, hd]`, appended as positions are accepted."""

    def __init__(self, draft: DFlashDraft) -> None:
        self.draft = draft
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.length = 0  # context positions cached: 0..length-1

    @torch.no_grad()
    def extend(self, hidden: torch.Tensor) -> None:
        d = self.draft
        dt = d.fc.weight.dtype
        n = hidden.shape[0]
        ctx = d.hidden_norm(d.fc(hidden.to(dt)))[None]  # [1, n, H]
        pos = torch.arange(self.length, self.length + n, device=hidden.device)[None]
        rope = d.rope(pos, dt)  # [1, n, hd] x2
        for i, layer in enumerate(_layers(d)):
            k, v = layer.self_attn.kv(ctx, rope)  # [1, nkv, n, hd]
            if i < len(self.k):
                self.k[i] = torch.cat([self.k[i], k], dim=2)
                self.v[i] = torch.cat([self.v[i], v], dim=2)
            else:
                self.k.append(k)
                self.v.append(v)
        self.length += n

    @torch.no_grad()
    def logits(self, seq: list[int]) -> torch.Tensor:
        """The block `[seq[-1], MASK × (bs-1)]` at positions p.., p = len(seq) - 1: it sees
        every cached context position (all < p) and its own block (no mask needed)."""
        d, bs = self.draft, self.draft.cfg.block_size
        p = len(seq) - 1
        assert p == self.length, (p, self.length)
        dt = d.fc.weight.dtype
        dev = d.embed_weight.device
        tok = torch.full((1, bs), d.cfg.mask_token_id, dtype=torch.long, device=dev)
        tok[0, 0] = seq[-1]
        x = F.embedding(tok, d.embed_weight).to(dt)  # [1, bs, H]
        rope = d.rope(torch.arange(p, p + bs, device=dev)[None], dt)  # [1, bs, hd] x2
        for i, layer in enumerate(_layers(d)):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            kb, vb = a.kv(h, rope)  # [1, nkv, bs, hd]
            k = torch.cat([self.k[i], kb], dim=2) if self.k else kb  # [1, nkv, p+bs, hd]
            v = torch.cat([self.v[i], vb], dim=2) if self.v else vb
            x = x + a.attend(h, k, v, rope, None)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return head_logits(d, d.norm(x)[0, 1:])  # [bs-1, V]


__all__ = ["DraftCache", "DraftContext", "UncachedDraft", "head_logits"]
