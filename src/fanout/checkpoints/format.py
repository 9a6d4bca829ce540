"""A checkpoint's `config.json`: the speculators config an engine reads (DFlash fields
every family shares, the family's own, layer ids in serving numbering) plus a `fanout`
section (format version, family, the draft config in fanout's numbering, train-time
numbers), written, read and format-checked here.

    from fanout.checkpoints.format import read_config, checkpoint_family
    cfg = read_config("out/draft/checkpoint-00000100")   # CheckpointError if refused
    fam = checkpoint_family(Path(...), cfg)               # the Family it names

The writer (fanout.checkpoints.save) builds it with `speculators_config`; resume,
`load_draft`, `fanout eval` and `fanout promote` read it back through `read_config`, so
both sides share one layer-numbering rule (fanout.families.numbering) and one format check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fanout.checkpoints.layout import MARKER
from fanout.errors import CheckpointError, ConfigError
from fanout.families.base import Family
from fanout.families.numbering import from_serving_layer_ids
from fanout.families.registry import family_of_config, family_of_model_type
from fanout.model.draft import Draft

# 2: aux_hidden_state_layer_ids in HF hidden_states numbering (layer id + 1), the
#    speculators 0.9.0 config layout. 1 (before 2026-12) named the layer below the
#    one the draft trained on; such checkpoints are refused (see check_format).
FORMAT_VERSION = 2


def _verifier_identity(verifier_name_or_path: str, serving_name: str | None) -> dict[str, Any]:
    """`speculators_config.verifier`: an absolute path for a local dir (a relative one
    breaks loading from any other directory) unless a serving name (`Qwen/Qwen3-8B`) is
    given, and the verifier's `architectures` from its config.json when it is local."""
    local = Path(verifier_name_or_path) if verifier_name_or_path else None
    archs: list[str] = []
    name = verifier_name_or_path
    if local is not None and local.is_dir():
        name = str(local.resolve())
        try:
            archs = list(json.loads((local / "config.json").read_text()).get("architectures") or [])
        except (OSError, json.JSONDecodeError):
            archs = []
    return {"name_or_path": serving_name or name, "architectures": archs}


def speculators_config(
    draft: Draft,
    verifier_name_or_path: str = "",
    *,
    verifier_serving_name: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `config.json` speculators 0.9.0 writes for a draft of this family and shape
    (and vLLM reads): the DFlash fields every family shares, the family's names and own
    fields (`Family.config_fields`), plus a `fanout` section (format version, the family,
    its full config in fanout's own layer numbering, and `extra`, e.g. the train-time
    EAL)."""
    c = draft.cfg
    fam = family_of_config(c)
    return {
        **fam.speculators_fields(
            c, _verifier_identity(verifier_name_or_path, verifier_serving_name)
        ),
        "fanout": {
            "format_version": FORMAT_VERSION,
            "family": fam.name,
            # fanout numbering (decoder-layer outputs); the family's layer field above
            # (aux_hidden_state_layer_ids, EAGLE-3's eagle_aux_...) is the same list + 1
            CONFIG_KEY: c.model_dump(),
            **(extra or {}),
        },
    }


# The key of fanout's section holding the draft's whole config (fanout numbering);
# checkpoints written before the family seam hold it under OLD_CONFIG_KEY.
CONFIG_KEY = "draft_config"
OLD_CONFIG_KEY = "dflash_config"


def saved_config(fan: dict[str, Any]) -> dict[str, Any]:
    """The draft config a checkpoint's `fanout` section `fan` records (field -> value;
    {} where none): the one reader of both keys."""
    saved = fan.get(CONFIG_KEY, fan.get(OLD_CONFIG_KEY))
    return dict(saved) if isinstance(saved, dict) else {}


def check_format(path: Path, cfg: dict[str, Any]) -> None:
    """Refuse checkpoints this fanout cannot read correctly, by name and reason."""
    fan = cfg.get("fanout")
    if not isinstance(fan, dict):
        raise CheckpointError(
            f"{path / 'config.json'}: no `fanout` section; not a checkpoint written by fanout "
            "(a speculators draft from elsewhere cannot be resumed by fanout)"
        )
    version = fan.get("format_version")
    if version == 1:
        raise CheckpointError(
            f"{path / 'config.json'}: fanout checkpoint format 1: its "
            "aux_hidden_state_layer_ids name the verifier layer *before* each one the draft "
            "trained on, so an engine would feed it the wrong hidden states. Rewrite its "
            f"config with `fanout upgrade-checkpoint {path}` (weights unchanged)"
        )
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path / 'config.json'}: fanout checkpoint format {version!r}; this fanout reads "
            f"format {FORMAT_VERSION}"
        )
    fan_ids = saved_config(fan).get("target_layer_ids")
    field = _layer_ids_field(cfg)
    aux = cfg.get(field)
    if not isinstance(aux, list) or from_serving_layer_ids(aux) != fan_ids:
        raise CheckpointError(
            f"{path / 'config.json'}: {field} {aux} is not "
            f"fanout.{CONFIG_KEY}.target_layer_ids {fan_ids} + 1; the file was edited "
            "inconsistently"
        )
    if aux != sorted(set(aux)):
        raise CheckpointError(
            f"{path / 'config.json'}: {field} {aux} are not in ascending "
            "order: its fc columns follow that order, but serving engines (and fanout eval) "
            "feed a draft its layers in ascending order, so it would read the wrong layers. "
            f"Rewrite it with `fanout upgrade-checkpoint {path}` (permutes the fc columns)"
        )


def _layer_ids_field(cfg: dict[str, Any]) -> str:
    """The field a checkpoint's config keeps its layers in: its family's (EAGLE-3:
    `eagle_aux_hidden_state_layer_ids`), DFlash's for a family fanout does not know
    (refused by name where the family is read)."""
    try:
        return family_of_model_type(cfg.get("speculators_model_type"), where="").layer_ids_field
    except ConfigError:
        return "aux_hidden_state_layer_ids"


def read_config(path: str | Path) -> dict[str, Any]:
    """A committed checkpoint's `config.json`, format-checked (CheckpointError if not)."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"{p}: no such checkpoint directory")
    if not (p / MARKER).is_file():
        raise CheckpointError(f"{p}: not a committed checkpoint (no {MARKER} marker)")
    try:
        cfg = json.loads((p / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{p / 'config.json'}: unreadable: {e}") from e
    check_format(p, cfg)
    return dict(cfg)


def checkpoint_family(path: Path, cfg: dict[str, Any]) -> Family:
    """The family a checkpoint's `config.json` names (`speculators_model_type`), checked
    against the family fanout recorded beside it."""
    where = str(path / "config.json")
    fam = family_of_model_type(cfg.get("speculators_model_type"), where=where)
    recorded = cfg.get("fanout", {}).get("family", "dflash")  # before families: DFlash
    if recorded != fam.name:
        raise CheckpointError(
            f"{where}: speculators_model_type {fam.speculators_model_type!r} but "
            f"fanout.family {recorded!r}: the file was edited inconsistently"
        )
    return fam


def train_eal(path: str | Path) -> float | None:
    """The train-time EAL a checkpoint recorded (mean of its last logged steps), if any."""
    v = read_config(path)["fanout"].get("train_eal")
    return float(v) if isinstance(v, int | float) else None
