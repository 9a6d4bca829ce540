"""A draft loaded for inference from a checkpoint's speculators files alone
(`config.json` + `model.safetensors`, what an engine loads) and its verifier.

    from fanout.checkpoints.load import load_draft
    draft = load_draft("out/draft/checkpoint-00000100", "models/qwen3-8b")

`fanout eval`, `fanout promote` and the family tests load drafts this way; a trainer
resumes through fanout.checkpoints.resume instead (training precision, optimizer, RNGs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from fanout.checkpoints.format import checkpoint_family, read_config, saved_config
from fanout.errors import CheckpointError
from fanout.families.numbering import from_serving_layer_ids
from fanout.model.draft import Draft
from fanout.model.draft_config import DraftConfig
from fanout.model.verifier_dir import read_verifier_config

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
    embedding/head/norm. Layer ids are read back from the family's `layer_ids_field` (-1;
    `eagle_aux_hidden_state_layer_ids` for EAGLE-3 and P-EAGLE).

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
