"""The networks: the verifier (a local HF model) and the DFlash draft.

    from fanout.model import DFlashDraft, DFlashConfig

Owns: loading and running the verifier with hidden-state capture (verifier), the
DFlash draft and its loss (dflash), anchor sampling (anchors), and greedy /
speculative decoding with a KV cache (spec_decode).

May import: ops and the core.
"""

from fanout.model.dflash import DFlashConfig, DFlashDraft, LossOutput, default_gamma

__all__ = ["DFlashConfig", "DFlashDraft", "LossOutput", "default_gamma"]
