"""What a draft family provides: the one page a newcomer reads (`Family` below), the
seam between the shared trainer, checkpoint and decoding code and one family's folder.

    from fanout.families.registry import family
    fam = family("dspark")
    draft = fam.build("models/qwen3-8b", target_layer_ids=[1, 9, 17, 25, 33])
    ctx = fam.context(draft, cached=True)  # the drafting step fanout eval runs

A family is its folder `fanout/families/<name>/` (its `FAMILY`, an instance of a
`Family` subclass) and its name in `fanout.families.registry.FAMILY_FOLDERS`; no part
needs another family's class. `Family` lists every part, each with its default (the
DFlash block drafter's): a family sets the class attributes that name it and overrides
the methods where it differs. The logic behind the defaults lives in functions:
`fanout.families.speculators_config` (the speculators config.json layouts),
`fanout.families.chain` (the chain drafters' parts: `ChainFamily`, `EagleFamily`),
`drafts_with` below the class (the one check a drafting step makes of its draft).
docs/training.md ("Adding a family") walks through one; tests/test_family_newcomer.py
adds one in a copy of the package and counts the files it touched.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from pydantic import BaseModel

from fanout.errors import ConfigError
from fanout.families.speculators_config import block_layout
from fanout.model.draft_config import DraftConfig, DraftRecipe, default_target_layer_ids

if TYPE_CHECKING:  # the model side imports torch: loaded on first use (`draft_class`)
    from fanout.model.draft import Draft
    from fanout.model.draft_cache import DraftContext

D = TypeVar("D", bound="Draft")


class NoOptions(BaseModel):
    """A family without flags of its own."""


class Family:
    """What one draft family provides, in six groups. A family's folder sets the
    attributes without a default (`name`, `model_ref`, `speculators_model_type`,
    `architectures`, `serving_method`) and overrides any other entry where it differs
    from the default (the DFlash block drafter's); the last group is derived from the
    others, never overridden."""

    # ---- what it is and what it is built from ---------------------------------------
    # its `--draft-family` value (= its folder's name)
    name: ClassVar[str]
    # its model, "module:Class" (a `fanout.model.draft.Draft` subclass: its modules and
    # its `loss`), imported with torch on first use of `draft_class`, so that the
    # registry and every config (flags, checks) load without torch
    model_ref: ClassVar[str]
    # its validated config (the model's `config_class`; tests/test_families.py checks)
    config_class: ClassVar[type[DraftConfig]] = DraftConfig
    # its own flags, a pydantic model mixed into `fanout train`'s config (field names
    # unique across families)
    recipe: ClassVar[type[BaseModel]] = NoOptions
    # shared DraftRecipe fields (block_size, max_anchors, ...) whose reference value
    # for this family differs from the DraftRecipe default
    recipe_defaults: ClassVar[dict[str, Any]] = {}

    # ---- its checkpoint, in speculators 0.9.0's names (the export adapter) ----------
    # `speculators_model_type` and `architectures` (the model class speculators saves)
    speculators_model_type: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]]
    # the config.json field holding its layers in serving numbering (fanout ids + 1;
    # fanout.families.numbering converts both ways)
    layer_ids_field: ClassVar[str] = "aux_hidden_state_layer_ids"
    # slot 0 (the anchor) predicts the next token too (DSpark): bs drafted tokens, not bs-1
    sample_from_anchor: ClassVar[bool] = False
    # speculators' `sliding_window_non_causal` default for the family (written as is)
    sliding_window_non_causal: ClassVar[bool] = False
    # tensors its model.safetensors holds that training never changes: the verifier's
    # head rows and the draft-vocabulary maps (what a parameter count leaves out)
    frozen_tensors: ClassVar[frozenset[str]] = frozenset({"lm_head.weight", "d2t", "t2d"})

    def serving_fields(self) -> list[str]:
        """Its own config fields speculators' config declares (written, read back)."""
        return []

    def speculators_fields(self, cfg: DraftConfig, verifier: dict[str, Any]) -> dict[str, Any]:
        """The speculators `config.json` of a draft of config `cfg` (all but fanout's own
        section; `verifier` is `speculators_config.verifier`): the DFlash layout."""
        return block_layout(self, cfg, verifier)

    def layout_fields(self, cfg: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
        """Config fields its checkpoint's speculators `config.json` (`cfg`) holds beyond
        the shared shapes, read back (`saved`: fanout's record of the config)."""
        return {"block_size": cfg["block_size"], "mask_token_id": cfg["mask_token_id"]}

    # ---- how it is served and decoded ---------------------------------------------
    # vLLM's `--speculative-config` method that serves it (docs/eval.md)
    serving_method: ClassVar[str]
    # vLLM has a proposer for it (False: fanout eval runs speculators' reference decoding)
    served_by_vllm: ClassVar[bool] = True
    # its drafting step where its own heads pick the block's tokens, "module:Class" (a
    # fanout.model.draft_cache.BlockHeads: DFlash2's selector, ...), imported with torch
    # on first use; None: DFlash's, each slot's own row
    context_ref: ClassVar[str | None] = None

    def context(self, draft: Draft, *, cached: bool = True) -> DraftContext:
        """The drafting step `fanout eval` runs (fanout.decode.spec_decode): on the block
        drafter's cache (`cached`) or its uncached forward, its `context_ref`'s heads."""
        from fanout.model.block_draft import BlockDraft
        from fanout.model.draft_cache import DraftCache, UncachedDraft

        if self.context_ref is None:
            block = drafts_with(draft, BlockDraft, self.name)
            return DraftCache(block) if cached else UncachedDraft(block)
        own = drafts_with(draft, self.draft_class, self.name)
        assert isinstance(own, BlockDraft)
        states = DraftCache(own) if cached else UncachedDraft(own)
        context: DraftContext = imported(self.context_ref)(own, states)
        return context

    def drafting_context(
        self, draft: Draft, *, cached: bool = True, num_speculative_tokens: int | None = None
    ) -> DraftContext:
        """The drafting step with `fanout eval --num-speculative-tokens` applied where the
        family drafts a chain of any length (EAGLE-3); a block family's block fixes it."""
        return self.context(draft, cached=cached)

    # ---- what it needs from a capture (`fanout produce --capture-for`) and a run -----
    def needs_last_hidden_states(self, recipe: Mapping[str, Any]) -> bool:
        """Whether training `recipe` (field -> value: `fanout train`'s draft fields, a
        built draft's `cfg.model_dump()`, or `reference_recipe()`) reads the verifier's
        final hidden states: `loss_type kl`, which every family may choose, or the
        family's own need. The one declaration of it: `--capture-for` captures them when
        the reference recipe needs them, and the trainer refuses a capture without them
        when its recipe does."""
        return recipe.get("loss_type") == "kl"

    def default_layers(self, num_verifier_layers: int) -> list[int]:
        """The verifier layers its reference recipe reads (fanout's decoder-layer ids),
        what `--capture-for` captures for it: the DFlash rule for the recipe's depth,
        with as many layers as the verifier's [1, L - 3] span holds (the demo's 6-layer
        verifier: 1, 2, 3)."""
        depth = self.reference_recipe()["num_layers"]
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

    # ---- its recipe's checks (`fanout train`, before anything is built) --------------
    def verify_width(self, recipe: dict[str, Any]) -> int:
        """Tokens one verify step of its recipe `recipe` (field -> value) checks: the block."""
        return int(recipe["block_size"])

    def block_size_for(self, width: int) -> int:
        """The `--block-size` this family trains in a side-by-side comparison at block
        `width` (the demo, benchmarks/families.py): a block family takes it; a chain
        family's verify width is its own (EAGLE-3: --ttt-steps + 1)."""
        return width

    def row_length_error(self, recipe: dict[str, Any], seq_len: int, where: str) -> str | None:
        """Why rows of `seq_len` tokens cannot train this recipe (None: they can)."""
        return block_row_length_error(self.verify_width(recipe), seq_len, where)

    def shared_conflict(self, values: dict[str, Any], given: set[str]) -> str | None:
        """Why shared recipe values (`values`: field -> value of `fanout train`'s config;
        `given`: the fields set on its command line or --config) do not apply to this
        family, as one line naming the flag; None when they do. Its config's
        `shared_rule` says which (none: DFlash, DFlash2, DSpark read every one)."""
        rule = self.config_class.shared_rule
        return None if rule is None else rule.problem(values, None)

    def speculative_tokens(self, cfg: DraftConfig) -> int:
        """Tokens one drafting step proposes (the verified block minus its anchor)."""
        return cfg.block_size if self.sample_from_anchor else cfg.block_size - 1

    # ---- derived from the above (not overridden) ------------------------------------
    @property
    def draft_class(self) -> type[Draft]:
        """Its model class (`model_ref`), imported on first use."""
        draft_class: type[Draft] = imported(self.model_ref)
        return draft_class

    def build(self, verifier_dir: Any, **fields: Any) -> Draft:
        """A fresh draft of this family for the verifier at `verifier_dir`."""
        return self.draft_class.from_verifier(verifier_dir, **fields)

    def options(self) -> list[str]:
        """The names of this family's own flags (fields of `recipe`)."""
        return list(self.recipe.model_fields)

    def reference_recipe(self) -> dict[str, Any]:
        """Its reference recipe (field -> value): the shared defaults, its
        `recipe_defaults`, its own flags' defaults."""
        return DraftRecipe().model_dump() | self.recipe_defaults | self.recipe().model_dump()

    def config_fields(self, cfg: DraftConfig) -> dict[str, Any]:
        """Its `serving_fields` of `cfg`, as `config.json` writes them."""
        return {k: getattr(cfg, k) for k in self.serving_fields()}


def imported(ref: str) -> Any:
    """The object a "module:Name" reference names, its module imported on first use
    (the model side imports torch; the registry and the configs load without it)."""
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def drafts_with(draft: Draft, cls: type[D], family: str) -> D:
    """`draft`, checked to be a `cls` (the model class family `family`'s drafting step
    runs); a draft of another family is refused in one line (ConfigError), the one check
    every family's `context` / `drafting_context` makes."""
    if not isinstance(draft, cls):
        raise ConfigError(
            f"the {family} family drafts with {cls.__name__}, got {type(draft).__name__}"
        )
    return draft


def block_row_length_error(block_size: int, seq_len: int, where: str) -> str | None:
    """Why rows of `seq_len` tokens cannot train blocks of `block_size` (None: they can):
    an anchor must lie before position T - block size (fanout.model.anchors), or every
    step would be empty."""
    if block_size < seq_len:
        return None
    return (
        f"--block-size {block_size} does not fit {where}'s rows of T = {seq_len} "
        f"tokens (its seq_len): an anchor must lie before position T - block size, "
        f"so the largest block that can train is {seq_len - 1} (anchored at position 0 "
        "only; a block well below T leaves room for anchors)"
    )


__all__ = ["Family", "NoOptions", "block_row_length_error", "drafts_with", "imported"]
