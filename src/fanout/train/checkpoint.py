"""Draft checkpoints: speculators DFlash format for serving + exact-resume state beside it.

The serving half (config layout, layer numbering, format check, `load_draft`) is
fanout.families.serving; this module writes, prunes and resumes checkpoints.

    from fanout.train.checkpoint import save_checkpoint, load_checkpoint
    from fanout.families.serving import latest_checkpoint
    save_checkpoint("out/draft", draft, opt, {"step": 100},
                    states={"stream": stream, "scheduler": sched}, generators={"anchors": gen})
    path = latest_checkpoint("out/draft")            # newest committed one, or None
    state = load_checkpoint(path, draft, opt, states={"stream": stream, "scheduler": sched},
                            generators={"anchors": gen})   # -> {"step": 100, ...}

How a trainer resumes is this module and fanout.train.consumer: like torchtitan's
checkpoint manager, anything with `state_dict()` / `load_state_dict()` (`states`: the
consumer stream's position in the run, the LR schedule) is saved with the draft, the
optimizer and the RNGs, and restored in place by `load_checkpoint`, before the stream
registers at its cursor.

Layout of `<save_dir>/checkpoint-<step:08d>/`:
- `config.json`         speculators DFlash config (`speculators_model_type: "dflash"`,
                        `transformer_layer_config`, `aux_hidden_state_layer_ids`,
                        `block_size`, `mask_token_id`, `draft_vocab_size`, ...) plus a
                        `fanout` section with the training-only fields of DraftConfig;
- `model.safetensors`   trainable weights in bf16 under speculators keys (`fc.weight`,
                        `layers.{i}.self_attn.q_proj.weight`, ..., `norm.weight`), and
                        `lm_head.weight`/`d2t`/`t2d` for a reduced draft vocabulary — what
                        an engine that reads the speculators format loads;
- `resume.safetensors`  the same weights at training precision (bf16 rounding would
                        change the next step), optimizer tensors (`opt.<param>.<name>`)
                        and RNG states (`rng.<name>`);
- `optimizer.json`      optimizer param groups and scalar state; `training_state.json`
                        the caller's dict (step, ...) and each of `states`' state_dict
                        under its name (`stream`: cursor, rows_done; `scheduler`);
- `COMMITTED`           written last. A directory without it is debris, never loaded.

Atomicity: everything is written into `<save_dir>/.tmp-<name>-<pid>/`, each file fsynced
(`FileSystem.write_new`), the directory renamed to its final name and the parent fsynced
(`FileSystem.commit_dir`), then `COMMITTED` written atomically (`FileSystem.write_atomic`:
temp, fsync, rename, fsync the directory). Every step goes through the FileSystem seam, so
tests inject faults into it. Only the newest `keep` (>= 2) committed checkpoints are kept.
No pickle.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file, save_file

from fanout.coord.liveness import pid_gone
from fanout.errors import CheckpointError, ConfigError
from fanout.families.registry import family_of
from fanout.families.serving import (
    MARKER,
    PREFIX,
    checkpoint_family,
    committed_checkpoints,
    json_bytes,
    read_config,
    saved_config,
    speculators_config,
)
from fanout.filesystem import FileSystem
from fanout.model.draft import Draft
from fanout.train.ema import WeightEMA

log = logging.getLogger(__name__)


class Stateful(Protocol):
    """Anything a checkpoint saves and restores through a JSON state dict (the consumer
    stream, the LR scheduler)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class Optimizer(Protocol):
    """What a checkpoint needs of an optimizer: `fanout.ops.adamw.ClippedAdamW`, or any
    `torch.optim.Optimizer` (the same state_dict layout)."""

    @property
    def state(self) -> Mapping[Any, dict[str, Any]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _optimizer_payload(
    optimizer: Optimizer,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, st in sd["state"].items():
        for name, val in st.items():
            if isinstance(val, torch.Tensor):
                tensors[f"opt.{pid}.{name}"] = val.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(pid), {})[name] = val
    return tensors, {"param_groups": sd["param_groups"], "scalar_state": scalars}


def _rng_tensors(generators: dict[str, torch.Generator] | None) -> dict[str, torch.Tensor]:
    out = {"rng.torch_cpu": torch.get_rng_state()}
    for name, g in (generators or {}).items():
        out[f"rng.gen.{name}"] = g.get_state()
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng.cuda.{i}"] = s
    return out


def save_checkpoint(
    save_dir: str | Path,
    draft: Draft,
    optimizer: Optimizer,
    training_state: dict[str, Any],
    *,
    states: Mapping[str, Stateful] | None = None,
    generators: dict[str, torch.Generator] | None = None,
    keep: int = 2,
    verifier_name_or_path: str = "",
    verifier_serving_name: str | None = None,
    config_extra: dict[str, Any] | None = None,
    fs: FileSystem | None = None,
    ema: WeightEMA | None = None,
) -> Path:
    """Write one committed checkpoint and prune older ones. Returns its directory.

    Args:
        save_dir: parent directory (created).
        draft, optimizer: what to save.
        training_state: JSON-serialisable dict; must hold an int `step` (names the
            checkpoint).
        states: objects whose `state_dict()` is saved under their name (the consumer
            stream, the scheduler); `load_checkpoint(states=...)` restores them.
        generators: named torch.Generators (e.g. the anchor sampler) to restore on load.
        keep: committed checkpoints to keep (at least 2).
        verifier_name_or_path: the verifier the draft trained against (a local dir is
            stored as an absolute path).
        verifier_serving_name: the name a serving config should carry instead (e.g.
            `Qwen/Qwen3-8B`); default: the (absolute) path.
        config_extra: JSON fields added to config.json's `fanout` section (e.g. train_eal).
        fs: the filesystem seam every write goes through (a FaultyFileSystem in tests).
        ema: an average of the weights (--ema-decay): model.safetensors serves it, the
            resume file keeps it beside the raw weights (fanout.train.ema).

    A failure (a full disk: an OSError with errno ENOSPC) removes the temp directory
    and leaves the committed checkpoints as they were.
    """
    if keep < 2:
        raise ConfigError(f"checkpoint keep must be >= 2, got {keep}")
    step = training_state.get("step")
    if not isinstance(step, int) or step < 0:
        raise ConfigError(f"training_state['step'] must be a non-negative int, got {step!r}")
    training_state = dict(training_state) | {
        name: obj.state_dict() for name, obj in (states or {}).items()
    }
    fs = fs or FileSystem()
    root = Path(save_dir)
    fs.makedirs(root)
    name = f"{PREFIX}{step:08d}"
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    config = speculators_config(
        draft,
        verifier_name_or_path,
        verifier_serving_name=verifier_serving_name,
        extra=config_extra,
    )
    shutil.rmtree(tmp, ignore_errors=True)
    fs.makedirs(tmp)
    try:
        _write_files(fs, tmp, draft, optimizer, training_state, generators, config, ema)
        fs.commit_dir(tmp, final)  # replaces an uncommitted (or superseded) one of this step
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fs.write_atomic(final / MARKER, f"{step}\n".encode())  # the commit: written last
    _prune(root, keep)
    return final


def _write_files(
    fs: FileSystem,
    tmp: Path,
    draft: Draft,
    optimizer: Optimizer,
    training_state: dict[str, Any],
    generators: dict[str, torch.Generator] | None,
    config: dict[str, Any],
    ema: WeightEMA | None = None,
) -> None:
    """Every file of a checkpoint but COMMITTED, each fsynced, into `tmp`."""
    weights = {k: v.detach().cpu().contiguous() for k, v in draft.trainable_state().items()}
    served = weights if ema is None else ema.serving(weights)  # --ema-decay: the average
    serve = {k: v.to(torch.bfloat16) for k, v in served.items()}
    if draft.cfg.draft_vocab_size is not None:
        serve["lm_head.weight"] = draft.lm_head_weight.detach().cpu().to(torch.bfloat16)
        serve["d2t"] = draft.d2t.cpu()  # type: ignore[union-attr]
        serve["t2d"] = draft.t2d.cpu()  # type: ignore[union-attr]
    opt_tensors, opt_meta = _optimizer_payload(optimizer)
    # The resume file holds what the draft's state_dict restores: not the verifier's
    # frozen tensors a family writes into its serving file too (EAGLE-3's embedding,
    # 2.5 GB in fp32 for Qwen3-8B), which a resumed draft reloads from the verifier.
    own = _resumed_keys(draft)
    resume = (
        {f"w.{k}": v for k, v in weights.items() if k in own}
        | opt_tensors
        | _rng_tensors(generators)
        | ({} if ema is None else ema.tensors())
    )
    # "pt": what transformers' from_pretrained (so speculators) requires of the format key
    fs.write_new(
        tmp / "model.safetensors",
        lambda t: save_file(serve, str(t.path), metadata={"format": "pt"}),
    )
    meta = {"format": "fanout-dflash", "step": str(training_state["step"])}
    fs.write_new(
        tmp / "resume.safetensors", lambda t: save_file(resume, str(t.path), metadata=meta)
    )
    fs.write_new(tmp / "config.json", json_bytes(config))
    fs.write_new(tmp / "optimizer.json", json_bytes(opt_meta))
    fs.write_new(tmp / "training_state.json", json_bytes(training_state))


def _prune(root: Path, keep: int) -> None:
    done = committed_checkpoints(root)
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    newest = done[-1].name if done else ""
    for p in root.glob(f"{PREFIX}*"):  # uncommitted debris older than the newest commit
        if not (p / MARKER).exists() and p.name < newest:
            shutil.rmtree(p, ignore_errors=True)
    # Temp dirs of processes that exited, and old ones a crash left set aside
    # (commit_dir). One live trainer holds a save path (fanout.train.savepath), but a
    # live process's directory is never removed even so: it may be writing into it.
    for p in [*root.glob(f".tmp-{PREFIX}*"), *root.glob(f".{PREFIX}*.old-*")]:
        if _writer_gone(p.name):
            shutil.rmtree(p, ignore_errors=True)


def _resumed_keys(draft: Draft) -> set[str]:
    """The serving tensors a resume file carries: those the draft's state_dict holds."""
    return set(draft.trainable_state()) & set(draft.state_dict())


def _writer_gone(name: str) -> bool:
    """Has the process whose pid ends `name` (`...-<pid>`) exited? Never this one."""
    pid = name.rpartition("-")[2]
    if not pid.isdigit():
        return True  # not a name fanout writes: debris
    return int(pid) != os.getpid() and pid_gone(int(pid))


def load_checkpoint(
    path: str | Path,
    draft: Draft,
    optimizer: Optimizer | None,
    *,
    states: Mapping[str, Stateful] | None = None,
    generators: dict[str, torch.Generator] | None = None,
    ema: WeightEMA | None = None,
) -> dict[str, Any]:
    """Restore weights (training precision), optimizer state, each of `states`, the
    weights' average (`ema`, when the checkpoint holds one; else it restarts from the
    weights) and RNG states in place; return the saved training_state. Raises ConfigError when the
    checkpoint is not committed, has an older format, or was written for a differently
    shaped draft (names the fields)."""
    p = Path(path)
    cfg = read_config(p)
    theirs, ours = checkpoint_family(p, cfg), family_of(draft)
    if theirs is not ours:
        raise CheckpointError(
            f"{p}: a {theirs.name} draft's checkpoint; this trainer trains a {ours.name} "
            f"draft (--draft-family {ours.name}): resume with --draft-family {theirs.name}, "
            "or give this draft another --save-path"
        )
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
    missing = _resumed_keys(draft) - set(weights)
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
