"""The draft's side of speculative decoding: its context, cached as an engine caches it.

    from fanout.model.draft_cache import DraftCache, UncachedDraft
    ctx = DraftCache(draft)            # or UncachedDraft(draft): the slow reference
    ctx.extend(hidden)                 # [n, k·H] verifier states of the next n positions
    logits = ctx.logits(seq)           # [bs-1, V] verifier-vocab logits after seq[-1]
    tokens, rows = ctx.propose(seq, choose)  # the drafting step the decoder calls

The draft's context at position t is `hidden_norm(fc(h_t))` injected as keys/values into
every layer through that layer's k/v projections, k-norm and RoPE at position t. None of
that depends on the block being drafted, so `DraftCache` computes each layer's k/v of a
position once, when the verifier accepts it (`extend`: written into preallocated
buffers, never rolled back — only accepted positions are ever written), and a block
forward costs O(bs · p) attention instead of recomputing fc + k/v over all p positions
(O(p) matmuls) every block, and copies no context (no O(p) `torch.cat` per step).

`UncachedDraft` recomputes the whole context every block through `block_hidden`, the
training forward with one anchor — the reference `DraftCache` is tested against (same
tokens, same τ). Both return logits over the verifier's vocabulary (a reduced draft
vocabulary is scattered back to verifier ids, -inf elsewhere: probability 0 there).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar, cast

import torch
import torch.nn.functional as F

from fanout.model.block_draft import BlockDraft, DecoderLayer
from fanout.model.draft import Draft
from fanout.rows import DOCUMENT_IDS, HIDDEN_STATES, INPUT_IDS, POSITION_IDS

B = TypeVar("B", bound=BlockDraft)


def _layers(draft: BlockDraft) -> list[DecoderLayer]:
    return cast("list[DecoderLayer]", list(draft.layers))


class DraftContext(Protocol):
    """What the decoder needs of a draft: grow the context, propose a block.

    `propose(seq, choose)` drafts the tokens after `seq[-1]` (the anchor, at position
    len(seq) - 1): `choose` turns one row of verifier-vocab logits `[V]` into a token
    (the argmax, or a draw at T > 0), and the rows are asked for in order, so a family
    whose later slots depend on the earlier choices (DFlash2's selector, DSpark's
    Markov head) conditions on the tokens `choose` returned. Returns the tokens and the
    logits rows `[k, V]` they were chosen from."""

    def extend(self, hidden: torch.Tensor) -> None: ...

    def propose(
        self, seq: list[int], choose: Callable[[torch.Tensor], int]
    ) -> tuple[list[int], torch.Tensor]: ...


class IndependentSlots:
    """DFlash's drafting step: one forward fixes every slot's logits (`logits(seq)`,
    `[k, V]`); each slot's token is chosen from its own row."""

    def logits(self, seq: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def propose(
        self, seq: list[int], choose: Callable[[torch.Tensor], int]
    ) -> tuple[list[int], torch.Tensor]:
        rows = self.logits(seq)
        return [choose(row) for row in rows], rows


def head_logits(draft: Draft, hid: torch.Tensor) -> torch.Tensor:
    """Final-norm states `[n, H]` -> logits `[n, V]` over the verifier's vocabulary."""
    logits = hid.to(draft.lm_head_weight.dtype) @ draft.lm_head_weight.t()  # [n, V or Vd]
    return verifier_vocab(draft, logits)


def verifier_vocab(draft: Draft, logits: torch.Tensor) -> torch.Tensor:
    """Draft-vocab logits `[n, Vd]` -> fp32 verifier-vocab logits `[n, V]` (-inf outside
    a reduced draft vocabulary: probability 0 there)."""
    if draft.d2t is None:
        return logits.float()
    full = logits.new_full((logits.shape[0], draft.cfg.vocab_size), float("-inf")).float()
    ids = torch.arange(logits.shape[1], device=logits.device) + draft.d2t  # verifier ids
    full[:, ids] = logits.float()
    return full


class UncachedDraft(IndependentSlots):
    """The reference: the whole context re-projected for every block (`block_hidden`)."""

    def __init__(self, draft: BlockDraft) -> None:
        self.draft = draft
        self.ctx: list[torch.Tensor] = []  # [n, k·H] pieces, positions 0..p-1

    def extend(self, hidden: torch.Tensor) -> None:
        self.ctx.append(hidden.to(self.draft.fc.weight.dtype))

    @torch.no_grad()
    def block_states(self, seq: list[int]) -> torch.Tensor:
        """Final-norm states of every slot of the block anchored at `seq[-1]` `[bs, H]`."""
        context = torch.cat(self.ctx)  # [p, k·H]
        p = context.shape[0]
        assert p == len(seq) - 1, (p, len(seq))  # the anchor seq[-1] sits at position p
        dev = context.device
        hs = torch.cat([context, context.new_zeros(1, context.shape[1])])[None]  # [1, p+1, n·H]
        ids = torch.zeros(1, p + 1, dtype=torch.long, device=dev)  # only ids[anchor] is read
        ids[0, p] = seq[-1]
        batch = {
            HIDDEN_STATES: hs,  # row p is masked out: the block sees context t < p
            INPUT_IDS: ids,
            POSITION_IDS: torch.arange(p + 1, device=dev)[None],  # [1, p+1]
            DOCUMENT_IDS: torch.zeros(1, p + 1, dtype=torch.long, device=dev),
        }
        anchors = torch.tensor([[p]], device=dev)  # [1, 1]
        valid = torch.ones(1, 1, dtype=torch.bool, device=dev)
        return self.draft.block_hidden(batch, anchors, valid)[0, 0]  # [bs, H]

    def logits(self, seq: list[int]) -> torch.Tensor:
        """Verifier-vocab logits of slots 1..bs-1 `[bs-1, V]` (DFlash's proposal)."""
        return head_logits(self.draft, self.block_states(seq)[1:])


class DraftCache(IndependentSlots):
    """Per-layer context keys/values in preallocated buffers `[1, nkv, capacity, hd]`,
    written as positions are accepted.

    Why buffers, not `torch.cat` per step: a cat copies the whole context every block (in
    `extend` and again in `logits`), O(p) bytes per layer per step — quadratic over a
    decode, the cost the cache exists to remove. Here `extend` writes only its n rows
    (capacity doubles when full: amortised O(n)) and `logits` writes the block's own
    k/v into the rows just past the context, as scratch, and attends over a view of the
    first p + bs rows. The scratch rows lie beyond `length`, so nothing accepted is ever
    overwritten; the next `extend` writes its accepted rows over them."""

    def __init__(self, draft: BlockDraft, capacity: int = 256) -> None:
        self.draft = draft
        self.k: list[torch.Tensor] = []  # per layer [1, nkv, capacity, hd]
        self.v: list[torch.Tensor] = []
        self.length = 0  # context positions cached: 0..length-1
        self.capacity = 0
        self._initial = capacity

    def _reserve(self, rows: int) -> None:
        """Room for `rows` positions in every layer (grown by doubling, rows kept)."""
        if rows <= self.capacity:
            return
        cap = max(rows, 2 * self.capacity, self._initial)
        attn = _layers(self.draft)[0].self_attn
        w, n = self.draft.fc.weight, self.length

        def grown(bufs: list[torch.Tensor]) -> list[torch.Tensor]:
            new = [w.new_empty(1, attn.nkv, cap, attn.hd) for _ in self.draft.layers]
            for old, buf in zip(bufs, new):  # none on the first allocation
                buf[:, :, :n] = old[:, :, :n]
            return new

        self.k, self.v, self.capacity = grown(self.k), grown(self.v), cap

    @torch.no_grad()
    def extend(self, hidden: torch.Tensor) -> None:
        d = self.draft
        dt = d.fc.weight.dtype
        n, at = hidden.shape[0], self.length
        ctx = d.hidden_norm(d.fc(hidden.to(dt)))[None]  # [1, n, H]
        rope = d.rope(torch.arange(at, at + n, device=hidden.device)[None], dt)  # [1, n, hd] x2
        self._reserve(at + n)
        for i, layer in enumerate(_layers(d)):
            k, v = layer.self_attn.kv(ctx, rope)  # [1, nkv, n, hd]
            self.k[i][:, :, at : at + n] = k
            self.v[i][:, :, at : at + n] = v
        self.length += n

    @torch.no_grad()
    def block_states(self, seq: list[int]) -> torch.Tensor:
        """Final-norm states `[bs, H]` of the block `[seq[-1], MASK × (bs-1)]` at
        positions p.., p = len(seq) - 1: it sees every cached context position (all < p)
        and its own block (no mask needed)."""
        d, bs = self.draft, self.draft.cfg.block_size
        p = len(seq) - 1
        assert p == self.length, (p, self.length)
        dt = d.fc.weight.dtype
        dev = d.embed_weight.device
        tok = torch.full((1, bs), d.cfg.mask_token_id, dtype=torch.long, device=dev)
        tok[0, 0] = seq[-1]
        x = F.embedding(tok, d.embed_weight).to(dt)  # [1, bs, H]
        rope = d.rope(torch.arange(p, p + bs, device=dev)[None], dt)  # [1, bs, hd] x2
        self._reserve(p + bs)
        for i, layer in enumerate(_layers(d)):
            x = layer.residual(x, functools.partial(self._attend, i, layer.self_attn, p, rope))
        return d.norm(x)[0]  # [bs, H]

    def _attend(self, i: int, a: Any, p: int, rope: Any, h: torch.Tensor) -> torch.Tensor:
        """Layer i's attention of the normed block `h` `[1, bs, H]` over the cache."""
        bs = h.shape[1]
        kb, vb = a.kv(h, rope)  # [1, nkv, bs, hd]
        self.k[i][:, :, p : p + bs] = kb  # scratch rows past the context
        self.v[i][:, :, p : p + bs] = vb
        k, v = self.k[i][:, :, : p + bs], self.v[i][:, :, : p + bs]  # [1, nkv, p+bs, hd]
        return cast("torch.Tensor", a.attend(h, k, v, rope, None))

    def logits(self, seq: list[int]) -> torch.Tensor:
        """Verifier-vocab logits of slots 1..bs-1 `[bs-1, V]` (DFlash's proposal)."""
        return head_logits(self.draft, self.block_states(seq)[1:])


class BlockHeads(Generic[B]):
    """A block family's drafting step beyond DFlash's: the block runs once on `states`
    (a DraftCache, or UncachedDraft: the uncached reference; `block_states`), then the
    family's own heads turn its slots into tokens in `propose` (DFlash2's selector,
    DSpark's Markov head, XPress's refiner). `Family.context` builds it from
    `Family.context_ref`."""

    def __init__(self, draft: B, states: DraftCache | UncachedDraft) -> None:
        self.draft = draft
        self.states = states

    def extend(self, hidden: torch.Tensor) -> None:
        """Append the verifier's hidden states of the next positions `[n, k·H]`."""
        self.states.extend(hidden)


__all__ = [
    "BlockHeads",
    "DraftCache",
    "DraftContext",
    "IndependentSlots",
    "UncachedDraft",
    "head_logits",
    "verifier_vocab",
]
