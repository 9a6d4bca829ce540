"""Which verifier layers a capture takes: the capture set, declared once.

    from fanout.model.capture_layers import CaptureLayers, resolve_capture_layer_ids
    CaptureLayers(capture_layer_ids="all").capture_layer_ids   # ['all']
    resolve_capture_layer_ids(36, None, 5)                     # [1, 9, 17, 25, 33]

The capture set is one of three layer lists, named apart: what the producer (and the
verifier it loads) captures, `capture_layer_ids` here; what a draft reads out of it,
`--draft-layer-ids` (fanout.train.consumer); and the on-disk name both are recorded
under, `target_layer_ids` (contract.json, a draft checkpoint's config), which stays
as it is because peers (speculators, DFlash, vLLM) read it.
`VerifierConfig` and `fanout produce` inherit this one field; its older flag
`--target-layer-ids` and key `target_layer_ids` are still accepted.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from fanout.errors import ConfigError
from fanout.flags import flag_options

# the DFlash layer rule lives with the draft (one rule for producer and trainer)
from fanout.model.draft_config import default_target_layer_ids

NEW, OLD = "capture_layer_ids", "target_layer_ids"
_BOTH = object()  # both names given: the field validator refuses it, under the field's name


class CaptureLayers(BaseModel):
    """The verifier layers to capture (0-based decoder-layer outputs), or 'all'."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    capture_layer_ids: list[int | Literal["all"]] | None = Field(
        None,
        validation_alias=AliasChoices(NEW, OLD),
        description="verifier layers to capture (contract), or 'all': a superset each trainer "
        "picks its own --draft-layer-ids from, in one verifier pass; default: the DFlash "
        "rule for --num-draft-layers",
        json_schema_extra=flag_options(aliases=("--target-layer-ids",)),
    )

    @model_validator(mode="before")
    @classmethod
    def _one_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and NEW in data and OLD in data:
            return {k: v for k, v in data.items() if k != OLD} | {NEW: _BOTH}
        return data

    @field_validator("capture_layer_ids", mode="before")
    @classmethod
    def _all_or_ids(cls, v: Any) -> Any:
        if v is _BOTH:
            raise PydanticCustomError(
                "both_names",
                "give --capture-layer-ids or its older name --target-layer-ids, not both",
            )
        if v == "all" or (isinstance(v, list | tuple) and list(v) == ["all"]):
            return ["all"]
        if isinstance(v, list | tuple) and "all" in v:
            raise ValueError(f"'all' stands alone, got {list(v)}")
        return v


def resolve_capture_layer_ids(
    num_verifier_layers: int,
    capture_layer_ids: list[int | Literal["all"]] | tuple[int, ...] | Literal["all"] | None,
    num_draft_layers: int | None,
) -> list[int]:
    """Explicit ids win (validated: in [0, L), distinct; "all" or ["all"]: every layer
    0..L-1); else the DFlash rule for `num_draft_layers`."""
    if capture_layer_ids == "all" or capture_layer_ids == ["all"]:
        return list(range(num_verifier_layers))
    if capture_layer_ids is None:
        if num_draft_layers is None:
            raise ConfigError("give capture_layer_ids or num_draft_layers (the DFlash rule)")
        return default_target_layer_ids(num_verifier_layers, num_draft_layers)
    ids = [int(i) for i in capture_layer_ids]
    if not ids:
        raise ConfigError("capture_layer_ids must not be empty")
    bad = [i for i in ids if not 0 <= i < num_verifier_layers]
    if bad:
        raise ConfigError(
            f"capture_layer_ids {bad} out of range for a {num_verifier_layers}-layer verifier "
            f"(valid: 0..{num_verifier_layers - 1})"
        )
    if len(set(ids)) != len(ids):
        raise ConfigError(f"capture_layer_ids has duplicates: {ids}")
    return ids
