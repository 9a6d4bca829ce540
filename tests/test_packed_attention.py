"""Packed-row attention equals dense same-document causal attention; the attention
functions fanout registers in transformers share one contract.

.venv/bin/python -m pytest tests/test_packed_attention.py -x -q

The oracle is SDPA under the dense [T, T] boolean mask the verifier builds for packed
rows (fanout.model.layer_types: same document, causal; a padding token sees only
itself). fp32, GQA (4 query heads on 2 key / value heads), rows longer than one query
block, documents that cross block boundaries.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fanout.model import local_attention as la
from fanout.model import packed_attention as pa
from fanout.model.layer_types import FULL, PackingRule
from fanout.ops.varlen_scan import SegmentLayout

H, HKV, D, DV = 4, 2, 8, 6


def _module(layer: int = 0, *, training: bool = False) -> Any:
    return SimpleNamespace(layer_idx=layer, training=training)


def _rows(t: int) -> torch.Tensor:
    """[2, t] document ids: a row of documents crossing query blocks, and a row of one
    long document then padding (−1)."""
    g = torch.Generator().manual_seed(0)
    cuts = sorted(torch.randperm(t - 1, generator=g)[:5].add(1).tolist())
    first = torch.zeros(t, dtype=torch.long)
    for i, c in enumerate(cuts):
        first[c:] = i + 1
    second = torch.full((t,), -1, dtype=torch.long)
    second[: t - 7] = 0
    return torch.stack([first, second])


def _layout(docs: torch.Tensor) -> SegmentLayout:
    return SegmentLayout.from_document_ids(docs)


def _dense(docs: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool: same segment and causal; each padding token only itself."""
    seg = _layout(docs).segment  # [B, T]
    t = docs.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]


@pytest.mark.parametrize("t", [1, pa.BLOCK - 1, pa.BLOCK + 3, 3 * pa.BLOCK + 17])
def test_packed_attention_equals_dense_document_masks(t: int) -> None:
    docs = _rows(t) if t > 8 else torch.zeros(2, t, dtype=torch.long)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, H, t, D, generator=g) * 2  # peaked softmaxes
    k = torch.randn(2, HKV, t, D, generator=g) * 2
    v = torch.randn(2, HKV, t, DV, generator=g)
    with pa.packed_attention(SimpleNamespace(_attn_implementation="sdpa"), _layout(docs)):
        got, _ = pa.attend(_module(), q, k, v, None, scaling=0.3)  # [B, T, H, Dv]
    want = F.scaled_dot_product_attention(
        q, k, v, attn_mask=_dense(docs), scale=0.3, enable_gqa=True
    )  # [B, H, T, Dv]
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-5)


def _blocks(impl: str) -> Any:
    """The block that installs implementation `impl` over 12-token rows."""
    cfg = SimpleNamespace(_attn_implementation="sdpa")
    if impl == "local":
        return la.local_attention(cfg, PackingRule((FULL,)))
    return pa.packed_attention(cfg, _layout(torch.zeros(1, 12, dtype=torch.long)))


@pytest.mark.parametrize("impl", ["local", "packed"])
def test_every_fanout_attention_refuses_what_transformers_may_pass(impl: str) -> None:
    attend = la.attend if impl == "local" else pa.attend
    q, k, v = torch.randn(1, H, 12, D), torch.randn(1, HKV, 12, D), torch.randn(1, HKV, 12, DV)
    with pytest.raises(RuntimeError, match="only inside"):
        attend(_module(), q, k, v, None)
    with _blocks(impl):
        with pytest.raises(RuntimeError, match="no mask and no cache"):
            attend(_module(), q, k, v, torch.ones(12, 12, dtype=torch.bool))
        with pytest.raises(RuntimeError, match="no mask and no cache"):
            attend(_module(), q[:, :, -1:], k, v, None)  # a cached decode step
        with pytest.raises(RuntimeError, match="no dropout"):
            attend(_module(training=True), q, k, v, None, dropout=0.1)
        out, none = attend(_module(), q, k, v, None)  # the default scale: D ** -0.5
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert none is None


def test_packed_attention_is_full_attention_only() -> None:
    q, k, v = torch.randn(1, H, 12, D), torch.randn(1, HKV, 12, D), torch.randn(1, HKV, 12, DV)
    with _blocks("packed"):
        for kw in ({"sliding_window": 4}, {"softcap": 30.0}, {"s_aux": torch.zeros(H)}):
            with pytest.raises(RuntimeError, match=r"causal full attention only \(layer 3\)"):
                pa.attend(_module(3), q, k, v, None, **kw)
        with pytest.raises(RuntimeError, match="packed rows whole"):
            pa.attend(_module(), q[:, :, :8], k[:, :, :8], v[:, :, :8], None)


def test_a_block_reads_keys_back_to_its_own_document_start_only() -> None:
    # row 0: documents of L < BLOCK tokens (a block's first query is < L into its
    # document); row 1: one document of 4 blocks. Blocks are bucketed by how far back
    # their own document began, so row 0's blocks read one block of earlier keys, not
    # row 1's three.
    t, doc_len = 4 * pa.BLOCK, pa.BLOCK * 100 // 128
    docs = torch.stack([torch.arange(t) // doc_len, torch.zeros(t, dtype=torch.long)])
    blocks = pa._Blocks.of(_layout(docs))
    back = {int(f): bk.back for bk in blocks.buckets for f in bk.flat}  # block → its keys back
    assert blocks.back == 3 * pa.BLOCK
    assert [back[j] for j in range(4)] == [0, pa.BLOCK, pa.BLOCK, pa.BLOCK]  # row 0
    assert [back[4 + j] for j in range(4)] == [0, pa.BLOCK, 2 * pa.BLOCK, 3 * pa.BLOCK]
