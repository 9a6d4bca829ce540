"""The chain drafter's backbone, shared by every family that drafts a chain from the
verifier's states a token (or a depth) at a time (EAGLE-3, P-EAGLE; MTP's layer builds
on its plain layer): the layers, the fused auxiliary states, the rows, and the
training-time-test unroll their losses start from.

    from fanout.model.chain_draft import ChainDraft
    class MyDraft(ChainDraft):                      # a family's model (families/<name>/model.py)
        config_class = MyConfig
        def loss(self, batch, generator):
            rows = self.rows(batch)                 # aux states, positions, documents [B, R]
            u = self.start(rows[HIDDEN_STATES], rows[POSITION_IDS], rows[DOCUMENT_IDS])
            tok, sup, teacher = self.step_inputs(batch, rows[DOCUMENT_IDS], 0)
            out = self.step(u, tok)                 # [B, R, H] the head's input
            ...                                     # the family's own loss on `out`

Architecture (speculators 0.9.0 `Eagle3DraftModel` with a Llama layer, vLLM's
`llama_eagle3.py`; the same parameter names, so `trainable_state()` keys are
speculators'):
- the verifier's states at the auxiliary layers `[.., n·H]`, optionally normed
  (`input_norm` over the concatenation with `norm_before_fc`, or `fc_norm.{i}` per state
  with `fc_norm`), fused by the bias-free `fc` (n·H -> H): `fuse`;
- the first decoder layer (`ChainFirstLayer`) reads `[embed(token) ; hidden]` (2H):
  `input_layernorm` on the embedding, `hidden_norm` on the hidden state, q/k/v
  projections from 2H, residual the hidden state (its normed version with
  `norm_before_residual`); further layers are plain Llama layers (`ChainLayer`; with
  `qk_norm`, Qwen3's per-head q/k norm); final `norm` (ones, as speculators initialises
  it) and the verifier's frozen head rows (of the draft vocabulary).

Rows (fanout's window rows `[B, T]`, unshifted; `rows`): draft row t (t = 0..T-2) reads
the verifier state at t and the token t+1, at the token's position `position_ids[t+1]`;
a row whose two positions lie in different documents is padding (document -1: it sees
only itself and nothing sees it), as speculators' per-sample shift never forms one.

Training-time test (`start`, `step`; EAGLE-3's loss, and its uncached drafting
reference): step s = 0, 1, .. feeds row t the data token t+1+s (teacher forcing, as
speculators; `step_inputs`) and, for s >= 1, its own step s-1 output (final-normed with
`norm_output`), at position `position_ids[t+1] + s`; it attends to step 0 of the rows
<= t of its document and to its own steps 1..s (speculators' diagonal mask,
`PrefixMask.causal`). Its output predicts token t+s+2; its target is the verifier's
distribution there (`last_hidden_states[t+s+1]` through the frozen head,
fanout.ops.teacher_head), supervised iff `loss_mask[t+s+2]` and that token is in row
t's document.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from fanout.errors import ConfigError
from fanout.model.block_draft import MLP
from fanout.model.draft import Draft, check_batch
from fanout.model.draft_attention import DraftAttention, PrefixMask, Rope
from fanout.model.draft_config import ChainConfig, DraftConfig
from fanout.rows import (
    DOCUMENT_IDS,
    HIDDEN_STATES,
    INPUT_IDS,
    LAST_HIDDEN_STATES,
    LOSS_MASK,
    POSITION_IDS,
)

Attend = Callable[[torch.Tensor], torch.Tensor]  # normed layer input -> attention output


class ChainAttention(DraftAttention):
    """Llama attention whose projections read `in_features` (2H in the first layer:
    `[embedding ; hidden]`); with `qk_norm`, Qwen3's per-head `q_norm`/`k_norm` before
    RoPE (a `qwen3` draft layer: P-EAGLE's reference, MTP's). The shared draft attention
    (fanout.model.draft_attention)."""

    def __init__(self, cfg: DraftConfig, in_features: int, *, qk_norm: bool = False) -> None:
        super().__init__(cfg, in_features, qk_norm=qk_norm)


class ChainFirstLayer(nn.Module):
    """speculators' EAGLE-3 first layer: attention over `[norm(embedding) ; norm(hidden)]`."""

    def __init__(self, cfg: ChainConfig, *, qk_norm: bool = False) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = ChainAttention(cfg, 2 * h, qk_norm=qk_norm)
        self.mlp = MLP(cfg)
        self.input_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.norm_before_residual = cfg.norm_before_residual

    def run(self, emb: torch.Tensor, x: torch.Tensor, attention: Attend) -> torch.Tensor:
        """The layer on hidden states `x` `[B, L, H]` fed tokens embedded as `emb`."""
        hid = self.hidden_norm(x)
        res = hid if self.norm_before_residual else x
        x = res + attention(torch.cat([self.input_layernorm(emb), hid], dim=-1))  # [B, L, H]
        return x + self.mlp(self.post_attention_layernorm(x))


