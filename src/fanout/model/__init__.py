"""The networks: the verifier (a local HF model) and the DFlash draft.

    from fanout.model import DFlashDraft, DFlashConfig

Owns: loading and running the verifier with hidden-state capture (verifier), the
DFlash draft and its loss (dflash), the verifier directory's config and tensors read
without loading the model (verifier_dir), anchor sampling (anchors), greedy / sampled /
speculative decoding with a KV cache (spec_decode), the draft's cached context at
inference (draft_cache), and the rejection-sampling rules at T > 0 (sampling).

May import: ops and the core.
"""

from fanout.model.dflash import DFlashConfig, DFlashDraft, LossOutput, default_gamma

__all__ = ["DFlashConfig", "DFlashDraft", "LossOutput", "default_gamma"]
