"""The block drafter's backbone, shared by every family that drafts a block in one
forward (DFlash, DFlash2, DSpark, XPress): blocks conditioned on the verifier's hidden
states, and the block objective their losses start from.

    from fanout.model.block_draft import BlockDraft
    class MyDraft(BlockDraft):                      # a family's model (families/<name>/model.py)
        config_class = MyConfig
        def loss(self, batch, generator):
            b = self.blocks(batch, generator)       # anchors, supervision, labels, slot states
            return self.block_loss(batch, b)        # + the family's own terms

Architecture (DFlash paper; speculators `DFlashDraftModel`; SpecForge `OnlineDFlashModel`):
- context = concat of the verifier's hidden states at `target_layer_ids` `[B, T, n·H]`
  -> bias-free `fc` (n·H -> H) -> RMSNorm `hidden_norm`; the same context is injected as
  extra keys/values (through each layer's own k/v projections and k-norm) into every
  draft layer and is not updated by the layers;
- queries come only from the noise blocks: the anchor's real token followed by
  `block_size - 1` copies of `mask_token_id`, embedded with the verifier's frozen
  embedding; Qwen3 decoder layers (q/k RMSNorm, RoPE, SwiGLU MLP); final RMSNorm `norm`
  (initialised from the verifier's final norm) and the verifier's frozen `lm_head`
  (optionally restricted to a draft vocabulary, `d2t`/`t2d` as in speculators);
- RoPE positions come from the row's `position_ids` (restart per packed document):
  context t at `position_ids[t]`, block slot k at `position_ids[anchor] + k`;
- anchors and the attention mask: see `fanout.model.anchors`; the attention computes only
  the scores that mask allows (fanout.model.draft_attention, shared by every family).

Block objective (`BlockDraft.block_loss`, DFlash's whole loss): slot k >= 1 of the block
at anchor a predicts token a+k; its label is `target_ids[a+k-1]` (the verifier's greedy
prediction of token a+k) or, with `label_source="input_ids"`, `input_ids[a+k]`;
supervised slots are those of `anchors.slot_supervision`. Per-slot CE (or KL) and the
slot weights and metrics are fanout.model.slot_loss's: weighted by `exp(-(k-1)/gamma)`
or D-PACE, summed, divided by the number of supervised slots (the speculators
normalisation); `per_slot_acc[k-1]` and `eal` over the blocks whose slot 1 is
supervised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fanout.model.anchors import block_positions, select_anchors, slot_supervision
from fanout.model.draft import Draft, LossOutput, check_batch
from fanout.model.draft_attention import DraftAttention, PrefixMask, Rope
from fanout.model.draft_config import DraftConfig
from fanout.model.slot_loss import acceptance, head_loss, slot_index, slot_weights
from fanout.rows import (
    DOCUMENT_IDS,
    HIDDEN_STATES,
    INPUT_IDS,
    LAST_HIDDEN_STATES,
    LOSS_MASK,
    POSITION_IDS,
    TARGET_IDS,
)


@dataclass
class Blocks:
    """One step's drawn blocks (`BlockDraft.blocks`)."""

    anchors: torch.Tensor  # [B, A] anchor positions (padding: anchor 0, valid False)
    valid: torch.Tensor  # [B, A] real anchors
    sup: torch.Tensor  # [B, A, bs] slots with a loss (after the draft-vocabulary cut)
    label: torch.Tensor  # [B, A, bs] each slot's label, draft-vocab ids (-100: not kept)
    has: torch.Tensor  # [B, A] blocks that count in EAL
    hid: torch.Tensor  # [B, A, bs, H] final-norm slot states


