"""What every draft family declares: the seam between the shared trainer, checkpoint
and decoding code and one family's folder.

    from fanout.families import family
    fam = family("dspark")
    draft = fam.build("models/qwen3-8b", target_layer_ids=[1, 9, 17, 25, 33])
    ctx = fam.context(draft, cached=True)  # the drafting step fanout eval runs

A family is a `Family` subclass with one instance in `fanout.families.registry`. It
names its model (`model_ref`, imported on first use of `draft_class`: the registry and
the configs load without torch) and its validated config (`config_class`), its
own flags (`recipe`, a pydantic model mixed into `fanout train`'s config; its field
names are unique across families), the shared recipe fields whose reference value
differs from DFlash's (`recipe_defaults`), what its checkpoint writes beyond the DFlash
fields (`config_fields`), what the capture must hold (`needs_last_hidden_states`) and
its drafting step (`context`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from fanout.model.draft_config import DFlashConfig, DraftRecipe, default_target_layer_ids

if TYPE_CHECKING:  # the model side imports torch: loaded on first use (`draft_class`)
    from fanout.model.dflash import DFlashDraft
    from fanout.model.draft_cache import DraftContext


class NoOptions(BaseModel):
    """A family without flags of its own."""


class Family:
    """One draft family (see the module docstring); subclasses set the class vars."""

    name: ClassVar[str]  # --draft-family value
    # its model, "module:Class", imported (with torch) on first use of `draft_class`, so
    # that the registry and every config (flags, checks) load without torch
    model_ref: ClassVar[str]
    # its validated config (the model's `config_class`; tests/test_families.py checks)
    config_class: ClassVar[type[DFlashConfig]] = DFlashConfig
    recipe: ClassVar[type[BaseModel]] = NoOptions
    # shared DraftRecipe fields (block_size, max_anchors, ...) whose reference value
    # for this family differs from the DraftRecipe default
    recipe_defaults: ClassVar[dict[str, Any]] = {}
    # speculators 0.9.0's names for it
    speculators_model_type: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]]
    # vLLM's `--speculative-config` method that serves it (docs/eval.md)
    serving_method: ClassVar[str]
    # vLLM has a proposer for it (False: fanout eval runs speculators' reference decoding)
    served_by_vllm: ClassVar[bool] = True
    # slot 0 (the anchor) predicts the next token too (DSpark): bs drafted tokens, not bs-1
    sample_from_anchor: ClassVar[bool] = False
    # speculators' `sliding_window_non_causal` default for the family (written as is)
    sliding_window_non_causal: ClassVar[bool] = False
    # its reference recipe trains on the verifier's final hidden states (what
    # `fanout produce --capture-for` captures for it)
    captures_last_hidden_states: ClassVar[bool] = False
    # the config.json field holding its layers in serving numbering (fanout ids + 1;
    # fanout.families.serving converts both ways)
    layer_ids_field: ClassVar[str] = "aux_hidden_state_layer_ids"
    # tensors its model.safetensors holds that training never changes: the verifier's
    # head rows and the draft-vocabulary maps (what a parameter count leaves out)
    frozen_tensors: ClassVar[frozenset[str]] = frozenset({"lm_head.weight", "d2t", "t2d"})

    @property
    def draft_class(self) -> type[DFlashDraft]:
        """Its model class (`model_ref`), imported on first use."""
        module, cls = self.model_ref.split(":")
        draft_class: type[DFlashDraft] = getattr(importlib.import_module(module), cls)
        return draft_class

    def default_layers(self, num_verifier_layers: int) -> list[int]:
        """The verifier layers its reference recipe reads (fanout's decoder-layer ids),
        what `fanout produce --capture-for` captures for it: the DFlash rule for the
        recipe's depth, with as many layers as the verifier's [1, L - 3] span holds (the
        demo's 6-layer verifier: 1, 2, 3)."""
        depth = {**DraftRecipe().model_dump(), **self.recipe_defaults}["num_layers"]
        fits = max(1, min(depth, num_verifier_layers - 3))
        return default_target_layer_ids(num_verifier_layers, fits)

    def draft_layers(self, captured: list[int], verifier_dir: Path) -> list[int]:
        """The layers a trainer of this family reads when `--draft-layer-ids` is not
        given: every captured one (DFlash families fuse any number)."""
        return captured

    def default_draft_vocab_size(self, vocab_size: int) -> int | None:
        """The draft vocabulary its reference recipe trains when `--draft-vocab-size` is
        not given (None: the verifier's whole vocabulary)."""
        return None

    def block_size_for(self, width: int) -> int:
        """The `--block-size` this family trains in a side-by-side comparison at block
        `width` (the demo, benchmarks/families.py): a block family takes it; a chain
        family's verify width is its own (EAGLE-3: --ttt-steps + 1)."""
        return width

    def verify_width(self, recipe: dict[str, Any]) -> int:
        """Tokens one verify step of its recipe `recipe` (field -> value) checks: the block."""
        return int(recipe["block_size"])

    def row_length_error(self, recipe: dict[str, Any], seq_len: int, where: str) -> str | None:
        """Why rows of `seq_len` tokens cannot train this recipe (None: they can)."""
        bs = self.verify_width(recipe)
        if bs < seq_len:
            return None
        return (  # no anchor fits (fanout.model.anchors): every step would be empty
            f"--block-size {bs} does not fit {where}'s rows of T = {seq_len} "
            f"tokens (its seq_len): an anchor must lie before position T - block size, "
            f"so the largest block that can train is {seq_len - 1} (anchored at position 0 "
            "only; a block well below T leaves room for anchors)"
        )

    def shared_conflict(self, values: dict[str, Any], given: set[str]) -> str | None:
        """Why shared recipe values (`values`: field -> value of `fanout train`'s config;
        `given`: the fields set on its command line or --config) do not apply to this
        family, as one line naming the flag; None when they do (every DFlash family)."""
        return None

    def build(self, verifier_dir: Any, **fields: Any) -> DFlashDraft:
        """A fresh draft of this family for the verifier at `verifier_dir`."""
        return self.draft_class.from_verifier(verifier_dir, **fields)

    def options(self) -> list[str]:
        """The names of this family's own flags (fields of `recipe`)."""
        return list(self.recipe.model_fields)

    def speculative_tokens(self, cfg: DFlashConfig) -> int:
        """Tokens one drafting step proposes (the verified block minus its anchor)."""
        return cfg.block_size if self.sample_from_anchor else cfg.block_size - 1

    def config_fields(self, cfg: DFlashConfig) -> dict[str, Any]:
        """Top-level `config.json` fields this family's speculators config adds (the
        family's own config fields, by speculators' names)."""
        return {k: getattr(cfg, k) for k in self.serving_fields()}

    def serving_fields(self) -> list[str]:
        """The family's own fields speculators' config declares (read back on load)."""
        return []

    def speculators_fields(self, cfg: DFlashConfig, verifier: dict[str, Any]) -> dict[str, Any]:
        """The speculators 0.9.0 `config.json` of a draft of this family (all but fanout's
        own section): the DFlash layout, the family's names and own fields
        (`config_fields`); `verifier` is `speculators_config.verifier`."""
        from fanout.families.numbering import SPECULATORS_VERSION, to_serving_layer_ids

        c = cfg
        layer_cfg = {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
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
        return {
            "speculators_model_type": self.speculators_model_type,
            # what speculators' save_pretrained of the family's draft writes (the model class)
            "architectures": list(self.architectures),
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": layer_cfg,
            "draft_vocab_size": c.draft_vocab_size or c.vocab_size,
            "block_size": c.block_size,
            "target_hidden_size": c.hidden_size,
            self.layer_ids_field: to_serving_layer_ids(c.target_layer_ids),
            "mask_token_id": c.mask_token_id,
            "sample_from_anchor": self.sample_from_anchor,
            "sliding_window_non_causal": self.sliding_window_non_causal,
            **self.config_fields(c),
            "speculators_config": self.proposal_config(c, verifier),
            "dtype": "bfloat16",
            # the draft's own head is never tied (speculators forces False and writes it)
            "tie_word_embeddings": False,
        }

    def proposal_config(self, cfg: DFlashConfig, verifier: dict[str, Any]) -> dict[str, Any]:
        """`speculators_config`: the greedy proposal of `speculative_tokens` tokens."""
        return {
            "algorithm": self.speculators_model_type,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": self.speculative_tokens(cfg),
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": verifier,
        }

    def layout_fields(self, cfg: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
        """Config fields its checkpoint's speculators `config.json` (`cfg`) holds beyond
        the shared shapes, read back (`saved`: fanout's record of the config)."""
        return {"block_size": cfg["block_size"], "mask_token_id": cfg["mask_token_id"]}

    def needs_last_hidden_states(self, recipe: Mapping[str, Any]) -> bool:
        """Whether training the recipe `recipe` (field -> value: `fanout train`'s draft
        fields, or a built draft's `cfg.model_dump()`) reads the verifier's final hidden
        states: `loss_type kl`, which every family may choose, or the family's own need."""
        return recipe.get("loss_type") == "kl"

    def context(self, draft: DFlashDraft, *, cached: bool = True) -> DraftContext:
        """The drafting step `fanout eval` runs (fanout.decode.spec_decode)."""
        from fanout.model.draft_cache import DraftCache, UncachedDraft

        return DraftCache(draft) if cached else UncachedDraft(draft)

    def drafting_context(
        self, draft: DFlashDraft, *, cached: bool = True, num_speculative_tokens: int | None = None
    ) -> DraftContext:
        """The drafting step with `fanout eval --num-speculative-tokens` applied where the
        family drafts a chain of any length (EAGLE-3); a block family's block fixes it."""
        return self.context(draft, cached=cached)


__all__ = ["Family", "NoOptions"]
