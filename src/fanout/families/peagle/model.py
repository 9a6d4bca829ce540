"""The P-EAGLE draft: the chain backbone drafting every depth of a chain in one forward,
trained on COD-sampled chains.

    from fanout.families.peagle.model import PEagleDraft
    draft = PEagleDraft.from_verifier("models/qwen3-8b", target_layer_ids=[1, 17, 32],
                                      block_size=9, num_depths=8)
    out = draft.loss(batch, torch.Generator().manual_seed(0))  # window rows + last states
    out.loss.backward(); print(out.per_slot_acc, out.eal)

Architecture (speculators 0.9.0 `PEagleDraftModel`, an `Eagle3DraftModel`; same
parameter names, so `trainable_state()` keys are speculators'): the chain drafters'
backbone (fanout.model.chain_draft, EAGLE-3's: `fc` over the auxiliary states, the
first layer over `[embed(token) ; hidden]`, final `norm`, the verifier's head rows)
with a Qwen3 layer (per-head q/k norm) by default, the embedding trained, and
`mask_hidden` `[1, 1, n·H]`: the auxiliary states every depth >= 1 position is fed,
with the token `mask_token_id`.

Rows: the chain drafters' (`ChainDraft.rows`): draft row t (t = 0..T-2) reads the verifier
state at t and the token t+1, at position `position_ids[t+1]`, and predicts token t+2.
A chain anchored at row a has depth 0 = row a itself and depth d = 1..K-1 a mask
position at `position_ids[a+1] + d` predicting token a+d+2: what one drafting step
proposes after the anchor (`fanout.families.peagle.propose`). Every row is depth 0 of
its chain; deeper positions are sampled (COD, `cod_sample`): depth d keeps a random
`max(ratio**d, ratio_min)` share of the chains that reached depth d-1, so the chains
are contiguous; at most `max_anchors` supervised rows seed them.

Attention (speculators' `create_peagle_mask_mod`): a position of chain a at depth d
sees every depth-0 row <= a of its document and its own chain's depths <= d; a
padding row (document -1) sees only itself.

Loss: KL from the verifier's distribution (the frozen head on `last_hidden_states[p+1]`
for a position predicting token p+2), or with `loss_type ce` CE against its argmax,
over the draft vocabulary (fanout.ops.teacher_head), summed over supervised positions of every depth and divided
by their count (speculators adds 1e-5 to it). No per-depth weight.

Semantics decided here (`tests/test_family_peagle.py` pins them against speculators):
- Supervision: the position predicting token p+2 counts iff `loss_mask[p+2]` and that
  token is in the anchor row's document (EAGLE-3's rule at step 0); the same mask
  drives the COD sampling (speculators reads its shifted mask at the fed token and
  may chain across packed documents).
- Positions: each row's own `position_ids` (speculators uses the index in the packed
  row; RoPE sees the same offsets within a document).
- Last hidden states: fanout's are after the verifier's final norm (the same teacher).

Metrics: `per_slot_acc[d]` greedy accuracy of depth d over its supervised positions,
`eal` = 1 + sum_d prod_{j<=d} acc_j (depths are sampled, not whole chains), `extra`:
`full_acc` (speculators' accuracy over every supervised position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from fanout.families.peagle.config import PEagleConfig
from fanout.model.chain_draft import ChainDraft, ChainFirstLayer, ChainLayer
from fanout.model.draft import LossOutput
from fanout.model.draft_attention import PrefixMask
from fanout.model.draft_config import DraftConfig
from fanout.ops.teacher_head import teacher_argmax, teacher_head
from fanout.rows import DOCUMENT_IDS, HIDDEN_STATES, LAST_HIDDEN_STATES, POSITION_IDS


@dataclass
class Samples:
    """The draft positions of one step, per batch row, padded to S: each position's
    chain (its depth-0 row) and depth; the first R are the rows themselves (depth 0)."""

    anchor: torch.Tensor  # [B, S] long (padding: 0)
    depth: torch.Tensor  # [B, S] long
    valid: torch.Tensor  # [B, S] bool

    @classmethod
    def stack(cls, rows: list[tuple[torch.Tensor, torch.Tensor]], device: Any) -> Samples:
        """Pad per-row `(anchor [S_b], depth [S_b])` to one `[B, S]` each."""
        s = max(a.numel() for a, _ in rows)
        b = len(rows)
        anchor = torch.zeros(b, s, dtype=torch.long)
        depth = torch.zeros(b, s, dtype=torch.long)
        valid = torch.zeros(b, s, dtype=torch.bool)
        for r, (a, d) in enumerate(rows):
            anchor[r, : a.numel()], depth[r, : a.numel()], valid[r, : a.numel()] = a, d, True
        return cls(anchor.to(device), depth.to(device), valid.to(device))


def cod_sample(
    row_mask: torch.Tensor,  # [R] bool: rows whose prediction is supervised
    num_depths: int,
    ratio: float,
    ratio_min: float,
    max_anchors: int | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """COD sampling (speculators' `generate_cod_sample_indices`, the same draws from the
    same generator state): every row at depth 0, then per depth d a random subset of
    the previous depth's positions moved one on (those still supervised). Returns
    `(anchor [S], depth [S])`, depth 0 first (anchor = the row), then depth 1, ..."""
    r = row_mask.numel()
    valid_rows = torch.nonzero(row_mask.cpu()).squeeze(1)  # [n]
    seeds = valid_rows
    if max_anchors is not None and valid_rows.numel() > max_anchors:
        pick = torch.randperm(valid_rows.numel(), generator=generator)[:max_anchors]
        seeds = valid_rows[pick].sort().values
    anchors, depths = [torch.arange(r)], [torch.zeros(r, dtype=torch.long)]
    prev = seeds
    for d in range(1, num_depths):
        size = int(max(0, seeds.numel() - d) * max(ratio**d, ratio_min))
        if size <= 0:
            break
        picked = prev
        if prev.numel() >= size:
            pick = torch.randperm(prev.numel(), generator=generator)[:size]
            picked = prev[pick].sort().values
        # row 0 as a depth-1 position would hang from row -1 (speculators indexes the
        # row's end there); dropped after the draw, which keeps the draws the same
        picked = picked[picked >= d]
        nxt = (picked + 1) % r  # the next depth's candidates: one position on
        nxt = nxt[nxt != 0]
        prev = nxt[torch.isin(nxt, valid_rows)]
        anchors.append(picked - d)
        depths.append(torch.full((picked.numel(),), d, dtype=torch.long))
    return torch.cat(anchors), torch.cat(depths)


class PEagleDraft(ChainDraft):
    """Trainable: the chain backbone's (`fc`, norms, `layers`) plus `embed_tokens` (with
    `embed_requires_grad`) and `mask_hidden`; frozen: the head rows, `d2t`/`t2d`."""

    config_class: ClassVar[type[DraftConfig]] = PEagleConfig
    family_label: ClassVar[str] = "P-EAGLE"
    capture_for: ClassVar[str] = "peagle"
    cfg: PEagleConfig

    def __init__(self, cfg: DraftConfig, *verifier: Any) -> None:
        """`Draft`'s arguments: the config, then the verifier's frozen tensors."""
        super().__init__(cfg, *verifier)
        cfg = self.cfg  # its own config class (Draft checked it)
        # the embedding is a parameter under speculators' name (trained by default)
        embed_weight = self._buffers.pop("embed_weight")
        assert embed_weight is not None  # Draft registered it
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # [V, H]
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed_weight)
        self.embed_tokens.weight.requires_grad_(cfg.embed_requires_grad)
        n = len(cfg.target_layer_ids) * cfg.hidden_size
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, n))  # [1, 1, n·H] as speculators

    @property
    def embed_weight(self) -> torch.Tensor:
        """The embedding `[V, H]` (the drafting steps and checkpoint code read it here)."""
        return self.embed_tokens.weight

    @embed_weight.setter
    def embed_weight(self, value: torch.Tensor) -> None:
        with torch.no_grad():  # a checkpoint's copy (fanout.checkpoints.load)
            self.embed_tokens.weight.copy_(value)

    def make_layer(self, cfg: DraftConfig, index: int) -> nn.Module:
        assert isinstance(cfg, PEagleConfig)
        qk = cfg.draft_arch == "qwen3"
        return ChainFirstLayer(cfg, qk_norm=qk) if index == 0 else ChainLayer(cfg, qk_norm=qk)

    # ---- the forward ---------------------------------------------------------------

    def draft_states(
        self,
        hs: torch.Tensor,  # [B, R, n·H] each row's auxiliary states
        pos: torch.Tensor,  # [B, R] each row's position
        row_doc: torch.Tensor,  # [B, R] each row's document (-1: padding)
        tokens: torch.Tensor,  # [B, R] each row's fed token
        s: Samples,
    ) -> torch.Tensor:
        """Final-normed states `[B, S, H]` of the sampled positions `s`, in one forward."""
        dt = self.fc.weight.dtype
        d0 = s.depth == 0  # [B, S]
        width = hs.shape[-1]
        tok = torch.where(d0, tokens.gather(1, s.anchor), self.cfg.mask_token_id)  # [B, S]
        real = hs.gather(1, s.anchor[:, :, None].expand(-1, -1, width)).to(dt)  # [B, S, n·H]
        # fused once for every mask position (they all read `mask_hidden`; `fuse` is per
        # position), and at the depth-0 positions only: `fuse` of all S, the same numbers
        x = self.fuse(self.mask_hidden.to(dt)).expand(*d0.shape, -1)  # [B, S, H]
        x = x.masked_scatter(d0[:, :, None], self.fuse(real[d0]))  # [B, S, H]
        emb = F.embedding(tok, self.embed_tokens.weight).to(dt)  # [B, S, H]
        rope = self.rope(pos.gather(1, s.anchor) + s.depth, dt)  # [B, S, hd] x2
        mask = PrefixMask.chains(s.anchor, s.depth, s.valid, row_doc, self.cfg.num_depths)
        for layer in self.layers:
            a = cast("ChainLayer", layer).self_attn

            def attend(h: torch.Tensor, a: Any = a) -> torch.Tensor:
                k, v = a.kv(h, rope)  # [B, nkv, S, hd]
                return cast("torch.Tensor", a.attend(h, k, v, rope, mask))

            x = cast("ChainLayer", layer).run(emb, x, attend)
        return cast("torch.Tensor", self.norm(x))

    def sample(self, row_mask: torch.Tensor, generator: torch.Generator | None) -> Samples:
        """COD samples of every batch row (`row_mask` `[B, R]`: supervised rows)."""
        c = self.cfg
        rows = [
            cod_sample(m, c.num_depths, c.down_sample_ratio, c.down_sample_ratio_min,
                       c.max_anchors, generator)
            for m in row_mask.bool().cpu()
        ]  # fmt: skip
        return Samples.stack(rows, row_mask.device)

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None) -> LossOutput:
        """COD-sample the chains from `generator`, return the loss and metrics (module
        docstring). `batch` needs `last_hidden_states` `[B, T, H]`."""
        self.check_rows(batch)
        rows = self.rows(batch)
        _, row_mask, _ = self.step_inputs(batch, rows[DOCUMENT_IDS], 0)  # [B, R]
        return self.sampled_loss(batch, self.sample(row_mask, generator))

    def sampled_loss(self, batch: dict[str, torch.Tensor], s: Samples) -> LossOutput:
        """The loss and metrics on given samples `s` (`loss` draws them)."""
        cfg = self.cfg
        rows = self.rows(batch)
        row_doc = rows[DOCUMENT_IDS]  # [B, R]
        tokens, row_mask, _ = self.step_inputs(batch, row_doc, 0)
        out = self.draft_states(
            rows[HIDDEN_STATES], rows[POSITION_IDS], row_doc, tokens, s
        )  # [B, S, H]
        at = s.anchor + s.depth  # [B, S] the row whose next token each position predicts
        doc = row_doc.gather(1, s.anchor)
        sup = s.valid & row_mask.gather(1, at) & (row_doc.gather(1, at) == doc) & (doc >= 0)
        last = batch[LAST_HIDDEN_STATES]  # [B, T, H]
        head = self.lm_head_weight
        n = int(sup.sum())
        loss = head.new_zeros((), dtype=torch.float32)
        right = torch.zeros_like(sup)
        if n:
            teacher = last.gather(1, (at + 1)[:, :, None].expand(-1, -1, last.shape[2]))
            x, t_rows = out[sup], teacher[sup].to(head.dtype)  # [M, H] each
            lab = None  # CE: the verifier's argmax once a position, not once a sample
            if cfg.loss_type != "kl":  # (a chain's depth d and the next's d-1 share it)
                t = last.shape[1]
                flat = (torch.arange(at.shape[0], device=at.device)[:, None] * t + at + 1)[sup]
                uniq, inv = torch.unique(flat, return_inverse=True)  # [U] <= [M]
                lab = teacher_argmax(last.flatten(0, 1)[uniq].to(head.dtype), head)[inv]
            per_row, pred, label = teacher_head(
                x, t_rows, head, kl=cfg.loss_type == "kl", label=lab, softcap=self.teacher_softcap
            )
            loss = per_row.sum() / n
            right[sup] = pred == label
        with torch.no_grad():
            k = cfg.num_depths
            cnt = torch.bincount(s.depth[sup], minlength=k)[:k]  # [K]
            hits = torch.bincount(s.depth[right], minlength=k)[:k]  # [K]
            acc = hits / cnt.clamp(min=1)
            eal = 1.0 + torch.cumprod(acc, 0).sum()
            extra = {"full_acc": float(hits.sum()) / max(n, 1)}
        chains = int((s.valid & (s.depth == 1)).sum())
        return LossOutput(loss, acc.float(), cnt, eal, n, chains, extra)


def chain_mask(s: Samples, row_doc: torch.Tensor) -> torch.Tensor:
    """Boolean SDPA mask `[B, 1, S, S]` of sampled positions `s` (module docstring):
    depth-0 rows <= the anchor in its document, and the chain's own depths <= its. The
    training forward computes only what it allows (`PrefixMask.chains`, the same mask;
    tests/test_draft_attention.py compares the two)."""
    doc = row_doc.gather(1, s.anchor)  # [B, S] the chain's document
    ok = s.valid & (doc >= 0)
    aq, ak = s.anchor[:, :, None], s.anchor[:, None, :]  # [B, S, 1], [B, 1, S]
    dq, dk = s.depth[:, :, None], s.depth[:, None, :]
    seen = ((dk == 0) & (aq >= ak)) | ((aq == ak) & (dq >= dk))  # [B, S, S]
    mask = seen & (doc[:, :, None] == doc[:, None, :]) & ok[:, :, None] & ok[:, None, :]
    eye = torch.eye(mask.shape[1], dtype=torch.bool, device=mask.device)
    return (mask | eye)[:, None]  # a padding position sees itself: no empty row


__all__ = ["PEagleDraft", "Samples", "chain_mask", "cod_sample"]
