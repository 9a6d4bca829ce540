"""Fused training ops: linear cross-entropy without full logits, AdamW backend choice.

from fanout.ops import linear_cross_entropy, make_optimizer
"""

from fanout.ops.adamw import AdamWBackend, ClippedAdamW, make_optimizer
from fanout.ops.linear_ce import (
    linear_cross_entropy,
    linear_cross_entropy_and_argmax,
    resolve_backend,
)

__all__ = [
    "AdamWBackend",
    "ClippedAdamW",
    "linear_cross_entropy",
    "linear_cross_entropy_and_argmax",
    "make_optimizer",
    "resolve_backend",
]