class Attention(DraftAttention):
    """Queries from the block; keys/values from [context ; block] (context injected)."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__(cfg, qk_norm=True)

    def forward(
        self,
        x: torch.Tensor,  # [B, Q, H] block states (after input_layernorm)
        ctx: torch.Tensor,  # [B, T, H] injected context
        rope_q: tuple[torch.Tensor, torch.Tensor],  # [B, Q, hd] x2
        rope_k: tuple[torch.Tensor, torch.Tensor],  # [B, T+Q, hd] x2
        mask: PrefixMask | torch.Tensor,  # PrefixMask.blocks, or its dense [B, 1, Q, T+Q]
    ) -> torch.Tensor:
        k, v = self.kv(torch.cat([ctx, x], dim=1), rope_k)  # [B, nkv, T+Q, hd]
        return self.attend(x, k, v, rope_q, mask)


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_q: Any, rope_k: Any, mask: Any):
        return self.residual(x, lambda h: self.self_attn(h, ctx, rope_q, rope_k, mask))

    def residual(
        self, x: torch.Tensor, attention: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The layer on block states `x` `[B, Q, H]` with `attention` (normed block states
        -> attention output) supplied by the caller: the training forward attends over
        the whole row, the inference cache over its cached context. A family whose layer
        wraps attention or MLP (DFlash2's convolutions) overrides this one method."""
        x = x + attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockDraft(Draft):
    """Trainable: `layers`, `fc`, `hidden_norm`, `norm`; frozen buffers as `Draft`'s.
    A family's block draft subclasses this and defines `loss` (`blocks` then
    `block_loss`, plus its own terms); one whose layers differ overrides `make_layer`."""

    def __init__(self, cfg: DraftConfig, *verifier: Any) -> None:
        """`Draft`'s arguments: the config, then the verifier's frozen tensors."""
        super().__init__(cfg, *verifier)
        cfg = self.cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.rope = Rope(cfg.head_dim, cfg.rope_theta)
        self.reset_parameters()
        with torch.no_grad():  # the head expects verifier-normed input
            self.norm.weight.copy_(self.verifier_norm_weight)

    def make_layer(self, cfg: DraftConfig, index: int) -> nn.Module:
        """One draft decoder layer (a family whose layers differ overrides this)."""
        return DecoderLayer(cfg)

    # ---- forward ---------------------------------------------------------------------

    def block_hidden(
        self,
        batch: dict[str, torch.Tensor],
        anchors: torch.Tensor,  # [B, A]
        valid: torch.Tensor,  # [B, A]
    ) -> torch.Tensor:
        """Final-norm hidden states of every block slot: `[B, A, bs, H]`."""
        cfg, bs = self.cfg, self.cfg.block_size
        dt = self.fc.weight.dtype
        hs = batch[HIDDEN_STATES].to(dt)  # [B, T, n·H]
        ids = batch[INPUT_IDS].long()  # [B, T]
        pos_ids = batch[POSITION_IDS].long()  # [B, T]
        b = ids.shape[0]
        a = anchors.shape[1]
        ctx = self.hidden_norm(self.fc(hs))  # [B, T, H]
        tok = torch.full((b, a, bs), cfg.mask_token_id, dtype=torch.long, device=ids.device)
        tok[:, :, 0] = ids.gather(1, anchors)  # slot 0 = the anchor's real token
        x = F.embedding(tok.view(b, a * bs), self.embed_weight).to(dt)  # [B, A·bs, H]
        pos_q = pos_ids.gather(1, anchors)[:, :, None] + torch.arange(bs, device=ids.device)
        pos_q = pos_q.view(b, a * bs)  # [B, A·bs] block slot k at anchor_pos + k
        rope_q = self.rope(pos_q, dt)
        rope_k = self.rope(torch.cat([pos_ids, pos_q], dim=1), dt)  # [B, T+A·bs, hd]
        mask = PrefixMask.blocks(batch[DOCUMENT_IDS], anchors, valid, bs)  # only what it allows
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_k, mask)
        return self.norm(x).view(b, a, bs, -1)  # [B, A, bs, H]

    def labels(self, batch: dict[str, torch.Tensor], anchors: torch.Tensor) -> torch.Tensor:
        """Verifier-vocab label of every slot `[B, A, bs]` (slot 0's is meaningless)."""
        bs = self.cfg.block_size
        t = batch[INPUT_IDS].shape[1]
        pos = block_positions(anchors, bs)  # [B, A, bs]
        if self.cfg.label_source == "target_ids":
            src, pos = batch[TARGET_IDS], pos - 1  # target_ids[p-1] predicts token p
        else:
            src = batch[INPUT_IDS]
        flat = pos.clamp(0, t - 1).flatten(1)
        return src.long().gather(1, flat).view_as(pos)

    def verifier_rows(self, batch: dict[str, torch.Tensor], anchors: torch.Tensor) -> torch.Tensor:
        """The verifier's final hidden state that predicts each slot's token: `[B, A, bs, H]`
        (`last_hidden_states[p-1]` for slot position p, as `target_ids` for labels)."""
        last = batch[LAST_HIDDEN_STATES]  # [B, T, H]
        _, t, h = last.shape
        pos = (block_positions(anchors, self.cfg.block_size) - 1).clamp(0, t - 1)  # [B, A, bs]
        idx = pos.flatten(1)[:, :, None].expand(-1, -1, h)  # [B, A·bs, H]
        return last.gather(1, idx).view(*pos.shape, h).to(self.lm_head_weight.dtype)

    def supervision(
        self, batch: dict[str, torch.Tensor], anchors: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        """Slots with a loss `[B, A, bs]`: `anchors.slot_supervision` (a family whose slot
        k predicts another token than a+k, DSpark's, overrides this)."""
        bs = self.cfg.block_size
        return slot_supervision(batch[LOSS_MASK], batch[DOCUMENT_IDS], anchors, valid, bs)

    def blocks(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None) -> Blocks:
        """One step's blocks, what every DFlash-family loss starts from: anchors drawn
        from `generator`, the supervised slots and their labels (cut to the draft
        vocabulary), the blocks that count in EAL, the final-norm slot states.
        `batch`: hidden_states [B,T,n·H], target_ids, input_ids, loss_mask, document_ids,
        position_ids [B,T] (as in a window row)."""
        cfg, bs = self.cfg, self.cfg.block_size
        check_batch(
            batch, len(cfg.target_layer_ids) * cfg.hidden_size,
            kl=cfg.loss_type == "kl", family=type(self).__name__,
        )  # fmt: skip
        anchors, valid = select_anchors(
            batch[LOSS_MASK], batch[DOCUMENT_IDS], cfg.max_anchors, bs, generator
        )
        sup = self.supervision(batch, anchors, valid)  # [B, A, bs]
        label = self.labels(batch, anchors)  # [B, A, bs]
        # Blocks that count in EAL: the first drafted slot supervised, *before* the
        # draft-vocabulary cut — a block whose next verifier token the draft cannot emit
        # still counts, as length 1 (serving accepts only the bonus token there).
        has = sup[:, :, self.first_drafted_slot].clone()  # [B, A]
        if cfg.draft_vocab_size is not None:
            label = self.t2d_index[label]  # verifier id -> draft id (-100 if not kept)
            sup = sup & (label >= 0)
        hid = self.block_hidden(batch, anchors, valid)  # [B, A, bs, H]
        return Blocks(anchors, valid, sup, label, has, hid)

    def block_loss(self, batch: dict[str, torch.Tensor], b: Blocks) -> LossOutput:
        """The block objective and metrics on drawn blocks `b` (module docstring): DFlash's
        whole loss; a family that adds a term (DFlash2's selector) calls this for the
        unary part."""
        cfg = self.cfg
        sup, label = b.sup, b.label
        rows = b.hid[sup]  # [M, H] only supervised slots reach the head
        teacher = self.verifier_rows(batch, b.anchors)[sup] if cfg.loss_type == "kl" else None
        head, cap = self.lm_head_weight, self.teacher_softcap
        ce, pred = head_loss(rows, head, labels=label[sup], teacher=teacher, softcap=cap)
        w = self.slot_weights(ce.detach(), sup, slot_index(sup))  # [M]
        n_tok = int(sup.sum())
        loss = (ce * w).sum() / max(n_tok, 1)
        correct = torch.zeros_like(sup)
        correct[sup] = pred.detach() == label[sup]
        acc, cnt, eal = acceptance(correct[:, :, 1:], sup[:, :, 1:], b.has)
        return LossOutput(loss, acc, cnt, eal, n_tok, int(b.valid.sum()))

    def slot_weights(self, ce: torch.Tensor, sup: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """The recipe's weight of each supervised slot `[M]` (fanout.model.slot_loss),
        counted from the first drafted slot."""
        return slot_weights(self.cfg, ce, sup, slot, first=self.first_drafted_slot)


__all__ = ["MLP", "Attention", "BlockDraft", "Blocks", "DecoderLayer"]
