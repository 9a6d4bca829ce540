"""A verifier directory read without loading the model: the DFlash-relevant fields of
its HF `config.json`, named tensors from its (possibly sharded) safetensors files, what
the directory must hold, and its identity (config hash, weights fingerprint).

    python -c "from pathlib import Path; from fanout.model.verifier_dir import read_verifier_config; print(read_verifier_config(Path('VERIFIER_DIR')))"
    python -c "from pathlib import Path; from fanout.model.verifier_dir import text_tensors; print(text_tensors(Path('VERIFIER_DIR')))"

The draft takes its shapes and its frozen embedding / head / norm from here
(fanout.model.draft.Draft.from_verifier); `fanout eval` and `load_draft` read
the config the same way (fanout.checkpoints.load). A multimodal checkpoint
(`…ForConditionalGeneration`) is read as its text model: shapes from its
`text_config`, tensors by the names its layout gives them (`text_tensors`: plain
`model.*`, `model.language_model.*` or `language_model.model.*`), the head tied or not
as the top-level config says (Gemma-3: tied at the top, untied in `text_config`).
Hybrid checkpoints name theirs otherwise and are read by the same rule (`_TEXT_NAMES`):
the final norm `model.final_layernorm` (Falcon-H1) or `model.embedding_norm` (LFM2), a
`backbone.embeddings` / `backbone.norm_f` text model (Nemotron-H); the layer count is
the per-layer list's length where a config lists its layers (`num_hidden_layers`:
Nemotron-H's `layers_block_type`, its config.json having no `num_hidden_layers`).
A verifier whose forward scales its logits after the head (Falcon-H1's
`lm_head_multiplier`, Granite's `logits_scaling`: `logit_scale`, looked up by
model_type) has its final-norm gain read times that scale, as the captured
`last_hidden_states` are: the verifier's logits are `rms_norm(h) · gain · Wᵀ` and
`last_hidden_states · Wᵀ` for every verifier, the head staying the stored one
(docs/producer.md, "Logit and embedding multipliers"); one that soft-caps them
(Gemma-2's `final_logit_softcapping`: `logit_softcap`) has them capped after that.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from fanout.errors import ConfigError
from fanout.hashing import hasher, identity_digest, labelled

# Files whose bytes are model weights (top level of the directory, like from_pretrained).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def read_verifier_config(vdir: Path) -> dict[str, Any]:
    """DraftConfig fields from a HF `config.json` (+ `_num_hidden_layers`, the function
    `num_hidden_layers`'s count): the text model's (a multimodal config's `text_config`), with
    the head's tie flag as the checkpoint's top level declares it (`tied_head`) and the
    norm epsilon under whichever of `_NORM_EPS_FIELDS` the config uses."""
    path = vdir / "config.json"
    try:
        top = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read verifier config {path}: {e}") from e
    c = top.get("text_config", top)  # multimodal wrappers nest the LM config
    try:
        return {
            "hidden_size": c["hidden_size"],
            "intermediate_size": c["intermediate_size"],
            "num_attention_heads": c["num_attention_heads"],
            "num_key_value_heads": c.get("num_key_value_heads", c["num_attention_heads"]),
            "head_dim": c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            "rms_norm_eps": _first(c, _NORM_EPS_FIELDS, 1e-6),
            "rope_theta": _rope_theta(c),
            "max_position_embeddings": c.get("max_position_embeddings", 40960),
            "vocab_size": c["vocab_size"],
            "tie_word_embeddings": bool(tied_head(top)),
            "_num_hidden_layers": num_hidden_layers(c, path),
        }
    except KeyError as e:
        raise ConfigError(f"{path}: missing field {e.args[0]!r}") from e


# The fields a text config gives its RMSNorm epsilon under, tried in order: most models;
# Nemotron-H (and Mamba); LFM2.
_NORM_EPS_FIELDS = ("rms_norm_eps", "layer_norm_epsilon", "norm_eps")
# The fields a text config gives its decoder-layer count by, tried in order: the per-layer
# lists that make the stack first (Nemotron-H builds one layer per entry of
# `layers_block_type`, or of a checkpoint's older `hybrid_override_pattern` string, one
# character per layer, whatever a stale `num_hidden_layers` beside it says), then
# `num_hidden_layers` (every other model), then `layer_types`.
_LAYER_COUNT_FIELDS = (
    "layers_block_type",
    "hybrid_override_pattern",
    "num_hidden_layers",
    "layer_types",
)


def _first(c: dict[str, Any], fields: tuple[str, ...], default: Any) -> Any:
    """The value of the first of `fields` that `c` sets (not None), else `default`."""
    return next((c[f] for f in fields if c.get(f) is not None), default)


def num_hidden_layers(c: dict[str, Any], where: Path | str) -> int:
    """The decoder-layer count of text config `c` (`_LAYER_COUNT_FIELDS`: an int, or
    the length of a per-layer list or pattern); ConfigError naming `where` when it
    declares none."""
    v = _first(c, _LAYER_COUNT_FIELDS, None)
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    if isinstance(v, list | str) and len(v) > 0:
        return len(v)
    raise ConfigError(
        f"{where}: no decoder-layer count (looked for {', '.join(_LAYER_COUNT_FIELDS)}; got {v!r})"
    )


def _rope_theta(c: dict[str, Any]) -> float:
    """The text model's RoPE base: `rope_theta`, or `rope_parameters.rope_theta`, or (one
    `rope_parameters` per layer type, Gemma-3) its full-attention layers'; else 1e4."""
    rp = c.get("rope_parameters") or {}
    full = rp.get("full_attention")
    full = full if isinstance(full, dict) else {}
    return float(c.get("rope_theta") or rp.get("rope_theta") or full.get("rope_theta") or 1e4)


def tied_head(config: dict[str, Any]) -> bool | None:
    """Whether the verifier's head is its embedding, as its `config.json` (`config`)
    declares it: the top level's `tie_word_embeddings` (what transformers ties by, also
    for a multimodal model, whose `text_config` may say otherwise: Gemma-3), else its
    `text_config`'s; None when neither declares it."""
    for section in (config, config.get("text_config")):
        if isinstance(section, dict) and section.get("tie_word_embeddings") is not None:
            return bool(section["tie_word_embeddings"])
    return None


# Where a checkpoint keeps its text model's tensors, tried in this order: a causal LM
# (`model.`); a multimodal one as transformers >= 4.52 names it (`model.language_model.`,
# Qwen3.5, Qwen3-VL); as older ones do and Gemma-3's conversion mapping still saves it
# (`language_model.model.`); a Mamba-style backbone (`backbone.`: Nemotron-H, Mamba).
_TEXT_PREFIXES = ("model.", "model.language_model.", "language_model.model.", "backbone.")
# The names a text model gives its input embedding and its final norm (the one after the
# last decoder layer, before the head), tried in this order under each prefix: most
# models; Falcon-H1; LFM2 (`embedding_norm`, applied after the last layer whatever its
# name says); Mamba-style backbones (Nemotron-H); RecurrentGemma. Names, not model
# types: a checkpoint of another architecture with one of these layouts is read the
# same way.
_TEXT_NAMES = (
    ("embed_tokens", "norm"),
    ("embed_tokens", "final_layernorm"),
    ("embed_tokens", "embedding_norm"),
    ("embeddings", "norm_f"),
    ("embed_tokens", "final_norm"),
)
_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
# model_types whose final norm has no weight (an RMSNorm without a gain: NanoChat's): the
# embedding alone (one of `_TEXT_NAMES`' embedding names) locates the text model, and the
# gain a draft takes is ones
_NORM_WITHOUT_WEIGHT = frozenset({"nanochat"})
_EMBED_NAMES = tuple(dict.fromkeys(e for e, _ in _TEXT_NAMES))  # in _TEXT_NAMES' order
# model_types whose final norm scales by (1 + w) rather than w (Gemma's RMSNorm; Qwen3.5's
# and Qwen3-Next's compute `output * (1.0 + weight)`), matched on the text config's
# model_type: speculators 0.9.0's GEMMA_STYLE_FINAL_NORM_MODEL_TYPES plus qwen3_next,
# which it misses (tests/test_zoo_families.py checks each zoo verifier's norm)
_ONE_PLUS_NORM = frozenset(
    {
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "qwen3_5",
        "qwen3_5_text",
        "qwen3_next",
        "recurrent_gemma",
    }
)
# The scalar a model_type's forward multiplies its logits by after the head (muP-trained
# models), by the text-config field that holds it and whether the forward divides by it.
# Falcon-H1: `lm_head(h) * lm_head_multiplier` (transformers' FalconH1ForCausalLM; vLLM's
# logits processor `scale`); Granite's: `lm_head(h) / logits_scaling`; Cohere's
# `* logit_scale`, HyperCLOVAX's `* logits_scaling`. fanout's "final state" is what the
# head multiplies, logits = state · Wᵀ, for every verifier: the scale goes into the
# final-norm gain (`read_text_tensors`) and the captured `last_hidden_states`
# (`Verifier.capture`), never into the head, which a serving engine hands a draft
# unscaled. Looked up by model_type, as `_ONE_PLUS_NORM`: a field of the same name
# elsewhere is not this scale. A model_type joins with a test against transformers'
# forward (tests/test_logit_scale.py, tests/test_logit_transforms.py).
_GRANITE = ("logits_scaling", True)
_LOGIT_SCALE_FIELDS: dict[str, tuple[str, bool]] = {
    "falcon_h1": ("lm_head_multiplier", False),
    "granite": _GRANITE,
    "granite_swa": _GRANITE,
    "granitemoe": _GRANITE,
    "granitemoe_swa": _GRANITE,
    "granitemoehybrid": _GRANITE,
    "granitemoeshared": _GRANITE,
    "cohere": ("logit_scale", False),
    "cohere2": ("logit_scale", False),
    "cohere2_moe": ("logit_scale", False),
    "cohere_compass_text": ("logit_scale", False),
    "hyperclovax": ("logits_scaling", False),
    # Inkling divides its final states by the width multiplier before the head: the
    # same linear scale (its `unpadded_vocab_size` slice of the logits is not taken in)
    "inkling_text": ("logits_mup_width_multiplier", True),
}
# model_types whose forward divides the final states by hidden_size / `field` before the
# head: MiniCPM3's `logits_scaling`, a property of its config computed from
# `dim_model_base` (not in config.json; unset: hidden_size, a scale of 1). The same
# linear scale, dim_model_base / hidden_size.
_WIDTH_RATIO_SCALES: dict[str, str] = {"minicpm3": "dim_model_base"}
# The model_types whose causal-LM forward soft-caps its logits after the head and any
# scale, `tanh(z / cap) · cap` with cap = the config's `final_logit_softcapping` (None:
# no cap): transformers' Gemma2ForCausalLM, Gemma3ForCausalLM (`gemma3_text`; its
# multimodal Gemma3ForConditionalGeneration applies none), VaultGemma's, Beam's,
# Gemma-4's and Gemma-4-Unified's causal and multimodal ones (`gemma4_text`, `gemma4`:
# the field read from its `text_config`), RecurrentGemma's (`logits_soft_cap`, always
# set). Not linear, so it cannot live in the stored states: the draft takes it from the
# verifier (`TextTensors.logit_softcap`, `Draft.teacher_softcap`) and the fused losses
# cap the teacher's logits (fanout.ops.linear_kl.teacher_logits). Keyed by the top-level
# config's model_type, the class the forward is, to the field that holds the cap;
# tests/test_logit_transforms.py (which also fails when transformers gains a forward
# that transforms its logits and is neither here nor listed as not handled).
_CAP = "final_logit_softcapping"
_LOGIT_SOFTCAP_FIELDS: dict[str, str] = {
    "gemma2": _CAP,
    "gemma3_text": _CAP,
    "vaultgemma": _CAP,
    "beam": _CAP,
    "gemma4_text": _CAP,
    "gemma4": _CAP,  # Gemma4ForConditionalGeneration: its text config's cap
    "gemma4_unified_text": _CAP,
    "gemma4_unified": _CAP,
    "recurrent_gemma": "logits_soft_cap",
    "nanochat": _CAP,
}


@dataclass(frozen=True, slots=True)
class TextTensors:
    """Where a verifier checkpoint keeps the text-model tensors a draft takes frozen."""

    embed: str  # [V, H] input embedding
    norm: str | None  # [H] final norm; None: a norm without a weight (a gain of ones)
    head: str | None  # [V, H] lm_head; None: tied to the embedding
    norm_offset: float  # the final norm's gain is weight + norm_offset (Gemma-style: 1)
    logit_scale: float = 1.0  # the forward's logits are head(h) · logit_scale (Falcon-H1)
    # then tanh(logits / cap) · cap (Gemma-2's final_logit_softcapping); None: no cap
    logit_softcap: float | None = None

    @property
    def tied(self) -> bool:
        return self.head is None

    def names(self) -> list[str]:
        """The tensors to read (the embedding once when the head is tied)."""
        return [
            self.embed,
            *([self.norm] if self.norm else []),
            *([self.head] if self.head else []),
        ]


def text_tensors(vdir: Path) -> TextTensors:
    """The names of the verifier's text embedding, final norm and head in its checkpoint,
    read from the safetensors index (or the single file's header) and `config.json`.

    The text model is the first of `_TEXT_PREFIXES` (`model.`, `model.language_model.`,
    `language_model.model.`, `backbone.`) that holds both tensors of one of
    `_TEXT_NAMES`' layouts (`embed_tokens` + `norm`, `final_layernorm`,
    `embedding_norm` or `final_norm`; `embeddings` + `norm_f`), or its embedding alone
    where the model_type's final norm has no weight (`_NORM_WITHOUT_WEIGHT`, NanoChat:
    `norm` None, a gain of ones). The head is tied when
    the config says so (`tied_head`); when it says nothing, when no head tensor exists. The logit
    scale is `logit_scale`'s, the soft cap `logit_softcap`'s. Raises ConfigError naming
    the directory and what is missing (a declared untied head without an
    `lm_head.weight` included) or malformed."""
    keys = _tensor_names(vdir)
    top = _read_config(vdir)
    text = top.get("text_config", top)
    model_type = str(text.get("model_type", "")).lower()
    found: tuple[str, str | None] | None = next(
        ((f"{p}{e}.weight", f"{p}{n}.weight") for p in _TEXT_PREFIXES for e, n in _TEXT_NAMES
         if f"{p}{e}.weight" in keys and f"{p}{n}.weight" in keys),
        None,
    )  # fmt: skip
    if found is None and model_type in _NORM_WITHOUT_WEIGHT:
        found = next(((f"{p}{e}.weight", None) for p in _TEXT_PREFIXES
                      for e in _EMBED_NAMES if f"{p}{e}.weight" in keys), None)  # fmt: skip
    if found is None:
        names = ", ".join(f"{e} + {n}" for e, n in _TEXT_NAMES)
        raise ConfigError(
            f"verifier {vdir}: no text model's embedding and final norm in its weights "
            f"(looked for {names} under {', '.join(_TEXT_PREFIXES)}; each + '.weight')"
        )
    embed, norm = found
    head = next((n for n in _HEAD_NAMES if n in keys), None)
    tied = tied_head(top)
    if tied is False and head is None:
        raise ConfigError(
            f"verifier {vdir}: config.json says tie_word_embeddings false, but its weights "
            f"hold no head ({' or '.join(_HEAD_NAMES)})"
        )
    offset = 1.0 if model_type in _ONE_PLUS_NORM else 0.0
    scale = logit_scale(top, vdir / "config.json")
    cap = logit_softcap(top, vdir / "config.json")
    return TextTensors(embed, norm, None if tied or head is None else head, offset, scale, cap)


def logit_scale(config: Mapping[str, Any], where: Path | str) -> float:
    """The scalar the verifier's forward multiplies its logits by after the head
    (`_LOGIT_SCALE_FIELDS`: Falcon-H1's `lm_head_multiplier`, 1 / Granite's
    `logits_scaling`, Cohere's `logit_scale`; `_WIDTH_RATIO_SCALES`: MiniCPM3's
    dim_model_base / hidden_size), from its config (a `config.json`'s object;
    a multimodal one's `text_config`): 1.0 for every other model_type and where the field
    is unset. ConfigError naming `where` and the field when it is not a positive finite
    number (a negative one would reverse the argmax)."""
    c = config.get("text_config") or config
    model_type = str(c.get("model_type", "")).lower()
    if model_type in _WIDTH_RATIO_SCALES:  # MiniCPM3: states / (hidden_size / dim_model_base)
        what = "the width the model's final states are scaled to"
        base = _positive(c, _WIDTH_RATIO_SCALES[model_type], where, what)
        width = _positive(c, "hidden_size", where, "the model's width")
        return 1.0 if base is None or width is None else base / width
    field, divides = _LOGIT_SCALE_FIELDS.get(model_type, ("", False))
    v = _positive(c, field, where, "what the model multiplies or divides its logits by")
    if v is None:
        return 1.0
    return 1.0 / v if divides else v


def logit_softcap(config: Mapping[str, Any], where: Path | str) -> float | None:
    """The soft cap the verifier's forward puts on its logits after the head,
    `tanh(z / cap) · cap` (`_LOGIT_SOFTCAP_FIELDS`: Gemma-2's `final_logit_softcapping`),
    from its config (a `config.json`'s object; a multimodal one's `text_config` holds
    the field): None for every other model_type and where the field is unset (null).
    ConfigError naming `where` and the field when it is not a positive finite number."""
    field = _LOGIT_SOFTCAP_FIELDS.get(str(config.get("model_type", "")).lower(), "")
    c = config.get("text_config") or config  # Gemma-4's multimodal forward reads its text's
    return _positive(c, field, where, "the cap on the model's logits")


def _positive(c: Mapping[str, Any], field: str, where: Path | str, what: str) -> float | None:
    """Config field `field` of `c` as a float (None when unset or `field` is empty);
    ConfigError naming `where` and the field when it is not a positive finite number."""
    v = c.get(field) if field else None
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{where}: {field} must be a positive number ({what}), got {v!r}")
    return float(v)


def read_text_tensors(
    vdir: Path, names: TextTensors | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The verifier's text embedding [V, H] and head [V, H] (None when tied to the
    embedding), as stored, and its final-norm gain [H] as the head reads it: (the stored
    weight + `norm_offset`) · `logit_scale`, so that the verifier's logits are
    `rms_norm(h) · gain · Wᵀ` (float32 where an offset or a scale was applied; the
    stored tensor itself otherwise); located by `names` (`text_tensors(vdir)` when not
    given: a caller that also needs its soft cap looks it up once)."""
    names = text_tensors(vdir) if names is None else names
    t = read_verifier_tensors(vdir, names.names())
    embed = t[names.embed]
    # a norm without a weight (NanoChat's): the gain of ones it computes with
    norm = t[names.norm] if names.norm else embed.new_ones(embed.shape[1])
    if names.norm_offset:
        norm = norm.float() + names.norm_offset  # w + 1 is not exact in bf16
    if names.logit_scale != 1.0:
        # Falcon-H1's lm_head_multiplier, Granite's logits_scaling: the draft's final norm
        # starts at the verifier's logit scale, and the head stays the one serving engines
        # share with drafts
        norm = norm.float() * names.logit_scale
    return embed, None if names.head is None else t[names.head], norm


def _tensor_names(vdir: Path) -> set[str]:
    """Every tensor name of the verifier's safetensors weights (index or single file)."""
    index = vdir / "model.safetensors.index.json"
    try:
        if index.exists():
            return set(json.loads(index.read_text())["weight_map"])
        with safe_open(str(vdir / "model.safetensors"), framework="pt") as sf:
            return set(sf.keys())
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        raise ConfigError(f"cannot read verifier weight names in {vdir}: {e}") from e


def read_verifier_tensors(vdir: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Read only `names` from the verifier's (possibly sharded) safetensors files."""
    index = vdir / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    else:
        weight_map = {n: "model.safetensors" for n in names}
    out: dict[str, torch.Tensor] = {}
    for n in names:
        if n not in weight_map:
            raise ConfigError(f"{index}: tensor {n!r} not in weight_map")
        f = vdir / weight_map[n]
        try:
            with safe_open(str(f), framework="pt") as sf:
                if n not in sf.keys():  # noqa: SIM118 - safe_open has no __contains__
                    raise ConfigError(f"{f}: verifier tensor {n!r} not found")
                out[n] = sf.get_tensor(n)
        except OSError as e:
            raise ConfigError(f"cannot read verifier weights {f}: {e}") from e
    return out


# --------------------------------------------------------------------------- identity


def config_hash(path: str | os.PathLike[str]) -> str:
    """sha256 (hex) of the verifier's `config.json`, canonicalised.

    Canonical = parsed and re-dumped with sorted keys, without the fields that name
    the writer rather than the model (`transformers_version`, `_name_or_path`), so
    re-saving the same model with another transformers version keeps the hash.
    """
    cfg = _read_config(Path(path))
    for k in ("transformers_version", "_name_or_path"):
        cfg.pop(k, None)
    return identity_digest(cfg)


def max_position_embeddings(path: str | os.PathLike[str]) -> int | None:
    """The verifier's `max_position_embeddings` from its config.json (a multimodal
    model's `text_config` when the top level has none); None if it declares none.
    Read from the file, without loading the model, so a producer can refuse a
    `--seq-len` above it before it creates anything."""
    cfg = _read_config(Path(path))
    for section in (cfg, cfg.get("text_config")):
        v = section.get("max_position_embeddings") if isinstance(section, dict) else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def weights_fingerprint(
    path: str | os.PathLike[str],
    *,
    full_hash_bytes: int = 64 << 20,
    samples_per_file: int = 16,
    sample_bytes: int = 256 << 10,
) -> str:
    """A cheap fingerprint of the weight files: changes when the weights change.

    Per weight file (sorted by name): its name and size; for files up to
    `full_hash_bytes` every byte; for larger ones the whole safetensors header
    (tensor names, dtypes, shapes, offsets) plus `samples_per_file` ranges of
    `sample_bytes` spread evenly over the data (first and last included). Index
    files are hashed whole. All through xxh3-128 (fanout.hashing).

    Why: hashing all of a 16 GB checkpoint takes a minute or more on a network
    filesystem, every producer start. Headers catch any change of architecture,
    dtype or layout; sizes catch truncation; sampled bytes catch re-trained or
    fine-tuned weights (which change essentially every tensor), for ~4 MiB of
    reads per file. What it cannot see: an edit confined to bytes outside the
    samples of a large file (say, one flipped weight) — small files, like the tiny
    test verifiers, are hashed in full so such edits are caught there.
    """
    root = Path(path)
    files = _weight_files(root)
    h = hasher()
    h.update(f"fanout-weights-v1:{full_hash_bytes}:{samples_per_file}:{sample_bytes};".encode())
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size};".encode())
        with open(f, "rb") as fh:
            if size <= full_hash_bytes or f.name in _WEIGHT_INDEXES:
                while chunk := fh.read(8 << 20):
                    h.update(chunk)
                continue
            data_start = 0
            if f.suffix == ".safetensors":
                n = int.from_bytes(fh.read(8), "little")
                h.update(fh.read(n))
                data_start = 8 + n
            last = max(data_start, size - sample_bytes)
            k = max(samples_per_file, 2)
            for j in range(k):
                fh.seek(data_start + (last - data_start) * j // (k - 1))
                h.update(fh.read(sample_bytes))
    return labelled(h)


def _weight_files(root: Path) -> list[Path]:
    files = sorted(
        p
        for p in root.iterdir()
        if p.is_file() and (p.suffix in _WEIGHT_SUFFIXES or p.name in _WEIGHT_INDEXES)
    )
    if not any(p.suffix in _WEIGHT_SUFFIXES for p in files):
        raise ConfigError(
            f"verifier directory {root}: no weight files (*.safetensors or pytorch_model*.bin)"
        )
    return files


def _read_config(root: Path) -> dict[str, Any]:
    if not root.exists():
        raise ConfigError(f"verifier directory {root} does not exist")
    if not root.is_dir():
        raise ConfigError(f"verifier path {root} is not a directory (want a from_pretrained dir)")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"verifier directory {root}: config.json is missing")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_path}:{e.lineno}: invalid JSON: {e.msg}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def check_verifier_dir(path: str | os.PathLike[str]) -> None:
    """What a verifier directory must hold, checked without loading it: a readable
    config.json (a JSON object) and weight files. ConfigError naming what is missing, so
    a command refuses the directory before it creates or loads anything."""
    root = Path(path)
    _read_config(root)
    _weight_files(root)
