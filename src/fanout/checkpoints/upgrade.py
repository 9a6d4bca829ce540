"""`fanout upgrade-checkpoint`: rewrite a checkpoint this fanout refuses into one it reads.

    fanout upgrade-checkpoint out/draft/checkpoint-00000100     # format 1 -> 2, in place
                                                # (and unsorted layers -> ascending)
    from fanout.checkpoints.upgrade import upgrade_checkpoint

Both upgrades predate every family but DFlash; what is refused and why is
fanout.checkpoints.format's `check_format`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save

from fanout.checkpoints.format import (
    CONFIG_KEY,
    FORMAT_VERSION,
    OLD_CONFIG_KEY,
    saved_config,
    speculators_config,
)
from fanout.checkpoints.layout import json_bytes
from fanout.errors import CheckpointError
from fanout.families.numbering import to_serving_layer_ids
from fanout.filesystem import FileSystem
from fanout.model.draft_config import DraftConfig


def upgrade_checkpoint(path: str | Path, fs: FileSystem | None = None) -> Path:
    """Rewrite a checkpoint this fanout refuses into one it reads, each file atomically
    (`FileSystem.write_atomic`; `fs` injects faults in tests):
    - format 1 -> 2: the config's layer numbering and speculators layout (weights as they are);
    - layer ids not ascending (written before the order was canonical): the `fc` columns
      (and their optimizer moments) permuted to ascending layer order, then the config.
    Weight files first, each marked as permuted in its metadata, the config last: an
    upgrade cut short leaves a checkpoint that is still refused, and running it again
    finishes it without permuting a file twice."""
    p = Path(path)
    fs = fs or FileSystem()
    cfg = json.loads((p / "config.json").read_text())
    fan = dict(cfg.get("fanout") or {})
    saved = saved_config(fan)
    ids = [int(i) for i in saved.get("target_layer_ids") or []]
    version = fan.get("format_version")
    kind = cfg.get("speculators_model_type", "dflash")
    if kind != "dflash":  # both upgrades predate every other family
        raise CheckpointError(
            f"{p / 'config.json'}: a {kind} checkpoint: every fanout that trains {kind} writes "
            "format 2 in ascending layer order, so there is nothing to upgrade"
        )
    if version not in (1, FORMAT_VERSION) or (version == FORMAT_VERSION and ids == sorted(ids)):
        raise CheckpointError(
            f"{p / 'config.json'}: not a format-1 fanout checkpoint, nor one with unsorted "
            "layer ids: nothing to upgrade"
        )
    order = sorted(range(len(ids)), key=ids.__getitem__)  # new column block j = old order[j]
    if order != list(range(len(ids))):
        for name in ("model.safetensors", "resume.safetensors"):
            _permute_fc(p / name, order, fs)
    dcfg = DraftConfig(**(saved | {"target_layer_ids": sorted(ids)}))
    if version == 1:
        verifier = cfg.get("speculators_config", {}).get("verifier", {}).get("name_or_path", "")
        new = speculators_config(_ConfigOnly(dcfg), verifier)  # type: ignore[arg-type]
        new["fanout"] = fan | new["fanout"]  # keeps what the trainer added (train_eal, ...)
    else:
        new = cfg | {"aux_hidden_state_layer_ids": to_serving_layer_ids(dcfg.target_layer_ids)}
        new["fanout"] = {k: v for k, v in fan.items() if k != OLD_CONFIG_KEY}
        new["fanout"][CONFIG_KEY] = dcfg.model_dump()
    fs.write_atomic(p / "config.json", json_bytes(new))
    return p


# Metadata key of a weights file whose fc columns upgrade_checkpoint put in ascending order.
_PERMUTED = "fanout_fc_layer_order"


def _permute_fc(path: Path, order: list[int], fs: FileSystem) -> None:
    """Permute the column blocks of `fc.weight` [H, n·H] (serving file) or `w.fc.weight`
    and its optimizer moments (resume file: fc is the draft's first parameter, so its
    state is `opt.0.*`) from the trained order into ascending layer order."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata() or {})
    if meta.get(_PERMUTED) == "ascending":
        return  # an earlier upgrade that was cut short got this far
    t = load_file(str(path))
    key = "fc.weight" if "fc.weight" in t else "w.fc.weight"
    if key not in t:
        raise CheckpointError(f"{path}: no fc.weight tensor")
    shape = t[key].shape
    keys = [key] + [k for k in t if k.startswith("opt.0.") and t[k].shape == shape]
    n = len(order)
    for k in keys:
        w = t[k]  # [H, n·H]
        t[k] = w.reshape(w.shape[0], n, -1)[:, order, :].reshape(shape).contiguous()
    fs.write_atomic(path, save(t, metadata=meta | {_PERMUTED: "ascending"}))


class _ConfigOnly:
    """What speculators_config reads of a draft: its `cfg` (no weights needed)."""

    def __init__(self, cfg: DraftConfig) -> None:
        self.cfg = cfg


def add_arguments(p: argparse.ArgumentParser, name: str = "upgrade-checkpoint") -> None:
    p.add_argument(
        "dirs", nargs="+", metavar="DIR", help="checkpoint directories (checkpoint-XXXXXXXX)"
    )


def run(args: argparse.Namespace, name: str = "upgrade-checkpoint") -> int:
    """`fanout upgrade-checkpoint DIR [DIR ...]`: rewrite format-1 configs as format 2,
    and put unsorted layer ids (and their fc columns) in ascending order
    (`python -m fanout.checkpoint upgrade DIR` before the package layout of 2026-12)."""
    for d in args.dirs:
        try:
            upgrade_checkpoint(d)
        except (
            OSError,
            ValueError,
            KeyError,
        ) as e:  # CheckpointError is a ConfigError: cli names it
            raise CheckpointError(f"{d}: cannot upgrade: {e}") from e
        print(f"upgraded {d} to format {FORMAT_VERSION}, layers in ascending order")
    return 0
