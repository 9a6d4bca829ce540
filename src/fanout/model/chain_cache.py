"""The chain drafters' side of speculative decoding (EAGLE-3, P-EAGLE, MTP): their kept
rows cached as vLLM's EAGLE proposer caches them, and the chain drafted on them.

    from fanout.model.chain_cache import ChainContext
    class MyContext(ChainContext):          # a family's drafting step (families/<name>/propose.py)
        def _out(self, x): ...               # (head input, hidden fed to the next entry)
        def _reference_chain(self, seq, choose): ...   # the uncached reference
    ctx = MyContext(draft, k=3)              # cached=False: the reference
    ctx.extend(hidden)                       # [n, k·H] verifier states of accepted positions
    tokens, rows = ctx.propose(seq, lambda row: int(row.argmax()))  # k tokens, [k, V]

The block drafters' counterpart is fanout.model.draft_cache. `extend` gets the
verifier's states of accepted positions; draft row t needs them and the token t+1, so
rows are formed in `propose(seq)`, when `seq` holds those tokens: every row t < p =
len(seq) - 1 not yet run (the prompt at first, then the anchor and the accepted drafts)
runs once through the draft at its position t + `row_offset` (the fused verifier state,
the token seq[t+1]), its keys/values kept for good in preallocated per-layer buffers
(vLLM writes them into the draft's KV cache; `ChainCache`). Row p-1's output gives the
first token (`choose` on its verifier-vocab logits). Then, in a chain (`ChainContext`,
EAGLE-3's and MTP's), for j = 1..k-1 one row: the token just chosen at position p-1+j
+ `row_offset`, fed the draft's own previous hidden state (`_out`: EAGLE-3's final-normed
with `norm_output`, MTP's its layer's output), attending to the kept rows and the
chain's earlier entries: what TTT step j trains. Chain entries (and P-EAGLE's mask
positions) are scratch past the kept rows, overwritten next step.

What the cache needs of a draft (`ChainModel`): `layers` (each with `self_attn.kv` /
`attend` and `run(emb, x, attend)`), `rope`, `embed_weight`, `fuse` and
`compute_dtype`: fanout.model.chain_draft.ChainDraft's, and MTP's draft's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from fanout.model.draft_cache import head_logits


class ChainModel(Protocol):
    """What `ChainCache` runs (module docstring); a `fanout.model.draft.Draft` too."""

    embed_weight: torch.Tensor
    lm_head_weight: torch.Tensor
    d2t: torch.Tensor | None
    rope: Any

    @property
    def layers(self) -> nn.ModuleList: ...

    @property
    def compute_dtype(self) -> torch.dtype: ...

    def fuse(self, hs: torch.Tensor) -> torch.Tensor: ...


class ChainCache:
    """The kept rows' keys/values of a chain draft (module docstring): `extend`, and
    `_run` of new rows over them. A family's drafting step subclasses it and defines
    `propose`."""

    # position of draft row t: t + row_offset (EAGLE-3: its token's; MTP: its state's)
    row_offset: ClassVar[int] = 1

    def __init__(
        self, draft: ChainModel, k: int, *, cached: bool = True, capacity: int = 256
    ) -> None:
        self.draft: Any = draft  # a family's draft (its context narrows the type)
        self.k = k
        self.cached = cached
        self.pending: list[torch.Tensor] = []  # [n, k·H] states of rows not yet run
        self.context: list[torch.Tensor] = []  # every extended state (the reference)
        self.length = 0  # rows whose keys/values are kept: 0..length-1
        self.capacity = 0
        self._initial = capacity
        self.keys: list[torch.Tensor] = []  # per layer [1, nkv, capacity, hd]
        self.values: list[torch.Tensor] = []

    def extend(self, hidden: torch.Tensor) -> None:
        h = hidden.to(self.draft.compute_dtype)
        self.pending.append(h)
        self.context.append(h)

    def propose(
        self, seq: list[int], choose: Callable[[torch.Tensor], int]
    ) -> tuple[list[int], torch.Tensor]:
        raise NotImplementedError

    def _take_pending(self, p: int) -> torch.Tensor:
        """The extended states of rows length..p-1 `[p - length, k·H]` (now to be run)."""
        new = torch.cat(self.pending)
        self.pending = []
        assert new.shape[0] == p - self.length, (new.shape, p, self.length)
        return new

    def _reserve(self, rows: int, device: torch.device) -> None:
        """Buffers for `rows` rows (doubling), on `device` in the draft's dtype."""
        if rows <= self.capacity:
            return
        cap = max(rows, 2 * self.capacity, self._initial)
        n = self.length
        attn = [layer.self_attn for layer in self.draft.layers]

        def grown(bufs: list[torch.Tensor]) -> list[torch.Tensor]:
            dt = self.draft.compute_dtype
            new = [torch.empty(1, a.nkv, cap, a.hd, dtype=dt, device=device) for a in attn]
            for old, buf in zip(bufs, new):
                buf[:, :, :n] = old[:, :, :n]
            return new

        self.keys, self.values, self.capacity = grown(self.keys), grown(self.values), cap

    def _run(
        self, emb: torch.Tensor, x: torch.Tensor, at: int, positions: torch.Tensor
    ) -> torch.Tensor:
        """Rows `x` `[1, n, H]` fed `emb`, written at cache rows at.., attending to the
        cache rows < at and causally among themselves: the last layer's output."""
        d = self.draft
        dt = d.compute_dtype
        rope = d.rope(positions[None], dt)  # [1, n, hd] x2
        n = x.shape[1]
        self._reserve(at + n, x.device)
        mask = None
        if n > 1:  # new row r sees the cache and the new rows <= r
            mask = torch.ones(n, at + n, dtype=torch.bool, device=x.device)
            mask[:, at:] = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        for i, layer in enumerate(d.layers):
            attend = functools.partial(self._attend, i, layer, at, rope, mask)
            x = layer.run(emb, x, attend)
        return x

    def _attend(self, i: int, layer: Any, at: int, rope: Any, mask: Any, h: torch.Tensor) -> Any:
        a = layer.self_attn
        k, v = a.kv(h, rope)  # [1, nkv, n, hd]
        n = h.shape[1]
        self.keys[i][:, :, at : at + n] = k
        self.values[i][:, :, at : at + n] = v
        ks, vs = self.keys[i][:, :, : at + n], self.values[i][:, :, : at + n]
        return a.attend(h, ks, vs, rope, mask)

    def _embed(self, tokens: list[int]) -> torch.Tensor:
        d = self.draft
        ids = torch.tensor([tokens], dtype=torch.long, device=d.embed_weight.device)
        return F.embedding(ids, d.embed_weight).to(d.compute_dtype)  # [1, n, H]


