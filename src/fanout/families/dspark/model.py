"""The DSpark draft: the DFlash backbone plus a Markov logit-bias head and a confidence head.

    from fanout.families.dspark.model import DSparkDraft
    draft = DSparkDraft.from_verifier("models/qwen3-8b", block_size=8, markov_rank=256)
    out = draft.loss(batch, torch.Generator().manual_seed(0))  # batch: window rows
    out.loss.backward(); print(out.per_slot_acc, out.eal, out.extra["accept_len"])

What it adds to DFlash (speculators 0.9.0 `DSparkDraftModel`, same parameter names, so
`trainable_state()` keys are speculators'):
- sample from the anchor: slot k = 0..bs-1 of the block at anchor a predicts token
  a+k+1, so a block drafts `block_size` tokens (slot 0 included) instead of bs-1;
- `markov_head.markov_w1` (Embedding [verifier V, rank]) and `markov_head.markov_w2`
  (Linear rank -> draft V, no bias): slot k's logits get the bias `W2(W1[prev_k])`,
  prev_k the token at a+k (slot 0: the anchor). The corrected logits are
  `h @ head^T + W1[prev] @ W2^T`, so the CE (or KL) is the two-head linear CE
  (`fanout.ops.two_head_ce`): no `[slots, vocab]` logits, no weight copy, gradients to
  h, W1 and W2 only (the frozen head gets none), and with the exp decay every gradient
  is computed in forward (the slot weights are known there), the acceptance rate from
  the same logits;
- `confidence_head.proj` (Linear H + rank -> 1, with bias) on `[h ; W1[prev]]` (or `h`
  alone without `confidence_head_with_markov`): a logit for the probability that the
  slot's token is accepted, trained with BCE against the analytical acceptance rate
  `1 - TV(q, p)` (q: the draft's Markov-corrected distribution, p: the verifier's).

Semantics (decided here; `tests/test_family_dspark.py` pins every difference from
speculators):
- Labels: slot k's label is `target_ids[a+k]`, the verifier's greedy token after
  position a+k (captured), or with `label_source="input_ids"` the data token
  `input_ids[a+k+1]`. The teacher distribution p (confidence target, `loss_type kl`)
  is the verifier's `last_hidden_states[a+k]` (after its final norm, as fanout
  captures it) through the frozen head, over the draft vocabulary as speculators
  does (renormalised there when the vocabulary is reduced).
- Supervision: slot k is supervised iff its block is valid and the token it predicts is:
  `loss_mask[a+k+1]` on and `document_ids[a+k+1] == document_ids[a]`. speculators
  gates slot k on `loss_mask[a+k]` (the mask of the slot's last context token), so it
  trains the slot whose context ends a response on predicting the unsupervised token
  after it (the next turn's header, another document's first token) and leaves
  untrained a slot that predicts the first supervised token after an unsupervised one.
  The loss mask marks the tokens the data wants predicted; fanout reads it at the
  predicted token, as DFlash does for its slots.
- Anchors: DFlash's rule (`fanout.model.anchors.select_anchors`) unchanged, and it is
  already the DSpark rule: a candidate `a < T - bs` is a supervised token whose slot 0
  predicts a supervised token of its document (`loss_mask[a]`, `loss_mask[a+1]`, same
  document). The anchor being a supervised token is training = serving: at serving
  every block is anchored at a token the verifier just emitted (a response token);
  `a < T - bs` keeps the last predicted token a+bs inside the row.
- Markov context: prev_k is the data token at a+k (teacher forcing, as speculators); at
  serving it is the token chosen for slot k-1 (`fanout.families.dspark.propose`), which
  equals it whenever slot k's prediction can still be accepted (on the verifier's own
  greedy data, `target_ids[a+k-1] == input_ids[a+k]`).
- Reduced draft vocabulary: W1 indexes the verifier vocabulary, W2 maps to the draft
  vocabulary (speculators). A slot whose verifier token is outside the draft vocabulary
  carries no CE and no BCE (as DFlash); its block still counts in `eal`/`accept_len`,
  stopping there.

Loss: `sum_k w_k CE_k / n + alpha * sum_k exp(-k/gamma) BCE_k / n` over the n supervised
slots; `w_k = exp(-k/gamma)` (speculators' `dflash_loss_decay` with
`sample_from_anchor`: slot 0 weight 1; fanout.model.slot_loss's weights counted from
`first_drafted_slot` 0) or D-PACE; the BCE always uses the exp decay
(speculators: D-PACE expects a token CE). `loss_type="kl"` replaces the CE with
KL(p || q). TV comes from the CE's / KL's own row chunks (no `[slots, V]` fp32 at once).

Metrics (`LossOutput`, fanout.model.slot_loss's `acceptance` over every slot):
`per_slot_acc[k]` greedy accuracy of slot k = 0..bs-1; `eal` =
1 + the exact-match prefix of slots 0, 1, ... averaged over blocks whose slot 0 is
supervised (speculators' dspark `eal`); `extra`: `accept_len` (1 + sum over slots of
the running product of the per-slot acceptance rates: speculators' analytical
estimate; when last hidden states are in the batch), `confidence_loss` (its BCE term,
unweighted by alpha) and `confidence_abs_error` (mean |sigmoid(c) - acceptance rate|).
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from fanout.errors import ConfigError
from fanout.families.dspark.config import DSparkConfig
from fanout.model.anchors import block_positions, slot_supervision
from fanout.model.block_draft import BlockDraft
from fanout.model.draft import LossOutput
from fanout.model.draft_config import DraftConfig
from fanout.model.slot_loss import acceptance, exp_decay, slot_index
from fanout.ops.linear_ce import mm_fp32, rows_per_chunk
from fanout.ops.linear_kl import teacher_logits
from fanout.ops.two_head_ce import two_head_cross_entropy_and_argmax, two_head_kl_div_and_argmax
from fanout.rows import DOCUMENT_IDS, INPUT_IDS, LAST_HIDDEN_STATES, LOSS_MASK, TARGET_IDS


class MarkovHead(nn.Module):
    """The vanilla low-rank Markov bias `W2(W1[prev])` (speculators' `MarkovHead`)."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # verifier ids -> rank
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)  # rank -> draft ids
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # speculators: W1 ~ N(0, 0.01); W2 keeps nn.Linear's own (Kaiming-uniform) init
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        self.markov_w2.reset_parameters()


