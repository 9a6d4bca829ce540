"""The speculators 0.9.0 `config.json` layouts the families write (their export
adapters' shared parts; `Family.speculators_fields` calls these), without torch.

    from fanout.families.speculators_config import block_layout
    block_layout(family("dflash"), draft.cfg, verifier)  # = its speculators_fields
"""

from __future__ import annotations

from typing import Any, Protocol

from fanout.families.numbering import SPECULATORS_VERSION, to_serving_layer_ids
from fanout.model.draft_config import ChainConfig, DraftConfig


class FamilyNames(Protocol):
    """What a layout reads of `fanout.families.base.Family` (a Protocol: base imports
    this module, not the other way round)."""

    @property
    def speculators_model_type(self) -> str: ...
    @property
    def architectures(self) -> tuple[str, ...]: ...
    @property
    def layer_ids_field(self) -> str: ...
    @property
    def sample_from_anchor(self) -> bool: ...
    @property
    def sliding_window_non_causal(self) -> bool: ...
    def speculative_tokens(self, cfg: DraftConfig) -> int: ...
    def config_fields(self, cfg: DraftConfig) -> dict[str, Any]: ...


def transformer_layer_config(
    cfg: DraftConfig, *, model_type: str = "qwen3", architecture: str = "Qwen3ForCausalLM"
) -> dict[str, Any]:
    """speculators' `transformer_layer_config` of a draft of shape `cfg`: a decoder layer
    config of `model_type` (qwen3 for the block drafters, llama for EAGLE-3's) with the
    draft's shapes, full attention in every layer (speculators' trainer defaults to a
    2048-token sliding window), one place for every family's `speculators_fields`."""
    c = cfg
    layer_cfg: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [architecture],
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
    if model_type == "llama":
        layer_cfg["mlp_bias"] = False  # LlamaConfig's field (a Qwen3 config has none)
    return layer_cfg


def proposal_config(fam: FamilyNames, cfg: DraftConfig, verifier: dict[str, Any]) -> dict[str, Any]:
    """`speculators_config`: the greedy proposal of `fam.speculative_tokens` tokens;
    `verifier` is `speculators_config.verifier`."""
    return {
        "algorithm": fam.speculators_model_type,
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": fam.speculative_tokens(cfg),
                "accept_tolerance": 0.0,
                "verifier_accept_k": 1,
            }
        ],
        "default_proposal_method": "greedy",
        "verifier": verifier,
    }


def _head(fam: FamilyNames, cfg: DraftConfig, layer_cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields every layout opens with: the family's names and the layer config."""
    return {
        "speculators_model_type": fam.speculators_model_type,
        # what speculators' save_pretrained of the family's draft writes (the model class)
        "architectures": list(fam.architectures),
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size,
    }


def _tail(fam: FamilyNames, cfg: DraftConfig, verifier: dict[str, Any]) -> dict[str, Any]:
    """The fields every layout closes with: the proposal, dtype, the untied head."""
    return {
        "speculators_config": proposal_config(fam, cfg, verifier),
        "dtype": "bfloat16",
        # the draft's own head is never tied (speculators forces False and writes it)
        "tie_word_embeddings": False,
    }


def block_layout(fam: FamilyNames, cfg: DraftConfig, verifier: dict[str, Any]) -> dict[str, Any]:
    """The DFlash layout (every block family's; MTP's, less what a chain has not): the
    family's names, a Qwen3 layer config, the block and mask token, its own fields
    (`Family.config_fields`)."""
    return {
        **_head(fam, cfg, transformer_layer_config(cfg)),
        "block_size": cfg.block_size,
        "target_hidden_size": cfg.hidden_size,
        fam.layer_ids_field: to_serving_layer_ids(cfg.target_layer_ids),
        "mask_token_id": cfg.mask_token_id,
        "sample_from_anchor": fam.sample_from_anchor,
        "sliding_window_non_causal": fam.sliding_window_non_causal,
        **fam.config_fields(cfg),
        **_tail(fam, cfg, verifier),
    }


def eagle_layout(fam: FamilyNames, cfg: DraftConfig, verifier: dict[str, Any]) -> dict[str, Any]:
    """speculators' `Eagle3SpeculatorConfig` layout (EAGLE-3's, P-EAGLE's): a Llama layer
    config, the aux layers under the family's `layer_ids_field`, the norm flags."""
    assert isinstance(cfg, ChainConfig)
    layer_cfg = transformer_layer_config(cfg, model_type="llama", architecture="LlamaForCausalLM")
    return {
        **_head(fam, cfg, layer_cfg),
        "target_hidden_size": cfg.hidden_size,
        fam.layer_ids_field: to_serving_layer_ids(cfg.target_layer_ids),
        "embed_requires_grad": cfg.embed_requires_grad,
        **fam.config_fields(cfg),
        **_tail(fam, cfg, verifier),
    }


__all__ = ["block_layout", "eagle_layout", "proposal_config", "transformer_layer_config"]