class ChainContext(ChainCache):
    """A chain's `DraftContext` (module docstring): k tokens, each drafted on the one
    chosen before it. A family defines `_out` and the uncached `_reference_chain`."""

    @torch.no_grad()
    def propose(
        self, seq: list[int], choose: Callable[[torch.Tensor], int]
    ) -> tuple[list[int], torch.Tensor]:
        """`k` tokens after `seq[-1]` and the verifier-vocab rows `[k, V]` they were
        chosen from, each row conditioned on the tokens chosen before it."""
        step = self._cached_chain if self.cached else self._reference_chain
        return step(seq, choose)

    def _out(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(head input, hidden state fed to the next chain entry) of states `[.., H]`."""
        raise NotImplementedError

    def _reference_chain(
        self, seq: list[int], choose: Callable[[torch.Tensor], int]
    ) -> tuple[list[int], torch.Tensor]:
        """The chain recomputed from scratch (what the cache is tested against)."""
        raise NotImplementedError

    def _cached_chain(
        self, seq: list[int], choose: Callable[[torch.Tensor], int]
    ) -> tuple[list[int], torch.Tensor]:
        d = self.draft
        p = len(seq) - 1  # rows 0..p-1 exist once seq[p] is known
        at = self.length
        new = self._take_pending(p)  # [p - length, k·H]
        dev = new.device
        x = self._run(
            self._embed(seq[at + 1 : p + 1]), d.fuse(new)[None], at,
            torch.arange(at, p, device=dev) + self.row_offset,
        )  # fmt: skip
        self.length = p
        normed, fed = self._out(x[:, -1:])  # [1, 1, H] row p-1
        tokens, rows = [], []
        for j in range(self.k):
            row = head_logits(d, normed[0])[0]  # [V]
            tokens.append(choose(row))
            rows.append(row)
            if j + 1 == self.k:
                break
            # chain entry j+1: the token just chosen at position p+j+row_offset, scratch
            # row p+j
            at_pos = torch.tensor([p + j + self.row_offset], device=dev)
            x = self._run(self._embed(tokens[-1:]), fed, p + j, at_pos)
            normed, fed = self._out(x)
        return tokens, torch.stack(rows)


__all__ = ["ChainCache", "ChainContext", "ChainModel"]
