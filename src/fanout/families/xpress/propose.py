"""XPress's drafting step: one block forward, then K parallel Jacobi refine passes.

    from fanout.families.xpress.propose import XPressContext
    ctx = XPressContext(draft, DraftCache(draft))   # or UncachedDraft(draft): the reference
    ctx.extend(hidden)                               # [n, k·H] accepted verifier states
    tokens, rows = ctx.propose(seq, lambda row: int(row.argmax()))  # bs-1 tokens, [bs-1, V]
    ctx.passes                                       # refine passes the last block ran

`propose(seq, choose)`: the block anchored at `seq[-1]` runs once (`block_states`, all
bs slots, as DFlash's). The seed is the backbone's own argmax of every slot (K = 0: the
plain DFlash proposal). Each pass sets slot 0 to the anchor, feeds the refiner the
previous tokens `[seq[-2], anchor, guess_1, ..., guess_{bs-2}]` (slot k sees the guess
of slot k-1; `seq[-2]` is the token before the anchor, the anchor itself for a
one-token sequence) and takes the argmax of `base + bias` as the next guesses — the
recurrence of speculators' training rounds (`XPressDraftModel.forward`: "the exact
recurrence of inference-time Jacobi decoding"). After `num_jacobi_passes` passes (or
earlier, at a fixed point: the same guesses give the same bias, so further passes change
nothing) slots 1..bs-1's refined rows, over the verifier's vocabulary, go to `choose`.
The bias of slot k depends only on the tokens before it (the mixer is lower-triangular),
so after bs - 1 passes the guesses are the sequential greedy chain.

vLLM has no XPress proposer (as of speculators 0.9.0); this is speculators' reference
decoding, which `fanout eval` runs. At T > 0 the passes stay greedy (the served rule
drafts argmax tokens) and `choose` draws from the last pass's rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fanout.families.xpress.model import XPressDraft
from fanout.model.draft_cache import BlockHeads, DraftCache, UncachedDraft, verifier_vocab


class XPressContext(BlockHeads[XPressDraft]):
    """XPress's `DraftContext`: the backbone's states from `states` (cached or the
    uncached reference), the refiner's Jacobi passes on top (module docstring)."""

    def __init__(
        self, draft: XPressDraft, states: DraftCache | UncachedDraft, passes: int | None = None
    ) -> None:
        super().__init__(draft, states)
        self.max_passes = draft.cfg.num_jacobi_passes if passes is None else passes
        self.passes = 0  # refine passes the last block ran (< max_passes: a fixed point)

    @torch.no_grad()
    def propose(
        self, seq: list[int], choose: Callable[[torch.Tensor], int]
    ) -> tuple[list[int], torch.Tensor]:
        """`block_size - 1` tokens after `seq[-1]` and the verifier-vocab rows `[bs-1, V]`
        they were chosen from, after the Jacobi passes."""
        d = self.draft
        hid = self.states.block_states(seq)  # [bs, H]
        head = d.lm_head_weight
        base = (hid.to(head.dtype) @ head.t()).float()  # [bs, Vd]
        ref = d.refiner_head
        hcache = ref.hidden_cache(hid[None])  # [1, bs, 2r]
        dev = hid.device
        anchor = torch.tensor([seq[-1]], device=dev)  # [1]
        before = torch.tensor([seq[-2] if len(seq) > 1 else seq[-1]], device=dev)  # [1]
        logits = base  # [bs, Vd]
        guess = d.to_verifier_ids(base.argmax(dim=-1))[None]  # [1, bs] the seed
        self.passes = 0
        for _ in range(self.max_passes):
            prev = d.jacobi_prev(guess, anchor, before)  # [1, bs]
            logits = base + ref(prev, hcache)[0].float()  # [bs, Vd]
            self.passes += 1
            new = d.to_verifier_ids(logits.argmax(dim=-1))[None]  # [1, bs]
            if torch.equal(new[:, 1:-1], guess[:, 1:-1]):
                break  # slots 1..bs-2 feed the next pass: unchanged, so is every later pass
            guess = new
        rows = verifier_vocab(d, logits[1:])  # [bs-1, V]
        return [choose(row) for row in rows], rows


__all__ = ["XPressContext"]
