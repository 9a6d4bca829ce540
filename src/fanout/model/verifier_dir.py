"""A verifier directory read without loading the model: the DFlash-relevant fields of
its HF `config.json` and named tensors from its (possibly sharded) safetensors files.

    python -c "from pathlib import Path; from fanout.model.verifier_dir import read_verifier_config; print(read_verifier_config(Path('VERIFIER_DIR')))"

The draft takes its shapes and its frozen embedding / head / norm from here
(fanout.model.dflash.DFlashDraft.from_verifier); `fanout eval` and `load_draft` read
the config the same way (fanout.families.serving).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from fanout.errors import ConfigError


def read_verifier_config(vdir: Path) -> dict[str, Any]:
    """DFlashConfig fields from a HF Qwen3-style `config.json` (+ `_num_hidden_layers`)."""
    path = vdir / "config.json"
    try:
        c = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read verifier config {path}: {e}") from e
    c = c.get("text_config", c)  # multimodal wrappers nest the LM config
    try:
        rope = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta") or 1e4
        return {
            "hidden_size": c["hidden_size"],
            "intermediate_size": c["intermediate_size"],
            "num_attention_heads": c["num_attention_heads"],
            "num_key_value_heads": c.get("num_key_value_heads", c["num_attention_heads"]),
            "head_dim": c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            "rms_norm_eps": c.get("rms_norm_eps", 1e-6),
            "rope_theta": float(rope),
            "max_position_embeddings": c.get("max_position_embeddings", 40960),
            "vocab_size": c["vocab_size"],
            "tie_word_embeddings": bool(c.get("tie_word_embeddings", False)),
            "_num_hidden_layers": c["num_hidden_layers"],
        }
    except KeyError as e:
        raise ConfigError(f"{path}: missing field {e.args[0]!r}") from e


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
