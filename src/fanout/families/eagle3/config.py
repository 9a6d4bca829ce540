"""EAGLE-3's own flags and its validated config.

    from fanout.families.eagle3.config import Eagle3Config, Eagle3Recipe
    Eagle3Recipe(ttt_steps=4)                      # the family's flags (fanout train)
    cfg = Eagle3Config(**draft_fields, ttt_steps=3, block_size=4)  # a draft's config

`Eagle3Recipe` holds what speculators 0.9.0's EAGLE-3 trainer lets a user choose beyond
the shared recipe, with the values its trainer resolves for `--speculator-type eagle3`
(`speculators/train/config/schema.py`): 3 training-time-test steps, no per-step decay,
`norm_before_fc` and `norm_output` on, `norm_before_residual` on, `fc_norm` off
(`norm_before_fc` unset means on unless `fc_norm`, which excludes it). (The
config class's own defaults, `Eagle3SpeculatorConfig`, are all False: they describe
drafts converted from elsewhere, not the recipe its trainer runs.)

`Eagle3Config` is `ChainConfig` (fanout.model.draft_config: the fields the chain
drafters share, e.g. the norms, one layer, `loss_type kl`; the embedding frozen, which
is refused otherwise) plus those fields. Of the shared recipe fields an EAGLE-3 draft:
- maps `block_size` to its verify width, `ttt_steps + 1` (the chain it drafts at the
  reference k plus the anchor); `Eagle3.build` sets it, any other value is refused;
- refuses `gamma`, `loss_weighting dpace` and `label_source input_ids` (its per-step
  weight is `ttt_step_loss_decay`, its targets the verifier's distribution);
- accepts and ignores `max_anchors`, `dpace_alpha` and `mask_token_id` (it trains every
  position, has no mask slots);
- reads `loss_type`: `kl` (the reference, speculators' `kl_div`) or `ce` (speculators'
  `ce`: against the argmax of the verifier's distribution over the draft vocabulary).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, Field, model_validator

from fanout.model.draft_config import (
    EAGLE_ACCEPTS,
    ChainConfig,
    SharedRule,
    fc_norm_problem,
    steps_flag,
)


class Eagle3Recipe(BaseModel):
    """EAGLE-3's flags (speculators' EAGLE-3 trainer defaults)."""

    ttt_steps: int = steps_flag(
        3, "EAGLE-3: training-time-test steps, the draft unrolled on its own hidden states"
    )
    ttt_step_loss_decay: float = Field(
        1.0, gt=0, description="EAGLE-3: loss weight of TTT step s is decay**s"
    )
    norm_before_fc: bool | None = Field(
        None,
        description="EAGLE-3: one RMSNorm over the concatenated auxiliary states before fc "
        "(default: on, unless --fc-norm)",
    )
    fc_norm: bool = Field(
        False,
        description="EAGLE-3: one RMSNorm per auxiliary state before fc (instead of "
        "--norm-before-fc; Eagle 3.1)",
    )
    norm_output: bool = Field(
        True,
        description="EAGLE-3: feed the final-normed hidden state back across TTT steps",
    )
    norm_before_residual: bool = Field(
        True, description="EAGLE-3: the first layer's residual is the normed hidden state"
    )

    @model_validator(mode="after")
    def _check_eagle3(self) -> Eagle3Recipe:
        if problem := fc_norm_problem(self.norm_before_fc, self.fc_norm):
            raise ValueError(problem)
        return self


class Eagle3Config(Eagle3Recipe, ChainConfig):
    """One EAGLE-3 draft: its shape (one Llama-style layer by default, the first over
    `[embedding ; hidden]`; the chain drafters' shared fields, `ChainConfig`), the
    verifier's layers it fuses, and its TTT recipe."""

    shared_rule: ClassVar[SharedRule] = SharedRule(
        "EAGLE-3",
        steps_field="ttt_steps",
        accepts=EAGLE_ACCEPTS,
        why="EAGLE-3 weighs its TTT steps by --ttt-step-loss-decay, not gamma or a block "
        "weighting, and trains on the verifier's distribution (its last hidden states), "
        "not on the data tokens",
    )

    norm_before_fc: bool = Field(
        True, description="one RMSNorm over the concatenated auxiliary states before fc"
    )

    @model_validator(mode="after")
    def _check_frozen_embedding(self) -> Eagle3Config:
        if self.embed_requires_grad:
            raise ValueError("embed_requires_grad: fanout keeps EAGLE-3's embedding frozen")
        return self


__all__ = ["Eagle3Config", "Eagle3Recipe"]
