"""Draft checkpoints: speculators DFlash format for serving + exact-resume state beside it.

    from fanout.train.checkpoint import save_checkpoint, latest_checkpoint, load_checkpoint
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

from fanout.errors import CheckpointError, ConfigError
from fanout.model.dflash import (
    DFlashConfig,
    DFlashDraft,
    read_verifier_config,
)

MARKER = "COMMITTED"
PREFIX = "checkpoint-"
# 2: aux_hidden_state_layer_ids in HF hidden_states numbering (layer id + 1), the
#    speculators 0.9.0 config layout. 1 (before 2026-12) named the layer below the
#    one the draft trained on; such checkpoints are refused (see check_format).
FORMAT_VERSION = 2
# The speculators release whose DFlash config this layout matches (tests/test_speculators.py
# loads our checkpoints with it when it is installed).
SPECULATORS_VERSION = "0.9.0"


# ---- layer numbering: where fanout's and the serving side's conventions meet ----------
#
# fanout (z-lab / SpecForge numbering): target layer i is the *output of decoder layer i*
#   (0-based), i.e. HF `output_hidden_states` entry `hidden_states[i + 1]`.
# speculators / vLLM: `aux_hidden_state_layer_ids` are indices into HF `hidden_states`
#   (entry 0 = embeddings); vLLM subtracts 1 when it wires the decoder layers.
# These two functions are the only place the +1 happens; every writer and reader of a
# checkpoint's `aux_hidden_state_layer_ids` goes through them.


def to_serving_layer_ids(target_layer_ids: list[int] | tuple[int, ...]) -> list[int]:
    """fanout decoder-layer ids -> speculators/vLLM `aux_hidden_state_layer_ids`.

    >>> to_serving_layer_ids([1, 9, 17])
    [2, 10, 18]
    """
    return [int(i) + 1 for i in target_layer_ids]


def from_serving_layer_ids(aux_hidden_state_layer_ids: list[int]) -> list[int]:
    """speculators/vLLM `aux_hidden_state_layer_ids` -> fanout decoder-layer ids.
    Entry 0 (the embeddings) is no decoder layer's output: refused."""
    if any(int(j) < 1 for j in aux_hidden_state_layer_ids):
        raise CheckpointError(
            f"aux_hidden_state_layer_ids {aux_hidden_state_layer_ids}: 0 is the embedding "
            "output, which no fanout capture provides"
        )
    return [int(j) - 1 for j in aux_hidden_state_layer_ids]


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
    draft: DFlashDraft,
    verifier_name_or_path: str = "",
    *,
    verifier_serving_name: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `config.json` speculators 0.9.0 writes for a DFlash draft of this shape (and
    vLLM reads), plus a `fanout` section (format version, the full DFlashConfig in
    fanout's own layer numbering, and `extra`, e.g. the train-time EAL)."""
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
        # transformers >= 5 (and speculators 0.9.0) keep RoPE under rope_parameters
        "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "layer_types": ["full_attention"] * c.num_layers,
        "tie_word_embeddings": c.tie_word_embeddings,
    }
    return {
        "speculators_model_type": "dflash",
        # what speculators' save_pretrained of a DFlash draft writes (the model class)
        "architectures": ["DFlashDraftModel"],
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": c.draft_vocab_size or c.vocab_size,
        "block_size": c.block_size,
        "target_hidden_size": c.hidden_size,
        "aux_hidden_state_layer_ids": to_serving_layer_ids(c.target_layer_ids),
        "mask_token_id": c.mask_token_id,
        "sample_from_anchor": False,
        "sliding_window_non_causal": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": c.block_size - 1,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": _verifier_identity(verifier_name_or_path, verifier_serving_name),
        },
        "dtype": "bfloat16",
        # the draft's own head is never tied (speculators forces False and writes it)
        "tie_word_embeddings": False,
        "fanout": {
            "format_version": FORMAT_VERSION,
            # fanout numbering (decoder-layer outputs); aux_hidden_state_layer_ids above
            # is the same list + 1
            "dflash_config": c.model_dump(),
            **(extra or {}),
        },
    }


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
            f"config with `python -m fanout.train.checkpoint upgrade {path}` (weights unchanged)"
        )
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path / 'config.json'}: fanout checkpoint format {version!r}; this fanout reads "
            f"format {FORMAT_VERSION}"
        )
    fan_ids = fan.get("dflash_config", {}).get("target_layer_ids")
    aux = cfg.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or from_serving_layer_ids(aux) != fan_ids:
        raise CheckpointError(
            f"{path / 'config.json'}: aux_hidden_state_layer_ids {aux} is not "
            f"fanout.dflash_config.target_layer_ids {fan_ids} + 1; the file was edited "
            "inconsistently"
        )


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


