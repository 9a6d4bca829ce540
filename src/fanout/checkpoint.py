"""Draft checkpoints: speculators DFlash format for serving + exact-resume state beside it.

    from fanout.checkpoint import save_checkpoint, latest_checkpoint, load_checkpoint
    save_checkpoint("out/draft", draft, opt, {"step": 100, "epoch": 0, "cursor": 7},
                    generators={"anchors": gen})
    path = latest_checkpoint("out/draft")            # newest committed one, or None
    state = load_checkpoint(path, draft, opt, generators={"anchors": gen})

Layout of `<save_dir>/checkpoint-<step:08d>/`:
- `config.json`         speculators DFlash config (`speculators_model_type: "dflash"`,
                        `transformer_layer_config`, `aux_hidden_state_layer_ids`,
                        `block_size`, `mask_token_id`, `draft_vocab_size`, ...) plus a
                        `fanout` section with the training-only fields of DFlashConfig;
- `model.safetensors`   trainable weights in bf16 under speculators keys (`fc.weight`,
                        `layers.{i}.self_attn.q_proj.weight`, ..., `norm.weight`), and
                        `lm_head.weight`/`d2t`/`t2d` for a reduced draft vocabulary — what
                        an engine that reads the speculators format loads;
- `resume.safetensors`  the same weights at training precision (bf16 rounding would
                        change the next step), optimizer tensors (`opt.<param>.<name>`)
                        and RNG states (`rng.<name>`);
- `optimizer.json`      optimizer param groups and scalar state; `training_state.json`
                        the caller's dict (step, epoch, consumer cursor, ...);
- `COMMITTED`           written last. A directory without it is debris, never loaded.

Atomicity: everything is written into `<save_dir>/.tmp-<name>-<pid>/`, each file fsynced,
the directory renamed to its final name, the parent fsynced, then `COMMITTED` written
and fsynced. Only the newest `keep` (>= 2) committed checkpoints are kept. No pickle.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fanout.errors import ConfigError
from fanout.model.dflash import DFlashDraft

MARKER = "COMMITTED"
PREFIX = "checkpoint-"
FORMAT_VERSION = 1


def speculators_config(draft: DFlashDraft, verifier_name_or_path: str = "") -> dict[str, Any]:
    """The `config.json` an engine reading the speculators DFlash format expects."""
    c = draft.cfg
    layer_cfg = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": c.tie_word_embeddings,
    }
    return {
        "speculators_model_type": "dflash",
        "architectures": ["DFlashSpeculator"],
        "speculators_version": "0.3.0",
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": c.draft_vocab_size or c.vocab_size,
        "block_size": c.block_size,
        "target_hidden_size": c.hidden_size,
        "aux_hidden_state_layer_ids": list(c.target_layer_ids),
        "mask_token_id": c.mask_token_id,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": c.block_size - 1}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": []},
        },
        "torch_dtype": "bfloat16",
        "fanout": {"format_version": FORMAT_VERSION, "dflash_config": c.model_dump()},
    }


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _optimizer_payload(
    optimizer: torch.optim.Optimizer,
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
    draft: DFlashDraft,
    optimizer: torch.optim.Optimizer,
    training_state: dict[str, Any],
    *,
    generators: dict[str, torch.Generator] | None = None,
    keep: int = 2,
    verifier_name_or_path: str = "",
) -> Path:
    """Write one committed checkpoint and prune older ones. Returns its directory.

    Args:
        save_dir: parent directory (created).
        draft, optimizer: what to save.
        training_state: JSON-serialisable dict; must hold an int `step` (names the
            checkpoint). Put the consumer cursor, epoch, scheduler state, ... here.
        generators: named torch.Generators (e.g. the anchor sampler) to restore on load.
        keep: committed checkpoints to keep (at least 2).
    """
    if keep < 2:
        raise ConfigError(f"checkpoint keep must be >= 2, got {keep}")
    step = training_state.get("step")
    if not isinstance(step, int) or step < 0:
        raise ConfigError(f"training_state['step'] must be a non-negative int, got {step!r}")
    root = Path(save_dir)
    root.mkdir(parents=True, exist_ok=True)
    name = f"{PREFIX}{step:08d}"
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    weights = {k: v.detach().cpu().contiguous() for k, v in draft.trainable_state().items()}
    serve = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    if draft.cfg.draft_vocab_size is not None:
        serve["lm_head.weight"] = draft.lm_head_weight.detach().cpu().to(torch.bfloat16)
        serve["d2t"] = draft.d2t.cpu()  # type: ignore[union-attr]
        serve["t2d"] = draft.t2d.cpu()  # type: ignore[union-attr]
    opt_tensors, opt_meta = _optimizer_payload(optimizer)
    resume = {f"w.{k}": v for k, v in weights.items()} | opt_tensors | _rng_tensors(generators)
    meta = {"format": "fanout-dflash", "step": str(step)}
    save_file(serve, str(tmp / "model.safetensors"), metadata=meta)
    save_file(resume, str(tmp / "resume.safetensors"), metadata=meta)
    _write_json(tmp / "config.json", speculators_config(draft, verifier_name_or_path))
    _write_json(tmp / "optimizer.json", opt_meta)
    _write_json(tmp / "training_state.json", training_state)
    for f in tmp.iterdir():
        os.chmod(f, 0o644)  # safetensors writes 0600
        _fsync_file(f)
    if final.exists():  # an uncommitted (or superseded) one with the same step
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_file(root)
    (final / MARKER).write_text(f"{step}\n")
    _fsync_file(final / MARKER)
    _fsync_file(final)
    _prune(root, keep)
    return final


def _committed(root: Path) -> list[Path]:
    found = [p for p in root.glob(f"{PREFIX}*") if (p / MARKER).is_file()]
    return sorted(found, key=lambda p: p.name)


def _prune(root: Path, keep: int) -> None:
    done = _committed(root)
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    newest = done[-1].name if done else ""
    for p in root.glob(f"{PREFIX}*"):  # uncommitted debris older than the newest commit
        if not (p / MARKER).exists() and p.name < newest:
            shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(f".tmp-{PREFIX}*"):
        if not p.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(save_dir: str | Path) -> Path | None:
    """The newest committed checkpoint directory under `save_dir`, or None."""
    root = Path(save_dir)
    if not root.is_dir():
        return None
    done = _committed(root)
    return done[-1] if done else None


def load_checkpoint(
    path: str | Path,
    draft: DFlashDraft,
    optimizer: torch.optim.Optimizer | None,
    *,
    generators: dict[str, torch.Generator] | None = None,
) -> dict[str, Any]:
    """Restore weights (training precision), optimizer state and RNG states in place;
    return the saved training_state. Raises ConfigError when the checkpoint is not
    committed or was written for a differently shaped draft (names the fields)."""
    p = Path(path)
    if not (p / MARKER).is_file():
        raise ConfigError(f"{p}: not a committed checkpoint (no {MARKER} marker)")
    cfg = json.loads((p / "config.json").read_text())
    saved = cfg.get("fanout", {}).get("dflash_config", {})
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
    missing = set(draft.trainable_state()) - set(weights)
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
    return dict(json.loads((p / "training_state.json").read_text()))
