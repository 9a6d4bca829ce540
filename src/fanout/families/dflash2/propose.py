"""DFlash2's drafting step: one block forward, then the selector's greedy walk.

    from fanout.families.dflash2.propose import SelectorContext
    ctx = SelectorContext(draft, DraftCache(draft))  # or UncachedDraft(draft): the reference
    ctx.extend(hidden)                          # [n, k·H] verifier states, as DraftCache
    tokens, rows = ctx.propose(seq, lambda row: int(row.argmax()))  # bs-1 tokens, [bs-1, V]

The block `[seq[-1], MASK x (bs-1)]` runs once (`block_states`: DraftCache's cached k/v,
or UncachedDraft's whole-row forward); each slot's unary logits come from the verifier's
head. Then slot k = 1, 2, ... in order: the candidates are the unary top-k, scored
`unary + selector transition` from the predecessor (slot 1: the anchor `seq[-1]`; slot
k: the token `choose` returned for slot k-1), and `choose` gets the verifier-vocab row
holding those scores at the candidates and -inf elsewhere: its argmax is the selector's
pick, and at T > 0 a draw from it is a draw over the K candidates.

This follows vLLM's DFlash2 serving (`vllm/model_executor/models/qwen3_dflash2.py`:
`compute_candidates` = lm_head top-k of each mask slot's state, `_score_edges` = the
unary value + the bilinear transition from each predecessor candidate, slot 1's
predecessor the request's anchor token; and the greedy lattice walk of vLLM's DFlash2
proposer, `_selector_walk_greedy_kernel`, which takes at each slot the argmax edge from
the candidate it took at the previous slot). The walk over the lattice and this
slot-by-slot choice are the same path; here the predecessor is whatever `choose`
returned, so a sampled draft conditions on its own draws as vLLM's T > 0 walk does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fanout.families.dflash2.model import DFlash2Draft
from fanout.model.draft_cache import BlockHeads, head_logits


class SelectorContext(BlockHeads[DFlash2Draft]):
    """A `DraftContext` for DFlash2 drafts: DraftCache (or UncachedDraft) for the block
    states, the candidate selector for the tokens."""

    @torch.no_grad()
    def propose(
        self, seq: list[int], choose: Callable[[torch.Tensor], int]
    ) -> tuple[list[int], torch.Tensor]:
        """The `bs - 1` tokens after `seq[-1]` and the rows `[bs-1, V]` they were chosen
        from (module docstring)."""
        d = self.draft
        hid = self.states.block_states(seq)[1:]  # [bs-1, H] final-norm states of slots 1..
        unary = head_logits(d, hid)  # [bs-1, V] fp32
        top = unary.topk(d.cfg.selector_top_k, dim=1)  # values, indices [bs-1, K]
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        prev = seq[-1]  # slot 1 follows the anchor
        for k in range(hid.shape[0]):
            cand = top.indices[k]  # [K]
            pred = torch.tensor(prev, device=hid.device)
            trans = d.candidate_selector.transitions(hid[k], pred, cand)  # [K]
            row = torch.full_like(unary[k], float("-inf"))  # [V]
            row[cand] = top.values[k] + trans.float()
            prev = choose(row)
            tokens.append(prev)
            rows.append(row)
        return tokens, torch.stack(rows)


__all__ = ["SelectorContext"]