def upgrade_checkpoint(path: str | Path) -> Path:
    """Rewrite a format-1 checkpoint's `config.json` as format 2 (weights are unchanged:
    only the layer numbering and the speculators layout of the config differ)."""
    p = Path(path)
    cfg = json.loads((p / "config.json").read_text())
    if cfg.get("fanout", {}).get("format_version") != 1:
        raise CheckpointError(f"{p / 'config.json'}: not a format-1 fanout checkpoint")
    dcfg = DFlashConfig(**cfg["fanout"]["dflash_config"])
    verifier = cfg.get("speculators_config", {}).get("verifier", {}).get("name_or_path", "")
    stub = _ConfigOnly(dcfg)
    new = speculators_config(stub, verifier)  # type: ignore[arg-type]
    write_json_atomic(p / "config.json", new)
    return p


class _ConfigOnly:
    """What speculators_config reads of a draft: its `cfg` (no weights needed)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        self.cfg = cfg


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_json_atomic(path: Path, obj: Any) -> None:
    """Replace `path` whole or not at all: tmp file, fsync, rename, fsync the dir."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    _write_json(tmp, obj)
    os.chmod(tmp, 0o644)
    _fsync_file(tmp)
    os.replace(tmp, path)
    _fsync_file(path.parent)


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
    verifier_serving_name: str | None = None,
    config_extra: dict[str, Any] | None = None,
) -> Path:
    """Write one committed checkpoint and prune older ones. Returns its directory.

    Args:
        save_dir: parent directory (created).
        draft, optimizer: what to save.
        training_state: JSON-serialisable dict; must hold an int `step` (names the
            checkpoint). Put the consumer cursor, epoch, scheduler state, ... here.
        generators: named torch.Generators (e.g. the anchor sampler) to restore on load.
        keep: committed checkpoints to keep (at least 2).
        verifier_name_or_path: the verifier the draft trained against (a local dir is
            stored as an absolute path).
        verifier_serving_name: the name a serving config should carry instead (e.g.
            `Qwen/Qwen3-8B`); default: the (absolute) path.
        config_extra: JSON fields added to config.json's `fanout` section (e.g. train_eal).
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
    # "pt": what transformers' from_pretrained (so speculators) requires of the format key
    save_file(serve, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    meta = {"format": "fanout-dflash", "step": str(step)}
    save_file(resume, str(tmp / "resume.safetensors"), metadata=meta)
    config = speculators_config(
        draft,
        verifier_name_or_path,
        verifier_serving_name=verifier_serving_name,
        extra=config_extra,
    )
    _write_json(tmp / "config.json", config)
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
    committed, has an older format, or was written for a differently shaped draft (names
    the fields)."""
    p = Path(path)
    cfg = read_config(p)
    saved = cfg["fanout"].get("dflash_config", {})
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


_TRAINING_ONLY = (
    "max_anchors",
    "gamma",
    "loss_weighting",
    "dpace_alpha",
    "label_source",
    "loss_type",
)


