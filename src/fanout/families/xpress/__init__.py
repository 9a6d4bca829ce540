"""XPress: the DFlash backbone plus a low-rank causal refiner of its logits, resolved
when drafting by parallel Jacobi passes (fanout.families.xpress.model is its model and
loss, .propose its drafting step, .config its flags).

    fanout produce --capture-for xpress ...                 # --store-last-hidden-states
    fanout train --draft-family xpress --xpress-rank 256 ...  # reference recipe by default
    fanout eval --draft out/xpress/checkpoint-...           # 6 Jacobi passes a block

Reference recipe (speculators 0.9.0's trainer for `--speculator-type xpress`): 5 layers,
block 16, 512 anchors, gamma 4 (its `--dflash-decay-gamma` default; DFlash's paper value
for block 16 is 7), the exp slot decay, loss CE 0.1 + TV 0.9 on the teacher-forced
refined logits + 0.3 x the mean of 3 free-running rounds + 0.6 x the backbone's own
logits, refiner rank 256 with MLP ratio 2, 6 Jacobi passes when drafting. Its checkpoint
is speculators' `xpress` (`XPressDraftModel`, `refiner_head.*`, `sample_from_anchor`
false). vLLM has no XPress proposer as far as we know (speculators 0.9.0 ships none
either), so `fanout eval` decodes it with speculators' reference decoding: the block
forward, then the Jacobi refine passes (`fanout.families.xpress.propose`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from fanout.families.base import Family
from fanout.families.xpress.config import XPressConfig, XPressRecipe


class XPress(Family):
    name = "xpress"
    model_ref = "fanout.families.xpress.model:XPressDraft"
    context_ref = "fanout.families.xpress.propose:XPressContext"
    config_class = XPressConfig
    recipe = XPressRecipe
    # speculators' XPress recipe: block 16 (DraftRecipe's too), 512 anchors, gamma 4.0
    # (its trainer's dflash_decay_gamma default, not fanout's block-16 value 7)
    recipe_defaults: ClassVar[dict[str, Any]] = {"gamma": 4.0}
    speculators_model_type = "xpress"
    # what speculators' save_pretrained of an XPressDraftModel writes (the model class;
    # its config's own default, "XPressSpeculator", is replaced on save)
    architectures = ("XPressDraftModel",)
    # no vLLM method: speculators' algorithm name (fanout eval runs its reference decoding)
    serving_method = "xpress"
    served_by_vllm = False  # speculators' reference decoding in eval

    def serving_fields(self) -> list[str]:
        return ["xpress_rank", "xpress_mlp_ratio", "num_jacobi_passes"]

    def needs_last_hidden_states(self, recipe: Mapping[str, Any]) -> bool:
        return True  # every loss term has a TV part (and the accept rates need p)


FAMILY = XPress()

__all__ = ["FAMILY", "XPress", "XPressConfig"]
