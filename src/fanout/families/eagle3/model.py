"""The EAGLE-3 draft and its training-time-test (TTT) loss.

    from fanout.families.eagle3.model import Eagle3Draft
    draft = Eagle3Draft.from_verifier("models/qwen3-8b", target_layer_ids=[1, 17, 32],
                                      num_layers=1, block_size=4, draft_vocab_size=None)
    out = draft.loss(batch, None)   # batch: window rows with last_hidden_states
    out.loss.backward(); print(out.per_slot_acc, out.eal)

Architecture (speculators 0.9.0 `Eagle3DraftModel` with a Llama layer, vLLM's
`llama_eagle3.py`; same parameter names, so `trainable_state()` keys are speculators'):
- the verifier's states at the auxiliary layers `[.., n·H]`, optionally normed
  (`input_norm` over the concatenation with `norm_before_fc`, or `fc_norm.{i}` per state
  with `fc_norm`), fused by the bias-free `fc` (n·H -> H);
- the first decoder layer reads `[embed(token) ; hidden]` (2H): `input_layernorm` on the
  embedding, `hidden_norm` on the hidden state, q/k/v projections from 2H, residual the
  hidden state (its normed version with `norm_before_residual`); further layers are plain
  Llama layers; final `norm` and the verifier's frozen head (rows of the draft vocabulary;
  the embedding is the verifier's, frozen).

Rows (fanout's window rows `[B, T]`, unshifted): draft row t (t = 0..T-2) reads the
verifier state at t and the token t+1, at the token's position `position_ids[t+1]`; a row
whose two positions lie in different documents is padding (document -1: it sees only
itself and nothing sees it), as speculators' per-sample shift never forms one.

TTT step s = 0..ttt_steps-1: row t is fed the data token t+1+s (teacher forcing, as
speculators) and, for s >= 1, its own step s-1 output (final-normed with `norm_output`),
at position `position_ids[t+1] + s`; it attends to step 0 of the rows <= t of its
document and to its own steps 1..s (speculators' diagonal mask). Its output predicts
token t+s+2 and is trained toward the verifier's distribution there: the frozen head on
`last_hidden_states[t+s+1]`, over the draft vocabulary (KL, speculators' `kl_div`; or
`loss_type ce`: CE against that distribution's argmax).

Semantics decided here (`tests/test_family_eagle3.py` pins each against speculators):
- Last hidden states: fanout captures them after the verifier's final norm; speculators
  applies `verifier_norm` to pre-norm ones. The teacher is the same.
- Supervision: step s of row t counts iff `loss_mask[t+s+2]` (the predicted token) and
  that token is in row t's document. speculators reads the mask at t+s+1 (the fed
  token) and across documents; fanout reads it at the predicted token, as every fanout
  family does.
- Normalisation: per step, the masked sum over all rows divided by the step's supervised
  count (speculators adds 1e-5 to it), weighted `ttt_step_loss_decay ** s`, summed.

Metrics: `per_slot_acc[s]` greedy accuracy of step s (draft argmax == the verifier
distribution's argmax over the draft vocabulary) over its supervised rows;
`eal` = 1 + the run of correct steps from step 0 (stopping at the first wrong or
unsupervised one), over rows whose step 0 is supervised; `extra["full_acc_{s}"]`
speculators' full accuracy (rows right at every step <= s, among step s's supervised).
Logits are never `[rows, V]` at once: the head runs in row chunks (`_ttt_head`).
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
from fanout.families.eagle3.config import Eagle3Config
from fanout.model.dflash import MLP, DFlashDraft, LossOutput
from fanout.model.draft_attention import DraftAttention, PrefixMask
from fanout.model.draft_config import DFlashConfig
from fanout.ops.linear_ce import _chunk_rows, _mm_fp32
from fanout.rows import (
    DOCUMENT_IDS,
    HIDDEN_STATES,
    INPUT_IDS,
    LAST_HIDDEN_STATES,
    LOSS_MASK,
    POSITION_IDS,
)

Attend = Callable[[torch.Tensor], torch.Tensor]  # normed layer input -> attention output


class Eagle3Attention(DraftAttention):
    """Llama attention whose projections read `in_features` (2H in the first layer:
    `[embedding ; hidden]`); with `qk_norm`, Qwen3's per-head `q_norm`/`k_norm` before
    RoPE (a `qwen3` draft layer, P-EAGLE's reference). The shared draft attention
    (fanout.model.draft_attention)."""

    def __init__(self, cfg: DFlashConfig, in_features: int, *, qk_norm: bool = False) -> None:
        super().__init__(cfg, in_features, qk_norm=qk_norm)


class Eagle3FirstLayer(nn.Module):
    """speculators' EAGLE-3 first layer: attention over `[norm(embedding) ; norm(hidden)]`."""

    def __init__(self, cfg: Eagle3Config, *, qk_norm: bool = False) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Eagle3Attention(cfg, 2 * h, qk_norm=qk_norm)
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


class Eagle3Layer(nn.Module):
    """A plain Llama decoder layer (the second and later layers)."""

    def __init__(self, cfg: DFlashConfig, *, qk_norm: bool = False) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Eagle3Attention(cfg, h, qk_norm=qk_norm)
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


class Eagle3Draft(DFlashDraft):
    """Trainable: `fc`, `input_norm` (norm_before_fc) or `fc_norm` (fc_norm), `layers`,
    `norm`; frozen buffers as DFlashDraft's (embedding, head rows, `d2t`/`t2d`)."""

    config_class: ClassVar[type[DFlashConfig]] = Eagle3Config
    cfg: Eagle3Config
    input_norm: nn.RMSNorm | None
    fc_norm: nn.ModuleList | None

    def __init__(
        self,
        cfg: DFlashConfig,
        embed_weight: torch.Tensor,  # [V, H]
        lm_head_weight: torch.Tensor,  # [V, H]
        verifier_norm_weight: torch.Tensor,  # [H]
        draft_vocab_ids: torch.Tensor | None = None,  # [draft V] sorted verifier ids
    ) -> None:
        super().__init__(cfg, embed_weight, lm_head_weight, verifier_norm_weight, draft_vocab_ids)
        cfg = self.cfg  # its own config class (DFlashDraft checked it)
        del self.hidden_norm  # DFlash's context norm: EAGLE-3 has none after fc
        h, n = cfg.hidden_size, len(cfg.target_layer_ids)
        self.input_norm = nn.RMSNorm(n * h, eps=cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(nn.RMSNorm(h, eps=cfg.rms_norm_eps) for _ in range(n))
            if cfg.fc_norm
            else None
        )
        with torch.no_grad():
            self.norm.weight.fill_(1.0)  # speculators initialises it to ones

    def make_layer(self, cfg: DFlashConfig, index: int) -> nn.Module:
        assert isinstance(cfg, Eagle3Config)
        return Eagle3FirstLayer(cfg) if index == 0 else Eagle3Layer(cfg)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Weights under speculators' EAGLE-3 names, plus the frozen `embed_tokens.weight`
        and `lm_head.weight`: speculators' EAGLE-3 reads both from its checkpoint (it
        writes them itself; a missing embedding stays uninitialised memory on load). A
        reduced vocabulary's head is written by the checkpoint itself."""
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

    def start(self, hs: torch.Tensor, pos: torch.Tensor, row_doc: torch.Tensor) -> Unroll:
        """An unroll over rows with auxiliary states `hs` `[B, R, n·H]`, step-0 positions
        `pos` `[B, R]` and documents `row_doc` `[B, R]` (-1: padding)."""
        n_layers = len(self.layers)
        return Unroll(
            self.fuse(hs), pos, row_doc,
            [[] for _ in range(n_layers)], [[] for _ in range(n_layers)],
        )  # fmt: skip

    def step(self, u: Unroll, tokens: torch.Tensor) -> torch.Tensor:
        """One TTT step fed `tokens` `[B, R]`: every row's final-normed state `[B, R, H]`
        (the head's input); `u` moves on to the next step."""
        dt = self.fc.weight.dtype
        emb = F.embedding(tokens, self.embed_weight).to(dt)  # [B, R, H]
        rope = self.rope(u.pos + u.step, dt)
        # step 0's rows <= r of its document, and row r's own steps 1..s: [B, 1, R, (s+1)·R]
        mask = PrefixMask.causal(u.row_doc, steps=u.step + 1)
        x = u.hidden
        for i, layer in enumerate(self.layers):
            attend = functools.partial(self._ttt_attend, u, i, layer, rope, mask)
            x = cast("Eagle3Layer", layer).run(emb, x, attend)
        out = cast("torch.Tensor", self.norm(x))  # [B, R, H]
        u.hidden = out if self.cfg.norm_output else x
        u.step += 1
        return out

    @staticmethod
    def _ttt_attend(
        u: Unroll, i: int, layer: Any, rope: Any, mask: PrefixMask, h: torch.Tensor
    ) -> torch.Tensor:
        a = layer.self_attn
        k, v = a.kv(h, rope)  # [B, nkv, R, hd]
        u.keys[i].append(k)
        u.values[i].append(v)
        keys, vals = torch.cat(u.keys[i], dim=2), torch.cat(u.values[i], dim=2)
        return cast("torch.Tensor", a.attend(h, keys, vals, rope, mask))

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

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None) -> LossOutput:
        """The TTT loss and metrics of a window batch (module docstring); `generator` is
        unused (every position trains). `batch` needs `last_hidden_states` `[B, T, H]`."""
        cfg = self.cfg
        _check_eagle3_batch(batch, len(cfg.target_layer_ids) * cfg.hidden_size)
        rows = self.rows(batch)
        u = self.start(rows[HIDDEN_STATES], rows[POSITION_IDS], rows[DOCUMENT_IDS])
        head = self.lm_head_weight
        loss = head.new_zeros((), dtype=torch.float32)
        sups: list[torch.Tensor] = []
        rights: list[torch.Tensor] = []
        extra: dict[str, float] = {}
        for s in range(cfg.ttt_steps):
            tok, sup, teacher = self.step_inputs(batch, rows[DOCUMENT_IDS], s)
            out = self.step(u, tok)  # [B, R, H]
            n = int(sup.sum())
            right = torch.zeros_like(sup)
            if n:
                x, t_rows = out[sup], teacher[sup].to(head.dtype)  # [M, H] each
                per_row, pred, label = ttt_head(x, t_rows, head, kl=cfg.loss_type == "kl")
                loss = loss + cfg.ttt_step_loss_decay**s * per_row.sum() / n
                right[sup] = pred == label
                extra[f"loss_{s}"] = float(per_row.detach().sum()) / n
            sups.append(sup)
            rights.append(right)
        with torch.no_grad():
            sup_all, right_all = torch.stack(sups, -1), torch.stack(rights, -1)  # [B, R, S]
            cnt = sup_all.sum(dim=(0, 1))  # [S]
            acc = right_all.sum(dim=(0, 1)) / cnt.clamp(min=1)
            run = torch.cumprod(right_all.long(), dim=-1)  # [B, R, S] right at every step <= s
            has = sup_all[:, :, 0]
            eal = (1.0 + run.sum(-1)[has].float()).mean() if has.any() else torch.tensor(1.0)
            for s in range(cfg.ttt_steps):
                full = (run[:, :, s].bool() & sup_all[:, :, s] & has).sum()
                extra[f"full_acc_{s}"] = float(full) / max(int(cnt[s]), 1)
        return LossOutput(
            loss, acc.float(), cnt, eal, int(cnt.sum()), int(has.sum()), extra
        )  # fmt: skip


