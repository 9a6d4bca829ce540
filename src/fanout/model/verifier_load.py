"""Load a verifier's HF model from a local directory, offline, with clear errors.

    from fanout.model.verifier_load import load_model
    model, device = load_model(VerifierConfig(path="/models/Qwen3-8B"))  # eval, no grads

Checks the directory before transformers reads it (fanout.model.verifier_dir), refuses
`--strict-layer-types` verifiers before the weights load, picks the causal-LM class (a
multimodal checkpoint's image-text-to-text class where there is none), falls back to
eager attention where the class has no sdpa, and refuses weights left missing (which
transformers would fill with random values). fanout.model.verifier wraps the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fanout.errors import ConfigError
from fanout.model.layer_types import PackingRule
from fanout.model.tp_shard import check_tp_model, model_device, tp_load_kwargs
from fanout.model.verifier_config import VerifierConfig, resolve_device, resolve_dtype
from fanout.model.verifier_dir import check_verifier_dir


def load_model(cfg: VerifierConfig) -> tuple[Any, torch.device]:
    from huggingface_hub.errors import StrictDataclassError  # a config that fails validation
    from safetensors import SafetensorError  # a damaged weight file
    from transformers import AutoConfig

    root = Path(cfg.path)
    check_verifier_dir(root)  # clear errors for missing dir / config / weights before HF's
    if cfg.tp > 1:
        check_tp_model(root, cfg.tp)  # before any weight is read
    dev = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, dev)
    bad = (OSError, ValueError, KeyError, RuntimeError, TypeError, SafetensorError)
    try:
        hf_cfg = AutoConfig.from_pretrained(root, local_files_only=True)
    except (*bad, StrictDataclassError) as e:
        raise ConfigError(f"verifier directory {root}: cannot load: {e}") from None
    # --strict-layer-types: unknown layer types refused before the weights load
    PackingRule.from_config(hf_cfg, str(root), strict=cfg.strict_layer_types)
    cls = model_class(hf_cfg, root)
    attn = cfg.attn_implementation
    if attn == "sdpa" and not getattr(cls, "_supports_sdpa", True):
        attn = "eager"  # e.g. attention sinks (gpt-oss), logit soft-capping (Gemma-2)
    try:
        model, info = cls.from_pretrained(
            root,
            dtype=dtype,
            local_files_only=True,
            attn_implementation=attn,
            output_loading_info=True,
            **(tp_load_kwargs(cfg.tp) if cfg.tp > 1 else {}),
        )
    except (*bad, StrictDataclassError) as e:
        raise ConfigError(f"verifier directory {root}: cannot load: {e}") from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:  # transformers would have left them random, silently
        raise ConfigError(
            f"verifier directory {root}: {len(missing)} weights missing for "
            f"{cls.__name__} (first: {missing[0]})"
        )
    if cfg.tp > 1:
        dev = model_device(model)  # transformers put this rank's shard on its device
    else:
        model.to(dev)
    model.eval()
    model.requires_grad_(False)
    return model, dev


def model_class(hf_cfg: Any, root: Path) -> Any:
    """The transformers class a verifier loads as: its causal-LM class (for some
    multimodal checkpoints, e.g. Qwen3.5, a text-only class that reads the text
    weights), else its image-text-to-text class (e.g. Gemma-3's ForConditionalGeneration,
    whose text model is then captured)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    )

    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING):
        if type(hf_cfg) in mapping:
            return mapping[type(hf_cfg)]
    raise ConfigError(
        f"verifier directory {root}: cannot load: {type(hf_cfg).__name__} "
        f"(model_type {hf_cfg.model_type!r}) has no causal-LM class in transformers"
    )
