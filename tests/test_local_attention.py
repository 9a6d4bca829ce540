"""Blocked sliding / chunked attention equals dense masked attention, edge cases included.

.venv/bin/python -m pytest tests/test_local_attention.py -x -q

The oracle is dense: SDPA under the [L, L] boolean mask transformers builds for one
sequence (masking_utils: sliding `kv > q − w`, chunked `kv // C == q // C`, causal),
and for soft-capping / sinks the eager functions of transformers' own Gemma-2 and
gpt-oss modeling files under its additive mask. fp32, GQA (4 query heads on 2 key /
value heads), batch 2, windows 1..9 against sequences shorter than, equal to, and
not a multiple of them.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fanout.model import local_attention as la
from fanout.model.layer_types import CHUNKED, FULL, SLIDING, PackingRule

B, H, HKV, D, DV = 2, 4, 2, 8, 6


def _qkv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n, D, generator=g) * 2  # large enough for peaked softmaxes
    k = torch.randn(B, HKV, n, D, generator=g) * 2
    v = torch.randn(B, HKV, n, DV, generator=g)
    return q, k, v


def _allowed(kind: str, size: int | None, n: int) -> torch.Tensor:
    """transformers' mask for one sequence alone: [n, n] bool, True = may attend."""
    qi, ki = torch.arange(n)[:, None], torch.arange(n)[None, :]
    m = qi >= ki
    if kind == SLIDING:
        assert size is not None
        m &= ki > qi - size
    elif kind == CHUNKED:
        assert size is not None
        m &= ki // size == qi // size
    return m


def _module(layer: int, sinks: torch.Tensor | None = None) -> Any:
    return SimpleNamespace(
        layer_idx=layer, training=False, num_key_value_groups=H // HKV, sinks=sinks, is_causal=True
    )


def _rule(kind: str, size: int) -> PackingRule:
    return PackingRule(
        (FULL, SLIDING, CHUNKED),
        sliding_window=size if kind == SLIDING else 3,
        chunk_size=size if kind == CHUNKED else 3,
    )


LAYER = {FULL: 0, SLIDING: 1, CHUNKED: 2}
CASES = [(kind, size, n) for kind in (SLIDING, CHUNKED) for size in (1, 3, 8) for n in
         (1, 2, 5, 8, 9, 16, 24, 29)] + [(FULL, 4, n) for n in (1, 7, 30)]  # fmt: skip


def _attend(kind: str, size: int, q: Any, k: Any, v: Any, **kw: Any) -> torch.Tensor:
    rule = _rule(kind, size)
    with la.local_attention(SimpleNamespace(_attn_implementation="sdpa"), rule):
        sw = size if kind == SLIDING else None
        out, _ = la.attend(_module(LAYER[kind], kw.get("s_aux")), q, k, v, None,
                           scaling=0.3, sliding_window=sw, **kw)  # fmt: skip
    return out  # [B, n, H, DV]


@pytest.mark.parametrize(("kind", "size", "n"), CASES)
def test_blocked_sdpa_equals_dense_masked_sdpa(kind: str, size: int, n: int) -> None:
    q, k, v = _qkv(n)
    got = _attend(kind, size, q, k, v)
    mask = _allowed(kind, size, n)  # [n, n]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("kind", "size", "n"), CASES[::3] + CASES[-3:])
@pytest.mark.parametrize("what", ["softcap", "sinks"])
def test_blocked_eager_math_equals_transformers_eager(
    kind: str, size: int, n: int, what: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss

    monkeypatch.setattr(la, "SCORE_BUDGET", 64)  # several query blocks even at n = 9
    q, k, v = _qkv(n, seed=1)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(2))  # [H]
    kw: dict[str, Any] = {"softcap": 2.0} if what == "softcap" else {"s_aux": sinks}
    got = _attend(kind, size, q, k, v, **kw)
    additive = torch.zeros(n, n).masked_fill_(~_allowed(kind, size, n), torch.finfo().min)
    ref = gemma2 if what == "softcap" else gpt_oss
    want, _ = ref(_module(0, sinks), q, k, v, additive[None, None], scaling=0.3, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_window_the_rule_does_not_have_is_an_error() -> None:
    q, k, v = _qkv(12)
    rule = _rule(SLIDING, 4)
    with la.local_attention(SimpleNamespace(_attn_implementation="sdpa"), rule):
        with pytest.raises(RuntimeError, match="layer 1: transformers passes sliding_window=5"):
            la.attend(_module(1), q, k, v, None, sliding_window=5)
        with pytest.raises(RuntimeError, match="layer 0"):
            la.attend(_module(0), q, k, v, None, sliding_window=4)  # a full layer
        with pytest.raises(RuntimeError, match="no mask"):
            la.attend(_module(1), q, k, v, torch.ones(12, 12, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="only inside"):
        la.attend(_module(1), q, k, v, None)


def test_the_block_restores_the_implementation() -> None:
    cfg = SimpleNamespace(_attn_implementation="eager")
    with pytest.raises(ValueError), la.local_attention(cfg, _rule(SLIDING, 4)):
        assert cfg._attn_implementation == la.NAME
        raise ValueError
    assert cfg._attn_implementation == "eager"


def _largest_allocation(fn: Any) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.self_cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize("eager", [False, True])
def test_memory_is_linear_in_the_sequence(eager: bool) -> None:
    # One head, a 4096-token sequence, window 64: an [L, L] mask alone would be 16 MiB
    # (bool) and the scores 64 MiB; the blocks hold O(L·w).
    n, w = 4096, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 16, generator=g) for _ in range(3))
    kw: dict[str, Any] = {"softcap": 30.0} if eager else {}
    largest = _largest_allocation(lambda: _attend_one(q, k, v, w, kw))
    assert largest < n * n // 4, largest  # bytes; q itself is n·16·4 = 256 KiB


def _attend_one(q: Any, k: Any, v: Any, w: int, kw: dict[str, Any]) -> None:
    rule = PackingRule((SLIDING,), sliding_window=w)
    with la.local_attention(SimpleNamespace(_attn_implementation="sdpa"), rule):
        la.attend(_module(0), q, k, v, None, scaling=0.25, sliding_window=w, **kw)