class ChainLayer(nn.Module):
    """A plain Llama decoder layer (the second and later layers; with `qk_norm` a Qwen3
    one). `run` takes the fed embedding too, as every chain layer's, and ignores it."""

    def __init__(self, cfg: DraftConfig, *, qk_norm: bool = False) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = ChainAttention(cfg, h, qk_norm=qk_norm)
        self.mlp = MLP(cfg)
        self.input_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)

    def run(self, emb: torch.Tensor, x: torch.Tensor, attention: Attend) -> torch.Tensor:
        x = x + attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class Unroll:
    """The state of one TTT unroll over rows `[B, R]` (training, or the uncached
    drafting reference): each layer's keys/values of every step so far, the hidden
    state fed to the next step, the rows' positions and documents (the mask)."""

    hidden: torch.Tensor  # [B, R, H]
    pos: torch.Tensor  # [B, R] step-0 positions
    row_doc: torch.Tensor  # [B, R] documents (-1: padding, which sees only itself)
    keys: list[list[torch.Tensor]] = field(default_factory=list)  # [layer][step] [B, nkv, R, hd]
    values: list[list[torch.Tensor]] = field(default_factory=list)
    step: int = 0
    # the TTT mask of every step so far and to come (`PrefixMask.causal` of the steps the
    # unroll was started for): one chunk plan for all of them (`ChainDraft.step`)
    mask: PrefixMask | None = None


