"""The DFlash draft: the block drafter (fanout.model.block_draft) trained on the block
objective alone.

    from fanout.families.dflash.model import DFlashDraft
    draft = DFlashDraft.from_verifier("path/to/Qwen3-8B", target_layer_ids=[1, 9, 17, 25, 33],
                                      block_size=16, num_layers=1, mask_token_id=151669)
    out = draft.loss(batch, torch.Generator().manual_seed(0))  # batch: dict of window rows
    out.loss.backward(); print(out.per_slot_acc, out.eal)

Its config is the shared DraftConfig (DFlash's recipe is DraftRecipe's defaults); its
architecture, loss and metrics are the backbone's (see fanout.model.block_draft).
"""

from __future__ import annotations

import torch

from fanout.model.block_draft import BlockDraft
from fanout.model.draft import LossOutput


class DFlashDraft(BlockDraft):
    """Trainable: `layers`, `fc`, `hidden_norm`, `norm` (speculators' DFlash names)."""

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None) -> LossOutput:
        """Draw the blocks (`blocks`, anchors from `generator`), return the block
        objective and its metrics."""
        return self.block_loss(batch, self.blocks(batch, generator))


__all__ = ["DFlashDraft"]