class ConfidenceHead(nn.Module):
    """A linear logit for the slot's acceptance probability (speculators' `ConfidenceHead`)."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)  # nn.Linear's init, as speculators'

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return cast("torch.Tensor", self.proj(features)).squeeze(-1)


class DSparkDraft(BlockDraft):
    """Trainable beyond DFlash's: `markov_head` (when `markov_rank > 0`) and
    `confidence_head` (when `enable_confidence_head`); see the module docstring."""

    config_class: ClassVar[type[DraftConfig]] = DSparkConfig
    first_drafted_slot: ClassVar[int] = 0  # slot 0 (the anchor) predicts the next token
    cfg: DSparkConfig

    def __init__(self, cfg: DraftConfig, *verifier: Any) -> None:
        """`Draft`'s arguments: the config, then the verifier's frozen tensors."""
        super().__init__(cfg, *verifier)
        cfg = self.cfg  # its own config class (Draft checked it)
        h, rank = cfg.hidden_size, cfg.markov_rank
        draft_v = cfg.draft_vocab_size or cfg.vocab_size
        self.markov_head: MarkovHead | None
        self.confidence_head: ConfidenceHead | None
        self.markov_head = MarkovHead(cfg.vocab_size, draft_v, rank) if rank else None
        self.confidence_head = (
            ConfidenceHead(h + (rank if cfg.confidence_head_with_markov else 0))
            if cfg.enable_confidence_head
            else None
        )

    def reset_parameters(self, std: float = 0.02) -> None:
        """The backbone's HF-style init, the heads' as speculators'. (The backbone's
        constructor calls this before the heads exist.)"""
        super().reset_parameters(std)
        markov = getattr(self, "markov_head", None)
        conf = getattr(self, "confidence_head", None)
        if markov is not None:
            markov.reset_parameters()
        if conf is not None:
            conf.proj.reset_parameters()

    # ---- what each slot predicts ----------------------------------------------------

    def supervision(
        self, batch: dict[str, torch.Tensor], anchors: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        """Supervised slots `[B, A, bs]`: slot k iff the token it predicts (a+k+1) is
        loss-supervised and in the anchor's document (module docstring)."""
        bs = self.cfg.block_size
        # slot_supervision of a block one longer: its slot k+1 is position a+k+1
        sup = slot_supervision(batch[LOSS_MASK], batch[DOCUMENT_IDS], anchors, valid, bs + 1)
        return sup[:, :, 1:]  # [B, A, bs]

    def labels(self, batch: dict[str, torch.Tensor], anchors: torch.Tensor) -> torch.Tensor:
        """Verifier-vocab label of every slot `[B, A, bs]`: the token a+k+1."""
        t = batch[INPUT_IDS].shape[1]
        pos = block_positions(anchors, self.cfg.block_size)  # [B, A, bs] = a+k
        if self.cfg.label_source == "target_ids":
            src = batch[TARGET_IDS]  # target_ids[p] predicts token p+1
        else:
            src, pos = batch[INPUT_IDS], pos + 1
        flat = pos.clamp(0, t - 1).flatten(1)
        return src.long().gather(1, flat).view_as(pos)

    def prev_tokens(self, batch: dict[str, torch.Tensor], anchors: torch.Tensor) -> torch.Tensor:
        """The Markov head's previous token of every slot `[B, A, bs]`: the data token at
        a+k (slot 0: the anchor)."""
        t = batch[INPUT_IDS].shape[1]
        pos = block_positions(anchors, self.cfg.block_size).clamp(0, t - 1)  # [B, A, bs]
        return batch[INPUT_IDS].long().gather(1, pos.flatten(1)).view_as(pos)

    def verifier_rows(self, batch: dict[str, torch.Tensor], anchors: torch.Tensor) -> torch.Tensor:
        """The verifier's final hidden state that predicts each slot's token:
        `last_hidden_states[a+k]` `[B, A, bs, H]`."""
        last = batch[LAST_HIDDEN_STATES]  # [B, T, H]
        _, t, h = last.shape
        pos = block_positions(anchors, self.cfg.block_size).clamp(0, t - 1)  # [B, A, bs]
        idx = pos.flatten(1)[:, :, None].expand(-1, -1, h)  # [B, A·bs, H]
        return last.gather(1, idx).view(*pos.shape, h).to(self.lm_head_weight.dtype)

    def markov_inputs(
        self, prev: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Previous tokens `prev` `[M]` -> the Markov head's second-head features
        `W1[prev]` `[M, rank]` (in `dtype`) and weights `W2` `[draft V, rank]` (in the
        head's dtype): the bias is `W1[prev] @ W2^T`. (None, None) without a Markov head."""
        if self.markov_head is None:
            return None, None
        emb = self.markov_head.markov_w1(prev).to(dtype)  # [M, rank]
        w2 = self.markov_head.markov_w2.weight.to(self.lm_head_weight.dtype)  # [Vd, rank]
        return emb, w2

    def confidence_logits(self, hid: torch.Tensor, emb: torch.Tensor | None) -> torch.Tensor:
        """Confidence-head logits `[M]` of rows `hid` `[M, H]` with their W1 embeddings."""
        assert self.confidence_head is not None
        feats = hid  # [M, H]
        if emb is not None and self.cfg.confidence_head_with_markov:
            feats = torch.cat([hid, emb], dim=-1)  # [M, H + rank]
        return cast("torch.Tensor", self.confidence_head(feats))

    # ---- loss ----------------------------------------------------------------------

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None) -> LossOutput:
        """Draw anchors from `generator`, run the blocks, return loss and metrics (module
        docstring). `batch` as DFlash's, plus `last_hidden_states` [B, T, H] for the
        confidence head or `loss_type kl`."""
        cfg = self.cfg
        conf_on = self.confidence_head is not None
        if conf_on and LAST_HIDDEN_STATES not in batch:
            raise ConfigError(
                "DSpark's confidence head needs last_hidden_states in the batch (its target "
                "is the verifier's distribution): capture the run with "
                "--store-last-hidden-states, or train with --no-enable-confidence-head"
            )
        # the backbone's draw with DSpark's supervision and labels; blocks that count in
        # EAL / accept_len: slot 0 supervised (first_drafted_slot), before the vocab cut
        b = self.blocks(batch, generator)
        sup, label = b.sup, b.label  # [B, A, bs]
        rows = b.hid[sup]  # [M, H] only supervised slots reach the heads
        emb, w2 = self.markov_inputs(self.prev_tokens(batch, b.anchors)[sup], rows.dtype)
        teacher = (
            self.verifier_rows(batch, b.anchors)[sup] if LAST_HIDDEN_STATES in batch else None
        )  # [M, H]
        slot = slot_index(sup)  # [M] slot index k
        decay = exp_decay(slot, cfg.resolved_gamma, first=self.first_drafted_slot)  # [M]
        n_tok = int(sup.sum())
        # The exp decay is known before the loss: the op folds every gradient into its
        # forward pass (sum_i w_i CE_i). D-PACE weighs by the CE itself: per-row CE, and
        # backward recomputes the logits.
        row_w = decay if cfg.loss_weighting == "exp" else None  # [M]
        head, cap = self.lm_head_weight, self.teacher_softcap
        if cfg.loss_type == "kl":
            assert teacher is not None
            out = two_head_kl_div_and_argmax(
                rows, emb, head, w2, teacher, row_weight=row_w, softcap=cap
            )
        else:
            out = two_head_cross_entropy_and_argmax(
                rows, emb, head, w2, label[sup], teacher=teacher, row_weight=row_w, softcap=cap
            )
        if row_w is None:  # D-PACE (the backbone's slot weights) of the detached CE
            ce_sum = (out.loss * self.slot_weights(out.rows, sup, slot)).sum()
        else:
            ce_sum = out.loss  # sum_i w_i CE_i
        loss = ce_sum / max(n_tok, 1)
        extra: dict[str, float] = {}
        accept = out.accept  # [M] fp32 1 - TV(q, p), no grad (None without a teacher)
        if conf_on:
            assert accept is not None
            logit = self.confidence_logits(rows, emb).float()  # [M]
            bce = F.binary_cross_entropy_with_logits(logit, accept, reduction="none")  # [M]
            conf_loss = (bce * decay).sum() / max(n_tok, 1)  # always the exp decay
            loss = loss + cfg.confidence_head_alpha * conf_loss
            extra["confidence_loss"] = float(conf_loss.detach())
            err = (logit.detach().sigmoid() - accept).abs()
            extra["confidence_abs_error"] = float(err.mean()) if n_tok else 0.0
        correct = torch.zeros_like(sup)
        correct[sup] = out.pred == label[sup]
        acc, cnt, eal = acceptance(correct, sup, b.has)  # every slot drafts (slot 0 too)
        if accept is not None:
            extra["accept_len"] = accept_length(accept, sup, b.has)
        return LossOutput(loss, acc, cnt, eal, n_tok, int(b.valid.sum()), extra)


@torch.no_grad()
def accept_length(
    accept: torch.Tensor,  # [M] per supervised slot acceptance rate 1 - TV(q, p)
    sup: torch.Tensor,  # [B, A, bs] supervised slots
    has: torch.Tensor,  # [B, A] blocks that count
) -> float:
    """speculators' analytical acceptance length: 1 + the sum over slots of the running
    product of the slots' acceptance rates (0 off supervision), averaged over `has`."""
    rate = torch.zeros(sup.shape, dtype=torch.float32, device=sup.device)
    rate[sup] = accept
    length = 1.0 + torch.cumprod(rate, dim=2).sum(dim=2)  # [B, A]
    return float(length[has].mean()) if has.any() else 1.0


# ---- the corrected distribution without [rows, vocab] logits ----------------------------


def _corrected_logits(
    h: torch.Tensor, emb: torch.Tensor | None, head: torch.Tensor, w2: torch.Tensor | None
) -> torch.Tensor:
    """fp32 logits `h @ head^T (+ emb @ w2^T)` of one chunk `[c, V]`."""
    z = mm_fp32(h, head.t())  # [c, V]
    if emb is not None and w2 is not None:
        z += mm_fp32(emb, w2.t())
    return z


@torch.no_grad()
def acceptance_rate(
    rows: torch.Tensor,  # [M, H] draft slot states
    emb: torch.Tensor | None,  # [M, rank] W1[prev] (None: no Markov head)
    draft: DSparkDraft,
    teacher: torch.Tensor,  # [M, H] verifier final states
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Per-row analytical acceptance rate `sum_v min(q_v, p_v) = 1 - TV(q, p)` `[M]`
    fp32: q the draft's corrected distribution, p the verifier's, both over the draft
    vocabulary; row chunks of about 256 MiB of fp32 logits per side. (Standalone: the
    loss takes it from its CE / KL pass, which has the logits already.)"""
    head = draft.lm_head_weight
    w2 = None if draft.markov_head is None else draft.markov_head.markov_w2.weight.to(head.dtype)
    n = rows.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=rows.device)
    c = rows_per_chunk(n, 2 * head.shape[0], chunk_rows)
    for s in range(0, n, c):
        e = min(s + c, n)
        q = _corrected_logits(rows[s:e], None if emb is None else emb[s:e], head, w2)
        q = q.softmax(dim=-1)  # [c, V]
        p = teacher_logits(teacher[s:e], head, draft.teacher_softcap).softmax(dim=-1)  # [c, V]
        out[s:e] = torch.minimum(q, p).sum(dim=-1)
        del q, p
    return out


def markov_kl_div_and_argmax(
    h: torch.Tensor,
    emb: torch.Tensor,
    head: torch.Tensor,
    w2: torch.Tensor,
    teacher: torch.Tensor,
    *,
    chunk_rows: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL(softmax(teacher @ head^T) || softmax(h @ head^T + emb @ w2^T)) `[N]`
    fp32 and the argmax of the corrected logits `[N]`, without `[N, V]` logits;
    differentiable in `h`, `emb` and `w2` (the head and teacher are frozen; the
    teacher's logits soft-capped by `softcap`). The loss calls `fanout.ops.two_head_ce`
    itself (with its row weights: no recompute)."""
    e, w = emb.to(head.dtype), w2.to(head.dtype)
    out = two_head_kl_div_and_argmax(
        h, e, head.detach(), w, teacher, chunk_rows=chunk_rows, softcap=softcap
    )
    return out.loss, out.pred


__all__ = [
    "ConfidenceHead",
    "DSparkDraft",
    "MarkovHead",
    "accept_length",
    "acceptance_rate",
    "markov_kl_div_and_argmax",
]
