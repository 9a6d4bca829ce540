"""What every draft family declares: the seam between the shared trainer, checkpoint
and decoding code and one family's folder.

    from fanout.families import family
    fam = family("dspark")
    draft = fam.build("models/qwen3-8b", target_layer_ids=[1, 9, 17, 25, 33])
    ctx = fam.context(draft, cached=True)  # the drafting step fanout eval runs

A family is a set of parts in its folder `fanout/families/<name>/`, registered once (its
name in `fanout.families.registry.FAMILY_FOLDERS`); no part needs another family's class:
- its config: `config_class` (a `DraftConfig` subclass: the speculators fields it
  writes, validated) and its own flags `recipe` (a pydantic model mixed into
  `fanout train`'s config; field names unique across families), with the shared recipe
  fields whose reference value differs (`recipe_defaults`);
- its draft module and its loss: `model_ref` ("module:Class", a
  `fanout.model.draft.Draft` subclass imported on first use of `draft_class`, so the
  registry and the configs load without torch), built from the shared parts (the block
  or chain backbone, the draft attention, the loss parts of fanout.model.slot_loss);
- its proposer: `context`, the drafting step `fanout eval` runs as its server drafts;
- its export adapter: `speculators_fields` / `serving_fields` / `layout_fields` (config)
  and the model's `trainable_state` (state dict), in speculators 0.9.0's names;
- what it needs from a capture: `default_layers`, `draft_layers`,
  `needs_last_hidden_states` (`fanout produce --capture-for`).
docs/training.md ("Adding a family") walks through one; tests/test_family_newcomer.py
adds one in a copy of the package and counts the files it touched.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from fanout.errors import ConfigError
from fanout.model.draft_config import DraftConfig, DraftRecipe, default_target_layer_ids

if TYPE_CHECKING:  # the model side imports torch: loaded on first use (`draft_class`)
    from fanout.model.draft import Draft
    from fanout.model.draft_cache import DraftContext


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


class NoOptions(BaseModel):
    """A family without flags of its own."""


class Family:
    """One draft family (see the module docstring); subclasses set the class vars."""

    name: ClassVar[str]  # --draft-family value
    # its model, "module:Class", imported (with torch) on first use of `draft_class`, so
    # that the registry and every config (flags, checks) load without torch
    model_ref: ClassVar[str]
    # its validated config (the model's `config_class`; tests/test_families.py checks)
    config_class: ClassVar[type[DraftConfig]] = DraftConfig
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
    def draft_class(self) -> type[Draft]:
        """Its model class (`model_ref`), imported on first use."""
        module, cls = self.model_ref.split(":")
        draft_class: type[Draft] = getattr(importlib.import_module(module), cls)
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

    def build(self, verifier_dir: Any, **fields: Any) -> Draft:
        """A fresh draft of this family for the verifier at `verifier_dir`."""
        return self.draft_class.from_verifier(verifier_dir, **fields)

    def options(self) -> list[str]:
        """The names of this family's own flags (fields of `recipe`)."""
        return list(self.recipe.model_fields)

    def speculative_tokens(self, cfg: DraftConfig) -> int:
        """Tokens one drafting step proposes (the verified block minus its anchor)."""
        return cfg.block_size if self.sample_from_anchor else cfg.block_size - 1

    def config_fields(self, cfg: DraftConfig) -> dict[str, Any]:
        """Top-level `config.json` fields this family's speculators config adds (the
        family's own config fields, by speculators' names)."""
        return {k: getattr(cfg, k) for k in self.serving_fields()}

    def serving_fields(self) -> list[str]:
        """The family's own fields speculators' config declares (read back on load)."""
        return []

    def speculators_fields(self, cfg: DraftConfig, verifier: dict[str, Any]) -> dict[str, Any]:
        """The speculators 0.9.0 `config.json` of a draft of this family (all but fanout's
        own section): the DFlash layout, the family's names and own fields
        (`config_fields`); `verifier` is `speculators_config.verifier`."""
        from fanout.families.numbering import SPECULATORS_VERSION, to_serving_layer_ids

        c = cfg
        layer_cfg = transformer_layer_config(c)
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

    def proposal_config(self, cfg: DraftConfig, verifier: dict[str, Any]) -> dict[str, Any]:
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

    def context(self, draft: Draft, *, cached: bool = True) -> DraftContext:
        """The drafting step `fanout eval` runs (fanout.decode.spec_decode)."""
        from fanout.model.block_draft import BlockDraft
        from fanout.model.draft_cache import DraftCache, UncachedDraft

        if not isinstance(draft, BlockDraft):  # a chain family names its own step
            raise ConfigError(
                f"{self.name} drafts blocks: {type(draft).__name__} is no block draft"
            )
        return DraftCache(draft) if cached else UncachedDraft(draft)

    def drafting_context(
        self, draft: Draft, *, cached: bool = True, num_speculative_tokens: int | None = None
    ) -> DraftContext:
        """The drafting step with `fanout eval --num-speculative-tokens` applied where the
        family drafts a chain of any length (EAGLE-3); a block family's block fixes it."""
        return self.context(draft, cached=cached)


