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

from fanout.model.dflash import DFlashConfig, DFlashDraft, LossOutput, default_gamma

__all__ = ["DFlashConfig", "DFlashDraft", "LossOutput", "default_gamma"]
