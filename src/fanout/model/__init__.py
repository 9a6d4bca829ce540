"""The networks: the verifier (a local HF model) and the shared parts of every draft.

    from fanout.model import Draft, DraftConfig

Owns: loading and running the verifier with hidden-state capture (verifier; the
per-layer-type packing rule, layer_types, and packed rows split into documents,
documents), the verifier directory's config and tensors read without loading the model,
with its identity hashes (verifier_dir); what every draft is (draft: the verifier-head
wrapper, construction, `LossOutput`) and its config (draft_config); the parts families
build their drafts from: the draft attention with its masks (draft_attention), the
block drafter's backbone (block_draft) and its cached context at inference
(draft_cache), the chain drafter's backbone (chain_draft) and its drafting cache (chain_cache), anchor
sampling (anchors),
the loss parts (slot_loss), and the rejection-sampling rules at T > 0 (sampling;
regeneration samples with them too). The serving loop is fanout.decode's; each family's
own model is in fanout.families.

May import: ops and the core.
"""

from typing import TYPE_CHECKING, Any

from fanout.model.draft_config import DraftConfig, default_gamma

if TYPE_CHECKING:
    from fanout.model.draft import Draft, LossOutput


def __getattr__(name: str) -> Any:
    """The draft model's classes, imported (with torch) on first use: a config alone
    (fanout.model.draft_config) must not import torch."""
    if name in ("Draft", "LossOutput"):
        from fanout.model import draft

        return getattr(draft, name)
    raise AttributeError(name)


__all__ = ["Draft", "DraftConfig", "LossOutput", "default_gamma"]
