"""EAGLE-3's drafting step: chain drafting of k tokens, as vLLM's EAGLE proposer does
(`vllm/v1/spec_decode/eagle.py`, model `vllm/model_executor/models/llama_eagle3.py`).

    from fanout.families.eagle3.propose import Eagle3Context
    ctx = Eagle3Context(draft, num_speculative_tokens=3)   # cached=False: the reference
    ctx.extend(hidden)                                      # [n, k·H] accepted positions
    tokens, rows = ctx.propose(seq, lambda row: int(row.argmax()))  # k tokens, [k, V]

`extend` gets the verifier's auxiliary states of accepted positions; draft row t needs
them and the token t+1, so rows are formed in `propose(seq)`, when `seq` holds those
tokens: every row t < p = len(seq) - 1 not yet run (the prompt at first, then the
anchor and the accepted drafts) runs once through the draft at its position t+1 (the
fused verifier state, the token seq[t+1]), its keys/values kept for good (vLLM writes
them into the draft's KV cache). Row p-1's output gives the first token (`choose` on
its verifier-vocab logits). Then for j = 1..k-1, one row: the token just chosen at
position p+j, fed the draft's own previous hidden state (final-normed with
`norm_output`, as vLLM's `hidden_states` output), attending to the kept rows and the
chain's earlier entries: what TTT step j trains (the row's own earlier steps on the
diagonal). Chain entries are scratch past the kept rows, overwritten next step.

`cached=False` runs the same through `Eagle3Draft.start`/`step`, the training unroll,
over every row each time: the reference the cache is tested against.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F

from fanout.families.eagle3.model import Eagle3Draft, Eagle3Layer
from fanout.model.draft_cache import head_logits


class Eagle3Context:
    """EAGLE-3's `DraftContext` (module docstring): `num_speculative_tokens` drafted a
    step (default: the draft's `ttt_steps`, what its checkpoint's proposal says)."""

    # position of draft row t: t + row_offset (EAGLE-3: its token's; MTP: its state's)
    row_offset: ClassVar[int] = 1

    def __init__(
        self,
        draft: Eagle3Draft,
        *,
        num_speculative_tokens: int | None = None,
        cached: bool = True,
        capacity: int = 256,
    ) -> None:
        self.draft = draft
        self.k = num_speculative_tokens or draft.cfg.ttt_steps
        self.cached = cached
        self.pending: list[torch.Tensor] = []  # [n, k·H] states of rows not yet run
        self.context: list[torch.Tensor] = []  # every extended state (the reference)
        self.length = 0  # rows whose keys/values are kept: 0..length-1
        self.capacity = 0
        self._initial = capacity
        self.keys: list[torch.Tensor] = []  # per layer [1, nkv, capacity, hd]
        self.values: list[torch.Tensor] = []

    def extend(self, hidden: torch.Tensor) -> None:
        h = hidden.to(self.draft.fc.weight.dtype)
        self.pending.append(h)
        self.context.append(h)

    @torch.no_grad()
    def propose(
        self, seq: list[int], choose: Callable[[torch.Tensor], int]
    ) -> tuple[list[int], torch.Tensor]:
        """`k` tokens after `seq[-1]` and the verifier-vocab rows `[k, V]` they were
        chosen from, each row conditioned on the tokens chosen before it."""
        step = self._cached_chain if self.cached else self._reference_chain
        return step(seq, choose)

    # ---- the cache ------------------------------------------------------------------

    def _reserve(self, rows: int) -> None:
        if rows <= self.capacity:
            return
        cap = max(rows, 2 * self.capacity, self._initial)
        d, n = self.draft, self.length
        w = d.fc.weight
        attn = [cast("Eagle3Layer", layer).self_attn for layer in d.layers]

        def grown(bufs: list[torch.Tensor]) -> list[torch.Tensor]:
            new = [w.new_empty(1, a.nkv, cap, a.hd) for a in attn]
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
        dt = d.fc.weight.dtype
        rope = d.rope(positions[None], dt)  # [1, n, hd] x2
        n = x.shape[1]
        self._reserve(at + n)
        mask = None
        if n > 1:  # new row r sees the cache and the new rows <= r
            mask = torch.ones(n, at + n, dtype=torch.bool, device=x.device)
            mask[:, at:] = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        for i, layer in enumerate(d.layers):
            attend = functools.partial(self._attend, i, layer, at, rope, mask)
            x = cast("Eagle3Layer", layer).run(emb, x, attend)
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
        return F.embedding(ids, d.embed_weight).to(d.fc.weight.dtype)  # [1, n, H]

    def _out(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(head input, hidden state fed to the next chain entry) of states `[.., H]`."""
        normed = cast("torch.Tensor", self.draft.norm(x))
        return normed, normed if self.draft.cfg.norm_output else x

    def _cached_chain(
        self, seq: list[int], choose: Callable[[torch.Tensor], int]
    ) -> tuple[list[int], torch.Tensor]:
        d = self.draft
        p = len(seq) - 1  # rows 0..p-1 exist once seq[p] is known
        new = torch.cat(self.pending)  # [p - length, k·H]
        self.pending = []
        at = self.length
        assert new.shape[0] == p - at, (new.shape, p, at)
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

    # ---- the reference --------------------------------------------------------------

    def _reference_chain(
        self, seq: list[int], choose: Callable[[torch.Tensor], int]
    ) -> tuple[list[int], torch.Tensor]:
        d = self.draft
        ctx = torch.cat(self.context)  # [p, k·H]
        p = len(seq) - 1
        assert ctx.shape[0] == p, (ctx.shape, p)
        dev = ctx.device
        pos = torch.arange(1, p + 1, device=dev)[None]  # [1, p] row t at position t+1
        u = d.start(ctx[None], pos, torch.zeros(1, p, dtype=torch.long, device=dev))
        tok = torch.tensor([seq[1:]], dtype=torch.long, device=dev)  # [1, p]
        tokens, rows = [], []
        for _ in range(self.k):
            out = d.step(u, tok)  # [1, p, H]; only row p-1 is read
            row = head_logits(d, out[0, -1:])[0]  # [V]
            tokens.append(choose(row))
            rows.append(row)
            tok = torch.full_like(tok, tokens[-1])  # row p-1's next entry (others unread)
        return tokens, torch.stack(rows)


__all__ = ["Eagle3Context"]
