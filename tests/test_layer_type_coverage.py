"""No verifier transformers can build is refused for an unknown layer type (issue #53).

.venv/bin/python -m pytest tests/test_layer_type_coverage.py -x -q             # classification
.venv/bin/python -m pytest tests/test_layer_type_coverage.py -x -q -m slow     # tiny models too

Every `*ForCausalLM` of the installed transformers whose (text) config has
`layer_types` or a field fanout.model.layer_types reads instead: its default config is
classified by PackingRule (no weights built) and must get a rule, with the layer
types it has none for running each document alone, never a refusal for an unknown
type; --strict-layer-types refuses exactly those. The slow test builds each one as a
tiny random model and captures a packed row through fanout: it equals each document
alone in plain transformers, or fanout refuses it for another reason (no decoder
layers, bidirectional attention, layers whose output is not one state per token),
said in one line.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import verifier_zoo
from fanout.errors import ConfigError
from fanout.model.layer_types import KNOWN_TYPES, UNDECLARED_MIXING_FIELDS, PackingRule

# config fields that say which kind of block a layer is, where `layer_types` is derived
HYBRID_FIELDS = (
    "layers_block_type",
    "hybrid_override_pattern",
    "attn_layer_indices",
    "attn_layer_period",
    "block_types",
    "full_attn_idxs",
    "index_topk",
    *UNDECLARED_MIXING_FIELDS,
)


def _causal_lm_configs() -> list[tuple[str, Any]]:
    """(model_type, default text config) of every causal LM whose config has layer
    types or a hybrid field; configs that do not build from defaults are left out
    (a checkpoint's own config.json is what fanout reads)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    # quiet while 80-odd configs are built from defaults, then as it was: a global
    # verbosity left at "error" hid transformers' load report from a later test
    # (tests/test_speculators.py's control of the missing/unexpected keys warning)
    was = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return _configs_with_layer_types(CONFIG_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    finally:
        transformers.logging.set_verbosity(was)


def _configs_with_layer_types(config_mapping: Any, names: Any) -> list[tuple[str, Any]]:
    CONFIG_MAPPING = config_mapping  # transformers' name for it
    out = []
    for model_type in sorted(names):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cfg = CONFIG_MAPPING[model_type]()
                text = cfg.get_text_config()
        except Exception:
            continue
        if getattr(text, "layer_types", None) is not None or any(
            getattr(text, f, None) is not None for f in HYBRID_FIELDS
        ):
            out.append((model_type, cfg))
    return out


CONFIGS = _causal_lm_configs()


def _text(cfg: Any) -> Any:
    try:
        return cfg.get_text_config()
    except AttributeError:  # a config whose text config reads back only once
        return cfg


def test_the_enumeration_sees_the_hybrids() -> None:
    # the control: the classes the issue names are among those checked
    types = {t for _, cfg in CONFIGS for t in (getattr(_text(cfg), "layer_types", None) or ())}
    assert {"hybrid", "conv", "indexed_attention", "mlp", "linear_attention"} <= types, types
    assert {"falcon_h1", "nemotron_h", "deepseek_v32", "lfm2", "qwen3_next"} <= {
        m for m, _ in CONFIGS
    }


@pytest.mark.parametrize(("model_type", "cfg"), CONFIGS, ids=[m for m, _ in CONFIGS])
def test_no_causal_lm_is_refused_for_an_unknown_layer_type(model_type: str, cfg: Any) -> None:
    try:
        rule = PackingRule.from_config(cfg, model_type)
    except ConfigError as e:  # another reason (bidirectional, a window size unset): fine
        assert "no packing rule" not in str(e) and "\n" not in str(e), str(e)
        return
    assert len(rule.layer_types) == int(_text(cfg).num_hidden_layers) or rule.unruled
    for t in rule.layer_types:  # every layer has a rule, or runs each document alone
        assert t in KNOWN_TYPES or t in rule.unruled, (model_type, t)
    if rule.unruled:
        assert rule.needs_alone(1)
        with pytest.raises(ConfigError, match="strict-layer-types"):
            PackingRule.from_config(cfg, model_type, strict=True)
    else:
        assert PackingRule.from_config(cfg, model_type, strict=True) == rule


# sizes a tiny model of any of these configs takes, where the config has the field
_TINY: dict[str, Any] = {
    **verifier_zoo._COMMON,  # the zoo's tiny sizes, then the fields only some configs have
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "attention_chunk_size": 8,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 8,
}


def _tiny(model_type: str, cfg: Any) -> Any:
    """`cfg`'s class with tiny sizes and at most 4 layers (its own layer-type pattern's
    first 4), or None where such a config does not build."""
    text = _text(cfg)
    if text is not cfg:
        return None  # multimodal: the zoo covers the text towers that matter
    try:  # a field a heterogeneous config refuses to read globally: not this test's
        kw = {k: v for k, v in _TINY.items() if hasattr(text, k)}
    except Exception:
        return None
    for k in ("sliding_window", "attention_chunk_size"):  # only where the model has them
        if k in kw and getattr(text, k) is None:
            del kw[k]
    n = min(4, int(text.num_hidden_layers))
    kw["num_hidden_layers"] = n
    if getattr(text, "layer_types", None) is not None:
        kw["layer_types"] = list(text.layer_types)[:n]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return type(cfg)(**kw)
    except Exception:
        return None


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "cfg"), CONFIGS, ids=[m for m, _ in CONFIGS])
def test_each_tiny_causal_lm_is_captured_exactly_or_refused_for_a_reason(
    model_type: str, cfg: Any, tmp_path: Path
) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from fanout.model.verifier import load_verifier

    tiny = _tiny(model_type, cfg)
    if tiny is None:
        pytest.skip(f"{model_type}: no tiny config from defaults")
    torch.manual_seed(0)
    try:
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(tiny)](tiny).eval()  # type: ignore[operator]
        with torch.inference_mode():
            model(input_ids=torch.arange(1, 13)[None], use_cache=False)
        model.save_pretrained(tmp_path)
    except Exception as e:
        pytest.skip(f"{model_type}: tiny model does not run: {type(e).__name__}")
    try:
        v = load_verifier(tmp_path, device="cpu", dtype="float32", storage_dtype="float32",
                          capture_layer_ids=["all"])  # fmt: skip
    except ConfigError as e:
        assert "no packing rule" not in str(e) and "\n" not in str(e), str(e)
        return
    lens, t = [12, 20, 9], 48
    ids = torch.randint(1, 160, (1, t), generator=torch.Generator().manual_seed(3))
    pos = torch.cat([torch.arange(n) for n in lens] + [torch.arange(t - sum(lens))])[None]
    doc = torch.tensor([k for k, n in enumerate(lens) for _ in range(n)]
                       + [-1] * (t - sum(lens)))[None]  # fmt: skip
    try:
        cap = v.capture(ids, pos, doc)
    except ConfigError as e:  # refused at the first capture (a layer output's shape)
        assert "no packing rule" not in str(e) and "\n" not in str(e), str(e)
        return
    layers = model.model.layers  # the oracle's own (fanout's text_model found v's)
    outs: list[torch.Tensor] = [torch.empty(0)] * len(layers)

    def hook(_m: Any, _a: Any, out: Any, i: int) -> None:
        outs[i] = (out[0] if isinstance(out, tuple) else out)[0].clone()

    hs = [lay.register_forward_hook(lambda m, a, o, i=i: hook(m, a, o, i))
          for i, lay in enumerate(layers)]  # fmt: skip
    s = 0
    for n in lens:
        with torch.inference_mode():
            model(input_ids=ids[:, s : s + n], use_cache=False)
        for j, ref in enumerate(outs):
            got = cap.layers[j][0, s : s + n]
            scale = max(ref.abs().max().item(), 1e-6)
            rel = (got - ref).abs().max().item() / scale
            assert rel < 1e-4, f"{model_type} document of {n}, layer {j}: {rel:.1e}"
        s += n
    for h in hs:
        h.remove()


def test_token_wise_layers_take_no_mask_of_their_own() -> None:
    # Nemotron-H-like types packed under masks: `mlp` / `moe` mix no tokens, so they
    # cost no mask memory; their keys hold the first mask (models look every type up).
    rule = PackingRule(("full_attention", "mlp", "sliding_attention", "moe"), sliding_window=2)
    assert rule.mask_types == ("full_attention", "sliding_attention")
    assert not rule.needs_alone(64) and rule.mask_bytes(1, 4, 1) == 2 * 16
    doc = torch.tensor([[0, 0, 0, 1]])
    masks = rule.masks(doc, torch.tensor([[0, 1, 2, 0]]))
    assert isinstance(masks, dict) and list(masks) == list(rule.distinct)
    assert masks["mlp"] is masks["full_attention"] and masks["moe"] is masks["full_attention"]
    assert not torch.equal(masks["sliding_attention"], masks["full_attention"])
    only = PackingRule(("mlp", "mlp"))  # no attention at all: still one (full) mask
    assert only.mask_types == ("full_attention",) and isinstance(only.masks(doc, doc), torch.Tensor)
