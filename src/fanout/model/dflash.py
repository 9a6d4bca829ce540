"""The DFlash draft model: block-diffusion drafter conditioned on verifier hidden states.

    from fanout.model.dflash import DFlashDraft
    draft = DFlashDraft.from_verifier("path/to/Qwen3-8B", target_layer_ids=[1, 9, 17, 25, 33],
                                      block_size=16, num_layers=1, mask_token_id=151669)
    out = draft.loss(batch, torch.Generator().manual_seed(0))  # batch: dict of window rows
    out.loss.backward(); print(out.per_slot_acc, out.eal)

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

Loss (`DFlashDraft.loss`): slot k >= 1 of the block at anchor a predicts token a+k; its
label is `target_ids[a+k-1]` (the verifier's greedy prediction of token a+k) or, with
`label_source="input_ids"`, `input_ids[a+k]`; supervised slots are those of
`anchors.slot_supervision`. Per-slot CE comes from the fused linear CE (no
`[slots, vocab]` logits) and is weighted by `exp(-(k-1)/gamma)` or D-PACE, summed, and
divided by the number of supervised slots (the speculators normalisation).

Metrics: `per_slot_acc[k-1]` = greedy-argmax accuracy of slot k over supervised slots;
`eal` = expected acceptance length under greedy verification, measured per block as
1 (the verifier's own token) + the length of the exact-match prefix of slots 1, 2, ...
(stopping at the first wrong *or unsupervised* slot), averaged over blocks whose slot 1
is supervised — the empirical form of `1 + sum_k prod_{j<=k} acc_j`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self

import torch
import torch.nn.functional as F
from torch import nn

from fanout.errors import ConfigError
from fanout.model.anchors import block_positions, select_anchors, slot_supervision
from fanout.model.draft_attention import DraftAttention, PrefixMask, Rope
from fanout.model.draft_config import DFlashConfig, DraftRecipe, default_target_layer_ids
from fanout.model.verifier_dir import read_text_tensors, read_verifier_config
from fanout.ops.linear_ce import linear_cross_entropy_and_argmax
from fanout.ops.linear_kl import linear_kl_div_and_argmax
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
    """One step's drawn blocks (`DFlashDraft.blocks`)."""

    anchors: torch.Tensor  # [B, A] anchor positions (padding: anchor 0, valid False)
    valid: torch.Tensor  # [B, A] real anchors
    sup: torch.Tensor  # [B, A, bs] slots with a loss (after the draft-vocabulary cut)
    label: torch.Tensor  # [B, A, bs] each slot's label, draft-vocab ids (-100: not kept)
    has: torch.Tensor  # [B, A] blocks that count in EAL
    hid: torch.Tensor  # [B, A, bs, H] final-norm slot states


@dataclass
class LossOutput:
    """What one `DFlashDraft.loss` call returns (tensors detached except `loss`)."""

    loss: torch.Tensor  # [] differentiable
    per_slot_acc: torch.Tensor  # [block_size - 1] accuracy of slots 1..bs-1 (0 where no labels)
    per_slot_count: torch.Tensor  # [block_size - 1] supervised slots per position
    eal: torch.Tensor  # [] expected acceptance length (see module docstring)
    n_tokens: int  # supervised slots in the loss
    n_blocks: int  # valid anchors (blocks) drawn
    # a family's own metrics beside these (e.g. DFlash2's selector loss), logged as given
    extra: dict[str, float] = field(default_factory=dict)


class Attention(DraftAttention):
    """Queries from the block; keys/values from [context ; block] (context injected)."""

    def __init__(self, cfg: DFlashConfig) -> None:
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
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
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


