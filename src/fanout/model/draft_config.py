"""A draft's config without torch: what a user chooses (DraftRecipe) and a whole
draft's shapes and semantics (DraftConfig, which every family's config extends and
DFlash's is), with the DFlash layer rule.

    from fanout.model.draft_config import DraftConfig, DraftRecipe, default_target_layer_ids
    DraftRecipe().block_size                       # 16: the reference recipe
    default_target_layer_ids(36, 5)                # [1, 9, 17, 25, 33]

Kept apart from the models (fanout.model.draft and each family's) so that every config a command's flags
build imports no torch: `fanout train`'s flag errors come back before torch is
imported (fanout.cli.EARLY; benchmarks/startup.py measures it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from fanout.contract import DraftLayerIds
from fanout.errors import ConfigError
from fanout.flags import field_flag, flag_name, flag_options
from fanout.rows import TARGET_IDS


def default_gamma(block_size: int) -> float:
    """Loss-decay gamma by block size: 4 for 8, 5 for 10, 7 for 16 (DFlash paper's values).
    Other sizes: `bs / 2` up to 10, then `5 + (bs - 10) / 3` — the piecewise-linear
    interpolation through those three points."""
    return block_size / 2 if block_size <= 10 else 5 + (block_size - 10) / 3


class DraftRecipe(BaseModel):
    """What a user chooses about a draft: its depth, block, anchors and loss. Declared
    once here; DraftConfig (a draft's full config) and `fanout train`'s TrainConfig
    (its flags) inherit these fields. The defaults are the recipe that works on a real
    verifier (DFlash's released drafts and speculators: 5 layers, block 16, 512
    anchors; docs/training.md says why); demos and tests set their own small values."""

    num_layers: int = Field(5, ge=1, description="draft decoder layers")
    block_size: int = Field(16, ge=2, description="tokens per draft block (anchor + masks)")
    max_anchors: int = Field(512, ge=1, description="anchors drawn per row per step")
    draft_vocab_size: int | None = Field(
        None,
        gt=0,
        description="reduced draft vocabulary: the N tokens the run's data uses most "
        "(token_counts.safetensors, written by the producer); default: the full vocab",
    )
    gamma: float | None = Field(None, gt=0, description="exp loss decay; default by block size")
    # Speculators' trainer calls it per_position_loss_weight (the flag); checkpoints have
    # always said loss_weighting (the field), so both names are accepted.
    loss_weighting: Literal["exp", "dpace"] = Field(
        "exp",
        validation_alias=AliasChoices("loss_weighting", "per_position_loss_weight"),
        description="per-slot loss weights",
        json_schema_extra=flag_options(
            flag="--per-position-loss-weight", aliases=("--loss-weighting",)
        ),
    )
    dpace_alpha: float = Field(0.5, ge=0, le=1, description="D-PACE confidence smoothing")
    label_source: Literal["target_ids", "input_ids"] = Field(
        "target_ids", description="labels: verifier greedy predictions or the data tokens"
    )
    loss_type: Literal["ce", "kl"] = Field(
        "ce",
        description="ce: cross-entropy against the labels; kl: KL from the verifier's full "
        "next-token distribution (the run must be captured with --store-last-hidden-states)",
    )

    @model_validator(mode="after")
    def _check_loss(self) -> DraftRecipe:
        if self.loss_type == "kl" and self.loss_weighting == "dpace":
            # D-PACE turns each slot's CE into an acceptance estimate; a KL is not one.
            raise ValueError(
                "loss_weighting (--per-position-loss-weight) 'dpace' needs loss_type 'ce'"
            )
        return self


@dataclass(frozen=True)
class SharedRule:
    """Which shared recipe fields a family's draft refuses: the one rule its config
    (`DraftConfig.shared_rule`) and `fanout train`'s flag check (`Family.shared_conflict`)
    both apply. Each field of `accepts` takes that one value only (`why` says what the
    family does instead). A family that drafts a chain, not a block (EAGLE-3, P-EAGLE,
    MTP; fanout.families.chain) names its steps flag (`steps_field`, the tokens one
    drafting step proposes): its verify width is its steps + 1, given as `block_size` or
    not at all."""

    name: str  # as a message writes the family: "EAGLE-3"
    accepts: Mapping[str, Any]  # shared recipe field -> the one value it takes
    why: str  # what the family does instead, the end of every refusal
    steps_field: str | None = None  # a chain drafter's steps flag

    def problem(self, values: Mapping[str, Any], block_size: int | None) -> str | None:
        """Why the values `values` (field -> value, a chain's steps included; a field
        absent: accepted) do not apply to the family, as one line naming the flag (None:
        they do). `block_size` None: not given (a chain's follows its steps)."""
        if self.steps_field is not None and block_size is not None:
            steps, flag = int(values[self.steps_field]), flag_name(self.steps_field)
            if block_size != steps + 1:
                return (
                    f"--block-size {block_size}: {self.name} drafts a chain, not a block; "
                    f"its verify width is {flag} + 1 = {steps + 1} (drop --block-size, or "
                    f"set {flag} {block_size - 1})"
                )
        for field, ok in self.accepts.items():
            if (value := values.get(field, ok)) != ok:
                shown = field_flag(field, DraftRecipe.model_fields[field])
                return f"{shown} {value}: {self.why}; drop it"
        return None


def steps_flag(default: int, what: str) -> Any:
    """The field of a chain drafter's steps flag (its config's `SharedRule.steps_field`):
    at least 1; its help is `what`, then what every steps flag means."""
    return Field(
        default,
        ge=1,
        description=f"{what}; the tokens one drafting step proposes (fanout eval's default "
        "--num-speculative-tokens); verify width = this + 1",
    )


def between(cfg: BaseModel, field: str, relation: str, other: str) -> str:
    """The one line a config check raises when two of `cfg`'s fields disagree, naming
    both with their values: `between(cfg, "conv_group_size", "must divide",
    "hidden_size")` -> "conv_group_size (12) must divide hidden_size (32)"."""
    return f"{field} ({getattr(cfg, field)}) {relation} {other} ({getattr(cfg, other)})"


class DraftConfig(DraftRecipe):
    """Shape and training semantics of one draft: the DraftRecipe plus what the
    verifier and the run fix (shapes, vocabulary, mask id, layers). Validated at
    construction."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    # the shared recipe fields the family refuses (None: it reads every one, DFlash)
    shared_rule: ClassVar[SharedRule | None] = None

    hidden_size: int = Field(gt=0, description="H: verifier (and draft) hidden size")
    intermediate_size: int = Field(gt=0, description="SwiGLU MLP width of each draft layer")
    num_attention_heads: int = Field(gt=0, description="query heads")
    num_key_value_heads: int = Field(gt=0, description="key/value heads (GQA)")
    head_dim: int = Field(gt=0, description="per-head width")
    rms_norm_eps: float = Field(1e-6, gt=0, description="RMSNorm epsilon")
    rope_theta: float = Field(1e6, gt=0, description="RoPE base")
    max_position_embeddings: int = Field(40960, gt=0, description="verifier's max positions")
    vocab_size: int = Field(gt=0, description="verifier vocabulary size")
    mask_token_id: int = Field(ge=0, description="token id of the noise/mask slots")
    # a draft's layers (--draft-layer-ids); the name speculators / DFlash / vLLM read, kept
    target_layer_ids: DraftLayerIds = Field(
        min_length=1, description="verifier layers whose hidden states form the context (ascending)"
    )
    tie_word_embeddings: bool = Field(False, description="verifier ties lm_head to embeddings")

    @model_validator(mode="after")
    def _check(self) -> DraftConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                between(self, "num_attention_heads", "must be a multiple of", "num_key_value_heads")
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.mask_token_id >= self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} >= vocab_size {self.vocab_size}")
        if self.draft_vocab_size is not None and self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} > vocab_size")
        if self.shared_rule and (problem := self.shared_rule.problem(dict(self), self.block_size)):
            raise ValueError(problem)
        return self

    @property
    def resolved_gamma(self) -> float:
        return self.gamma if self.gamma is not None else default_gamma(self.block_size)


def default_target_layer_ids(num_verifier_layers: int, num_draft_layers: int) -> list[int]:
    """The DFlash rule: one target layer per draft layer, spaced evenly over [1, L − 3].

    One draft layer takes the middle layer `L // 2`. Same rule (and Python's `round`,
    half to even) as `build_target_layer_ids` in the DFlash reference code, SGLang's
    `python/sglang/srt/speculative/dflash_utils.py` and speculators' DFlash utils.

    >>> default_target_layer_ids(36, 5)
    [1, 9, 17, 25, 33]

    Raises ConfigError when the verifier is too shallow to give distinct layers
    (then pass `target_layer_ids` explicitly or fewer draft layers).
    """
    if num_verifier_layers <= 0:
        raise ConfigError(f"num_verifier_layers must be > 0, got {num_verifier_layers}")
    if num_draft_layers <= 0:
        raise ConfigError(f"num_draft_layers must be > 0, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_verifier_layers // 2]
    start, end = 1, num_verifier_layers - 3
    span = end - start
    ids = [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]
    if span < 0 or len(set(ids)) != len(ids):
        raise ConfigError(
            f"the DFlash layer rule gives {ids} for a {num_verifier_layers}-layer verifier and "
            f"{num_draft_layers} draft layers (not distinct); pass target_layer_ids explicitly "
            "or use fewer draft layers"
        )
    return ids


# ---- the chain drafters' shared fields (EAGLE-3, P-EAGLE) ---------------------------


def fc_norm_problem(norm_before_fc: bool | None, fc_norm: bool) -> str | None:
    """Why the two norms before a chain draft's `fc` cannot both be on (None: they can
    be): one norm over the concatenated states, or one per state."""
    if norm_before_fc and fc_norm:
        return (
            "fc_norm and norm_before_fc are exclusive (one norm over the concatenated "
            "states, or one per state): drop --norm-before-fc"
        )
    return None


# The one value each of these shared recipe fields takes in an EAGLE-style draft (its
# config's `SharedRule.accepts`): its steps weigh by its family's own flag, not gamma or
# D-PACE, and its targets are the verifier's distribution, not the data tokens.
EAGLE_ACCEPTS: Mapping[str, Any] = {
    "gamma": None,
    "loss_weighting": "exp",
    "label_source": TARGET_IDS,
}


class ChainConfig(DraftConfig):
    """What the EAGLE-style chain drafters (EAGLE-3, P-EAGLE; fanout.model.chain_draft)
    share beyond DraftConfig: one draft layer by default, the first over `[embedding ;
    fc(auxiliary states)]`, the norms around `fc` and the hidden state fed back, trained
    against the verifier's distribution. The norm flags default off, as speculators'
    `Eagle3SpeculatorConfig` (drafts converted from elsewhere); each family's config
    sets what its trainer resolves."""

    # the reference recipe where a draft is built directly (`fanout train` passes them)
    num_layers: int = Field(1, ge=1, description="draft decoder layers (EAGLE-3: one)")
    loss_type: Literal["ce", "kl"] = Field(
        "kl", description="kl: KL from the verifier's distribution; ce: CE against its argmax"
    )
    norm_before_fc: bool = Field(
        False, description="one RMSNorm over the concatenated auxiliary states before fc"
    )
    fc_norm: bool = Field(
        False, description="one RMSNorm per auxiliary state before fc (instead of norm_before_fc)"
    )
    norm_output: bool = Field(
        False, description="feed the final-normed hidden state back to the next step"
    )
    norm_before_residual: bool = Field(
        False, description="the first layer's residual is the normed hidden state"
    )
    embed_requires_grad: bool = Field(False, description="train the embedding")

    @model_validator(mode="before")
    @classmethod
    def _resolve_norm_before_fc(cls, data: Any) -> Any:
        # unset (EAGLE-3's flag, None): the family's default, which its trainer resolves,
        # off where fc_norm is on (they are exclusive)
        if isinstance(data, dict) and data.get("norm_before_fc") is None:
            on = cls.model_fields["norm_before_fc"].default and not data.get("fc_norm", False)
            return {**data, "norm_before_fc": on}
        return data

    @model_validator(mode="after")
    def _check_fc_norms(self) -> ChainConfig:
        if problem := fc_norm_problem(self.norm_before_fc, self.fc_norm):
            raise ValueError(problem)
        return self
