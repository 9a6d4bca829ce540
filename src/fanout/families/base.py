"""What every draft family declares: the seam between the shared trainer, checkpoint
and decoding code and one family's folder.

    from fanout.families import family
    fam = family("dspark")
    draft = fam.build("models/qwen3-8b", target_layer_ids=[1, 9, 17, 25, 33])
    ctx = fam.context(draft, cached=True)  # the drafting step fanout eval runs

A family is a `Family` subclass with one instance in `fanout.families.registry`. It
names its model (`draft_class`, whose `config_class` is its validated config), its
own flags (`recipe`, a pydantic model mixed into `fanout train`'s config; its field
names are unique across families), the shared recipe fields whose reference value
differs from DFlash's (`recipe_defaults`), what its checkpoint writes beyond the DFlash
fields (`config_fields`), what the capture must hold (`needs_last_hidden_states`) and
its drafting step (`context`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel

from fanout.model.dflash import DFlashConfig, DFlashDraft
from fanout.model.draft_cache import DraftCache, DraftContext, UncachedDraft


class NoOptions(BaseModel):
    """A family without flags of its own."""


class Family:
    """One draft family (see the module docstring); subclasses set the class vars."""

    name: ClassVar[str]  # --draft-family value
    draft_class: ClassVar[type[DFlashDraft]]
    recipe: ClassVar[type[BaseModel]] = NoOptions
    # shared DraftRecipe fields (block_size, max_anchors, ...) whose reference value
    # for this family differs from the DraftRecipe default
    recipe_defaults: ClassVar[dict[str, Any]] = {}
    # speculators 0.9.0's names for it
    speculators_model_type: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]]
    # vLLM's `--speculative-config` method that serves it (docs/eval.md)
    serving_method: ClassVar[str]
    # slot 0 (the anchor) predicts the next token too (DSpark): bs drafted tokens, not bs-1
    sample_from_anchor: ClassVar[bool] = False
    # speculators' `sliding_window_non_causal` default for the family (written as is)
    sliding_window_non_causal: ClassVar[bool] = False
    # its reference recipe trains on the verifier's final hidden states (what
    # `fanout produce --capture-for` captures for it)
    captures_last_hidden_states: ClassVar[bool] = False

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

    def needs_last_hidden_states(self, cfg: DFlashConfig) -> bool:
        """Whether training reads the verifier's final hidden states (beyond
        `loss_type kl`, which every family may choose)."""
        return cfg.loss_type == "kl"

    def context(self, draft: DFlashDraft, *, cached: bool = True) -> DraftContext:
        """The drafting step `fanout eval` runs (fanout.decode.spec_decode)."""
        return DraftCache(draft) if cached else UncachedDraft(draft)


__all__ = ["Family", "NoOptions"]
