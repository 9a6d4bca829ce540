"""The MTP draft: one multi-token-prediction layer over the verifier's final hidden state
and the next token's embedding, with the verifier's whole vocabulary, trained unrolled
on its own output.

    from fanout.families.mtp.model import MTPDraft
    draft = MTPDraft.from_verifier("models/qwen3-8b", target_layer_ids=[35], block_size=4)
    out = draft.loss(batch, None)   # batch: window rows (the last layer's states)
    out.loss.backward(); print(out.per_slot_acc, out.eal)

Architecture (speculators 0.9.0 `MTPDraftModel` with a Qwen3 layer; a Qwen3-Next /
Qwen3.5 / Qwen3.5-MoE verifier's own full-attention layer with `cfg.layer_config`,
fanout.families.mtp.layers;
`speculators/models/mtp/model_definitions.py` `MTPLayerMixin`; vLLM's `mtp` models;
same parameter names, so `trainable_state()` keys are speculators'
`mtp_layers.0.*`): `input_proj` (2H -> H, bias-free) over
`[token_layernorm(embed(token)) ; hidden_layernorm(hidden)]`, a Qwen3 decoder layer
(per-head q/k norm), then `final_layernorm`, whose output is both the head's input
(the verifier's frozen `lm_head`, whole vocabulary) and the hidden state of the next
step. The embedding and head are the verifier's, frozen (speculators writes neither).

Input: the verifier's final hidden states, after its final norm (what its head reads;
speculators' `verifier_last_hidden_states`, vLLM's target hidden states): fanout
captures the last decoder layer (`target_layer_ids` `[L - 1]`, speculators'
`[num_hidden_layers]` in HF numbering) and applies the verifier's final norm (`fuse`),
in training and in decoding alike.

Rows (speculators' `forward`): with K = `mtp_steps` and R = T - K - 1 rows, step
k = 0..K-1 feeds row t the token t+k+1 and the hidden state of row t (step 0: the
verifier's at t; step k: this layer's step k-1 output), at position `position_ids[t]`,
attending causally to the rows <= t of its document at the same step; its output
predicts token t+k+2. Loss: per step, cross-entropy summed over supervised rows and
divided by their count (at least 1), weighted by `step_weights()` (FastMTP's normalised
beta**k), summed over steps.

Semantics decided here (`tests/test_family_mtp.py` pins them against speculators):
- Supervision: step k of row t counts iff `loss_mask[t+k+2]` and that token is in row
  t's document (speculators reads the same index of its loss mask; it has no documents).
- Labels: `label_source input_ids` the data token t+k+2 (speculators); `target_ids`
  the verifier's greedy token there (`target_ids[t+k+1]`).
- Positions: each row's own `position_ids` (speculators: the same when given).

Metrics: `per_slot_acc[k]` greedy accuracy of step k over its supervised rows; `eal`
= 1 + the run of correct steps from step 0 over rows whose step 0 is supervised;
`extra["loss_{k}"]` each step's unweighted loss.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from fanout.errors import ConfigError
from fanout.families.mtp.config import MTPConfig
from fanout.families.mtp.layers import HybridMTPLayer, layer_rope
from fanout.model.chain_draft import Attend, ChainLayer
from fanout.model.draft import Draft, LossOutput
from fanout.model.draft_attention import PrefixMask, Rope
from fanout.model.draft_config import DraftConfig
from fanout.model.slot_loss import acceptance, head_loss
from fanout.rows import DOCUMENT_IDS, HIDDEN_STATES, INPUT_IDS, LOSS_MASK, POSITION_IDS, TARGET_IDS

IGNORE = -100


class MTPLayer(ChainLayer):
    """speculators' `MTPLayerMixin` over a Qwen3 decoder layer (the chain drafters' plain
    layer with q/k norm)."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__(cfg, qk_norm=True)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.hidden_layernorm = nn.RMSNorm(h, eps=eps)
        self.token_layernorm = nn.RMSNorm(h, eps=eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.final_layernorm = nn.RMSNorm(h, eps=eps)

    def run(self, emb: torch.Tensor, x: torch.Tensor, attention: Attend) -> torch.Tensor:
        """The layer on hidden states `x` `[B, L, H]` fed tokens embedded as `emb`:
        the final-normed output `[B, L, H]` (head input and next step's hidden)."""
        cat = torch.cat([self.token_layernorm(emb), self.hidden_layernorm(x)], dim=-1)
        x = super().run(emb, self.input_proj(cat), attention)
        return cast("torch.Tensor", self.final_layernorm(x))


class MTPDraft(Draft):
    """Trainable: `mtp_layers.0` (speculators' names); frozen buffers: the verifier's
    embedding, head and final norm (`fuse`)."""

    config_class: ClassVar[type[DraftConfig]] = MTPConfig
    cfg: MTPConfig

    def __init__(self, cfg: DraftConfig, *verifier: Any) -> None:
        """`Draft`'s arguments: the config, then the verifier's frozen tensors."""
        super().__init__(cfg, *verifier)
        cfg = self.cfg  # its own config class (Draft checked it)
        # speculators' module names: one `mtp_layers` entry (no fc, context norm or norm)
        self.mtp_layers = nn.ModuleList([self.make_layer(cfg)])
        # the hybrid layer's partial RoPE, or the draft's
        self.rope: nn.Module = (
            Rope(cfg.head_dim, cfg.rope_theta)
            if cfg.layer_config is None
            else layer_rope(cfg.layer_config)
        )
        self.reset_parameters()

    @property
    def layers(self) -> nn.ModuleList:
        """The MTP layer (as speculators' `layers` property), what the drafting step runs."""
        return self.mtp_layers

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the draft computes in (its `input_proj`'s; the drafting step's)."""
        return cast("MTPLayer", self.mtp_layers[0]).input_proj.weight.dtype

    def make_layer(self, cfg: MTPConfig) -> nn.Module:
        """speculators' MTP layer for the verifier: Qwen3's, or the hybrid one."""
        return MTPLayer(cfg) if cfg.layer_config is None else HybridMTPLayer(cfg.layer_config)

    def fuse(self, hs: torch.Tensor) -> torch.Tensor:
        """The last decoder layer's output `[.., H]` -> the verifier's final-normed state."""
        dt = self.compute_dtype
        w = self.verifier_norm_weight
        return F.rms_norm(hs.to(dt), (w.shape[0],), w.to(dt), self.cfg.rms_norm_eps)

    # ---- the forward ---------------------------------------------------------------

    def states(
        self,
        hidden: torch.Tensor,  # [B, R, H] final-normed hidden state of each row
        tokens: torch.Tensor,  # [B, R] fed tokens
        pos: torch.Tensor,  # [B, R] positions
        mask: PrefixMask | torch.Tensor,  # PrefixMask.causal, or a [B, 1, R, R] bool
    ) -> torch.Tensor:
        """One pass of the MTP layer over rows: outputs `[B, R, H]` (final-normed)."""
        dt = self.compute_dtype
        emb = F.embedding(tokens, self.embed_weight).to(dt)
        rope = self.rope(pos, dt)
        layer = cast("MTPLayer", self.mtp_layers[0])
        a = layer.self_attn

        def attend(h: torch.Tensor) -> torch.Tensor:
            k, v = a.kv(h, rope)
            return a.attend(h, k, v, rope, mask)

        return layer.run(emb, hidden.to(dt), attend)

    def unroll(self, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Every step's outputs `[B, R, H]` (the head's input), R = T - mtp_steps - 1."""
        cfg = self.cfg
        _check_mtp_batch(batch, cfg.hidden_size, cfg.mtp_steps)
        ids, doc = batch[INPUT_IDS].long(), batch[DOCUMENT_IDS].long()
        r = ids.shape[1] - cfg.mtp_steps - 1  # speculators' valid_len
        row_doc, pos = doc[:, :r], batch[POSITION_IDS].long()[:, :r]
        mask = PrefixMask.causal(row_doc)  # rows <= t of its document; padding only itself
        hidden = self.fuse(batch[HIDDEN_STATES][:, :r])  # [B, R, H]
        outs = []
        for k in range(cfg.mtp_steps):
            hidden = self.states(hidden, ids[:, k + 1 : k + 1 + r], pos, mask)
            outs.append(hidden)
        return outs

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None) -> LossOutput:
        """The unrolled MTP loss and metrics of a window batch (module docstring);
        `generator` is unused (every row trains)."""
        cfg = self.cfg
        outs = self.unroll(batch)
        ids, lm = batch[INPUT_IDS].long(), batch[LOSS_MASK].bool()
        doc = batch[DOCUMENT_IDS].long()
        r = outs[0].shape[1]
        row_doc = doc[:, :r]
        weights = cfg.step_weights()
        loss = outs[0].new_zeros((), dtype=torch.float32)
        sups, rights, extra = [], [], {}
        for k, out in enumerate(outs):
            at = slice(k + 2, k + 2 + r)  # the predicted tokens
            if cfg.label_source == TARGET_IDS:
                label = batch[TARGET_IDS].long()[:, k + 1 : k + 1 + r]
            else:
                label = ids[:, at]
            sup = lm[:, at] & (doc[:, at] == row_doc) & (row_doc >= 0)  # [B, R]
            n = int(sup.sum())
            right = torch.zeros_like(sup)
            if n:
                per_row, pred = head_loss(out[sup], self.lm_head_weight, labels=label[sup])
                step_loss = per_row.float().sum() / n
                loss = loss + weights[k] * step_loss
                right[sup] = pred == label[sup]
                extra[f"loss_{k}"] = float(step_loss.detach())
            sups.append(sup)
            rights.append(right)
        sup_all, right_all = torch.stack(sups, -1), torch.stack(rights, -1)  # [B, R, K]
        has = sup_all[:, :, 0]  # rows whose step 0 is supervised
        acc, cnt, eal = acceptance(right_all, sup_all, has)
        return LossOutput(loss, acc, cnt, eal, int(cnt.sum()), int(has.sum()), extra)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """`mtp_layers.0.*` under speculators' names (it writes no embedding or head)."""
        return {k: v for k, v in self.state_dict().items() if k.startswith("mtp_layers.")}


def _check_mtp_batch(batch: dict[str, Any], width: int, steps: int) -> None:
    for k in (HIDDEN_STATES, INPUT_IDS, LOSS_MASK, DOCUMENT_IDS, POSITION_IDS):
        if k not in batch:
            raise ConfigError(f"MTP batch is missing {k!r} (has {sorted(batch)})")
    b, t = batch[INPUT_IDS].shape
    if batch[HIDDEN_STATES].shape != (b, t, width):
        raise ConfigError(
            f"hidden_states {tuple(batch[HIDDEN_STATES].shape)} != [B, T, H] = {(b, t, width)}: "
            "MTP reads one layer, the verifier's last (--draft-layer-ids L-1)"
        )
    if t < steps + 2:
        raise ConfigError(f"MTP with --mtp-steps {steps} needs rows of at least {steps + 2} tokens")


__all__ = ["MTPDraft", "MTPLayer"]
