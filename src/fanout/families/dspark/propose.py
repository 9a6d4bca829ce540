"""DSpark's drafting step: one block forward, then the slots in order, each conditioned
on the token chosen for the one before it.

    from fanout.families.dspark.propose import DSparkContext
    ctx = DSparkContext(draft, DraftCache(draft))   # or UncachedDraft(draft): the reference
    ctx.extend(hidden)                               # [n, k·H] accepted verifier states
    tokens, rows = ctx.propose(seq, lambda row: int(row.argmax()))  # bs tokens, [bs, V]
    ctx.confidence, ctx.proposed_length              # the confidence head on that block

`propose(seq, choose)`: the block anchored at `seq[-1]` runs once (`block_states`, all
bs slots; the anchor at position p = len(seq) - 1 sees the context < p). Then for
k = 0..bs-1: row_k = head logits of slot k + the Markov bias `W2(W1[prev_k])`, over the
verifier's vocabulary (a reduced draft vocabulary scattered back, -inf elsewhere),
prev_0 = the anchor and prev_k = the token `choose` returned for slot k-1; the token is
`choose(row_k)`. So a block drafts `block_size` tokens (slot 0 predicts the token after
the anchor), exactly as training conditions slot k on the token at a+k.

The confidence head's c_k = sigmoid(proj([h_k ; W1[prev_k]])) is kept per block, with
the draft length it implies: the number of leading slots whose running product
c_0·c_1·…·c_k stays >= 0.5 (`CONFIDENT_PREFIX`). vLLM's own DSpark proposer
(`vllm/v1/spec_decode/dspark.py`) always verifies the whole block and leaves
confidence-scheduled verification out; its follow-up (vllm PR #47808, adaptive
verification) allocates one verify budget across a batch by these running products,
a rule with no single-request threshold. So this fixed-threshold rule is fanout's own,
a report beside τ: decoding verifies all bs tokens either way, which keeps it lossless.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fanout.families.dspark.model import DSparkDraft
from fanout.model.draft_cache import BlockHeads, DraftCache, UncachedDraft, verifier_vocab

# Slots are kept while the running product of the confidence head's probabilities is at
# least this (the probability that the whole prefix is accepted).
CONFIDENT_PREFIX = 0.5


def confident_length(confidence: list[float], threshold: float = CONFIDENT_PREFIX) -> int:
    """Leading slots whose running product of `confidence` stays >= `threshold`.

    >>> confident_length([0.9, 0.8, 0.6, 0.99])
    2
    """
    n, run = 0, 1.0
    for c in confidence:
        run *= c
        if run < threshold:
            break
        n += 1
    return n


class DSparkContext(BlockHeads[DSparkDraft]):
    """DSpark's `DraftContext`: the backbone's states from `states` (cached or the
    uncached reference), the heads applied slot by slot (module docstring)."""

    def __init__(self, draft: DSparkDraft, states: DraftCache | UncachedDraft) -> None:
        super().__init__(draft, states)
        self.confidence: list[float] = []  # c_k of the last block (empty: no head)
        self.proposed_length = draft.cfg.block_size  # what the confidence head implies
        self.proposed_lengths: list[int] = []  # every block's, in order

    @torch.no_grad()
    def propose(
        self, seq: list[int], choose: Callable[[torch.Tensor], int]
    ) -> tuple[list[int], torch.Tensor]:
        """`block_size` tokens after `seq[-1]` and the verifier-vocab rows `[bs, V]`
        they were chosen from, slot k's row biased by the token chosen for slot k-1."""
        d = self.draft
        hid = self.states.block_states(seq)  # [bs, H]
        head = d.lm_head_weight
        base = (hid.to(head.dtype) @ head.t()).float()  # [bs, Vd]
        markov, conf_head = d.markov_head, d.confidence_head
        prev = seq[-1]  # slot 0's previous token: the anchor
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        conf: list[float] = []
        for k in range(d.cfg.block_size):
            emb = None
            logits = base[k]  # [Vd]
            if markov is not None:
                emb = markov.markov_w1.weight[prev]  # [rank]
                logits = logits + markov.markov_w2(emb).float()  # [Vd]
            row = verifier_vocab(d, logits[None])[0]  # [V]
            tok = choose(row)
            if conf_head is not None:
                c = d.confidence_logits(hid[k : k + 1], None if emb is None else emb[None])
                conf.append(float(c.float().sigmoid()))
            tokens.append(tok)
            rows.append(row)
            prev = tok
        self.confidence = conf
        self.proposed_length = confident_length(conf) if conf_head is not None else len(tokens)
        self.proposed_lengths.append(self.proposed_length)
        return tokens, torch.stack(rows)


__all__ = ["CONFIDENT_PREFIX", "DSparkContext", "confident_length"]
