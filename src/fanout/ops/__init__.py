"""Fused ops: linear cross-entropy / KL without full logits, AdamW, argmax, fp8.

    from fanout.ops import linear_cross_entropy, make_optimizer

May import: the core only (errors). Each fast path is tested against a slow
reference (tests/test_linear_ce.py, test_adamw.py, test_argmax.py, test_fp8.py).
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
