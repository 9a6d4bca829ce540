"""The XPress draft: the DFlash backbone plus a low-rank causal refiner of its logits.

    from fanout.families.xpress.model import XPressDraft
    draft = XPressDraft.from_verifier("models/qwen3-8b", block_size=16, xpress_rank=256)
    out = draft.loss(batch, torch.Generator().manual_seed(0))  # batch: window rows
    out.loss.backward(); print(out.per_slot_acc, out.eal, out.extra["jacobi_eal"])

What it adds to DFlash (speculators 0.9.0 `XPressDraftModel` / `XPressRefinerHead`, same
parameter names, so `trainable_state()` keys are speculators'): `refiner_head`, a
per-slot logit bias computed in r-space (r = `xpress_rank`):
- `hidden_cache`: `[down_h(h_k) ; down_g(mean_j h_j)]` `[N, bs, 2r]` from the block's
  final-norm slot states (the mean over all bs slots of the block);
- `features(prev)`: `x = in_proj([hcache ; token_embed(prev_k)])`, then the causal mixer
  `x_k += sum_{j <= k} L[:, k, j] * x_j` (`mix_l` `[r, bs, bs]`, lower triangle, zero
  at init so the head starts as a no-op), then `x += mlp_down(silu(mlp_gate(x)) *
  mlp_up(x))`;
- `readout` (r -> draft V): the bias. Refined logits = `h @ head^T + x @ readout^T`,
  a two-head linear (`fanout.ops.two_head_ce`): no `[slots, vocab]` logits.
Layout: DFlash's (speculators' `sample_from_anchor` False, XPress's default): slot 0 is
the anchor, slot k >= 1 predicts token a+k; its previous token prev_k is the token at
a+k-1 (slot 1: the anchor; slot 0: the token before the anchor when it is in the
anchor's document, else the anchor itself). The bias of slot k depends on prev_0..prev_k
only (the mixer's lower triangle), so it is causal within the block.

Loss (speculators' `xpress/metrics.py`), each term the compound
`w_ce CE(label) + w_tv TV(q, p)` (`xpress_ce_weight` 0.1, `xpress_tv_weight` 0.9) summed
over the supervised slots with DFlash's exp decay `exp(-(k-1)/gamma)` and divided by
their number n:
- the teacher-forced refined logits (prev = the data tokens);
- `consistency_weight` x the mean over `consistency_passes` free-running rounds: round 0
  feeds the refiner the backbone's own argmax, round j the argmax of round j-1 (slot 0
  kept the anchor; stop-grad between rounds), the recurrence `fanout eval`'s Jacobi
  passes run (`fanout.families.xpress.propose`);
- `base_anchor_weight` x the backbone's own logits (the Jacobi seed; without the decay
  when `base_anchor_full_weight`).
Labels, supervised slots and the teacher are DFlash's (`BlockDraft.labels`,
`anchors.slot_supervision`, `verifier_rows`): label `target_ids[a+k-1]` (or
`input_ids[a+k]`, speculators' `ce_from_data`), p the verifier's distribution from
`last_hidden_states[a+k-1]` through the frozen head. Semantics differ from speculators
exactly where DFlash's do (`tests/test_speculators.py`): slots past the anchor's
document carry no loss, a slot whose token is outside a reduced draft vocabulary
neither; speculators divides by n + 1e-5.

Metrics (`LossOutput`, fanout.model.slot_loss's `acceptance`): `per_slot_acc` / `eal`
of the teacher-forced refined argmax (the sequential greedy chain's acceptance);
`extra`: `jacobi_eal` (EAL of the last free-running round: what `consistency_passes`
Jacobi passes would propose), `base_eal` (the backbone alone, K = 0), `tf_loss`,
`consistency_loss`, `base_anchor_loss` (each term before its weight), `accept_rate` /
`base_accept_rate` (mean `1 - TV(q, p)` of the teacher-forced refined / the backbone's
slots).
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from fanout.errors import ConfigError
from fanout.families.xpress.config import XPressConfig
from fanout.model.anchors import block_positions
from fanout.model.block_draft import BlockDraft
from fanout.model.draft import LossOutput
from fanout.model.draft_config import DraftConfig
from fanout.model.slot_loss import acceptance, exp_decay
from fanout.ops.two_head_ce import TwoHeadOut, two_head_ce_tv_and_argmax
from fanout.rows import DOCUMENT_IDS, INPUT_IDS, LAST_HIDDEN_STATES


class XPressRefinerHead(nn.Module):
    """speculators' `XPressRefinerHead`: the causal low-rank logit bias (module docstring)."""

    causal_tril: torch.Tensor

    def __init__(
        self, vocab_size: int, draft_vocab_size: int, hidden_size: int, block_size: int,
        rank: int, mlp_ratio: int,
    ) -> None:  # fmt: skip
        super().__init__()
        r = rank
        self.token_embed = nn.Embedding(vocab_size, r)  # verifier ids -> r
        self.down_h = nn.Linear(hidden_size, r, bias=False)
        self.down_g = nn.Linear(hidden_size, r, bias=False)
        self.in_proj = nn.Linear(3 * r, r, bias=False)
        self.mix_l = nn.Parameter(torch.zeros(r, block_size, block_size))  # [r, bs, bs]
        self.mlp_gate = nn.Linear(r, r * mlp_ratio, bias=False)
        self.mlp_up = nn.Linear(r, r * mlp_ratio, bias=False)
        self.mlp_down = nn.Linear(r * mlp_ratio, r, bias=False)
        self.readout = nn.Linear(r, draft_vocab_size, bias=False)  # r -> draft ids
        tril = torch.tril(torch.ones(block_size, block_size))
        self.register_buffer("causal_tril", tril, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # speculators: every linear and the embedding N(0, 0.02), the mixer zero
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
        nn.init.zeros_(self.mix_l)

    def hidden_cache(self, hid: torch.Tensor) -> torch.Tensor:
        """Slot states `[N, bs, H]` -> `[down_h(h) ; down_g(block mean)]` `[N, bs, 2r]`
        (pass-invariant: computed once per block)."""
        hid = hid.to(self.down_h.weight.dtype)
        g = hid.mean(dim=1, keepdim=True).expand_as(hid)  # [N, bs, H]
        return torch.cat([self.down_h(hid), self.down_g(g)], dim=-1)

    def features(self, prev: torch.Tensor, hcache: torch.Tensor) -> torch.Tensor:
        """The r-space refiner state `[N, bs, r]` of previous tokens `prev` `[N, bs]`
        (verifier ids); the bias is `readout` of it."""
        lat = self.token_embed(prev.long())  # [N, bs, r]
        x = self.in_proj(torch.cat([hcache, lat.to(hcache.dtype)], dim=-1))  # [N, bs, r]
        mix = self.mix_l * self.causal_tril.to(self.mix_l.dtype)  # [r, bs, bs] j <= k
        x = x + torch.einsum("ckj,njc->nkc", mix, x)
        return x + self.mlp_down(F.silu(self.mlp_gate(x)) * self.mlp_up(x))

    def forward(self, prev: torch.Tensor, hcache: torch.Tensor) -> torch.Tensor:
        """The logit bias `[N, bs, draft V]` (speculators' `block_bias`)."""
        return cast("torch.Tensor", self.readout(self.features(prev, hcache)))


class XPressDraft(BlockDraft):
    """Trainable beyond DFlash's: `refiner_head` (see the module docstring)."""

    config_class: ClassVar[type[DraftConfig]] = XPressConfig
    cfg: XPressConfig

    def __init__(self, cfg: DraftConfig, *verifier: Any) -> None:
        """`Draft`'s arguments: the config, then the verifier's frozen tensors."""
        super().__init__(cfg, *verifier)
        cfg = self.cfg  # its own config class (Draft checked it)
        self.refiner_head = XPressRefinerHead(
            cfg.vocab_size, cfg.draft_vocab_size or cfg.vocab_size, cfg.hidden_size,
            cfg.block_size, cfg.xpress_rank, cfg.xpress_mlp_ratio,
        )  # fmt: skip

    def reset_parameters(self, std: float = 0.02) -> None:
        """The backbone's HF-style init, the refiner's as speculators'. (The backbone's
        constructor calls this before the refiner exists.)"""
        super().reset_parameters(std)
        if (refiner := getattr(self, "refiner_head", None)) is not None:
            refiner.reset_parameters()

    def to_verifier_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab token ids -> verifier ids (speculators' `d + d2t[d]`)."""
        return ids if self.d2t is None else ids + self.d2t[ids]

    def block_tokens(
        self, batch: dict[str, torch.Tensor], anchors: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The data tokens of every slot `[B, A, bs]` (token a+k) and the token before each
        anchor `[B, A]` (the anchor's own where a = 0 or a-1 is another document)."""
        ids, doc = batch[INPUT_IDS].long(), batch[DOCUMENT_IDS]
        t = ids.shape[1]
        pos = block_positions(anchors, self.cfg.block_size).clamp(max=t - 1)  # [B, A, bs]
        tok = ids.gather(1, pos.flatten(1)).view_as(pos)  # [B, A, bs]
        before = (anchors - 1).clamp(min=0)  # [B, A]
        ok = (anchors > 0) & (doc.gather(1, before) == doc.gather(1, anchors))
        return tok, torch.where(ok, ids.gather(1, before), tok[:, :, 0])

    @staticmethod
    def jacobi_prev(pred: torch.Tensor, anchor: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        """The refiner's previous tokens `[N, bs]` for a pass over the block's current
        guesses `pred` `[N, bs]` (verifier ids): slot 0 keeps the anchor `[N]`, slot k
        gets the guess of slot k-1, slot 0 the token `before` `[N]` the anchor."""
        guess = torch.cat([anchor[:, None], pred[:, 1:-1]], dim=1)  # [N, bs-1]
        return torch.cat([before[:, None], guess], dim=1)  # [N, bs]

    # ---- loss ----------------------------------------------------------------------

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None) -> LossOutput:
        """Draw anchors from `generator`, run the blocks, return loss and metrics (module
        docstring). `batch` as DFlash's plus `last_hidden_states` [B, T, H] (the TV
        term's verifier distribution)."""
        cfg, bs = self.cfg, self.cfg.block_size
        if LAST_HIDDEN_STATES not in batch:
            raise ConfigError(
                "XPress's loss needs last_hidden_states in the batch (its TV term and the "
                "labels' distribution are the verifier's): capture the run with "
                "--store-last-hidden-states"
            )
        b = self.blocks(batch, generator)
        v = b.valid  # [B, A]
        sup, label = b.sup[v], b.label[v]  # [N, bs] real blocks only
        hid = b.hid[v]  # [N, bs, H]
        n_blk, h = hid.shape[0], hid.shape[-1]
        tok, before = (t[v] for t in self.block_tokens(batch, b.anchors))  # [N, bs], [N]
        rows = hid.reshape(-1, h)  # [N·bs, H] every slot: a round's guesses need all
        teacher = self.verifier_rows(batch, b.anchors)[v].reshape(-1, h)  # [N·bs, H]
        target = torch.where(sup, label, -100).reshape(-1)  # [N·bs] draft ids
        slot = torch.arange(bs, device=sup.device).expand_as(sup)  # [N, bs] slot index k
        decay = exp_decay(slot, cfg.resolved_gamma, first=self.first_drafted_slot)  # [N, bs]
        decayed = (decay * sup).reshape(-1)  # [N·bs] DFlash's exp decay, 0 off supervision
        n_tok = int(sup.sum())
        denom = max(n_tok, 1)
        head = self.lm_head_weight
        ref = self.refiner_head
        readout = ref.readout.weight.to(head.dtype)  # [Vd, r]
        hcache = ref.hidden_cache(hid)  # [N, bs, 2r]
        ce_w, tv_w = cfg.xpress_ce_weight, cfg.xpress_tv_weight

        def refined(prev: torch.Tensor) -> TwoHeadOut:  # prev [N, bs] verifier ids
            e = ref.features(prev, hcache).reshape(n_blk * bs, -1).to(rows.dtype)  # [N·bs, r]
            return two_head_ce_tv_and_argmax(
                rows, e, head, readout, target, teacher,
                ce_weight=ce_w, tv_weight=tv_w, row_weight=decayed,
            )  # fmt: skip

        tf = refined(torch.cat([before[:, None], tok[:, :-1]], dim=1))
        loss = tf.loss / denom
        extra = {"tf_loss": float(tf.loss.detach()) / denom}
        rounds = cfg.consistency_passes if cfg.consistency_weight > 0 else 0
        base: TwoHeadOut | None = None
        if cfg.base_anchor_weight > 0 or rounds:
            with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.base_anchor_weight > 0):
                w = sup.reshape(-1).float() if cfg.base_anchor_full_weight else decayed
                base = two_head_ce_tv_and_argmax(
                    rows, None, head, None, target, teacher,
                    ce_weight=ce_w, tv_weight=tv_w, row_weight=w,
                )  # fmt: skip
            if cfg.base_anchor_weight > 0:
                loss = loss + cfg.base_anchor_weight * base.loss / denom
                extra["base_anchor_loss"] = float(base.loss.detach()) / denom
        last = None
        if rounds:
            assert base is not None
            pred = self.to_verifier_ids(base.pred).view(n_blk, bs)  # the seed: K = 0
            terms = []
            for _ in range(rounds):
                last = refined(self.jacobi_prev(pred, tok[:, 0], before))
                terms.append(last.loss / denom)
                pred = self.to_verifier_ids(last.pred).view(n_blk, bs)
            consistency = torch.stack(terms).mean()
            loss = loss + cfg.consistency_weight * consistency
            extra["consistency_loss"] = float(consistency.detach())
        has = b.has[v]  # [N] blocks that count in EAL

        def greedy(out: TwoHeadOut) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """Per-slot accuracy, counts [bs-1] and EAL of a pass's argmax (drafted slots)."""
            correct = out.pred.view(n_blk, bs) == label  # [N, bs]
            return acceptance(correct[:, 1:], sup[:, 1:], has)

        def accept(out: TwoHeadOut) -> float:
            assert out.accept is not None
            return float(out.accept[sup.reshape(-1)].mean()) if n_tok else 0.0

        acc, cnt, eal = greedy(tf)
        extra["accept_rate"] = accept(tf)
        if base is not None:
            extra["base_eal"] = float(greedy(base)[2])
            extra["base_accept_rate"] = accept(base)
        if last is not None:
            extra["jacobi_eal"] = float(greedy(last)[2])
        return LossOutput(loss, acc, cnt, eal, n_tok, int(v.sum()), extra)


__all__ = ["XPressDraft", "XPressRefinerHead"]