class DFlashDraft(nn.Module):
    """Trainable: `layers`, `fc`, `hidden_norm`, `norm`. Frozen buffers (not in
    `state_dict`): `embed_weight` [V, H], `lm_head_weight` [V or draft V, H],
    `verifier_norm_weight` [H], and for a draft vocabulary `d2t`/`t2d`/`t2d_index`."""

    # the config a family's draft is built from (a family subclass names its own)
    config_class: ClassVar[type[DFlashConfig]] = DFlashConfig
    # the block's first drafted slot: 1 (the anchor is the verifier's bonus token); a
    # family that drafts from the anchor too (DSpark) sets 0
    first_drafted_slot: ClassVar[int] = 1
    embed_weight: torch.Tensor
    lm_head_weight: torch.Tensor
    verifier_norm_weight: torch.Tensor
    t2d_index: torch.Tensor

    def __init__(
        self,
        cfg: DFlashConfig,
        embed_weight: torch.Tensor,  # [V, H]
        lm_head_weight: torch.Tensor,  # [V, H]
        verifier_norm_weight: torch.Tensor,  # [H]
        draft_vocab_ids: torch.Tensor | None = None,  # [draft V] sorted verifier ids
    ) -> None:
        # every family's draft takes its own config (the one check each family's class shares)
        if not isinstance(cfg, want := type(self).config_class):
            name = want.__name__  # "an" before a letter read with a vowel sound (an MTP...)
            a = "an" if name[0] in "AEFHILMNORSX" else "a"
            raise ConfigError(f"{type(self).__name__} needs {a} {name}, got {type(cfg).__name__}")
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        if embed_weight.shape != (cfg.vocab_size, h) or lm_head_weight.shape != (cfg.vocab_size, h):
            raise ConfigError(
                f"verifier embed/lm_head shapes {tuple(embed_weight.shape)} / "
                f"{tuple(lm_head_weight.shape)} do not match vocab_size x hidden_size "
                f"({cfg.vocab_size}, {h})"
            )
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.rope = Rope(cfg.head_dim, cfg.rope_theta)
        self.reset_parameters()
        with torch.no_grad():
            self.norm.weight.copy_(verifier_norm_weight)  # head expects verifier-normed input
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer(
            "verifier_norm_weight", verifier_norm_weight.detach(), persistent=False
        )
        head = lm_head_weight.detach()
        self.d2t: torch.Tensor | None
        self.t2d: torch.Tensor | None
        self.register_buffer("d2t", None, persistent=False)
        self.register_buffer("t2d", None, persistent=False)
        if cfg.draft_vocab_size is not None:
            if draft_vocab_ids is None or draft_vocab_ids.numel() != cfg.draft_vocab_size:
                raise ConfigError(
                    f"draft_vocab_size={cfg.draft_vocab_size} needs draft_vocab_ids with that "
                    "many verifier token ids (e.g. the most frequent tokens of the data)"
                )
            ids = draft_vocab_ids.long().sort().values
            # speculators mapping: draft id d -> verifier id d + d2t[d]; t2d marks kept ids
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[ids] = True
            self.register_buffer("d2t", ids - torch.arange(ids.numel()), persistent=False)
            self.register_buffer("t2d", t2d, persistent=False)
            t2d_index = torch.full((cfg.vocab_size,), -100, dtype=torch.long)
            t2d_index[ids] = torch.arange(ids.numel())
            self.register_buffer("t2d_index", t2d_index, persistent=False)
            head = head[ids]
        self.register_buffer("lm_head_weight", head, persistent=False)

    def make_layer(self, cfg: DFlashConfig, index: int) -> nn.Module:
        """One draft decoder layer (a family whose layers differ overrides this)."""
        return DecoderLayer(cfg)

    def reset_parameters(self, std: float = 0.02) -> None:
        """HF-style init: normal(0, std) linears, unit norms."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, nn.RMSNorm) and m.weight is not None:
                nn.init.ones_(m.weight)

    # ---- construction from a local verifier directory -------------------------------

    @classmethod
    def from_verifier(
        cls,
        verifier_dir: str | Path,
        *,
        draft_vocab_ids: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        **overrides: Any,
    ) -> Self:
        """Build a draft from a local HF verifier: shapes from its `config.json`, and only
        `embed_tokens`, `lm_head` (or the tied embedding) and the final norm read from its
        safetensors (`safe_open`, one tensor at a time). `overrides` are DFlashConfig fields
        (e.g. `num_layers`, `block_size`, `target_layer_ids`, `mask_token_id`)."""
        vdir = Path(verifier_dir)
        vcfg = read_verifier_config(vdir)
        fields = {**vcfg, **overrides}
        if fields.get("target_layer_ids") is None:  # the DFlash rule, as the producer's
            n_draft = fields.get("num_layers", DraftRecipe.model_fields["num_layers"].default)
            fields["target_layer_ids"] = default_target_layer_ids(
                vcfg["_num_hidden_layers"], n_draft
            )
        fields.setdefault("mask_token_id", vcfg["vocab_size"] - 1)
        fields.pop("_num_hidden_layers")
        try:
            cfg = cls.config_class(**fields)
        except ValueError as e:
            raise ConfigError(
                f"{cls.config_class.__name__} from {vdir / 'config.json'} + overrides: {e}"
            ) from e
        return cls.with_verifier_tensors(cfg, vdir, draft_vocab_ids, dtype, device=device)

    @classmethod
    def with_verifier_tensors(
        cls,
        cfg: DFlashConfig,
        verifier_dir: str | Path,
        draft_vocab_ids: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        *,
        device: str | torch.device = "cpu",
    ) -> Self:
        """A draft of shape `cfg` (freshly initialised weights, drawn on the CPU) with the
        verifier's frozen embedding, `lm_head` (or the tied embedding) and final norm (its
        gain: Gemma-style 1 + w), read by the names the checkpoint gives its text model
        (fanout.model.verifier_dir.text_tensors: a multimodal one's too), on `device` in
        `dtype`. The verifier's tensors move to `device` as stored (bf16 for
        most) and are cast there: half the copy, and a GPU casts in milliseconds what takes
        the CPU seconds (two 151,936 x 4,096 matrices for Qwen3-8B)."""
        embed, head, norm = read_text_tensors(Path(verifier_dir))  # the text model's
        embed = embed.to(device).to(dtype)
        head = embed if head is None else head.to(device).to(dtype)  # None: tied
        draft = cls(cfg, embed, head, norm.to(device).to(dtype), draft_vocab_ids)
        return draft.to(dtype=dtype).to(device=device)

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
        _check_batch(batch, len(cfg.target_layer_ids) * cfg.hidden_size, cfg.loss_type == "kl")
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

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None) -> LossOutput:
        """Draw the blocks (`blocks`), return DFlash's loss and metrics on them."""
        return self.block_loss(batch, self.blocks(batch, generator))

    def block_loss(self, batch: dict[str, torch.Tensor], b: Blocks) -> LossOutput:
        """DFlash's loss and metrics on drawn blocks `b` (see the module docstring); a
        family that adds a term (DFlash2's selector) calls this for the unary part."""
        cfg, bs = self.cfg, self.cfg.block_size
        anchors, valid, sup, label, has, hid = b.anchors, b.valid, b.sup, b.label, b.has, b.hid
        rows = hid[sup]  # [M, H] only supervised slots reach the head
        if cfg.loss_type == "kl":
            teacher = self.verifier_rows(batch, anchors)[sup]  # [M, H]
            ce, pred = linear_kl_div_and_argmax(rows, teacher, self.lm_head_weight)  # [M], [M]
        else:
            ce, pred = linear_cross_entropy_and_argmax(
                rows, self.lm_head_weight, label[sup], reduction="none"
            )  # [M], [M]
        slot = torch.arange(bs, device=sup.device).expand_as(sup)[sup]  # [M] slot index k
        w = self._slot_weights(ce.detach(), sup, slot)  # [M]
        n_tok = int(sup.sum())
        loss = (ce * w).sum() / max(n_tok, 1)
        with torch.no_grad():
            correct = torch.zeros_like(sup)
            correct[sup] = pred == label[sup]
            cnt = sup[:, :, 1:].sum(dim=(0, 1))  # [bs-1]
            acc = correct[:, :, 1:].sum(dim=(0, 1)) / cnt.clamp(min=1)
            run = torch.cumprod(correct[:, :, 1:].long(), dim=2).sum(dim=2)  # [B, A]
            eal = (1.0 + run[has].float()).mean() if has.any() else torch.tensor(1.0)
        return LossOutput(loss, acc.float(), cnt, eal, n_tok, int(valid.sum()))

    def _slot_weights(
        self, ce: torch.Tensor, sup: torch.Tensor, slot: torch.Tensor
    ) -> torch.Tensor:
        if self.cfg.loss_weighting == "exp":
            return torch.exp(-(slot - 1).clamp(min=0).float() / self.cfg.resolved_gamma)
        # D-PACE (speculators dpace_loss_decay): q = exp(-CE) confidence, smoothed
        # (1-α)q + α on supervised slots (1 elsewhere), prefix products along the block,
        # weight of slot k = sum over supervised slots m >= k of prefix_m.
        alpha = self.cfg.dpace_alpha
        q = torch.ones(sup.shape, dtype=torch.float32, device=sup.device)  # [B, A, bs]
        q[sup] = (1 - alpha) * torch.exp(-ce.float()) + alpha
        prefix = torch.cumprod(q, dim=2) * sup
        weight = prefix.flip(2).cumsum(2).flip(2)
        return weight[sup]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Weights in speculators DFlash key names (`fc.weight`, `layers.0.self_attn...`)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rope.")}


def _check_batch(batch: dict[str, torch.Tensor], width: int, kl: bool = False) -> None:
    need = [HIDDEN_STATES, INPUT_IDS, LOSS_MASK, DOCUMENT_IDS, POSITION_IDS]
    for k in need:
        if k not in batch:
            raise ConfigError(f"DFlash batch is missing {k!r} (has {sorted(batch)})")
    if kl and LAST_HIDDEN_STATES not in batch:
        raise ConfigError(
            "loss_type 'kl' needs last_hidden_states in the batch: capture the run with "
            "--store-last-hidden-states"
        )
    b, t = batch[INPUT_IDS].shape
    if batch[HIDDEN_STATES].shape != (b, t, width):
        raise ConfigError(
            f"hidden_states {tuple(batch[HIDDEN_STATES].shape)} != [B, T, n·H] = "
            f"{(b, t, width)}: target_layer_ids/hidden_size disagree with the capture"
        )


def count_parameters(model: nn.Module) -> int:
    """Trainable parameter count."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


__all__ = [
    "Blocks",
    "DFlashDraft",
    "LossOutput",
    "count_parameters",
]
