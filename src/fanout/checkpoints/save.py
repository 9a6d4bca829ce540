"""Writing a checkpoint: the draft for serving, its exact-resume state beside it, the
training config, committed atomically; older ones pruned.

    from fanout.checkpoints.save import save_checkpoint
    save_checkpoint("out/draft", draft, opt, {"step": 100},
                    states={"stream": stream, "scheduler": sched}, generators={"anchors": gen},
                    training_config=cfg.recorded())

Like torchtitan's checkpoint manager, anything with `state_dict()` / `load_state_dict()`
(`states`: the consumer stream's position in the run, the LR schedule) is saved with the
draft, the optimizer and the RNGs; fanout.checkpoints.resume restores them in place. The
files and the order they are committed in: fanout.checkpoints (the package docstring).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from fanout.checkpoints.format import speculators_config
from fanout.checkpoints.layout import (
    MARKER,
    PREFIX,
    TRAINING_CONFIG,
    checkpoint_name,
    committed_checkpoints,
    json_bytes,
)
from fanout.errors import ConfigError
from fanout.filesystem import FileSystem
from fanout.model.draft import Draft
from fanout.netfs import temp_tag, temp_writer_gone


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


class Average(Protocol):
    """What a checkpoint needs of a weight average (`fanout.train.ema.WeightEMA`,
    --ema-decay): the weights it serves, its tensors for the resume file, and a restore."""

    def serving(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def tensors(self) -> dict[str, torch.Tensor]: ...

    def load(self, saved: dict[str, torch.Tensor]) -> bool: ...

    def reset(self, draft: torch.nn.Module) -> None: ...


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
    ema: Average | None = None,
    training_config: Mapping[str, Any] | None = None,
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
        training_config: the trainer's whole validated config (JSON), written as
            training_config.json; a resume compares its own against it
            (fanout.train.setup.check_resume).

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
    name = checkpoint_name(step)
    final = root / name
    tmp = root / f".tmp-{name}-{temp_tag()}"
    config = speculators_config(
        draft,
        verifier_name_or_path,
        verifier_serving_name=verifier_serving_name,
        extra=config_extra,
    )
    shutil.rmtree(tmp, ignore_errors=True)
    fs.makedirs(tmp)
    try:
        _write_files(
            fs,
            tmp,
            draft,
            optimizer,
            training_state,
            generators,
            config,
            ema,
            training_config,
        )
        fs.commit_dir(tmp, final)  # replaces an uncommitted (or superseded) one of this step
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fs.write_atomic(final / MARKER, f"{step}\n".encode())  # the commit: written last
    _prune(root, keep, final)
    return final


def _write_files(
    fs: FileSystem,
    tmp: Path,
    draft: Draft,
    optimizer: Optimizer,
    training_state: dict[str, Any],
    generators: dict[str, torch.Generator] | None,
    config: dict[str, Any],
    ema: Average | None = None,
    training_config: Mapping[str, Any] | None = None,
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
    own = resumed_keys(draft)
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
    # the resume file's tag since DFlash was the only family, kept for every family's
    meta = {"format": "fanout-dflash", "step": str(training_state["step"])}
    fs.write_new(
        tmp / "resume.safetensors", lambda t: save_file(resume, str(t.path), metadata=meta)
    )
    fs.write_new(tmp / "config.json", json_bytes(config))
    fs.write_new(tmp / "optimizer.json", json_bytes(opt_meta))
    fs.write_new(tmp / "training_state.json", json_bytes(training_state))
    if training_config is not None:
        fs.write_new(tmp / TRAINING_CONFIG, json_bytes(dict(training_config)))


def _prune(root: Path, keep: int, written: Path) -> None:
    """Keep the newest `keep` committed checkpoints by step, and always `written`, the one
    just committed: a lower step than those already there (a trainer started from 0 on a
    used save path, which fanout.train.savepath refuses) must never be deleted the moment
    it is written, while the run looks healthy."""
    done = [p for p in committed_checkpoints(root) if p != written]
    for old in done[: max(len(done) - (keep - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)
    done = committed_checkpoints(root)
    newest = done[-1].name if done else ""
    for p in root.glob(f"{PREFIX}*"):  # uncommitted debris older than the newest commit
        if not (p / MARKER).exists() and p.name < newest:
            shutil.rmtree(p, ignore_errors=True)
    # Temp dirs of processes that exited, and old ones a crash left set aside
    # (commit_dir). One live trainer holds a save path (fanout.train.savepath), but a
    # live process's directory is never removed even so: it may be writing into it.
    for p in [*root.glob(f".tmp-{PREFIX}*"), *root.glob(f".{PREFIX}*.old-*")]:
        if _writer_gone(p):
            shutil.rmtree(p, ignore_errors=True)


def resumed_keys(draft: Draft) -> set[str]:
    """The serving tensors a resume file carries: those the draft's state_dict holds."""
    return set(draft.trainable_state()) & set(draft.state_dict())


def _writer_gone(path: Path) -> bool:
    """May temp `path` go? Its writer exited, or, on another host, it is old (never this
    process's: fanout.netfs.temp_writer_gone)."""
    return temp_writer_gone(path)
