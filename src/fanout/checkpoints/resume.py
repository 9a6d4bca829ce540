"""Resuming from a checkpoint: weights at training precision, optimizer, RNGs, the
weight average and every stateful part restored in place, after checking the checkpoint
is of this draft's family and shape.

    from fanout.checkpoints.resume import load_checkpoint
    state = load_checkpoint(path, draft, opt, states={"stream": stream, "scheduler": sched},
                            generators={"anchors": gen})   # -> {"step": 100, ...}

The trainer (fanout.train.trainer `_resume`) first checks its flags against the
checkpoint's training config (fanout.train.setup.check_resume), then calls this before
the consumer stream registers at the restored cursor.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from fanout.checkpoints.format import checkpoint_family, read_config, saved_config
from fanout.checkpoints.save import Average, Optimizer, Stateful, resumed_keys
from fanout.errors import CheckpointError, ConfigError
from fanout.families.base import Family
from fanout.families.registry import family_of_draft
from fanout.model.draft import Draft

log = logging.getLogger(__name__)


def check_family(path: Path, ours: Family, cfg: dict[str, Any] | None = None) -> None:
    """CheckpointError unless checkpoint `path` (its config.json `cfg`, read if not
    given) holds a draft of family `ours`: one line naming both ways out."""
    theirs = checkpoint_family(path, read_config(path) if cfg is None else cfg)
    if theirs is not ours:
        raise CheckpointError(
            f"{path}: a {theirs.name} draft's checkpoint; this trainer trains a {ours.name} "
            f"draft (--draft-family {ours.name}): resume with --draft-family {theirs.name}, "
            "or give this draft another --save-path"
        )


def load_checkpoint(
    path: str | Path,
    draft: Draft,
    optimizer: Optimizer | None,
    *,
    states: Mapping[str, Stateful] | None = None,
    generators: dict[str, torch.Generator] | None = None,
    ema: Average | None = None,
) -> dict[str, Any]:
    """Restore weights (training precision), optimizer state, each of `states`, the
    weights' average (`ema`, when the checkpoint holds one; else it restarts from the
    weights) and RNG states in place; return the saved training_state. Raises ConfigError when the
    checkpoint is not committed, has an older format, or was written for a differently
    shaped draft (names the fields)."""
    p = Path(path)
    cfg = read_config(p)
    check_family(p, family_of_draft(draft), cfg)
    saved = saved_config(cfg["fanout"])
    mine = draft.cfg.model_dump()
    diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
    if diff:
        parts = "; ".join(
            f"{k}: checkpoint {a!r}, draft {b!r}" for k, (a, b) in sorted(diff.items())
        )
        raise ConfigError(f"{p / 'config.json'}: draft config differs: {parts}")
    if draft.d2t is not None:
        # Same size, other tokens (the run's counts changed) would silently mislabel.
        saved_d2t = load_file(str(p / "model.safetensors")).get("d2t")
        if saved_d2t is None or not torch.equal(saved_d2t, draft.d2t.cpu()):
            raise ConfigError(
                f"{p / 'model.safetensors'}: its draft vocabulary (d2t) is not the one this "
                "draft was built with; were the run's token counts rewritten?"
            )
    dev = next(draft.parameters()).device
    t = load_file(str(p / "resume.safetensors"))
    weights = {k[2:]: v for k, v in t.items() if k.startswith("w.")}
    draft.load_state_dict(weights, strict=False)  # rope buffers are recomputed, not saved
    missing = resumed_keys(draft) - set(weights)
    if missing:
        raise ConfigError(f"{p / 'resume.safetensors'}: missing weights {sorted(missing)}")
    if optimizer is not None:
        meta = json.loads((p / "optimizer.json").read_text())
        state: dict[int, dict[str, Any]] = {}
        for k, v in t.items():
            if k.startswith("opt."):
                _, pid, name = k.split(".", 2)
                state.setdefault(int(pid), {})[name] = v
        for pid, sc in meta["scalar_state"].items():
            state.setdefault(int(pid), {}).update(sc)
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        for st in optimizer.state.values():  # load_state_dict casts to param device
            for name, v in st.items():
                if isinstance(v, torch.Tensor) and name != "step":
                    st[name] = v.to(dev)
    if ema is not None and not ema.load(t):
        ema.reset(draft)  # from the resumed weights
        log.warning("%s holds no weight average: --ema-decay starts one from its weights", p)
    torch.set_rng_state(t["rng.torch_cpu"])
    for name, g in (generators or {}).items():
        key = f"rng.gen.{name}"
        if key not in t:
            raise ConfigError(f"{p}: no saved state for generator {name!r}")
        g.set_state(t[key])
    if torch.cuda.is_available():
        cuda = [t[k] for k in sorted(t) if k.startswith("rng.cuda.")]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    saved_state = dict(json.loads((p / "training_state.json").read_text()))
    if "stream" not in saved_state and "cursor" in saved_state:  # written before the stream
        pos = {"cursor": saved_state["cursor"], "rows_done": saved_state.get("rows_done", 0)}
        saved_state["stream"] = pos  # had its own state: the trainer's cursor, rows_done
    for name, obj in (states or {}).items():
        if name not in saved_state:
            raise ConfigError(f"{p / 'training_state.json'}: no saved state for {name!r}")
        obj.load_state_dict(saved_state[name])
    return saved_state
