"""The EAGLE-3 draft and its training-time-test (TTT) loss.

    from fanout.families.eagle3.model import Eagle3Draft
    draft = Eagle3Draft.from_verifier("models/qwen3-8b", target_layer_ids=[1, 17, 32],
                                      num_layers=1, block_size=4, draft_vocab_size=None)
    out = draft.loss(batch, None)   # batch: window rows with last_hidden_states
    out.loss.backward(); print(out.per_slot_acc, out.eal)

The backbone is the chain drafters' (fanout.model.chain_draft: `fc` over the
auxiliary states, the first layer over `[embed(token) ; hidden]`, plain Llama layers,
final `norm`, the verifier's frozen head rows; the rows and the TTT unroll), with
speculators 0.9.0's `Eagle3DraftModel` parameter names, so `trainable_state()` keys are
speculators'. EAGLE-3's layers are Llama ones (no q/k norm) and its embedding is the
verifier's, frozen.

Loss: TTT steps s = 0..ttt_steps-1 (`ChainDraft.step`): step s of row t is fed the data
token t+1+s and its own step s-1 output, and predicts token t+s+2, trained toward the
verifier's distribution there: the frozen head on `last_hidden_states[t+s+1]`, over the
draft vocabulary (KL, speculators' `kl_div`; or `loss_type ce`: CE against that
distribution's argmax; fanout.ops.teacher_head). Once a batch, not once a step (issue
#56): the steps' attention mask and its chunk plan (`ChainDraft.start(.., ttt_steps)`)
and, with CE, the verifier's argmax at every position (step s reads position t+s+1).

Semantics decided here (`tests/test_family_eagle3.py` pins each against speculators):
- Last hidden states: fanout captures them after the verifier's final norm; speculators
  applies `verifier_norm` to pre-norm ones. The teacher is the same, but for a verifier
  that scales its logits (Falcon-H1's `lm_head_multiplier`, Granite's `logits_scaling`),
  whose scale fanout's stored states carry and speculators' teacher lacks, or caps them
  (Gemma-2), whose cap fanout's KL applies (docs/producer.md).
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
Logits are never `[rows, V]` at once: the head runs in row chunks
(fanout.ops.teacher_head).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from fanout.families.eagle3.config import Eagle3Config
from fanout.model.chain_draft import ChainDraft
from fanout.model.draft import LossOutput
from fanout.model.draft_config import DraftConfig
from fanout.model.slot_loss import acceptance
from fanout.ops.teacher_head import teacher_argmax, teacher_head
from fanout.rows import DOCUMENT_IDS, HIDDEN_STATES, LAST_HIDDEN_STATES, POSITION_IDS


class Eagle3Draft(ChainDraft):
    """Trainable: `fc`, `input_norm` (norm_before_fc) or `fc_norm` (fc_norm), `layers`,
    `norm`; frozen buffers as `Draft`'s (embedding, head rows, `d2t`/`t2d`)."""

    config_class: ClassVar[type[DraftConfig]] = Eagle3Config
    family_label: ClassVar[str] = "EAGLE-3"
    capture_for: ClassVar[str] = "eagle3"
    cfg: Eagle3Config

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None) -> LossOutput:
        """The TTT loss and metrics of a window batch (module docstring); `generator` is
        unused (every position trains). `batch` needs `last_hidden_states` `[B, T, H]`."""
        cfg = self.cfg
        self.check_rows(batch)
        rows = self.rows(batch)
        u = self.start(rows[HIDDEN_STATES], rows[POSITION_IDS], rows[DOCUMENT_IDS], cfg.ttt_steps)
        head = self.lm_head_weight
        loss = head.new_zeros((), dtype=torch.float32)
        # CE: the verifier's argmax at every position once, not once a step (step s reads
        # position t+s+1: the steps share all but s of their rows)
        labels = None
        if cfg.loss_type != "kl":
            last = batch[LAST_HIDDEN_STATES]  # [B, T, H]
            labels = teacher_argmax(last.flatten(0, 1).to(head.dtype), head).view(last.shape[:2])
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
                lab = (
                    None
                    if labels is None
                    else labels[:, s + 1 :][sup[:, : labels.shape[1] - s - 1]]
                )
                per_row, pred, label = teacher_head(
                    x, t_rows, head, kl=cfg.loss_type == "kl", label=lab,
                    softcap=self.teacher_softcap,
                )  # fmt: skip
                loss = loss + cfg.ttt_step_loss_decay**s * per_row.sum() / n
                right[sup] = pred == label
                extra[f"loss_{s}"] = float(per_row.detach().sum()) / n
            sups.append(sup)
            rights.append(right)
        sup_all, right_all = torch.stack(sups, -1), torch.stack(rights, -1)  # [B, R, S]
        has = sup_all[:, :, 0]  # rows whose step 0 is supervised
        acc, cnt, eal = acceptance(right_all, sup_all, has)
        with torch.no_grad():
            run = torch.cumprod(right_all.long(), dim=-1)  # [B, R, S] right at every step <= s
            for s in range(cfg.ttt_steps):
                full = (run[:, :, s].bool() & sup_all[:, :, s] & has).sum()
                extra[f"full_acc_{s}"] = float(full) / max(int(cnt[s]), 1)
        return LossOutput(loss, acc, cnt, eal, int(cnt.sum()), int(has.sum()), extra)


__all__ = ["Eagle3Draft"]
