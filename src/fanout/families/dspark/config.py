"""DSpark's own flags and its validated config.

    from fanout.families.dspark.config import DSparkConfig, DSparkRecipe
    DSparkRecipe(markov_rank=128)                  # the family's flags (fanout train)
    cfg = DSparkConfig(**dflash_fields, markov_rank=128)  # a draft's full config

`DSparkRecipe` holds the fields speculators 0.9.0's DSpark declares beyond DFlash
(`markov_rank`, `markov_head_type`, `enable_confidence_head`,
`confidence_head_with_markov`: written top-level into `config.json`) and its trainer's
`confidence_head_alpha` (training only), with speculators' defaults. `DSparkConfig` is
`DraftConfig` plus those, frozen and validated at construction.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from fanout.model.draft_config import DraftConfig

# Markov head variants speculators declares; fanout trains (and serves) the first.
IMPLEMENTED_HEADS = ("vanilla",)


class DSparkRecipe(BaseModel):
    """DSpark's own options (speculators' DSpark defaults: rank 256, vanilla head, the
    confidence head on and fed the Markov embedding, BCE weight 1)."""

    markov_rank: int = Field(
        256,
        ge=0,
        description="low-rank width of the Markov logit-bias head (bias = W2(W1[previous "
        "token])); 0: no Markov head (plain DFlash logits)",
    )
    enable_confidence_head: bool = Field(
        True,
        description="train the confidence head (predicts each slot's acceptance rate; "
        "needs a capture with --store-last-hidden-states)",
    )
    confidence_head_with_markov: bool = Field(
        True,
        description="feed the confidence head the Markov previous-token embedding beside "
        "the slot's hidden state (needs markov_rank > 0)",
    )
    confidence_head_alpha: float = Field(
        1.0, ge=0, description="weight of the confidence head's BCE term in the loss"
    )

    @model_validator(mode="after")
    def _check_dspark(self) -> DSparkRecipe:
        if (
            self.enable_confidence_head
            and self.confidence_head_with_markov
            and not self.markov_rank
        ):
            raise ValueError(
                "confidence_head_with_markov needs markov_rank > 0 (no Markov embedding to "
                "feed the confidence head); set --no-confidence-head-with-markov"
            )
        return self


class DSparkConfig(DSparkRecipe, DraftConfig):
    """One DSpark draft: the DFlash backbone's shape and recipe plus DSpark's heads."""

    # Not a flag: speculators declares three variants, fanout implements (and so
    # trains) the first; a checkpoint naming another is refused when it is read.
    markov_head_type: Literal["vanilla", "gated", "rnn"] = Field(
        "vanilla",
        description="Markov head variant: vanilla (bias from the previous token alone; "
        "the only one fanout implements)",
    )

    @field_validator("markov_head_type")
    @classmethod
    def _implemented(cls, v: str) -> str:
        if v not in IMPLEMENTED_HEADS:
            raise ValueError(
                f"markov_head_type {v!r} is not implemented in fanout (only "
                f"{', '.join(IMPLEMENTED_HEADS)}); train it with speculators"
            )
        return v


__all__ = ["IMPLEMENTED_HEADS", "DSparkConfig", "DSparkRecipe"]
