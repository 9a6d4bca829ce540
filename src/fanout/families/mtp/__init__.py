"""MTP: one multi-token-prediction layer (attention + MLP) over the verifier's final
hidden state and the next token's embedding, with the verifier's whole vocabulary
(fanout.families.mtp.model: the model and loss; .propose: the drafting step; .config:
its flags).

    fanout produce --capture-for mtp ...                 # the last decoder layer
    fanout train --draft-family mtp --mtp-steps 3 ...    # reference recipe by default
    fanout eval --draft out/mtp/checkpoint-... --num-speculative-tokens 3

Reference recipe (speculators 0.9.0's `MTPDraftModel.from_training_args` and
`get_trainer_kwargs`): one Qwen3 MTP layer, 3 steps, cross-entropy against the data
tokens weighted per step by FastMTP's normalised 0.6**k, the embedding and head the
verifier's (frozen, not written). Its checkpoint is speculators' `mtp` (`MTPDraftModel`,
`num_nextn_predict_layers` 1); vLLM serves it under method `mtp`, drafting a chain
(`fanout.families.mtp.propose`), which is how `fanout eval` decodes it.

Start: a verifier that ships its own MTP weights (Qwen3.5 / Qwen3-Next / DeepSeek-V3
style `mtp.*` tensors, which transformers drops at load) starts the draft from them,
read with safetensors' `safe_open` and renamed as speculators' `MTPConverter` does
(`verifier_mtp_state`); weights that do not fit the layer the verifier's config
describes are refused in one line. Otherwise speculators' initialisation (normal(0,
0.02) linears, unit norms). `MTP.build` logs which.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import BaseModel

from fanout.errors import ConfigError
from fanout.families.base import Family
from fanout.families.mtp.config import MTPConfig, MTPRecipe, shared_field_problem
from fanout.families.mtp.model import MTPDraft
from fanout.families.mtp.propose import MTPContext
from fanout.model.dflash import DFlashConfig, DFlashDraft, DraftRecipe
from fanout.model.draft_cache import DraftContext
from fanout.rows import INPUT_IDS

log = logging.getLogger(__name__)

# speculators' MTPConverter renames (verifier checkpoint -> MTPDraftModel)
_EXACT = {
    "mtp.fc.weight": "mtp_layers.0.input_proj.weight",
    "mtp.norm.weight": "mtp_layers.0.final_layernorm.weight",
}
_PREFIX = (
    ("mtp.pre_fc_norm_hidden.", "mtp_layers.0.hidden_layernorm."),
    ("mtp.pre_fc_norm_embedding.", "mtp_layers.0.token_layernorm."),
    ("mtp.layers.0.", "mtp_layers.0."),
)


def _renamed(key: str) -> str:
    if key in _EXACT:
        return _EXACT[key]
    for src, dst in _PREFIX:
        if key.startswith(src):
            return dst + key[len(src) :]
    return key


def verifier_mtp_state(
    verifier_dir: Path, shapes: dict[str, torch.Size]
) -> dict[str, torch.Tensor] | None:
    """The verifier's own MTP weights under the draft's names (None: it ships none), its
    norm gains as the draft's norms multiply by (a zero-centred norm's w + 1). Raises
    ConfigError in one line when they do not fit `shapes` (the draft's tensors)."""
    from fanout.model.verifier_dir import _tensor_names, read_verifier_tensors, text_tensors

    names = sorted(n for n in _tensor_names(verifier_dir) if n.startswith("mtp."))
    if not names:
        return None
    offset = text_tensors(verifier_dir).norm_offset
    by_name = {_renamed(n): n for n in names}
    where = f"verifier {verifier_dir}'s mtp.* weights"
    unexpected = sorted(k for k in by_name if k not in shapes)
    missing = sorted(k for k in shapes if k not in by_name)
    if unexpected or missing:
        bad = [by_name[k] for k in unexpected[:3]] + missing[:3]
        raise ConfigError(
            f"--draft-family mtp: {where} do not match the dense Qwen3 MTP layer its config "
            f"describes ({len(unexpected)} unexpected, {len(missing)} missing: "
            f"{', '.join(bad)}); a gated-attention / MoE / MLA MTP layer is not one fanout's "
            "mtp trains"
        )
    tensors = read_verifier_tensors(verifier_dir, names)
    out = {}
    for k, n in by_name.items():
        t = tensors[n]
        if t.shape != shapes[k]:
            raise ConfigError(
                f"--draft-family mtp: {where}: {n} is {list(t.shape)}, but the verifier's "
                f"config gives {list(shapes[k])}"
            )
        out[k] = t.float() + offset if (offset and "norm" in k) else t
    return out


class MTP(Family):
    """One MTP layer drafting a chain; the verifier's last layer its only input."""

    name: ClassVar[str] = "mtp"
    draft_class: ClassVar[type[DFlashDraft]] = MTPDraft
    recipe: ClassVar[type[BaseModel]] = MTPRecipe
    recipe_defaults: ClassVar[dict[str, Any]] = {"num_layers": 1, "label_source": INPUT_IDS}
    speculators_model_type: ClassVar[str] = "mtp"
    architectures: ClassVar[tuple[str, ...]] = ("MTPDraftModel",)
    serving_method: ClassVar[str] = "mtp"

    def default_layers(self, num_verifier_layers: int) -> list[int]:
        """The verifier's last decoder layer (speculators' `[num_hidden_layers]`)."""
        return [num_verifier_layers - 1]

    def draft_layers(self, captured: list[int], verifier_dir: Path) -> list[int]:
        from fanout.model.verifier_dir import read_verifier_config

        return self.default_layers(read_verifier_config(verifier_dir)["_num_hidden_layers"])

    def block_size_for(self, width: int) -> int:
        return self.verify_width({})

    def verify_width(self, recipe: dict[str, Any]) -> int:
        return int(recipe.get("mtp_steps", MTPRecipe().mtp_steps)) + 1

    def row_length_error(self, recipe: dict[str, Any], seq_len: int, where: str) -> str | None:
        need = self.verify_width(recipe) + 1  # step K-1 of row 0 predicts token K+1
        if seq_len >= need:
            return None
        return (
            f"--mtp-steps {need - 2} does not fit {where}'s rows of T = {seq_len} tokens: "
            f"its last step predicts token mtp_steps + 1, so T must be >= {need}"
        )

    def build(self, verifier_dir: Any, **fields: Any) -> DFlashDraft:
        """A fresh draft (`block_size` mapped to `mtp_steps + 1`, the verifier's last
        layer its input), started from the verifier's own MTP weights where it ships
        them."""
        from fanout.model.verifier_dir import read_verifier_config

        vdir = Path(verifier_dir)
        steps = int(fields.get("mtp_steps", MTPRecipe().mtp_steps))
        bs = fields.get("block_size")
        given = None if bs == DraftRecipe().block_size else bs
        problem = shared_field_problem(steps, given, None, "exp", "ce", None)
        if problem:
            raise ConfigError(problem)
        last = self.default_layers(read_verifier_config(vdir)["_num_hidden_layers"])
        if fields.get("target_layer_ids") not in (None, last):
            raise ConfigError(
                f"--draft-layer-ids {fields['target_layer_ids']}: MTP reads the verifier's "
                f"last layer only ({last}); drop it"
            )
        draft = super().build(
            vdir, **(fields | {"block_size": steps + 1, "target_layer_ids": last})
        )
        shapes = {k: v.shape for k, v in draft.trainable_state().items()}
        own = verifier_mtp_state(vdir, shapes)
        if own is None:
            log.info("mtp: %s ships no mtp.* weights; speculators' initialisation", vdir)
        else:
            dt = draft.fc.weight.dtype
            draft.load_state_dict({k: v.to(dt) for k, v in own.items()}, strict=False)
            log.info("mtp: starting from %s's own MTP weights (%d tensors)", vdir, len(own))
        return draft

    def shared_conflict(self, values: dict[str, Any], given: set[str]) -> str | None:
        bs = values["block_size"] if "block_size" in given else None
        if bs == DraftRecipe().block_size:
            bs = None  # a whole config written back carries the shared default
        return shared_field_problem(
            int(values.get("mtp_steps", MTPRecipe().mtp_steps)), bs, values.get("gamma"),
            values.get("loss_weighting", "exp"), values.get("loss_type", "ce"),
            values.get("draft_vocab_size"),
        )  # fmt: skip

    def speculative_tokens(self, cfg: DFlashConfig) -> int:
        """speculators writes its steps as the greedy proposal's tokens."""
        assert isinstance(cfg, MTPConfig)
        return cfg.mtp_steps

    def speculators_fields(self, cfg: DFlashConfig, verifier: dict[str, Any]) -> dict[str, Any]:
        """speculators 0.9.0's `MTPSpeculatorConfig`: the verifier's (Qwen3) layer config
        (its depth as `num_hidden_layers`), `num_nextn_predict_layers` 1, and fanout's
        layer field (the last layer, speculators' `target_layer_ids`)."""
        out = super().speculators_fields(cfg, verifier)
        layer = out["transformer_layer_config"]
        depth = cfg.target_layer_ids[0] + 1
        layer |= {"num_hidden_layers": depth, "layer_types": ["full_attention"] * depth}
        drop = ("block_size", "target_hidden_size", "mask_token_id", "sample_from_anchor",
                "sliding_window_non_causal", "draft_vocab_size")  # fmt: skip
        return {k: v for k, v in out.items() if k not in drop} | {"num_nextn_predict_layers": 1}

    def layout_fields(self, cfg: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
        steps = int(saved.get("mtp_steps", MTPRecipe().mtp_steps))
        return {"block_size": steps + 1, "mask_token_id": saved["mask_token_id"]}

    def context(self, draft: DFlashDraft, *, cached: bool = True) -> DraftContext:
        return self.drafting_context(draft, cached=cached)

    def drafting_context(
        self, draft: DFlashDraft, *, cached: bool = True, num_speculative_tokens: int | None = None
    ) -> DraftContext:
        """Chain drafting of `num_speculative_tokens` (default: the draft's mtp_steps)."""
        if not isinstance(draft, MTPDraft):
            raise ConfigError(f"the mtp family drafts with an MTPDraft, got {type(draft).__name__}")
        return MTPContext(draft, num_speculative_tokens=num_speculative_tokens, cached=cached)


FAMILY = MTP()

__all__ = ["FAMILY", "MTP", "MTPConfig", "MTPDraft", "verifier_mtp_state"]
