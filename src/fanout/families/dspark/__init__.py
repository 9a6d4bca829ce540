"""DSpark: the DFlash backbone drafting from the anchor (bs tokens a block) with a
low-rank Markov logit bias on the previous token and a confidence head
(fanout.families.dspark.model is its model and loss, .propose its drafting step,
.config its flags).

    fanout train --draft-family dspark --markov-rank 256 ...   # capture with
                                                               # --store-last-hidden-states
Reference recipe (speculators 0.9.0's DSpark): 5 layers, block 8, markov_rank 256,
vanilla head, the confidence head on (with the Markov embedding, BCE weight 1), 512
anchors (speculators' trainer CLI default). Served by vLLM under method `dspark`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from fanout.families.base import Family
from fanout.families.dspark.config import DSparkConfig, DSparkRecipe


class DSpark(Family):
    name = "dspark"
    model_ref = "fanout.families.dspark.model:DSparkDraft"
    context_ref = "fanout.families.dspark.propose:DSparkContext"
    config_class = DSparkConfig
    recipe = DSparkRecipe
    # speculators' DSpark recipe: block 8 (its config default), 512 anchors (its CLI
    # default, as DFlash's; 3072 is only DSparkDraftModel's fallback without the CLI)
    recipe_defaults: ClassVar[dict[str, Any]] = {"block_size": 8}
    speculators_model_type = "dspark"
    # what speculators' save_pretrained of a DSparkDraftModel writes (the model class;
    # its config's own default, "DSparkSpeculator", is replaced on save)
    architectures = ("DSparkDraftModel",)
    serving_method = "dspark"
    sample_from_anchor = True

    def serving_fields(self) -> list[str]:
        return [
            "markov_rank",
            "markov_head_type",
            "enable_confidence_head",
            "confidence_head_with_markov",
        ]

    def needs_last_hidden_states(self, recipe: Mapping[str, Any]) -> bool:
        """The confidence head's target is the verifier's distribution."""
        conf = recipe.get("enable_confidence_head", DSparkRecipe().enable_confidence_head)
        return bool(conf) or super().needs_last_hidden_states(recipe)


FAMILY = DSpark()

__all__ = ["FAMILY", "DSpark"]
