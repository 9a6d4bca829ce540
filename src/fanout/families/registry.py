"""The one list of draft families (`--draft-family`): adding a family is its folder
and its name in `FAMILY_FOLDERS`.

    from fanout.families.registry import FAMILIES, family
    family("mtp").speculators_model_type   # 'mtp'; an unknown name: ConfigError
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, model_validator

from fanout.errors import ConfigError
from fanout.families.base import Family
from fanout.flags import field_flag, flag_options
from fanout.model.draft_config import DraftConfig

if TYPE_CHECKING:
    from fanout.model.draft import Draft

# The families, in the order every table lists them: adding one is its folder
# (`fanout/families/<name>/`, whose `FAMILY` is its `Family`) and its name here.
FAMILY_FOLDERS = ("dflash", "dflash2", "dspark", "eagle3", "mtp", "peagle", "xpress")


def _load(folder: str) -> Family:
    """The `FAMILY` of `fanout.families.<folder>` (imported without torch)."""
    fam = importlib.import_module(f"fanout.families.{folder}").FAMILY
    if not isinstance(fam, Family) or fam.name != folder:
        raise TypeError(f"fanout.families.{folder}.FAMILY must be a Family named {folder!r}")
    return fam


FAMILIES: dict[str, Family] = {name: _load(name) for name in FAMILY_FOLDERS}

# The names `--draft-family` and `--capture-for` accept (choices in --help).
if TYPE_CHECKING:
    FamilyName = str
else:
    FamilyName = Literal[tuple(FAMILIES)]

# Every family's own options, once each (families without options share NoOptions).
_RECIPES = tuple(dict.fromkeys(f.recipe for f in FAMILIES.values()))


class FamilyOptions(*_RECIPES):  # type: ignore[misc]
    """`fanout train`'s family flags: `--draft-family` and every family's own options
    (each family's `recipe`, its reference defaults). An option of a family other than
    the chosen one is refused when given; the shared recipe fields the chosen family
    sets differently (`Family.recipe_defaults`, e.g. block 8) apply where not given
    (`family_recipe`)."""

    draft_family: FamilyName = Field(
        "dflash",
        description=f"draft family to train: {', '.join(FAMILIES)} (docs/training.md says "
        "which to choose); its own options are the flags it names",
        json_schema_extra=flag_options(choices_checked_by_config=True),
    )

    @model_validator(mode="after")
    def _own_options_only(self) -> FamilyOptions:
        chosen = family(self.draft_family)
        fields = type(self).model_fields
        for f in FAMILIES.values():
            # Set away from its default: a whole config written back (`to_flags` of a
            # dump, a saved --config) carries every family's options at their defaults.
            given = [
                k
                for k in f.options()
                if k in self.model_fields_set and getattr(self, k) != fields[k].default
            ]
            if f is not chosen and given:
                flags = ", ".join(field_flag(k, fields[k]) for k in given)
                # ConfigError, not ValueError: one line as it is, not a validation report
                raise ConfigError(
                    f"{flags}: {f.name} option(s), but --draft-family is {chosen.name} "
                    f"(its options: {_flags_of(chosen, type(self)) or 'none'})"
                )
        if problem := chosen.shared_conflict(self.model_dump(), set(self.model_fields_set)):
            raise ConfigError(problem)
        return self

    def family_recipe(self, shared: dict[str, Any]) -> dict[str, Any]:
        """The chosen family's draft fields: the shared recipe `shared` (field -> value)
        with the family's reference values where the user gave none, plus its options."""
        fam = family(self.draft_family)
        defaults = {k: v for k, v in fam.recipe_defaults.items() if k not in self.model_fields_set}
        return shared | defaults | {k: getattr(self, k) for k in fam.options()}


def _flags_of(f: Family, model: type[BaseModel]) -> str:
    return ", ".join(field_flag(k, model.model_fields[k]) for k in f.options())


def family(name: str, *, where: str = "--draft-family") -> Family:
    """The family called `name`; ConfigError naming the known ones otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        known = ", ".join(sorted(FAMILIES))
        raise ConfigError(f"{where} {name!r}: unknown draft family (known: {known})") from None


def family_of_draft(draft: Draft) -> Family:
    """The family whose model `draft` is (its exact class)."""
    for f in FAMILIES.values():
        if type(draft) is f.draft_class:
            return f
    raise ConfigError(f"{type(draft).__name__} is no registered family's draft")


def family_of_config(cfg: DraftConfig) -> Family:
    """The family whose validated config `cfg` is (its exact class)."""
    for f in FAMILIES.values():
        if type(cfg) is f.config_class:
            return f
    raise ConfigError(f"{type(cfg).__name__} is no registered family's config")


def family_of_model_type(model_type: object, *, where: str) -> Family:
    """The family a checkpoint's `speculators_model_type` names."""
    for f in FAMILIES.values():
        if f.speculators_model_type == model_type:
            return f
    known = ", ".join(sorted(f.speculators_model_type for f in FAMILIES.values()))
    raise ConfigError(
        f"{where}: speculators_model_type {model_type!r} is no family fanout trains "
        f"(known: {known})"
    )


__all__ = [
    "FAMILIES",
    "FAMILY_FOLDERS",
    "FamilyOptions",
    "family",
    "family_of_config",
    "family_of_draft",
    "family_of_model_type",
]
