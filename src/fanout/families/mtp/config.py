"""MTP's own flags and its validated config.

    from fanout.families.mtp.config import MTPConfig, MTPRecipe
    MTPRecipe(mtp_steps=3)                               # the family's flags (fanout train)
    cfg = MTPConfig(**draft_fields, mtp_steps=3, block_size=4)  # a draft's config

`MTPRecipe` holds what speculators 0.9.0's MTP trainer lets a user choose beyond the
shared recipe, with its defaults (`speculators/models/mtp/core.py`
`MTPDraftModel.from_training_args` / `get_trainer_kwargs`): 3 speculative steps
(`num_speculative_steps`, written as the greedy proposal's `speculative_tokens`) and the
FastMTP step-weight decay `step_weight_beta` 0.6 (step k weighs
beta**k / sum_j beta**j).

`MTPConfig` is `DraftConfig` plus those fields and `layer_config`: for a Qwen3-Next /
Qwen3.5 / Qwen3.5-MoE verifier, its text config (what speculators writes as
`transformer_layer_config` and builds the layer from; fanout.families.mtp.layers), None
for the dense Qwen3 layer every other verifier gets. speculators' MTP has one layer
(`num_nextn_predict_layers` 1, the only value it accepts), the verifier's whole
vocabulary (no draft vocabulary) and the verifier's final hidden states as input (its
`target_layer_ids` is `[num_hidden_layers]` in HF numbering: fanout's last decoder
layer, normed by the verifier's final norm as the verifier's head sees it). Of the
shared recipe fields an MTP draft:
- maps `block_size` to its verify width, `mtp_steps + 1`; `MTP.build` sets it, any other
  value is refused;
- refuses `gamma`, `loss_weighting dpace`, `loss_type kl` and a draft vocabulary
  (speculators' MTP trains cross-entropy over the whole vocabulary, weighted per step);
- reads `label_source` (`input_ids`, speculators' targets, or `target_ids`, the
  verifier's greedy tokens) and ignores `max_anchors` and `mask_token_id`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_validator

from fanout.model.draft_config import DraftConfig, SharedRule, steps_flag


class MTPRecipe(BaseModel):
    """MTP's flags (speculators' MTP trainer defaults)."""

    mtp_steps: int = steps_flag(3, "MTP: steps the layer is unrolled on its own output in training")
    mtp_step_weight_beta: float = Field(
        0.6, gt=0, description="MTP: step k's loss weight is beta**k / sum_j beta**j (FastMTP)"
    )


class MTPConfig(MTPRecipe, DraftConfig):
    """One MTP draft: one MTP layer (a decoder layer over `input_proj([norm(embed) ;
    norm(hidden)])`, then `final_layernorm`: Qwen3's, or with `layer_config` the hybrid
    verifier's own full-attention layer) and its step recipe."""

    shared_rule: ClassVar[SharedRule] = SharedRule(
        "MTP",
        steps_field="mtp_steps",
        accepts={
            "gamma": None,
            "loss_weighting": "exp",
            "loss_type": "ce",
            "draft_vocab_size": None,
        },
        why="MTP trains cross-entropy over the verifier's whole vocabulary, each step weighted "
        "by --mtp-step-weight-beta (speculators' MTP)",
    )

    num_layers: int = Field(1, ge=1, le=1, description="MTP layers (speculators: exactly one)")
    layer_config: dict[str, Any] | None = Field(
        None,
        description="a hybrid verifier's text config (speculators' transformer_layer_config: "
        "Qwen3-Next / Qwen3.5 / Qwen3.5-MoE, fanout.families.mtp.layers); None: a dense "
        "Qwen3 layer",
    )
    label_source: Literal["target_ids", "input_ids"] = Field(
        "input_ids", description="labels: the data tokens (speculators) or target_ids"
    )

    @model_validator(mode="before")
    @classmethod
    def _one_layer(cls, data: Any) -> Any:
        # speculators writes the verifier's own layer config: its depth (the last layer
        # + 1) as `num_hidden_layers`, read back as the one MTP layer
        if isinstance(data, dict) and data.get("num_layers") not in (None, 1):
            ids = data.get("target_layer_ids") or []
            if len(ids) == 1 and data["num_layers"] == ids[0] + 1:
                return {**data, "num_layers": 1}
        return data

    def step_weights(self) -> list[float]:
        """speculators' `compute_step_weights(beta, steps)`: normalised beta**k."""
        raw = [self.mtp_step_weight_beta**k for k in range(self.mtp_steps)]
        return [w / sum(raw) for w in raw]


__all__ = ["MTPConfig", "MTPRecipe"]
