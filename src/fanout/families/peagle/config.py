"""P-EAGLE's own flags and its validated config.

    from fanout.families.peagle.config import PEagleConfig, PEagleRecipe
    PEagleRecipe(num_depths=6)                           # the family's flags (fanout train)
    cfg = PEagleConfig(**draft_fields, num_depths=8, block_size=9)  # a draft's config

`PEagleRecipe` holds what speculators 0.9.0's P-EAGLE trainer lets a user choose beyond
the shared recipe, with its defaults (`speculators/train/config/schema.py`
`PEagleArgs`, `DraftArgs`): 8 parallel depths, COD sampling ratio 0.7 with floor 0.2,
and the draft layer's architecture (`--draft-arch`, `qwen3` for every speculator type
but eagle3).

`PEagleConfig` is the chain drafters' config (`ChainConfig`, fanout.model.draft_config:
the layer, fc and norm fields the chain backbone reads) with those fields and the
values speculators' trainer resolves for `--speculator-type peagle`: `norm_before_fc`
off, `fc_norm` off, `norm_output` off, `norm_before_residual` on, the embedding trained
(`embed_requires_grad`, the `PEagleSpeculatorConfig` default). Of the shared recipe
fields a P-EAGLE draft:
- maps `block_size` to its verify width, `num_depths + 1` (the depths it drafts in one
  forward plus the anchor); `PEagle.build` sets it, any other value is refused;
- refuses `gamma`, `loss_weighting dpace` and `label_source input_ids` (every sampled
  position weighs 1; its targets are the verifier's distribution);
- reads `max_anchors` (the COD seed positions per row, speculators' `max_anchors`),
  `mask_token_id` (the token of the depth >= 1 positions) and `loss_type` (`kl`, the
  reference `kl_div`, or `ce` against the verifier distribution's argmax).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, Field

from fanout.model.draft_config import EAGLE_ACCEPTS, ChainConfig, SharedRule, steps_flag


class PEagleRecipe(BaseModel):
    """P-EAGLE's flags (speculators' P-EAGLE trainer defaults)."""

    num_depths: int = steps_flag(8, "P-EAGLE: parallel depths drafted in one forward")
    down_sample_ratio: float = Field(
        0.7, gt=0, le=1, description="P-EAGLE: COD sampling keeps ratio**d of depth d's seeds"
    )
    down_sample_ratio_min: float = Field(
        0.2, ge=0, le=1, description="P-EAGLE: floor of the COD retention ratio"
    )
    draft_arch: Literal["qwen3", "llama"] = Field(
        "qwen3",
        description="P-EAGLE: draft layer architecture (qwen3: per-head q/k RMSNorm, "
        "speculators' default; llama: EAGLE-3's layer)",
    )


class PEagleConfig(PEagleRecipe, ChainConfig):
    """One P-EAGLE draft: EAGLE-3's layer over `[embedding ; fused hidden]` (one by
    default), the learned `mask_hidden` for depths >= 1, and its COD recipe."""

    shared_rule: ClassVar[SharedRule] = SharedRule(
        "P-EAGLE",
        steps_field="num_depths",
        accepts=EAGLE_ACCEPTS,
        why="P-EAGLE weighs every sampled position 1 against the verifier's distribution "
        "(its last hidden states)",
    )

    norm_before_fc: bool = Field(
        False, description="one RMSNorm over the concatenated auxiliary states before fc"
    )
    norm_output: bool = Field(False, description="unused by P-EAGLE (no TTT feedback)")
    norm_before_residual: bool = Field(
        True, description="the first layer's residual is the normed hidden state"
    )
    embed_requires_grad: bool = Field(
        True, description="train the embedding (speculators' P-EAGLE does; the mask token's row)"
    )


__all__ = ["PEagleConfig", "PEagleRecipe"]
