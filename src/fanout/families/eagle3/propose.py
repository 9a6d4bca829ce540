"""EAGLE-3's drafting step: chain drafting of k tokens, as vLLM's EAGLE proposer does
(`vllm/v1/spec_decode/eagle.py`, model `vllm/model_executor/models/llama_eagle3.py`).

    from fanout.families.eagle3.propose import Eagle3Context
    ctx = Eagle3Context(draft, 3)       # k = 3; cached=False: the reference
    ctx.extend(hidden)                  # [n, k·H] accepted positions
    tokens, rows = ctx.propose(seq, lambda row: int(row.argmax()))  # k tokens, [k, V]

The kept rows and the chain on them are the chain drafters' (fanout.model.chain_cache:
row t, the verifier's fused state at t and the token t+1, runs at the token's position
t+1 and is kept for good; row p-1's output gives the first token; chain entry j fed the
token just chosen and the draft's previous hidden state). EAGLE-3's own part: that
hidden state is the last layer's output final-normed with `norm_output` (as vLLM's
`hidden_states` output), the head's input always final-normed.

`cached=False` runs the same through `Eagle3Draft.start`/`step`, the training unroll,
over every row each time: the reference the cache is tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from fanout.families.eagle3.model import Eagle3Draft
from fanout.model.chain_cache import ChainContext
from fanout.model.draft_cache import head_logits


class Eagle3Context(ChainContext):
    """EAGLE-3's `DraftContext` (module docstring): `k` tokens drafted a step (`fanout
    eval --num-speculative-tokens`; by default its `ttt_steps`, what its checkpoint's
    proposal says: fanout.families.chain.ChainFamily.drafting_context)."""

    draft: Eagle3Draft

    def _out(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(head input, hidden state fed to the next chain entry) of states `[.., H]`."""
        normed = cast("torch.Tensor", self.draft.norm(x))
        return normed, normed if self.draft.cfg.norm_output else x

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
