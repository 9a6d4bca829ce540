"""Where checkpoints are and what their files are called: finding the newest committed
one, and the training config a checkpoint records.

    from fanout.checkpoints.layout import latest_checkpoint, read_training_config
    ckpt = latest_checkpoint("runs/r1/drafts/b8")     # checkpoint-00000460, or None
    read_training_config(ckpt)                         # {"seed": 0, "lr": 0.0003, ...} or None

No torch: `fanout promote` and the benchmarks list checkpoints without loading one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fanout.errors import CheckpointError

# `<save_dir>/checkpoint-<step:08d>/`: zero-padded, so the names sort by step
PREFIX = "checkpoint-"
# Written last into a checkpoint directory (fanout.checkpoints.save); one without it is
# debris, never read.
MARKER = "COMMITTED"
# The trainer's whole validated config (fanout.train.config.TrainConfig.recorded), beside
# the draft config in config.json; checkpoints written before 2026-12-07 have none.
TRAINING_CONFIG = "training_config.json"


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint of `step`."""
    return f"{PREFIX}{step:08d}"


def committed_checkpoints(root: Path) -> list[Path]:
    """The committed checkpoint directories under `root`, oldest (lowest step) first."""
    found = [p for p in root.glob(f"{PREFIX}*") if (p / MARKER).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(save_dir: str | Path) -> Path | None:
    """The newest committed checkpoint directory under `save_dir`, or None."""
    root = Path(save_dir)
    if not root.is_dir():
        return None
    done = committed_checkpoints(root)
    return done[-1] if done else None


def json_bytes(obj: Any) -> bytes:
    """How every JSON file of a checkpoint is written: indented, keys sorted."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def read_training_config(path: str | Path) -> dict[str, Any] | None:
    """The training config checkpoint `path` records (field -> value), or None for one
    written before checkpoints recorded it. CheckpointError when the file is unreadable."""
    f = Path(path) / TRAINING_CONFIG
    if not f.is_file():
        return None
    try:
        got = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: unreadable: {e}") from e
    if not isinstance(got, dict):
        raise CheckpointError(f"{f}: not a JSON object")
    return got