# ---- the chain drafters' family parts (EAGLE-3, P-EAGLE, MTP) -----------------------

# speculators' and vLLM's default draft vocabulary of an EAGLE draft
EAGLE_DRAFT_VOCAB_SIZE = 32000


def vllm_default_layers(num_verifier_layers: int) -> list[int]:
    """vLLM's (and speculators') default EAGLE-3 auxiliary layers, (2, n//2, n-3) in HF
    `hidden_states` numbering, as fanout decoder-layer ids (HF - 1), distinct and
    ascending (a verifier of fewer than 8 layers repeats some).

    >>> vllm_default_layers(36)
    [1, 17, 32]
    """
    from fanout.families.numbering import from_serving_layer_ids

    n = num_verifier_layers
    hf = sorted({2, n // 2, n - 3} & set(range(1, n + 1)))
    if not hf:
        raise ConfigError(f"a {n}-layer verifier has none of EAGLE-3's default layers")
    return from_serving_layer_ids(hf)


class ChainFamily(Family):
    """A family that drafts a chain, not a block (EAGLE-3, P-EAGLE, MTP): its verify
    width is its steps + 1 (`steps_field`, its own flag), written as the draft's
    `block_size` by `chain_fields`; the shared flags that mean nothing to it are refused
    by its one rule `field_problem`; it reads its own layers, not every captured one;
    `fanout eval --num-speculative-tokens` sets the chain's length."""

    # its own flag: the tokens one drafting step proposes (ttt_steps, num_depths, ...)
    steps_field: ClassVar[str]

    def steps(self, recipe: Mapping[str, Any]) -> int:
        """`steps_field` of `recipe` (field -> value), its flag's default where absent."""
        default = self.recipe.model_fields[self.steps_field].default
        return int(recipe.get(self.steps_field, default))

    def field_problem(self, values: Mapping[str, Any], block_size: int | None) -> str | None:
        """Why the shared recipe values `values` do not apply to this family (None: they
        do); `block_size` None: not given (it follows the steps)."""
        raise NotImplementedError

    def chain_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """`build`'s `fields` with `block_size` mapped to the verify width; a value other
        than that or DraftRecipe's default is refused (ConfigError)."""
        steps = self.steps(fields)
        bs = fields.get("block_size")
        given = None if bs == DraftRecipe().block_size else bs  # the shared default: unset
        if problem := self.field_problem({self.steps_field: steps}, given):
            raise ConfigError(problem)
        return fields | {"block_size": steps + 1}

    def shared_conflict(self, values: dict[str, Any], given: set[str]) -> str | None:
        """The shared recipe flags that mean nothing to a chain draft (`field_problem`),
        refused when `fanout train` parses its flags."""
        bs = values["block_size"] if "block_size" in given else None
        if bs == DraftRecipe().block_size:
            bs = None  # a whole config written back carries the shared default
        return self.field_problem(values, bs)

    def draft_layers(self, captured: list[int], verifier_dir: Path) -> list[int]:
        """Its own layers (not every captured one): what serving feeds it."""
        from fanout.model.verifier_dir import read_verifier_config

        return self.default_layers(read_verifier_config(verifier_dir)["_num_hidden_layers"])

    def block_size_for(self, width: int) -> int:
        return self.verify_width({})  # its reference chain: its steps + the anchor

    def verify_width(self, recipe: dict[str, Any]) -> int:
        return self.steps(recipe) + 1

    def speculative_tokens(self, cfg: DraftConfig) -> int:
        """speculators writes its steps as the greedy proposal's tokens."""
        return int(getattr(cfg, self.steps_field))

    def layout_fields(self, cfg: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
        """Its config has no block or mask token: the verify width follows its steps, the
        (unused) mask id is fanout's record."""
        return {"block_size": self.steps(saved) + 1, "mask_token_id": saved["mask_token_id"]}

    def context(self, draft: Draft, *, cached: bool = True) -> DraftContext:
        return self.drafting_context(draft, cached=cached)


class EagleFamily(ChainFamily):
    """The EAGLE layout (EAGLE-3's; P-EAGLE's too, which vLLM serves under method
    `eagle3`): one layer over `[embedding ; fc(aux states)]` (speculators' recipe: KL
    against the verifier's distribution, so the capture holds its last hidden states),
    vLLM's default auxiliary layers, a 32,000-token draft vocabulary, the norm flags,
    speculators' `Eagle3SpeculatorConfig` layout (a Llama layer config)."""

    recipe_defaults: ClassVar[dict[str, Any]] = {"num_layers": 1, "loss_type": "kl"}
    serving_method: ClassVar[str] = "eagle3"
    captures_last_hidden_states: ClassVar[bool] = True  # its targets
    layer_ids_field: ClassVar[str] = "eagle_aux_hidden_state_layer_ids"

    def default_layers(self, num_verifier_layers: int) -> list[int]:
        return vllm_default_layers(num_verifier_layers)

    def default_draft_vocab_size(self, vocab_size: int) -> int | None:
        return EAGLE_DRAFT_VOCAB_SIZE if vocab_size > EAGLE_DRAFT_VOCAB_SIZE else None

    def build(self, verifier_dir: Any, **fields: Any) -> Draft:
        """A fresh draft; `block_size` is mapped to its verify width (`chain_fields`),
        the layers vLLM's default where not given."""
        fields = self.chain_fields(fields)
        if fields.get("target_layer_ids") is None:
            from fanout.model.verifier_dir import read_verifier_config

            n = read_verifier_config(Path(verifier_dir))["_num_hidden_layers"]
            fields["target_layer_ids"] = self.default_layers(n)
        return super().build(verifier_dir, **fields)

    def serving_fields(self) -> list[str]:
        return ["norm_before_fc", "fc_norm", "norm_output", "norm_before_residual"]

    def needs_last_hidden_states(self, recipe: Mapping[str, Any]) -> bool:
        return True  # the targets are the verifier's distribution

    def speculators_fields(self, cfg: DraftConfig, verifier: dict[str, Any]) -> dict[str, Any]:
        """speculators 0.9.0's `Eagle3SpeculatorConfig` layout: a Llama layer config, the
        aux layers under `eagle_aux_hidden_state_layer_ids`, the norm flags."""
        from fanout.families.numbering import SPECULATORS_VERSION, to_serving_layer_ids
        from fanout.model.draft_config import ChainConfig

        assert isinstance(cfg, ChainConfig)
        c = cfg
        return {
            "speculators_model_type": self.speculators_model_type,
            "architectures": list(self.architectures),
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": transformer_layer_config(
                c, model_type="llama", architecture="LlamaForCausalLM"
            ),
            "draft_vocab_size": c.draft_vocab_size or c.vocab_size,
            "target_hidden_size": c.hidden_size,
            self.layer_ids_field: to_serving_layer_ids(c.target_layer_ids),
            "embed_requires_grad": c.embed_requires_grad,
            **self.config_fields(c),
            "speculators_config": self.proposal_config(c, verifier),
            "dtype": "bfloat16",
            "tie_word_embeddings": False,
        }


__all__ = [
    "EAGLE_DRAFT_VOCAB_SIZE",
    "ChainFamily",
    "EagleFamily",
    "Family",
    "NoOptions",
    "transformer_layer_config",
    "vllm_default_layers",
]
