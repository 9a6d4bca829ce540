"""Tiny random verifiers of every architecture fanout captures, built offline.

    from verifier_zoo import ZOO, build, load_oracle   # tests/ is on sys.path under pytest
    path = build("gemma3_text", tmp_dir)      # save_pretrained dir: config.json + weights
    model = load_oracle("gemma3_text", path)  # the same weights in plain transformers
    build("falcon_h1", tmp_dir)               # HYBRID_AND_SPARSE: Mamba-2 beside attention

Each entry builds a seeded, random-init model from transformers' own config class
(hidden 32, 2-4 layers, vocab 160, a few experts) and `save_pretrained`s it: no
download. Sliding windows and attention chunks are 8 tokens, so documents of 10-30
tokens cross them. Nothing here imports fanout: the test compares fanout's capture
against these models run by transformers alone.

ZOO holds the attention and linear-attention architectures; HYBRID_AND_SPARSE the
hybrid and sparse-attention ones: Nemotron-H (Mamba-2, attention-free `mlp` and `moe`
blocks beside attention), Falcon-H1 (`hybrid`: attention and Mamba-2 in parallel),
LFM2 (`conv`: short convolutions) and DeepSeek-V3.2 (`indexed_attention`: a lightning
indexer's top-k). Both are captured exactly (tests/test_verifier_zoo.py), decoded
losslessly (tests/test_eval_zoo.py) and trained by every draft family
(tests/test_zoo_families.py); HYBRID_AND_SPARSE is apart because tensor parallelism
and batched regeneration are not tested on it (tests/test_tp.py and
tests/test_regen_zoo.py take ZOO alone).
`build` and `load_oracle` take either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

VOCAB = 160
WINDOW = 8  # sliding window / attention chunk of the zoo's local-attention layers
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 512,
    # larger than the 0.02 default, so attention is far from uniform and a wrong
    # mask shows up as a large difference rather than a small one
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    # the real checkpoints' special-token ids lie outside the tiny vocabulary
    "pad_token_id": 0,
    "bos_token_id": None,
    "eos_token_id": None,
}
# DeepSeek's multi-head latent attention and group-limited MoE, tiny (V3 and V3.2)
_MLA: dict[str, Any] = {
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "n_routed_experts": 4,
    "n_group": 2,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "first_k_dense_replace": 1,
}


@dataclass(frozen=True, slots=True)
class Arch:
    """One zoo entry: how to build its config and which class to save it with."""

    config: Callable[..., Any]  # a transformers config object (text ones take overrides)
    model_class: str  # transformers class the checkpoint is saved (and oracle-loaded) with


def _cfg(cls_name: str, **kw: Any) -> Callable[..., Any]:
    def make(**over: Any) -> Any:
        import transformers

        return getattr(transformers, cls_name)(**(_COMMON | kw | over))

    return make


def _qwen3_5_multimodal() -> Any:
    from transformers import Qwen3_5Config

    text = _COMMON | {"num_hidden_layers": 4, **_LINEAR}
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 32,
        "num_position_embeddings": 16,
        "patch_size": 4,
    }
    return Qwen3_5Config(text_config=text, vision_config=vision)


def _gemma3_multimodal() -> Any:
    from transformers import Gemma3Config

    text = _COMMON | {
        "num_hidden_layers": 4,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 16,
        "patch_size": 4,
    }
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)


# the linear-attention (gated delta rule) sizes of Qwen3-Next / Qwen3.5
_LINEAR: dict[str, Any] = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
_MOE: dict[str, Any] = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}

ZOO: dict[str, Arch] = {
    "qwen3": Arch(_cfg("Qwen3Config", num_hidden_layers=3), "Qwen3ForCausalLM"),
    "llama": Arch(_cfg("LlamaConfig", num_hidden_layers=3), "LlamaForCausalLM"),
    "qwen3_moe": Arch(_cfg("Qwen3MoeConfig", num_hidden_layers=2, **_MOE), "Qwen3MoeForCausalLM"),
    "glm4_moe": Arch(
        _cfg(
            "Glm4MoeConfig",
            num_hidden_layers=3,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
        ),
        "Glm4MoeForCausalLM",
    ),
    "deepseek_v3": Arch(  # MLA + group-limited MoE routing
        _cfg(
            "DeepseekV3Config",
            num_hidden_layers=3,
            num_key_value_heads=4,
            **_MLA,
        ),
        "DeepseekV3ForCausalLM",
    ),
    "phi3": Arch(_cfg("Phi3Config", num_hidden_layers=3), "Phi3ForCausalLM"),
    # a final norm without a weight (also applied to the embeddings), QK norm, relu²,
    # logit soft-capping (its default, 15)
    "nanochat": Arch(_cfg("NanoChatConfig", num_hidden_layers=3), "NanoChatForCausalLM"),
    "olmo2": Arch(_cfg("Olmo2Config", num_hidden_layers=3), "Olmo2ForCausalLM"),
    "gemma2": Arch(  # alternating sliding / full, logit soft-capping
        _cfg("Gemma2Config", num_hidden_layers=4, sliding_window=WINDOW), "Gemma2ForCausalLM"
    ),
    "gemma3_text": Arch(  # sliding 3:1 full
        _cfg(
            "Gemma3TextConfig",
            num_hidden_layers=4,
            sliding_window=WINDOW,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
        ),
        "Gemma3ForCausalLM",
    ),
    "gemma3_multimodal": Arch(_gemma3_multimodal, "Gemma3ForConditionalGeneration"),
    "mistral_sliding": Arch(  # no layer_types: every layer slides
        _cfg("MistralConfig", num_hidden_layers=3, sliding_window=WINDOW), "MistralForCausalLM"
    ),
    "qwen3_next": Arch(  # gated delta rule (linear attention) 3:1 full, MoE
        _cfg(
            "Qwen3NextConfig",
            num_hidden_layers=4,
            shared_expert_intermediate_size=16,
            **_LINEAR,
            **_MOE,
        ),
        "Qwen3NextForCausalLM",
    ),
    "qwen3_5_text": Arch(
        _cfg("Qwen3_5TextConfig", num_hidden_layers=4, **_LINEAR), "Qwen3_5ForCausalLM"
    ),
    "qwen3_5_multimodal": Arch(_qwen3_5_multimodal, "Qwen3_5ForConditionalGeneration"),
    "gpt_oss": Arch(  # attention sinks, alternating sliding / full, MoE
        _cfg(
            "GptOssConfig",
            num_hidden_layers=4,
            sliding_window=WINDOW,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=131072,  # = its YaRN factor x 4096, as in the release
        ),
        "GptOssForCausalLM",
    ),
    "llama4_text": Arch(  # chunked (RoPE) 1:1 full (NoPE, temperature-tuned past floor_scale)
        _cfg(
            "Llama4TextConfig",
            num_hidden_layers=4,
            attention_chunk_size=WINDOW,
            no_rope_layer_interval=2,
            floor_scale=16,  # rows longer than this scale NoPE queries by their row index
            num_local_experts=4,
            intermediate_size_mlp=64,
        ),
        "Llama4ForCausalLM",
    ),
}


# The hybrid and sparse-attention architectures (see the module doc).
HYBRID_AND_SPARSE: dict[str, Arch] = {
    "nemotron_h": Arch(  # Mamba-2, attention-free MLP and MoE blocks, attention
        _cfg(
            "NemotronHConfig",
            layers_block_type=["linear_attention", "mlp", "full_attention", "moe"],
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16,
            mamba_num_heads=4,
            mamba_head_dim=8,
            ssm_state_size=8,
            n_groups=2,
            chunk_size=8,
        ),
        "NemotronHForCausalLM",
    ),
    "falcon_h1": Arch(  # attention and Mamba-2 in parallel in every layer (`hybrid`)
        _cfg(
            "FalconH1Config",
            num_hidden_layers=2,
            mamba_d_ssm=32,
            mamba_n_heads=4,
            mamba_d_head=8,
            mamba_d_state=8,
            mamba_n_groups=2,
            mamba_chunk_size=8,
        ),
        "FalconH1ForCausalLM",
    ),
    "lfm2": Arch(  # short causal convolutions (`conv`) around one attention layer
        _cfg("Lfm2Config", num_hidden_layers=3, full_attn_idxs=[1], conv_L_cache=3),
        "Lfm2ForCausalLM",
    ),
    "deepseek_v32": Arch(  # MLA with a lightning indexer's top-k (`indexed_attention`)
        _cfg(
            "DeepseekV32Config",
            num_hidden_layers=2,
            num_key_value_heads=4,
            **_MLA,
            index_topk=WINDOW,  # fewer keys than a document has: the top-k chooses
            index_n_heads=16,  # the ReLU scores of few heads tie at 0 (top-k: any order)
            index_head_dim=16,
        ),
        "DeepseekV32ForCausalLM",
    ),
}


def packed_row(
    docs: tuple[int, ...], seed: int = 3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, position_ids, document_ids `[1, T]` of one row packing documents of
    lengths `docs` (random tokens, positions restarting per document)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (1, sum(docs)), generator=g)
    pos = torch.cat([torch.arange(n) for n in docs])[None]
    doc = torch.cat([torch.full((n,), d) for d, n in enumerate(docs)])[None]
    return ids, pos, doc


def doc_spans(docs: tuple[int, ...]) -> list[tuple[int, int]]:
    """Each document's `(start, end)` in the packed row of `packed_row(docs)`."""
    ends = torch.tensor(docs).cumsum(0).tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _arch(name: str) -> Arch:
    return ZOO[name] if name in ZOO else HYBRID_AND_SPARSE[name]


