"""The networks: the verifier (a local HF model) and the DFlash draft.

    from fanout.model import DFlashDraft, DFlashConfig

Owns: loading and running the verifier with hidden-state capture (verifier; the
per-layer-type packing rule, layer_types, and packed rows split into documents,
documents), the
DFlash draft and its loss (dflash), the verifier directory's config and tensors read
without loading the model, with its identity hashes (verifier_dir), anchor sampling (anchors), the DFlash backbone's cached context at inference
(draft_cache; every DFlash-family drafting step builds on it), and the
rejection-sampling rules at T > 0 (sampling; regeneration samples with them too).
The serving loop is fanout.decode's; the families built on this backbone are
fanout.families'.

May import: ops and the core.
"""

from typing import TYPE_CHECKING, Any

from fanout.model.draft_config import DFlashConfig, default_gamma

if TYPE_CHECKING:
    from fanout.model.dflash import DFlashDraft, LossOutput


def __getattr__(name: str) -> Any:
    """The draft model's classes, imported (with torch) on first use: a config alone
    (fanout.model.draft_config) must not import torch."""
    if name in ("DFlashDraft", "LossOutput"):
        from fanout.model import dflash

        return getattr(dflash, name)
    raise AttributeError(name)


__all__ = ["DFlashConfig", "DFlashDraft", "LossOutput", "default_gamma"]