def load_draft(
    path: str | Path,
    verifier_dir: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> DFlashDraft:
    """Build a draft for inference from a checkpoint's speculators files alone
    (`config.json` + `model.safetensors`, what an engine loads) and the verifier's frozen
    embedding/head/norm. Layer ids are read back from `aux_hidden_state_layer_ids` (-1).

    Raises CheckpointError naming the file and field when the directory is not a committed
    format-2 checkpoint, misses files or tensors, or does not fit the verifier (hidden
    size, vocabulary, layer ids beyond its depth)."""
    p = Path(path)
    cfg = read_config(p)
    tl = cfg.get("transformer_layer_config") or {}
    vdir = Path(verifier_dir)
    vcfg = read_verifier_config(vdir)
    nvl = vcfg["_num_hidden_layers"]
    layers = from_serving_layer_ids(cfg["aux_hidden_state_layer_ids"])
    where = p / "config.json"
    for key, mine in (("hidden_size", tl.get("hidden_size")), ("vocab_size", tl.get("vocab_size"))):
        if mine != vcfg[key]:
            raise CheckpointError(
                f"{where}: transformer_layer_config.{key} = {mine} but verifier {vdir} has "
                f"{key} = {vcfg[key]}: this draft was trained for another verifier"
            )
    if max(layers) >= nvl:
        raise CheckpointError(
            f"{where}: aux_hidden_state_layer_ids {cfg['aux_hidden_state_layer_ids']} "
            f"(decoder layers {layers}) do not exist in the {nvl}-layer verifier {vdir}"
        )
    rope = tl.get("rope_parameters") or {}
    # Training-only semantics (anchors, loss weights, label source) do not change what the
    # draft proposes; take them from the fanout section so `loss` matches training too.
    saved = cfg["fanout"].get("dflash_config", {})
    training = {k: saved[k] for k in _TRAINING_ONLY if k in saved}
    try:
        dcfg = DFlashConfig(
            **training,
            hidden_size=tl["hidden_size"],
            intermediate_size=tl["intermediate_size"],
            num_layers=tl["num_hidden_layers"],
            num_attention_heads=tl["num_attention_heads"],
            num_key_value_heads=tl["num_key_value_heads"],
            head_dim=tl["head_dim"],
            rms_norm_eps=tl["rms_norm_eps"],
            rope_theta=float(rope.get("rope_theta", tl.get("rope_theta", 1e4))),
            max_position_embeddings=tl["max_position_embeddings"],
            vocab_size=tl["vocab_size"],
            draft_vocab_size=(
                cfg["draft_vocab_size"] if cfg["draft_vocab_size"] != tl["vocab_size"] else None
            ),
            block_size=cfg["block_size"],
            mask_token_id=cfg["mask_token_id"],
            target_layer_ids=layers,
            tie_word_embeddings=bool(tl.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise CheckpointError(f"{where}: missing field {e.args[0]!r}") from e
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from e
    weights_file = p / "model.safetensors"
    if not weights_file.is_file():
        raise CheckpointError(f"{weights_file}: missing (the draft's weights)")
    try:
        w = load_file(str(weights_file))
    except Exception as e:  # safetensors raises its own SafetensorError on a bad header
        raise CheckpointError(f"{weights_file}: unreadable: {e}") from e
    vocab_ids = None
    if dcfg.draft_vocab_size is not None:
        if "d2t" not in w:
            raise CheckpointError(f"{weights_file}: draft_vocab_size set but no d2t tensor")
        d2t = w.pop("d2t").long()
        vocab_ids = d2t + torch.arange(d2t.numel())  # speculators: draft d -> d + d2t[d]
        w.pop("t2d", None)
    draft = DFlashDraft.with_verifier_tensors(dcfg, vdir, vocab_ids, dtype)
    saved_head = w.pop("lm_head.weight", None)
    if saved_head is not None:  # a reduced head is part of the checkpoint: use its copy
        if saved_head.shape != draft.lm_head_weight.shape:
            raise CheckpointError(
                f"{weights_file}: lm_head.weight {tuple(saved_head.shape)} != "
                f"{tuple(draft.lm_head_weight.shape)}"
            )
        draft.lm_head_weight = saved_head.to(dtype)
    shapes = {k: v.shape for k, v in draft.trainable_state().items()}
    missing, unexpected = sorted(set(shapes) - set(w)), sorted(set(w) - set(shapes))
    if missing or unexpected:
        raise CheckpointError(
            f"{weights_file}: missing tensors {missing}, unexpected tensors {unexpected}"
        )
    for k, v in w.items():
        want = shapes[k]
        if v.shape != want:
            raise CheckpointError(
                f"{weights_file}: {k} is {tuple(v.shape)}, expected {tuple(want)}"
            )
    draft.load_state_dict({k: v.to(dtype) for k, v in w.items()}, strict=False)
    return draft.to(device=device, dtype=dtype).eval()


def train_eal(path: str | Path) -> float | None:
    """The train-time EAL a checkpoint recorded (mean of its last logged steps), if any."""
    v = read_config(path)["fanout"].get("train_eal")
    return float(v) if isinstance(v, int | float) else None


def main(argv: list[str] | None = None) -> int:
    """`python -m fanout.train.checkpoint upgrade DIR [DIR ...]`: rewrite format-1 configs."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m fanout.train.checkpoint")
    ap.add_argument("command", choices=["upgrade"])
    ap.add_argument("dirs", nargs="+", help="checkpoint directories (checkpoint-XXXXXXXX)")
    args = ap.parse_args(argv)
    for d in args.dirs:
        try:
            upgrade_checkpoint(d)
        except (CheckpointError, OSError, ValueError) as e:
            print(f"upgrade: error: {e}", file=sys.stderr)
            return 1
        print(f"upgraded {d} to format {FORMAT_VERSION}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
