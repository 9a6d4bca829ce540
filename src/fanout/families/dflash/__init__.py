"""DFlash: the block-diffusion draft (its model: the shared block backbone,
fanout.model.block_draft, trained on the block objective alone; fanout.model.draft_cache
is its drafting step).

Reference recipe (DraftRecipe's defaults): 5 layers, block 16, 512 anchors, CE against
the verifier's greedy tokens with exp decay; served by vLLM under method `dflash`.
"""

from __future__ import annotations

from fanout.families.base import Family


class DFlash(Family):
    name = "dflash"
    model_ref = "fanout.families.dflash.model:DFlashDraft"
    speculators_model_type = "dflash"
    architectures = ("DFlashDraftModel",)
    serving_method = "dflash"


FAMILY = DFlash()

__all__ = ["FAMILY", "DFlash"]
