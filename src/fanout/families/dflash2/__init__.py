"""DFlash2: DFlash plus block-local dynamic convolutions around every layer's attention
and MLP, and a candidate selector that reranks each slot's unary top-k given the token
before it (fanout.families.dflash2.model; its drafting step: .propose).

    from fanout.families.registry import family
    fam = family("dflash2")
    draft = fam.build("models/qwen3-8b", block_size=8, mask_token_id=151669)  # selector top-16
    ctx = fam.context(draft, cached=True)

Reference recipe (speculators 0.9.0's DFlash2 defaults): 5 layers, block 8, 512 anchors,
exp decay, conv kernel 2 / group 16, selector rank 256 / top-16, selector loss weight 1;
the full verifier vocabulary only. `fanout train` applies block 8 (`recipe_defaults`);
`build` takes the fields it is given. Its checkpoint is speculators' `dflash2`
(`DFlash2DraftModel`); vLLM serves it under method `dflash` (it detects the
architecture).
"""

from __future__ import annotations

from typing import Any, ClassVar

from fanout.families.base import Family
from fanout.families.dflash2.config import DFlash2Config, DFlash2Recipe


class DFlash2(Family):
    name = "dflash2"
    model_ref = "fanout.families.dflash2.model:DFlash2Draft"
    context_ref = "fanout.families.dflash2.propose:SelectorContext"
    config_class = DFlash2Config
    recipe = DFlash2Recipe
    recipe_defaults: ClassVar[dict[str, Any]] = {"block_size": 8}
    speculators_model_type = "dflash2"
    architectures = ("DFlash2DraftModel",)
    serving_method = "dflash"
    sliding_window_non_causal = True

    def serving_fields(self) -> list[str]:
        """The DFlash2SpeculatorConfig fields beyond DFlash's (selector_loss_alpha is a
        training flag: speculators' config has no such field)."""
        return ["conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"]


FAMILY = DFlash2()

__all__ = ["FAMILY", "DFlash2", "DFlash2Config", "DFlash2Recipe"]