class ChainDraft(Draft):
    """Trainable: `fc`, `input_norm` (norm_before_fc) or `fc_norm` (fc_norm), `layers`,
    `norm`; frozen buffers as `Draft`'s (embedding, head rows, `d2t`/`t2d`). A family's
    chain draft subclasses this and defines `loss`; one whose layers differ overrides
    `make_layer`."""

    config_class: ClassVar[type[DraftConfig]] = ChainConfig
    # the family's name in a bad batch's message, and its --capture-for value
    family_label: ClassVar[str] = "chain draft"
    capture_for: ClassVar[str] = "<family>"
    cfg: ChainConfig
    input_norm: nn.RMSNorm | None
    fc_norm: nn.ModuleList | None

    def __init__(self, cfg: DraftConfig, *verifier: Any) -> None:
        """`Draft`'s arguments: the config, then the verifier's frozen tensors."""
        super().__init__(cfg, *verifier)
        cfg = self.cfg  # its own config class (Draft checked it)
        h, n = cfg.hidden_size, len(cfg.target_layer_ids)
        # registered in this order (the parameters' order: an optimizer's state ids)
        self.fc = nn.Linear(n * h, h, bias=False)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)  # ones: speculators initialises it so
        self.rope = Rope(cfg.head_dim, cfg.rope_theta)
        self.input_norm = nn.RMSNorm(n * h, eps=cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(nn.RMSNorm(h, eps=cfg.rms_norm_eps) for _ in range(n))
            if cfg.fc_norm
            else None
        )
        self.reset_parameters()

    def make_layer(self, cfg: DraftConfig, index: int) -> nn.Module:
        """One draft decoder layer: the first over `[embedding ; hidden]`, then plain ones
        (a family whose layers differ overrides this)."""
        assert isinstance(cfg, ChainConfig)
        return ChainFirstLayer(cfg) if index == 0 else ChainLayer(cfg)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the draft computes in (its weights'; the drafting step follows it)."""
        return self.fc.weight.dtype

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Weights under speculators' EAGLE-3 names, plus `embed_tokens.weight` and
        `lm_head.weight`: speculators' EAGLE-3 reads both from its checkpoint (it writes
        them itself; a missing embedding stays uninitialised memory on load). A reduced
        vocabulary's head is written by the checkpoint itself."""
        state = super().trainable_state()
        state["embed_tokens.weight"] = self.embed_weight
        if self.d2t is None:
            state["lm_head.weight"] = self.lm_head_weight
        return state

    # ---- the forward ---------------------------------------------------------------

    def fuse(self, hs: torch.Tensor) -> torch.Tensor:
        """Auxiliary states `[.., n·H]` -> the fused hidden state `[.., H]`."""
        hs = hs.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            hs = self.input_norm(hs)
        if self.fc_norm is not None:
            parts = hs.chunk(len(self.fc_norm), dim=-1)
            hs = torch.cat([norm(x) for norm, x in zip(self.fc_norm, parts)], dim=-1)
        return cast("torch.Tensor", self.fc(hs))

    def start(
        self, hs: torch.Tensor, pos: torch.Tensor, row_doc: torch.Tensor, steps: int = 1
    ) -> Unroll:
        """An unroll over rows with auxiliary states `hs` `[B, R, n·H]`, step-0 positions
        `pos` `[B, R]` and documents `row_doc` `[B, R]` (-1: padding), for `steps` TTT
        steps: their mask (and its chunk plan) is made once here, each step reads its
        first (s+1)·R keys (a step past them makes its own)."""
        n_layers = len(self.layers)
        return Unroll(
            self.fuse(hs), pos, row_doc,
            [[] for _ in range(n_layers)], [[] for _ in range(n_layers)],
            mask=PrefixMask.causal(row_doc, steps=steps),
        )  # fmt: skip

    def step(self, u: Unroll, tokens: torch.Tensor) -> torch.Tensor:
        """One TTT step fed `tokens` `[B, R]`: every row's final-normed state `[B, R, H]`
        (the head's input); `u` moves on to the next step."""
        dt = self.fc.weight.dtype
        emb = F.embedding(tokens, self.embed_weight).to(dt)  # [B, R, H]
        rope = self.rope(u.pos + u.step, dt)
        # step 0's rows <= r of its document, and row r's own steps 1..s: [B, 1, R, (s+1)·R]
        # (the unroll's mask of all its steps, cut to the keys so far: one plan a batch)
        if u.mask is None or u.mask.own.shape[2] <= u.step:
            u.mask = PrefixMask.causal(u.row_doc, steps=u.step + 1)
        mask = u.mask
        x = u.hidden
        for i, layer in enumerate(self.layers):
            attend = functools.partial(self._ttt_attend, u, i, layer, rope, mask)
            x = cast("ChainLayer", layer).run(emb, x, attend)
        out = cast("torch.Tensor", self.norm(x))  # [B, R, H]
        u.hidden = out if self.cfg.norm_output else x
        u.step += 1
        return out

    @staticmethod
    def _ttt_attend(
        u: Unroll, i: int, layer: Any, rope: Any, mask: PrefixMask, h: torch.Tensor
    ) -> torch.Tensor:
        """Layer `i`'s attention at the unroll's step: this step's keys/values join the
        earlier steps' (row r's own steps on the diagonal of `mask`)."""
        a = layer.self_attn
        k, v = a.kv(h, rope)  # [B, nkv, R, hd]
        u.keys[i].append(k)
        u.values[i].append(v)
        keys, vals = torch.cat(u.keys[i], dim=2), torch.cat(u.values[i], dim=2)
        return cast("torch.Tensor", a.attend(h, keys, vals, rope, mask))

    # ---- the rows and their targets -----------------------------------------------

    def check_rows(self, batch: dict[str, torch.Tensor]) -> None:
        """ConfigError unless `batch` holds window rows with the auxiliary states, the
        verifier's last hidden states (the targets) and at least 3 tokens a row."""
        cfg, label = self.cfg, self.family_label
        width = len(cfg.target_layer_ids) * cfg.hidden_size
        check_batch(batch, width, kl=True, family=label, capture_for=self.capture_for)
        t = batch[INPUT_IDS].shape[1]
        if t < 3:
            raise ConfigError(f"{label} rows need at least 3 tokens, got T = {t}")

    @staticmethod
    def rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The draft rows of a window batch (module docstring): auxiliary states `[B, R,
        n·H]`, positions and documents `[B, R]`, R = T - 1."""
        doc = batch[DOCUMENT_IDS].long()
        row_doc = torch.where(
            doc[:, :-1] == doc[:, 1:], doc[:, 1:], torch.full_like(doc[:, 1:], -1)
        )
        return {
            HIDDEN_STATES: batch[HIDDEN_STATES][:, :-1],
            POSITION_IDS: batch[POSITION_IDS].long()[:, 1:],
            DOCUMENT_IDS: row_doc,
        }

    @staticmethod
    def step_inputs(
        batch: dict[str, torch.Tensor], row_doc: torch.Tensor, s: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step s's fed tokens `[B, R]` (the data token t+1+s, 0 past the row), its
        supervision `[B, R]` and the verifier states of its targets `[B, R, H]`
        (`last_hidden_states[t+s+1]`)."""
        ids, lm = batch[INPUT_IDS].long(), batch[LOSS_MASK].bool()
        doc = batch[DOCUMENT_IDS].long()
        b = ids.shape[0]
        tok = torch.cat([ids[:, 1 + s :], ids.new_zeros(b, s)], dim=1)  # [B, R]
        pad = s + 1
        pred_mask = torch.cat([lm[:, s + 2 :], lm.new_zeros(b, pad)], dim=1)  # [B, R]
        pred_doc = torch.cat([doc[:, s + 2 :], doc.new_full((b, pad), -2)], dim=1)
        sup = pred_mask & (pred_doc == row_doc) & (row_doc >= 0)
        last = batch[LAST_HIDDEN_STATES]  # [B, T, H]
        teacher = torch.cat([last[:, s + 1 :], last.new_zeros(b, s, last.shape[2])], dim=1)
        return tok, sup, teacher


__all__ = [
    "Attend",
    "ChainAttention",
    "ChainDraft",
    "ChainFirstLayer",
    "ChainLayer",
    "Unroll",
]