def build(arch: str, out_dir: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Build zoo entry `arch` with random weights (seeded) and save it to `out_dir`;
    `overrides`: config fields instead of the zoo's (text-only entries; the
    benchmarks' larger sizes)."""
    import transformers

    a = _arch(arch)
    cfg = a.config(**overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, a.model_class)(cfg)
    model.save_pretrained(out_dir)
    return out_dir


def load_oracle(arch: str, path: Path, *, attn_implementation: str | None = None) -> Any:
    """The saved model in plain transformers (fp32, CPU, eval), the class it was saved
    with; attention as given, else as transformers picks it for that class."""
    import transformers

    cls = getattr(transformers, _arch(arch).model_class)
    model = cls.from_pretrained(
        path, dtype=torch.float32, local_files_only=True, attn_implementation=attn_implementation
    )
    return model.eval().requires_grad_(False)


def add_mtp(path: Path, *, seed: int = 1) -> dict[str, torch.Tensor]:
    """Write a random MTP layer into the checkpoint at `path` as the real Qwen3-Next /
    Qwen3.5 / Qwen3.5-MoE checkpoints ship it (tensors transformers drops at load), and
    return them (bf16, by name): `mtp.fc.weight` [H, 2H], `mtp.norm.weight`,
    `mtp.pre_fc_norm_hidden.weight`, `mtp.pre_fc_norm_embedding.weight`, and the
    architecture's decoder layer at its last full-attention index (transformers' own
    class) as `mtp.layers.0.*`, a MoE layer's experts one tensor per expert and
    projection (`mlp.experts.{i}.gate_proj.weight`, ...) as the checkpoints and
    `save_pretrained` store them. Norm weights are drawn too (zero-centred: 0 is a gain
    of 1), so a dropped or mis-named norm shows."""
    import importlib
    import json

    import transformers
    from safetensors.torch import load_file, save_file
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cfg = transformers.AutoConfig.from_pretrained(path)
    cfg = getattr(cfg, "text_config", None) or cfg
    lm: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]  # e.g. Qwen3NextForCausalLM
    modeling = importlib.import_module(lm.__module__)
    layer_cls = getattr(modeling, lm.__name__.replace("ForCausalLM", "DecoderLayer"))
    idx = max(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
    torch.manual_seed(seed)
    layer = layer_cls(cfg, idx)
    g = torch.Generator().manual_seed(seed)
    h = cfg.hidden_size
    out: dict[str, torch.Tensor] = {
        "mtp.fc.weight": 0.1 * torch.randn(h, 2 * h, generator=g),
        "mtp.norm.weight": 0.1 * torch.randn(h, generator=g),
        "mtp.pre_fc_norm_hidden.weight": 0.1 * torch.randn(h, generator=g),
        "mtp.pre_fc_norm_embedding.weight": 0.1 * torch.randn(h, generator=g),
    }
    for k, v in layer.state_dict().items():
        t = 0.1 * torch.randn(v.shape, generator=g)
        if k.endswith("experts.gate_up_proj"):  # [E, 2I, H] -> per expert gate, up
            for i, expert in enumerate(t.unbind(0)):
                gate, up = expert.chunk(2, dim=0)
                out[f"mtp.layers.0.mlp.experts.{i}.gate_proj.weight"] = gate
                out[f"mtp.layers.0.mlp.experts.{i}.up_proj.weight"] = up
        elif k.endswith("experts.down_proj"):
            for i, down in enumerate(t.unbind(0)):
                out[f"mtp.layers.0.mlp.experts.{i}.down_proj.weight"] = down
        else:
            out[f"mtp.layers.0.{k}"] = t
    out = {k: v.contiguous().bfloat16() for k, v in out.items()}
    first = sorted(path.glob("*.safetensors"))[0]
    save_file({**load_file(str(first)), **out}, str(first), metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.exists():
        idx_json = json.loads(index.read_text())
        idx_json["weight_map"] |= {n: first.name for n in out}
        index.write_text(json.dumps(idx_json))
    return out
