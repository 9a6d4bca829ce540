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
  a two-head linear (`fanout.ops.two_head_ce`): no `[slots, vocab]` logits beyond a
  chunk's. Every term below shares the slot states, the frozen head and the teacher
  (`TwoHeadTerms`: the head's logits and the teacher's softmax once, x's gradient one
  matmul, 15 `[slots, vocab]` matmuls for the five terms instead of 27: issue #56),
  so the blocks go in chunks (whole blocks: a round needs its block's last argmax).
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

import functools
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
from fanout.ops.two_head_ce import TwoHeadOut, TwoHeadTerms, chunk_rows_for_terms
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

    def _refined(
        self, terms: TwoHeadTerms, hcache: torch.Tensor, row_weight: torch.Tensor,
        prev: torch.Tensor, weight: float,
    ) -> TwoHeadOut:  # fmt: skip
        """One refined term of `terms`: the refiner fed previous tokens `prev` `[n, bs]`
        (verifier ids) over blocks with `hcache` `[n, bs, 2r]`, weighted `row_weight`
        `[n·bs]` (the slot decay) times `weight`."""
        e = self.refiner_head.features(prev, hcache)  # [n, bs, r]
        e = e.reshape(-1, e.shape[-1]).to(terms.x.dtype)  # [n·bs, r]
        return terms.add(e, row_weight=row_weight, weight=weight)

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
        tf_prev = torch.cat([before[:, None], tok[:, :-1]], dim=1)  # [N, bs] the data tokens
        rounds = cfg.consistency_passes if cfg.consistency_weight > 0 else 0
        with_base = cfg.base_anchor_weight > 0 or rounds > 0
        base_w = sup.reshape(-1).float() if cfg.base_anchor_full_weight else decayed  # [N·bs]
        # Every term shares the rows, the frozen head and the teacher (`TwoHeadTerms`: the
        # head's and the teacher's logits once, not once a term); a round needs the last
        # one's argmax over its whole block, so the rows go in chunks of whole blocks.
        per = max(1, chunk_rows_for_terms(n_blk * bs, head.shape[0]) // bs)  # blocks a chunk
        outs: dict[str, list[TwoHeadOut]] = {"tf": [], "base": [], "last": []}
        round_sums = [0.0] * rounds
        loss = head.new_zeros((), dtype=torch.float32)
        for lo in range(0, max(n_blk, 1), per):  # one (empty) chunk when no block is real
            hi = min(lo + per, n_blk)
            r0, r1 = lo * bs, hi * bs
            terms = TwoHeadTerms(
                rows[r0:r1], head, readout, target[r0:r1], teacher[r0:r1],
                ce_weight=cfg.xpress_ce_weight, tv_weight=cfg.xpress_tv_weight,
                softcap=self.teacher_softcap,
            )  # fmt: skip
            refine = functools.partial(self._refined, terms, hcache[lo:hi], decayed[r0:r1])
            outs["tf"].append(refine(tf_prev[lo:hi], 1.0))
            if with_base:  # the backbone's own logits: its loss term, and the rounds' seed
                w = base_w[r0:r1] if cfg.base_anchor_weight > 0 else None
                base = terms.add(None, row_weight=w, weight=cfg.base_anchor_weight)
                outs["base"].append(base)
                pred = self.to_verifier_ids(base.pred).view(hi - lo, bs)  # the seed: K = 0
                for j in range(rounds):  # stop-grad between rounds: pred is an argmax
                    last = refine(self.jacobi_prev(pred, tok[lo:hi, 0], before[lo:hi]),
                                  cfg.consistency_weight / rounds)  # fmt: skip
                    round_sums[j] += float(last.loss)
                    pred = self.to_verifier_ids(last.pred).view(hi - lo, bs)
                    if j == rounds - 1:
                        outs["last"].append(last)
            loss = loss + terms.loss()
        loss = loss / denom
        tf, base_out, final = (_joined(outs[k]) for k in ("tf", "base", "last"))
        assert tf is not None
        extra = {"tf_loss": float(tf.loss) / denom}
        if cfg.base_anchor_weight > 0 and base_out is not None:
            extra["base_anchor_loss"] = float(base_out.loss) / denom
        if rounds:
            extra["consistency_loss"] = sum(x / denom for x in round_sums) / rounds
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
        if base_out is not None:
            extra["base_eal"] = float(greedy(base_out)[2])
            extra["base_accept_rate"] = accept(base_out)
        if final is not None:
            extra["jacobi_eal"] = float(greedy(final)[2])
        return LossOutput(loss, acc, cnt, eal, n_tok, int(v.sum()), extra)


def _joined(outs: list[TwoHeadOut]) -> TwoHeadOut | None:
    """One term's outputs over every chunk of rows, in row order (None: no chunk ran it)."""
    if not outs:
        return None
    accept = [o.accept for o in outs if o.accept is not None]
    return TwoHeadOut(
        sum((o.loss for o in outs[1:]), outs[0].loss),
        torch.cat([o.rows for o in outs]),
        torch.cat([o.pred for o in outs]),
        torch.cat(accept) if accept else None,
    )


__all__ = ["XPressDraft", "XPressRefinerHead"]
