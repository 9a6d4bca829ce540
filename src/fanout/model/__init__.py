"""Draft models trained by fanout consumers.

from fanout.model import DFlashDraft, DFlashConfig
"""

from fanout.model.dflash import DFlashConfig, DFlashDraft, LossOutput, default_gamma

__all__ = ["DFlashConfig", "DFlashDraft", "LossOutput", "default_gamma"]
