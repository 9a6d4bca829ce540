"""MTP's drafting step: a chain of k tokens, as vLLM's `mtp` method drafts
(`vllm/v1/spec_decode/eagle.py` with method `mtp`, the models' `*_mtp.py`).

    from fanout.families.mtp.propose import MTPContext
    ctx = MTPContext(draft, 3)          # k = 3; cached=False: the reference
    ctx.extend(hidden)                  # [n, H] last-layer states
    tokens, rows = ctx.propose(seq, lambda row: int(row.argmax()))  # k tokens, [k, V]

The chain drafters' kept rows and chain (fanout.model.chain_cache) with vLLM's MTP
positions: draft row t (the verifier's final-normed state at t and the token t+1)
runs at position t, the position of its hidden state, and is kept for good; row p-1
(p = len(seq) - 1) gives the first token. Chain entry j = 1..k-1 feeds the token just
chosen and the MTP layer's previous output (already `final_layernorm`-ed: vLLM's MTP
returns it as the next hidden state) at position p-1+j, attending to the kept rows and
the chain's earlier entries; entries are scratch past the kept rows.

`cached=False` recomputes every row and chain entry from scratch with one causal pass
of the layer (`MTPDraft.states`) per token: the reference the cache is tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from fanout.families.mtp.model import MTPDraft
from fanout.model.chain_cache import ChainContext
from fanout.model.draft_cache import head_logits


class MTPContext(ChainContext):
    """MTP's `DraftContext` (module docstring): `k` tokens drafted a step (`fanout eval
    --num-speculative-tokens`; by default its `mtp_steps`, its checkpoint's proposal)."""

    row_offset: ClassVar[int] = 0
    draft: MTPDraft

    def _out(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x  # the layer's output is final-normed: head input and next hidden

    def _reference_chain(
        self, seq: list[int], choose: Callable[[torch.Tensor], int]
    ) -> tuple[list[int], torch.Tensor]:
        d = self.draft
        ctx = d.fuse(torch.cat(self.context))  # [p, H]
        p = len(seq) - 1
        assert ctx.shape[0] == p, (ctx.shape, p)
        dev = ctx.device
        hid = ctx
        tokens: list[int] = []
        rows = []
        for _ in range(self.k):
            n = hid.shape[0]
            fed = torch.tensor([[*seq[1:], *tokens]], dtype=torch.long, device=dev)  # [1, n]
            mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril()[None, None]
            out = d.states(hid[None], fed, torch.arange(n, device=dev)[None], mask)[0]
            row = head_logits(d, out[-1:])[0]  # [V]
            tokens.append(choose(row))
            rows.append(row)
            hid = torch.cat([ctx, out[p - 1 :]])  # entry j+1 is fed entry j's output
        return tokens, torch.stack(rows)


__all__ = ["MTPContext"]
