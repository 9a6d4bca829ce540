"""The DFlash2 draft: DFlash with block-local dynamic convolutions and a candidate selector.

    from fanout.families.dflash2.model import DFlash2Draft
    draft = DFlash2Draft.from_verifier("path/to/Qwen3-8B", block_size=8, mask_token_id=151669)
    out = draft.loss(batch, torch.Generator().manual_seed(0))  # a DFlash window batch
    out.loss.backward(); print(out.eal, out.extra["selector_loss"])

Architecture (speculators 0.9.0 `DFlash2DraftModel`, after Z Lab's DFlash2):
- every decoder layer wraps its attention and its MLP in a grouped dynamic causal
  convolution (`attention_conv`, `mlp_conv`): `prepare` convolves the sublayer's normed
  input along the block, `finish` convolves its output with a second kernel predicted
  from the same input. Slot i of a block mixes slots i, i-1, ..., i-taps+1 of the same
  block only; channel c in group g(c) uses `base_kernel[tap, c] + delta[i, tap, g(c)]`,
  `delta` a linear projection of the sublayer input. Initialised as the identity
  (`base_kernel[:, 0] = 1`, the rest and the projection 0): a fresh DFlash2 draft is a
  DFlash draft;
- a `candidate_selector` reranks the unary (lm_head) top-k of each slot given the
  previous token p: `score(c) = unary(c) + <A[p] * (W h), B[c]>` (A, B the
  predecessor/successor codebooks [V, rank], W the hidden projection [rank, H], h the
  slot's final-norm state). Serving walks the block greedily: slot 1's predecessor is
  the anchor, slot k's the token chosen at slot k-1 (fanout.families.dflash2.propose).

Loss (`DFlash2Draft.loss`): on one `BlockDraft.blocks` pass, `BlockDraft.block_loss`
unchanged (the unary loss: fanout's CE or KL, its supervision rule, its per-slot weights
and normalisation) plus
`selector_loss_alpha` x the selector's K-way cross-entropy over the training candidates
(the unary top-k with the label written over rank K when the top-k misses it,
speculators' `selector_training_candidates`), teacher-forced (slot k's predecessor is
the row's token at a+k-1, speculators' `_predecessor_ids`), weighted per slot and
normalised like the unary loss. The top-k runs over the vocabulary in row chunks under
no_grad, and the candidates' unary logits are gathered from the k head rows with a
chunked autograd op, so no `[slots, V]` logits are kept.

Metrics (`fanout.model.slot_loss.acceptance`): `per_slot_acc` / `eal` follow the
realised greedy selector path, as
speculators' DFlash2 `eal`: slot k counts as right when the selector's argmax over the
training candidates is the label *and* the label is in the unary top-k (training may
inject it; serving cannot). `extra`: `unary_loss`, `selector_loss`, `unary_acc` and
`unary_eal` (the unary argmax's, as DFlash reports them), `selector_acc`, and
`candidate_recall` (share of supervised slots whose label is in the unary top-k).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from fanout.families.dflash2.config import DFlash2Config
from fanout.model.anchors import block_positions
from fanout.model.block_draft import BlockDraft, DecoderLayer
from fanout.model.draft import LossOutput
from fanout.model.draft_config import DraftConfig
from fanout.model.slot_loss import acceptance, slot_index
from fanout.rows import INPUT_IDS

# Rows per chunk are sized so one chunk's temporary ([chunk, V] logits for the top-k,
# [chunk, K, H] gathered head rows for the candidate logits) stays near this many fp32s.
_CHUNK_ELEMENTS = 1 << 26


def grouped_dynamic_conv(
    x: torch.Tensor,  # [B, Q, H] block states, Q = blocks x block_size
    delta: torch.Tensor,  # [B, Q, taps, G] per-slot kernel offsets, one per channel group
    base: torch.Tensor,  # [taps, H] per-channel base kernel
    block_size: int,
) -> torch.Tensor:
    """Causal convolution within each block: `out[i] = sum_t (base[t] + delta[i, t]) *
    x[i - t]` over taps t with i - t in slot i's block (slot index >= t). `[B, Q, H]`."""
    b, q, h = x.shape
    taps, groups = delta.shape[-2], delta.shape[-1]
    xs = x.view(b, q, groups, h // groups)  # [B, Q, G, gs]
    slot = torch.arange(q, device=x.device) % block_size  # [Q] slot index within its block
    out = xs * (base[0].to(x.dtype).view(groups, -1) + delta[:, :, 0, :, None])
    for tap in range(1, taps):
        shifted = F.pad(xs, (0, 0, 0, 0, tap, 0))[:, :q]  # [B, Q, G, gs]: x[i - tap]
        coef = base[tap].to(x.dtype).view(groups, -1) + delta[:, :, tap, :, None]
        out = out + shifted * coef * (slot >= tap).view(1, q, 1, 1)  # no tap across blocks
    return out.view(b, q, h)


class GroupedDynamicConv(nn.Module):
    """The input-side and output-side convolutions of one sublayer (speculators'
    `GroupedDynamicCausalConv`: `base_kernel [2, taps, H]`, one `kernel_projection`
    H -> 2·taps·G giving both sides' offsets from the sublayer input)."""

    def __init__(self, hidden_size: int, *, block_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        self.block_size, self.taps = block_size, taps
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity on both sides (a DFlash layer)."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's convolved input `[B, Q, H]` and its output-side offsets
        `[B, Q, taps, G]` (for `finish`)."""
        k = self.kernel_projection(x).view(*x.shape[:-1], 2, self.taps, self.groups)
        inp, out = k[..., 0, :, :], k[..., 1, :, :]  # [B, Q, taps, G] each
        return grouped_dynamic_conv(x, inp, self.base_kernel[0], self.block_size), out

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The sublayer's output `[B, Q, H]` convolved with the offsets `prepare` gave."""
        return grouped_dynamic_conv(y, delta, self.base_kernel[1], self.block_size)


class DFlash2Layer(DecoderLayer):
    """A DFlash decoder layer whose attention and MLP are wrapped in `attention_conv` /
    `mlp_conv` (one `residual` serves the training forward and the inference cache)."""

    def __init__(self, cfg: DFlash2Config) -> None:
        super().__init__(cfg)
        kw = {
            "block_size": cfg.block_size,
            "taps": cfg.conv_kernel_size,
            "group_size": cfg.conv_group_size,
        }
        self.attention_conv = GroupedDynamicConv(cfg.hidden_size, **kw)
        self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, **kw)

    def residual(
        self, x: torch.Tensor, attention: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The layer on block states `x` `[B, Q, H]` (Q a whole number of blocks)."""
        h, out_delta = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(attention(h), out_delta)
        h, out_delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), out_delta)


class CandidateSelector(nn.Module):
    """`transitions(h, p, c)`: the bilinear score `<A[p] * (W h), B[c]>` of candidates c
    after predecessor p (speculators' `CandidateSelector`, same parameter names)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """normal(0, std) everywhere (speculators: the verifier's initializer_range)."""
        for w in (
            self.predecessor_codebook,
            self.successor_codebook,
            self.hidden_projection.weight,
        ):
            nn.init.normal_(w, std=std)

    def transitions(
        self,
        hidden: torch.Tensor,  # [..., H] final-norm slot states
        predecessor: torch.Tensor,  # [...] token ids
        candidates: torch.Tensor,  # [..., K] token ids
    ) -> torch.Tensor:
        """`[..., K]` transition scores, in the codebooks' dtype."""
        pred = self.predecessor_codebook[predecessor.long()]  # [..., r]
        ctx = pred * self.hidden_projection(hidden).to(pred.dtype)  # [..., r]
        succ = self.successor_codebook[candidates.long()]  # [..., K, r]
        return (ctx.unsqueeze(-2) * succ).sum(-1)  # [..., K]


def training_candidates(
    top: torch.Tensor,  # [M, K] unary top-k, best first
    target: torch.Tensor,  # [M] labels
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(candidates [M, K], the label's rank in them [M], label in the unary top-k [M]):
    a label the top-k misses replaces its last (weakest) candidate, so every slot has a
    K-way label (speculators' `selector_training_candidates`)."""
    match = top == target[:, None]  # [M, K]
    present = match.any(dim=1)  # [M]
    k = top.shape[1]
    rank = torch.where(present, match.long().argmax(dim=1), torch.full_like(target, k - 1))
    cand = top.clone()
    cand[:, -1] = torch.where(present, top[:, -1], target)
    return cand, rank, present


@torch.no_grad()
def unary_top_k(rows: torch.Tensor, head: torch.Tensor, k: int) -> torch.Tensor:
    """Ids `[M, k]` of the k largest logits of `rows @ head.T` (`[M, H]`, `[V, H]`),
    best first, computed `chunk` rows at a time (never `[M, V]` at once)."""
    chunk = max(1, _CHUNK_ELEMENTS // head.shape[0])
    out = [
        (rows[i : i + chunk].to(head.dtype) @ head.t()).float().topk(k, dim=1).indices
        for i in range(0, rows.shape[0], chunk)
    ]  # [c, k] each
    return torch.cat(out) if out else torch.zeros(0, k, dtype=torch.long, device=rows.device)


class _CandidateLogits(torch.autograd.Function):
    """`out[m, j] = rows[m] · head[cand[m, j]]` in fp32, with the gradient to `rows`
    (the head is frozen), gathering `[chunk, K, H]` head rows at a time in both passes
    instead of keeping `[M, K, H]` for backward."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, head: torch.Tensor, cand: torch.Tensor) -> Any:
        ctx.save_for_backward(head, cand)
        ctx.rows_dtype = rows.dtype
        m, k = cand.shape
        chunk = max(1, _CHUNK_ELEMENTS // max(k * head.shape[1], 1))
        out = torch.empty(m, k, dtype=torch.float32, device=rows.device)
        for i in range(0, m, chunk):
            w = head[cand[i : i + chunk]].float()  # [c, K, H]
            out[i : i + chunk] = torch.bmm(w, rows[i : i + chunk].float()[:, :, None])[..., 0]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # grad [M, K]
        head, cand = ctx.saved_tensors
        m, k = cand.shape
        chunk = max(1, _CHUNK_ELEMENTS // max(k * head.shape[1], 1))
        out = torch.empty(m, head.shape[1], dtype=ctx.rows_dtype, device=grad.device)
        for i in range(0, m, chunk):
            w = head[cand[i : i + chunk]].float()  # [c, K, H]
            out[i : i + chunk] = torch.bmm(grad[i : i + chunk].float()[:, None, :], w)[:, 0]
        return out, None, None


def candidate_logits(rows: torch.Tensor, head: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """Unary logits of the candidates `[M, K]` (fp32) of rows `[M, H]`, differentiable in
    `rows`; `head` `[V, H]` must be frozen."""
    return cast("torch.Tensor", _CandidateLogits.apply(rows, head, cand))


class DFlash2Draft(BlockDraft):
    """The block draft with `DFlash2Layer`s and a `candidate_selector` (trainable, saved in
    speculators' DFlash2 key names by `trainable_state()`)."""

    config_class: ClassVar[type[DraftConfig]] = DFlash2Config
    cfg: DFlash2Config
    candidate_selector: CandidateSelector

    def __init__(self, cfg: DraftConfig, *verifier: Any) -> None:
        """`Draft`'s arguments: the config, then the verifier's frozen tensors."""
        super().__init__(cfg, *verifier)
        cfg = self.cfg  # its own config class (Draft checked it)
        self.candidate_selector = CandidateSelector(
            cfg.vocab_size, cfg.hidden_size, cfg.selector_rank
        )

    def make_layer(self, cfg: DraftConfig, index: int) -> nn.Module:
        return DFlash2Layer(cast("DFlash2Config", cfg))

    def reset_parameters(self, std: float = 0.02) -> None:
        """DFlash's init, then identity convolutions and a normal(0, std) selector."""
        super().reset_parameters(std)
        for layer in self.layers:
            cast("DFlash2Layer", layer).attention_conv.reset_parameters()
            cast("DFlash2Layer", layer).mlp_conv.reset_parameters()
        if "candidate_selector" in self._modules:  # absent while BlockDraft.__init__ runs
            self.candidate_selector.reset_parameters(std)

    def predecessors(self, batch: dict[str, torch.Tensor], anchors: torch.Tensor) -> torch.Tensor:
        """The token before each slot `[B, A, bs]`: the row's token at a+k-1 (slot 1's is
        the anchor; slot 0's, never supervised, is clamped to a-1)."""
        ids = batch[INPUT_IDS].long()  # [B, T]
        pos = (block_positions(anchors, self.cfg.block_size) - 1).clamp(0, ids.shape[1] - 1)
        return ids.gather(1, pos.flatten(1)).view_as(pos)

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None) -> LossOutput:
        """DFlash's loss on one block pass (`blocks`, anchors drawn from `generator`) plus
        `selector_loss_alpha` x the selector loss; metrics as the module docstring says."""
        cfg = self.cfg
        b = self.blocks(batch, generator)  # one block pass for both losses
        unary = self.block_loss(batch, b)
        sup = b.sup  # [B, A, bs] (full vocabulary: no slot cut)
        rows = b.hid[sup]  # [M, H] supervised slots, as the unary loss
        target = b.label[sup]  # [M] verifier ids (= draft ids: full vocab)
        prev = self.predecessors(batch, b.anchors)[sup]  # [M]
        slot = slot_index(sup)  # [M] slot index k
        top = unary_top_k(rows.detach(), self.lm_head_weight, cfg.selector_top_k)  # [M, K]
        cand, rank, present = training_candidates(top, target)  # [M, K], [M], [M]
        scores = candidate_logits(rows, self.lm_head_weight, cand)  # [M, K] fp32
        scores = scores + self.candidate_selector.transitions(rows, prev, cand).to(scores.dtype)
        ce = F.cross_entropy(scores, rank, reduction="none")  # [M]
        n_tok = unary.n_tokens
        selector_loss = (ce * self.slot_weights(ce.detach(), sup, slot)).sum() / max(n_tok, 1)
        with torch.no_grad():
            pick = cand.gather(1, scores.argmax(dim=1, keepdim=True))[:, 0]  # [M]
            correct = torch.zeros_like(sup)
            correct[sup] = (pick == target) & present  # a served selector never sees the label
        # the realised greedy path's metrics, over the blocks that count (BlockDraft.blocks)
        acc, cnt, eal = acceptance(correct[:, :, 1:], sup[:, :, 1:], b.has)  # [bs-1] x2, []
        n = max(n_tok, 1)
        extra = {
            "unary_loss": float(unary.loss.detach()),
            "selector_loss": float(selector_loss.detach()),
            "unary_acc": float((unary.per_slot_acc * unary.per_slot_count).sum()) / n,
            "unary_eal": float(unary.eal),
            "selector_acc": float(correct.sum()) / n,
            "candidate_recall": float(present.sum()) / n,
        }
        loss = unary.loss + cfg.selector_loss_alpha * selector_loss
        return LossOutput(loss, acc, cnt, eal, n_tok, unary.n_blocks, extra)


__all__ = [
    "CandidateSelector",
    "DFlash2Draft",
    "DFlash2Layer",
    "GroupedDynamicConv",
    "candidate_logits",
    "grouped_dynamic_conv",
    "training_candidates",
    "unary_top_k",
]
