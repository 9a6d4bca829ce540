"""What a serving engine reads of a checkpoint: the speculators DFlash config, layer
numbering, format versions, and drafts loaded from `config.json` + `model.safetensors` alone.

    fanout upgrade-checkpoint out/draft/checkpoint-00000100     # format 1 -> 2, in place
                                                # (and unsorted layers -> ascending)
    from fanout.families.serving import load_draft, read_config
    draft = load_draft("out/draft/checkpoint-00000100", "models/qwen3-8b")

fanout.train.checkpoint writes checkpoints (and their exact-resume state) with
`speculators_config` from here; `fanout eval` and anything that serves a draft read them
back through `read_config` / `load_draft`, so both sides share one layer-numbering rule
(`to_serving_layer_ids` / `from_serving_layer_ids`) and one format check.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from fanout.errors import CheckpointError, ConfigError
from fanout.families.base import Family
from fanout.families.numbering import (
    from_serving_layer_ids,
    to_serving_layer_ids,
)
from fanout.families.registry import family_of_config, family_of_model_type
from fanout.filesystem import FileSystem
from fanout.model.draft import Draft
from fanout.model.draft_config import DraftConfig
from fanout.model.verifier_dir import read_verifier_config

# Written last into a checkpoint directory (fanout.train.checkpoint); one without it is
# debris, never read.
MARKER = "COMMITTED"
# `<save_dir>/checkpoint-<step:08d>/` (fanout.train.checkpoint writes them)
PREFIX = "checkpoint-"
# 2: aux_hidden_state_layer_ids in HF hidden_states numbering (layer id + 1), the
#    speculators 0.9.0 config layout. 1 (before 2026-12) named the layer below the
#    one the draft trained on; such checkpoints are refused (see check_format).
FORMAT_VERSION = 2


def committed_checkpoints(root: Path) -> list[Path]:
    """The committed checkpoint directories under `root`, oldest first."""
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
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


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
) -> Draft:
    """Build a draft for inference from a checkpoint's speculators files alone
    (`config.json` + `model.safetensors`, what an engine loads) and the verifier's frozen
    embedding/head/norm. Layer ids are read back from `aux_hidden_state_layer_ids` (-1).

    Raises CheckpointError naming the file and field when the directory is not a committed
    format-2 checkpoint, misses files or tensors, or does not fit the verifier (hidden
    size, vocabulary, layer ids beyond its depth)."""
    p = Path(path)
    vdir = Path(verifier_dir)
    cfg = read_config(p)
    fam = checkpoint_family(p, cfg)
    dcfg = draft_config(p, cfg, read_verifier_config(vdir), vdir)
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
    draft = fam.draft_class.with_verifier_tensors(dcfg, vdir, vocab_ids, dtype)
    _load_weights(draft, w, weights_file, dtype)
    return draft.to(device=device, dtype=dtype).eval()


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


def draft_config(path: Path, cfg: dict[str, Any], vcfg: dict[str, Any], vdir: Path) -> DraftConfig:
    """The config (the family's `config_class`) a checkpoint's speculators `config.json`
    describes, checked against the verifier it will run beside (hidden size, vocabulary,
    layer ids within its depth)."""
    fam = checkpoint_family(path, cfg)
    tl = cfg.get("transformer_layer_config") or {}
    nvl = vcfg["_num_hidden_layers"]
    layers = from_serving_layer_ids(cfg[fam.layer_ids_field])
    where = path / "config.json"
    for key, mine in (("hidden_size", tl.get("hidden_size")), ("vocab_size", tl.get("vocab_size"))):
        if mine != vcfg[key]:
            raise CheckpointError(
                f"{where}: transformer_layer_config.{key} = {mine} but verifier {vdir} has "
                f"{key} = {vcfg[key]}: this draft was trained for another verifier"
            )
    if max(layers) >= nvl:
        raise CheckpointError(
            f"{where}: {fam.layer_ids_field} {cfg[fam.layer_ids_field]} "
            f"(decoder layers {layers}) do not exist in the {nvl}-layer verifier {vdir}"
        )
    rope = tl.get("rope_parameters") or {}
    # Training-only semantics (anchors, loss weights, label source) do not change what the
    # draft proposes; take them from the fanout section so `loss` matches training too.
    saved = saved_config(cfg["fanout"])
    # the family's training-only options (e.g. a loss weight) likewise; its serving
    # fields come from the speculators config, as an engine reads them
    serving = fam.serving_fields()
    own = [k for k in fam.options() if k not in serving]
    training = {k: saved[k] for k in (*_TRAINING_ONLY, *own) if k in saved}
    try:
        return fam.config_class(
            **training,
            **{k: cfg[k] for k in serving},
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
                # speculators' MTP config has no such field (its whole vocabulary)
                None
                if cfg.get("draft_vocab_size", tl["vocab_size"]) == tl["vocab_size"]
                else cfg["draft_vocab_size"]
            ),
            **fam.layout_fields(cfg, saved),
            target_layer_ids=layers,
            tie_word_embeddings=bool(tl.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise CheckpointError(f"{where}: missing field {e.args[0]!r}") from e
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from e


def _load_weights(
    draft: Draft, w: dict[str, torch.Tensor], weights_file: Path, dtype: torch.dtype
) -> None:
    """Load `model.safetensors` tensors into `draft`: exactly its trainable tensors, each
    of the draft's shape, plus a reduced `lm_head.weight` when the checkpoint has one."""
    saved_head = w.pop("lm_head.weight", None)
    if saved_head is not None:  # a reduced head is part of the checkpoint: use its copy
        if saved_head.shape != draft.lm_head_weight.shape:
            raise CheckpointError(
                f"{weights_file}: lm_head.weight {tuple(saved_head.shape)} != "
                f"{tuple(draft.lm_head_weight.shape)}"
            )
        draft.lm_head_weight = saved_head.to(dtype)
    # a family that writes the frozen embedding and head whole (EAGLE-3, as speculators'
    # reads them) lists them in trainable_state: the file's copies are used, as above
    saved_embed = w.pop("embed_tokens.weight", None)
    if saved_embed is not None:
        if saved_embed.shape != draft.embed_weight.shape:
            raise CheckpointError(
                f"{weights_file}: embed_tokens.weight {tuple(saved_embed.shape)} != "
                f"{tuple(draft.embed_weight.shape)}"
            )
        draft.embed_weight = saved_embed.to(dtype)
    frozen = ("lm_head.weight", "embed_tokens.weight")
    shapes = {k: v.shape for k, v in draft.trainable_state().items() if k not in frozen}
    missing, unexpected = sorted(set(shapes) - set(w)), sorted(set(w) - set(shapes))
    if missing or unexpected:
        raise CheckpointError(
            f"{weights_file}: missing tensors {missing}, unexpected tensors {unexpected}"
        )
    for k, v in w.items():
        if v.shape != shapes[k]:
            raise CheckpointError(
                f"{weights_file}: {k} is {tuple(v.shape)}, expected {tuple(shapes[k])}"
            )
    draft.load_state_dict({k: v.to(dtype) for k, v in w.items()}, strict=False)


def train_eal(path: str | Path) -> float | None:
    """The train-time EAL a checkpoint recorded (mean of its last logged steps), if any."""
    v = read_config(path)["fanout"].get("train_eal")
    return float(v) if isinstance(v, int | float) else None


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
