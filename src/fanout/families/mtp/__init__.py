"""MTP: one multi-token-prediction layer (attention + MLP) over the verifier's final
hidden state and the next token's embedding, with the verifier's whole vocabulary
(fanout.families.mtp.model: the model and loss; .layers: a hybrid verifier's own layer;
.propose: the drafting step; .config: its flags).

    fanout produce --capture-for mtp ...                 # the last decoder layer
    fanout train --draft-family mtp --mtp-steps 3 ...    # reference recipe by default
    fanout eval --draft out/mtp/checkpoint-... --num-speculative-tokens 3

Reference recipe (speculators 0.9.0's `MTPDraftModel.from_training_args` and
`get_trainer_kwargs`): one MTP layer, 3 steps, cross-entropy against the data tokens
weighted per step by FastMTP's normalised 0.6**k, the embedding and head the
verifier's (frozen, not written). Its checkpoint is speculators' `mtp` (`MTPDraftModel`,
`num_nextn_predict_layers` 1); vLLM serves it under method `mtp`, drafting a chain
(`fanout.families.mtp.propose`), which is how `fanout eval` decodes it.

The layer is the one speculators builds for the verifier's model type: for
`qwen3_next`, `qwen3_5_text` and `qwen3_5_moe_text` (Qwen3-Next, Qwen3.5, Qwen3.5-MoE)
the architecture's own full-attention decoder layer (gated attention, partial RoPE,
its MLP or sparse MoE, zero-centred norms; fanout.families.mtp.layers), its config the
verifier's text config (`MTPConfig.layer_config`, written as speculators'
`transformer_layer_config`); for any other verifier a dense Qwen3 layer of its shapes.
A DeepSeek-V3 / GLM-4.5 style MTP layer in the checkpoint is refused in one line:
speculators 0.9.0 has no MTP layer for it.

Start: a verifier that ships its own MTP weights (Qwen3.5 / Qwen3-Next style `mtp.*`
tensors, which transformers drops at load) starts the draft from them, read with
safetensors' `safe_open`, renamed and their per-expert tensors fused as speculators'
`MTPConverter` does (`verifier_mtp_state`); weights that do not fit the layer the
verifier's config describes are refused in one line. Otherwise speculators'
initialisation (normal(0, 0.02) linears, unit norms; fanout.families.mtp.layers for
the hybrid layer's router and experts). `MTP.build` logs which layer and which start.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

from fanout.errors import ConfigError
from fanout.families.chain import ChainFamily
from fanout.families.mtp.config import MTPConfig, MTPRecipe
from fanout.model.draft_config import DraftConfig
from fanout.rows import INPUT_IDS

if TYPE_CHECKING:
    from fanout.families.mtp.model import MTPDraft
    from fanout.model.draft import Draft

log = logging.getLogger(__name__)


class MTP(ChainFamily):
    """One MTP layer drafting a chain (`--mtp-steps` long); the verifier's last layer its
    only input."""

    name = "mtp"
    model_ref = "fanout.families.mtp.model:MTPDraft"
    context_ref = "fanout.families.mtp.propose:MTPContext"
    config_class = MTPConfig
    recipe = MTPRecipe
    recipe_defaults: ClassVar[dict[str, Any]] = {"num_layers": 1, "label_source": INPUT_IDS}
    speculators_model_type = "mtp"
    architectures = ("MTPDraftModel",)
    serving_method = "mtp"

    def default_layers(self, num_verifier_layers: int) -> list[int]:
        """The verifier's last decoder layer (speculators' `[num_hidden_layers]`)."""
        return [num_verifier_layers - 1]

    def build(self, verifier_dir: Any, **fields: Any) -> Draft:
        """A fresh draft (`block_size` mapped to `mtp_steps + 1`, the verifier's last
        layer its input), started from the verifier's own MTP weights where it ships
        them."""
        from fanout.families.mtp.layers import verifier_layer_config
        from fanout.families.mtp.weights import verifier_mtp_state
        from fanout.model.verifier_dir import read_verifier_config

        vdir = Path(verifier_dir)
        fields = self.chain_fields(fields)  # block_size: mtp_steps + 1
        last = self.default_layers(read_verifier_config(vdir)["_num_hidden_layers"])
        if fields.get("target_layer_ids") not in (None, last):
            raise ConfigError(
                f"--draft-layer-ids {fields['target_layer_ids']}: MTP reads the verifier's "
                f"last layer only ({last}); drop it"
            )
        layer_config = verifier_layer_config(vdir)
        kind = "qwen3" if layer_config is None else layer_config["model_type"]
        fields |= {"target_layer_ids": last, "layer_config": layer_config}
        draft = cast("MTPDraft", super().build(vdir, **fields))
        shapes = {k: v.shape for k, v in draft.trainable_state().items()}
        own = verifier_mtp_state(vdir, shapes, zero_centred=layer_config is not None)
        if own is None:
            log.info(
                "mtp: a %s MTP layer; %s ships no mtp.* weights: speculators' "
                "initialisation", kind, vdir,
            )  # fmt: skip
        else:
            dt = draft.compute_dtype
            draft.load_state_dict({k: v.to(dt) for k, v in own.items()}, strict=False)
            log.info(
                "mtp: a %s MTP layer, starting from %s's own MTP weights (%d tensors, "
                "renamed as speculators' MTPConverter)", kind, vdir, len(own),
            )  # fmt: skip
        return draft

    def speculators_fields(self, cfg: DraftConfig, verifier: dict[str, Any]) -> dict[str, Any]:
        """speculators 0.9.0's `MTPSpeculatorConfig`: the verifier's layer config (a
        Qwen3 one of its shapes, its depth as `num_hidden_layers`; a hybrid verifier's
        own text config), `num_nextn_predict_layers` 1, and fanout's layer field (the
        last layer, speculators' `target_layer_ids`): the block drafters' layout, less
        what a chain has not."""
        out = super().speculators_fields(cfg, verifier)
        assert isinstance(cfg, MTPConfig)
        layer = out["transformer_layer_config"]
        depth = cfg.target_layer_ids[0] + 1
        layer |= {"num_hidden_layers": depth, "layer_types": ["full_attention"] * depth}
        if cfg.layer_config is not None:  # the hybrid verifier's own text config
            out["transformer_layer_config"] = dict(cfg.layer_config)
        drop = ("block_size", "target_hidden_size", "mask_token_id", "sample_from_anchor",
                "sliding_window_non_causal", "draft_vocab_size")  # fmt: skip
        return {k: v for k, v in out.items() if k not in drop} | {"num_nextn_predict_layers": 1}

    def layout_fields(self, cfg: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
        from fanout.families.mtp.layers import HYBRID_MODEL_TYPES

        tl = cfg.get("transformer_layer_config") or {}
        hybrid = tl.get("model_type") in HYBRID_MODEL_TYPES
        # the layer an engine builds
        return super().layout_fields(cfg, saved) | {"layer_config": tl if hybrid else None}


FAMILY = MTP()

__all__ = ["FAMILY", "MTP", "MTPConfig"]
