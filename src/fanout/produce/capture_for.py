"""`fanout produce --capture-for FAMILY,...`: one capture that every named family can
train on.

    fanout produce --capture-for dflash,dflash2,dspark ...   # then any mix of trainers

Each family's default layers are its own (`Family.default_layers`: for the DFlash
families the DFlash rule at the reference depth, capped at the distinct layers a shallow
verifier has: the demo's 6 give 1, 2, 3); the capture is their union with any
`--capture-layer-ids` given.
A family whose reference recipe trains on the verifier's final hidden states (DSpark's
confidence head; `Family.needs_last_hidden_states`, the declaration the trainer checks
too) turns on `--store-last-hidden-states`. What each trainer reads out of
it is its own `--draft-layer-ids` (default: every captured layer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, Field, field_validator

from fanout.families.registry import FamilyName, family
from fanout.model.verifier_dir import read_verifier_config


class CaptureForOptions(BaseModel):
    """The families a capture is for (ProducerConfig inherits this field)."""

    capture_for: list[FamilyName] | None = Field(
        None,
        description="draft families this capture must feed (e.g. dflash dspark): captures "
        "the union of their default layers (with any --capture-layer-ids) and the tensors "
        "they train on (docs/training.md)",
    )

    @field_validator("capture_for", mode="before")
    @classmethod
    def _names(cls, v: Any) -> Any:
        if isinstance(v, str):  # "dflash,dspark" as one word
            v = [v]
        if isinstance(v, list | tuple):  # each name is checked against the registry
            return [n.strip() for item in v for n in str(item).split(",") if n.strip()]
        return v


class _Capture(Protocol):
    @property
    def capture_for(self) -> list[FamilyName] | None: ...
    @property
    def capture_layer_ids(self) -> list[Any] | None: ...
    @property
    def store_last_hidden_states(self) -> bool: ...
    @property
    def verifier_name_or_path(self) -> str: ...


def capture_fields(cfg: _Capture) -> dict[str, Any]:
    """The capture fields `--capture-for` sets (empty without it): the layer union and
    `store_last_hidden_states`."""
    if not cfg.capture_for:
        return {}
    n = read_verifier_config(Path(cfg.verifier_name_or_path))["_num_hidden_layers"]
    given = cfg.capture_layer_ids
    if given == ["all"]:
        layers: set[int] = set(range(n))
    else:
        layers = {int(i) for i in given or []}
    last = cfg.store_last_hidden_states
    for name in cfg.capture_for:
        fam = family(name, where="--capture-for")
        layers |= set(fam.default_layers(n))
        last = last or fam.needs_last_hidden_states(fam.reference_recipe())
    return {"capture_layer_ids": sorted(layers), "store_last_hidden_states": last}


__all__ = ["CaptureForOptions", "capture_fields"]
