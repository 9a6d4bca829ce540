"""P-EAGLE's drafting step: every depth in one forward, as vLLM's EAGLE proposer drafts
with parallel drafting (method `eagle3`, a P-EAGLE checkpoint).

    from fanout.families.peagle.propose import PEagleContext
    ctx = PEagleContext(draft, 8)                  # k <= num_depths; cached=False: the reference
    ctx.extend(hidden)                             # [n, k·H] accepted positions
    tokens, rows = ctx.propose(seq, lambda row: int(row.argmax()))  # k tokens, [k, V]

As every chain drafter's step (the kept rows of fanout.model.chain_cache), draft row t
needs the verifier's state at t and the token t+1, so the rows not yet run (the
prompt at first, then the anchor and the accepted drafts) run when `propose(seq)`
knows their tokens, their keys/values kept for good. In the same forward, k - 1 mask
positions follow row p-1 (p = len(seq) - 1): the token `mask_token_id` and the learned
`mask_hidden` states at positions p+1..p+k-1, each seeing the kept rows and the mask
positions before it (what depth d trains). Row p-1's output and the k - 1 mask
outputs give the k tokens, each chosen from its own row (no token conditions
another); the mask positions are scratch past the kept rows.

`cached=False` runs the training forward (`PEagleDraft.draft_states`) over every row
and the one chain anchored at row p-1 each step: the reference the cache is tested
against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fanout.errors import ConfigError
from fanout.families.peagle.model import PEagleDraft, Samples
from fanout.model.chain_cache import ChainCache
from fanout.model.draft_cache import head_logits


class PEagleContext(ChainCache):
    """P-EAGLE's `DraftContext` (module docstring): `k` tokens drafted a step (`fanout
    eval --num-speculative-tokens`), at most the draft's `num_depths` (by default all of
    them: fanout.families.chain.ChainFamily.drafting_context)."""

    draft: PEagleDraft

    def __init__(self, draft: PEagleDraft, k: int, *, cached: bool = True) -> None:
        if k > draft.cfg.num_depths:
            raise ConfigError(
                f"--num-speculative-tokens {k}: this P-EAGLE draft trained "
                f"{draft.cfg.num_depths} depths (its --num-depths); draft at most that many"
            )
        super().__init__(draft, k, cached=cached)

    @torch.no_grad()
    def propose(
        self, seq: list[int], choose: Callable[[torch.Tensor], int]
    ) -> tuple[list[int], torch.Tensor]:
        """`k` tokens after `seq[-1]` and the verifier-vocab rows `[k, V]` they were
        chosen from, all from one forward."""
        rows = self._cached_rows(seq) if self.cached else self._reference_rows(seq)
        return [choose(row) for row in rows], rows

    def _cached_rows(self, seq: list[int]) -> torch.Tensor:
        d = self.draft
        p, at, m = len(seq) - 1, self.length, self.k - 1
        new = self._take_pending(p)  # [p - at, k·H]
        dt = d.compute_dtype
        hid = torch.cat([new, d.mask_hidden[0].to(dt).expand(m, -1)])  # [p - at + m, k·H]
        tokens = [*seq[at + 1 : p + 1], *[d.cfg.mask_token_id] * m]
        positions = torch.arange(at + 1, p + m + 1, device=new.device)
        x = self._run(self._embed(tokens), d.fuse(hid)[None], at, positions)  # [1, n, H]
        self.length = p  # the mask positions are scratch
        return head_logits(d, d.norm(x[0, -self.k :]))  # [k, V]

    def _reference_rows(self, seq: list[int]) -> torch.Tensor:
        d = self.draft
        ctx = torch.cat(self.context)[None]  # [1, p, k·H]
        p, m = len(seq) - 1, self.k - 1
        assert ctx.shape[1] == p, (ctx.shape, p)
        dev = ctx.device
        anchor = torch.cat([torch.arange(p), torch.full((m,), p - 1)])[None]  # [1, p + m]
        depth = torch.cat([torch.zeros(p, dtype=torch.long), torch.arange(1, m + 1)])[None]
        s = Samples(
            anchor.to(dev), depth.to(dev), torch.ones_like(anchor, dtype=torch.bool, device=dev)
        )
        out = d.draft_states(
            ctx, torch.arange(1, p + 1, device=dev)[None],  # row t at position t+1
            torch.zeros(1, p, dtype=torch.long, device=dev),
            torch.tensor([seq[1:]], dtype=torch.long, device=dev), s,
        )  # fmt: skip
        return head_logits(d, out[0, p - 1 :])  # [k, V]


__all__ = ["PEagleContext"]