def _check_eagle3_batch(batch: dict[str, torch.Tensor], width: int) -> None:
    need = [HIDDEN_STATES, INPUT_IDS, LOSS_MASK, DOCUMENT_IDS, POSITION_IDS]
    for k in need:
        if k not in batch:
            raise ConfigError(f"EAGLE-3 batch is missing {k!r} (has {sorted(batch)})")
    if LAST_HIDDEN_STATES not in batch:
        raise ConfigError(
            "EAGLE-3 trains on the verifier's distribution: the batch needs "
            "last_hidden_states (capture the run with --store-last-hidden-states, or "
            "--capture-for eagle3)"
        )
    b, t = batch[INPUT_IDS].shape
    if batch[HIDDEN_STATES].shape != (b, t, width):
        raise ConfigError(
            f"hidden_states {tuple(batch[HIDDEN_STATES].shape)} != [B, T, n·H] = "
            f"{(b, t, width)}: target_layer_ids/hidden_size disagree with the capture"
        )
    if t < 3:
        raise ConfigError(f"EAGLE-3 rows need at least 3 tokens, got T = {t}")


# ---- the head: KL / CE against the verifier's distribution, in row chunks ---------------


class _TTTHead(torch.autograd.Function):
    """Per row: KL(p || q) (or CE against argmax p), the draft argmax and the verifier
    argmax; q = softmax(x @ W^T), p = softmax(teacher @ W^T). Forward stores the input
    gradient per row (`q - p` or `q - onehot`, times W), backward scales it."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,  # [N, H]
        teacher: torch.Tensor,  # [N, H]
        weight: torch.Tensor,  # [V, H] frozen
        kl: bool,
        chunk_rows: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, h = x.shape
        c = _chunk_rows(n, 2 * weight.shape[0], chunk_rows)  # two [c, V] blocks live
        loss = torch.empty(n, dtype=torch.float32, device=x.device)
        pred = torch.empty(n, dtype=torch.long, device=x.device)
        label = torch.empty(n, dtype=torch.long, device=x.device)
        gx = torch.empty(n, h, dtype=torch.float32, device=x.device)
        with torch.no_grad():
            for s in range(0, n, c):
                e = min(s + c, n)
                log_q = torch.log_softmax(_mm_fp32(x[s:e], weight.t()), dim=-1)  # [c, V]
                log_p = torch.log_softmax(_mm_fp32(teacher[s:e], weight.t()), dim=-1)
                pred[s:e] = log_q.argmax(dim=-1)
                label[s:e] = log_p.argmax(dim=-1)
                if kl:
                    p = log_p.exp()
                    loss[s:e] = (p * (log_p - log_q)).sum(dim=-1)
                else:
                    p = torch.zeros_like(log_p).scatter_(1, label[s:e, None], 1.0)
                    loss[s:e] = -log_q.gather(1, label[s:e, None])[:, 0]
                gx[s:e] = _mm_fp32(log_q.exp_().sub_(p), weight)  # (q - p) @ W
                del log_q, log_p, p
        ctx.save_for_backward(gx)
        ctx.x_dtype = x.dtype
        ctx.mark_non_differentiable(pred, label)
        return loss, pred, label

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        (gx,) = ctx.saved_tensors
        return (gx * g.float()[:, None]).to(ctx.x_dtype), None, None, None, None


def ttt_head(
    x: torch.Tensor,
    teacher: torch.Tensor,
    weight: torch.Tensor,
    *,
    kl: bool = True,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row loss `[N]` fp32 (KL from the verifier's distribution, or CE against its
    argmax), the draft's argmax `[N]` and the verifier's `[N]` (draft-vocabulary ids),
    without `[N, V]` logits at once; differentiable in `x` only."""
    loss, pred, label = _TTTHead.apply(x, teacher.detach(), weight.detach(), kl, chunk_rows)
    return loss, pred, label


__all__ = [
    "Eagle3Attention",
    "Eagle3Draft",
    "Eagle3FirstLayer",
    "Eagle3Layer",
    "Unroll",
    "ttt_head",
]
