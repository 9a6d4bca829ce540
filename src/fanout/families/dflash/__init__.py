"""DFlash: the block-diffusion draft (fanout.model.dflash is its model and the backbone
every DFlash-family draft builds on; fanout.model.draft_cache its drafting step).

Reference recipe (DraftRecipe's defaults): 5 layers, block 16, 512 anchors, CE against
the verifier's greedy tokens with exp decay; served by vLLM under method `dflash`.
"""

from __future__ import annotations

from typing import ClassVar

from fanout.families.base import Family


class DFlash(Family):
    name: ClassVar[str] = "dflash"
    model_ref: ClassVar[str] = "fanout.model.dflash:DFlashDraft"
    speculators_model_type: ClassVar[str] = "dflash"
    architectures: ClassVar[tuple[str, ...]] = ("DFlashDraftModel",)
    serving_method: ClassVar[str] = "dflash"


FAMILY = DFlash()

__all__ = ["FAMILY", "DFlash"]
