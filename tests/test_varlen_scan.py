"""The varlen scans (fanout.ops.varlen_scan) equal transformers' own ops run on each
document alone, and the resets are what makes them so.

.venv/bin/python -m pytest tests/test_varlen_scan.py -q
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fanout.ops.varlen_scan import SegmentLayout, causal_conv1d_varlen, gated_delta_rule_varlen

# two rows: documents of these lengths, then padding (−1) to T; 70 and 130 cross chunks
# of 64, 1 is a one-token document
ROWS = [[70, 5, 130, 1], [64, 40]]
T = 210


def _doc_ids() -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    doc = torch.full((len(ROWS), T), -1, dtype=torch.long)
    spans = []
    for b, lens in enumerate(ROWS):
        s = 0
        for i, n in enumerate(lens):
            doc[b, s : s + n] = i
            spans.append((b, s, s + n))
            s += n
    return doc, spans


def test_layout_names_each_document_and_each_padding_token_a_segment() -> None:
    doc, spans = _doc_ids()
    lay = SegmentLayout.from_document_ids(doc)
    for b, s, e in spans:
        assert torch.equal(lay.offset[b, s:e], torch.arange(e - s))
        assert (lay.segment[b, s:e] == lay.segment[b, s]).all()
    pad = doc < 0
    assert (lay.offset[pad] == 0).all()  # each padding token starts its own segment
    assert lay.cu_seqlens.tolist()[:6] == [0, 70, 75, 205, 206, 207]
    assert lay.cu_seqlens[-1] == doc.numel() and len(lay.cu_seqlens) == int(pad.sum()) + 7


def _one_segment(lay: SegmentLayout) -> SegmentLayout:
    """The layout with no boundary: each row one segment (what transformers' torch
    fallback computes over a packed row)."""
    b = lay.segment.shape[0]
    one = torch.arange(T).expand(b, T)
    return dataclasses.replace(
        lay, segment=torch.zeros_like(lay.segment), offset=one, host_offset=one
    )


def _conv_alone(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """transformers' torch causal conv1d (causal_conv1d_fn) on one sequence [1, C, n]."""
    n = x.shape[-1]
    pad = w.shape[-1] - 1
    out = F.conv1d(x, w[:, None], bias, padding=pad, groups=x.shape[1])[..., :n]
    return F.silu(out)


def test_causal_conv1d_varlen_equals_each_document_alone() -> None:
    doc, spans = _doc_ids()
    lay = SegmentLayout.from_document_ids(doc)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(len(ROWS), 12, T, generator=g)  # [B, C, T]
    w, bias = torch.randn(12, 4, generator=g), torch.randn(12, generator=g)
    got = causal_conv1d_varlen(x, w, bias, lay, activation="silu")
    for b, s, e in spans:
        want = _conv_alone(x[b : b + 1, :, s:e], w, bias)[0]
        torch.testing.assert_close(got[b, :, s:e], want, rtol=1e-5, atol=1e-6)
    # the control: without the segment offsets (one segment per row) the taps cross
    one = _one_segment(lay)
    crossed = causal_conv1d_varlen(x, w, bias, one, activation="silu")
    b, s, e = spans[1]
    assert not torch.allclose(crossed[b, :, s:e], _conv_alone(x[b : b + 1, :, s:e], w, bias)[0])


def _qkv(hk: int = 2, hv: int = 4, d: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    b = len(ROWS)
    q, k = (torch.randn(b, T, hk, d, generator=g) for _ in range(2))
    v = torch.randn(b, T, hv, d, generator=g)
    decay = -F.softplus(torch.randn(b, T, hv, generator=g))  # ≤ 0
    beta = torch.rand(b, T, hv, generator=g)
    return q, k, v, decay, beta


def _alone(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    b: int,
    s: int,
    e: int,
) -> torch.Tensor:
    """transformers' gated delta rule on document [s, e) of row b alone (the oracle)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    want, _ = torch_chunk_gated_delta_rule(
        *(x[b : b + 1, s:e] for x in (q, k, v)),
        g=decay[b : b + 1, s:e],
        beta=beta[b : b + 1, s:e],
        use_qk_l2norm_in_kernel=True,
    )
    return want


def test_gated_delta_rule_varlen_equals_transformers_on_each_document_alone() -> None:
    doc, spans = _doc_ids()
    lay = SegmentLayout.from_document_ids(doc)
    q, k, v, decay, beta = _qkv()
    got = gated_delta_rule_varlen(q, k, v, decay, beta, lay)  # [B, T, Hv, d]
    assert got.shape == v.shape
    for b, s, e in spans:
        want = _alone(q, k, v, decay, beta, b, s, e)
        torch.testing.assert_close(got[b : b + 1, s:e], want, rtol=1e-4, atol=1e-5)


def test_gated_delta_rule_without_the_resets_carries_state_across_documents() -> None:
    # The control: with no boundary in the layout each row runs as one recurrence, and
    # the documents after the first differ from themselves alone.
    doc, spans = _doc_ids()
    lay = SegmentLayout.from_document_ids(doc)
    no_reset = _one_segment(lay)
    q, k, v, decay, beta = _qkv()
    got = gated_delta_rule_varlen(q, k, v, decay, beta, no_reset)
    b, s, e = spans[2]  # the third document of row 0
    want = _alone(q, k, v, decay, beta, b, s, e)
    assert (got[b : b + 1, s:e] - want).abs().max() > 1e-3


@pytest.mark.parametrize("chunk", [8, 64])
def test_segments_are_exact_at_any_chunk_size(chunk: int) -> None:
    # chunks that start anywhere in a document (8: several per document and documents
    # within one chunk; 64: as transformers) compute the recurrence of each alone
    doc, spans = _doc_ids()
    lay = SegmentLayout.from_document_ids(doc)
    q, k, v, decay, beta = _qkv()
    got = gated_delta_rule_varlen(q, k, v, decay, beta, lay, chunk=chunk)
    for b, s, e in spans:
        want = _alone(q, k, v, decay, beta, b, s, e)
        torch.testing.assert_close(got[b : b + 1, s:e], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("group_floats", [1, 1 << 30])
def test_groups_of_chunks_carry_the_state_across(
    group_floats: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the CPU path takes the chunks a cache-sized group at a time; the state carried out
    # of one group is the next one's (1: each chunk a group of its own, so documents of
    # 70 and 130 tokens cross 8 or more groups; 1 << 30: all chunks in one group)
    from fanout.ops import varlen_scan

    monkeypatch.setattr(varlen_scan, "GROUP_FLOATS", group_floats)
    doc, spans = _doc_ids()
    lay = SegmentLayout.from_document_ids(doc)
    q, k, v, decay, beta = _qkv()
    got = gated_delta_rule_varlen(q, k, v, decay, beta, lay, chunk=8)
    for b, s, e in spans:
        want = _alone(q, k, v, decay, beta, b, s, e)
        torch.testing.assert_close(got[b : b + 1, s:e], want, rtol=1e-4, atol=1e-5)


def test_steep_decays_give_no_subnormal_and_stay_exact() -> None:
    # Heads that forget fast (log decay -4 to -12 a token): most pair decays of a chunk
    # fall past e^-87, where exp's float32 result is subnormal (~30x slower on the CPU)
    # or 0. They are clamped to the smallest normal number's log, weigh nothing at
    # float32's precision, and each document still equals transformers' run alone.
    from fanout.ops.varlen_scan import LOG_TINY, _decay_

    logs = torch.linspace(-120.0, 0.0, 4001)
    got = _decay_(logs.clone())
    tiny = torch.finfo(torch.float32).tiny  # the smallest normal
    assert not ((got > 0) & (got < tiny)).any()
    above = logs >= LOG_TINY
    torch.testing.assert_close(got[above], logs[above].exp(), rtol=1e-6, atol=0.0)
    assert float(torch.tensor(LOG_TINY).exp()) >= tiny
    doc, spans = _doc_ids()
    lay = SegmentLayout.from_document_ids(doc)
    q, k, v, _, beta = _qkv()
    steep = -4.0 - 8.0 * torch.rand(v.shape[:3], generator=torch.Generator().manual_seed(3))
    out = gated_delta_rule_varlen(q, k, v, steep, beta, lay)
    for b, s, e in spans:
        want = _alone(q, k, v, steep, beta, b, s, e)
        torch.testing.assert_close(out[b : b + 1, s:e], want, rtol=1e-4, atol=1e-5)


def _ssd_inputs(seed: int, p: int = 8, n: int = 8) -> tuple[Any, ...]:
    """The layout of ROWS and Mamba-2 scan inputs over it: x [B, T, 4, p], dt [B, T, 4]
    (after softplus), A [4] < 0, B and C [B, T, 2 groups, n]."""
    doc, _spans = _doc_ids()
    g = torch.Generator().manual_seed(seed)
    b, h, groups = len(ROWS), 4, 2
    x = torch.randn(b, T, h, p, generator=g)
    dt = F.softplus(torch.randn(b, T, h, generator=g))
    a = -torch.arange(1, h + 1, dtype=torch.float32)
    bb, cc = (torch.randn(b, T, groups, n, generator=g) for _ in range(2))
    return SegmentLayout.from_document_ids(doc), x, dt, a, bb, cc


def test_ssd_varlen_equals_transformers_mamba2_chunk_scan_on_each_document_alone() -> None:
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    from fanout.ops.varlen_scan import ssd_varlen

    _doc, spans = _doc_ids()
    lay, x, dt, a, bb, cc = _ssd_inputs(2)
    got = ssd_varlen(x, dt, a, bb, cc, lay, chunk=16)  # [B, T, H, P]
    for r, s, e in spans:
        want = mamba2_chunk_scan(
            x[r : r + 1, s:e], dt[r : r + 1, s:e], a, bb[r : r + 1, s:e], cc[r : r + 1, s:e],
            chunk_size=16,
        )  # fmt: skip
        torch.testing.assert_close(got[r : r + 1, s:e], want, rtol=1e-4, atol=1e-5)
    crossed = ssd_varlen(x, dt, a, bb, cc, _one_segment(lay), chunk=16)
    r, s, e = spans[1]  # the second document of row 0: 5 tokens right after the first
    want = mamba2_chunk_scan(
        x[r : r + 1, s:e], dt[r : r + 1, s:e], a, bb[r : r + 1, s:e], cc[r : r + 1, s:e],
        chunk_size=16,
    )  # fmt: skip
    assert (crossed[r : r + 1, s:e] - want).abs().max() > 1e-3


def test_the_fla_path_hands_each_segment_to_the_kernel_as_a_varlen_sequence() -> None:
    # The CUDA path's plumbing, on the CPU: a stand-in for fla's chunk_gated_delta_rule
    # that runs transformers' torch rule on each cu_seqlens sequence of the flattened
    # rows gives what the torch varlen path gives (where fla is installed, the same
    # comparison on CUDA: test_fla_kernel_equals_the_torch_path).
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from fanout.ops.varlen_scan import _gated_delta_rule_fla

    calls: list[list[int]] = []

    def fake_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor,
                 beta: torch.Tensor, cu_seqlens: torch.Tensor, **kw: object) -> tuple:  # fmt: skip
        assert q.shape[0] == 1 and kw["use_qk_l2norm_in_kernel"] is True
        cu = cu_seqlens.tolist()
        calls.append(cu)
        outs = [
            torch_chunk_gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e],
                                         beta=beta[:, s:e], use_qk_l2norm_in_kernel=True)[0]
            for s, e in itertools.pairwise(cu)
        ]  # fmt: skip
        return torch.cat(outs, dim=1), None

    doc, _spans = _doc_ids()
    lay = SegmentLayout.from_document_ids(doc)
    q, k, v, decay, beta = _qkv()
    got = _gated_delta_rule_fla(fake_fla, (q, k, v, decay, beta), lay, True)
    want = gated_delta_rule_varlen(q, k, v, decay, beta, lay)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert calls == [lay.cu_seqlens.tolist()]


def _runs(seq_idx: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of each run of one `seq_idx` value in [B, T]."""
    out = []
    for r, row in enumerate(seq_idx.tolist()):
        s = 0
        for t in range(1, len(row) + 1):
            if t == len(row) or row[t] != row[s]:
                out.append((r, s, t))
                s = t
    return out


def test_the_conv_kernel_path_hands_the_segments_over_as_seq_idx() -> None:
    # The CUDA path's plumbing, on the CPU: a stand-in for causal-conv1d's
    # causal_conv1d_fn that convolves each run of one seq_idx value alone gives what the
    # torch varlen path gives; it receives the channel-last layout the kernel requires
    # for seq_idx (a contiguous [B, C, T] input is handed over transposed).
    from fanout.ops.varlen_scan import _causal_conv1d_kernel

    doc, _spans = _doc_ids()
    lay = SegmentLayout.from_document_ids(doc)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(len(ROWS), 12, T, generator=g)  # [B, C, T], contiguous
    w, bias = torch.randn(12, 4, generator=g), torch.randn(12, generator=g)
    calls: list[torch.Tensor] = []

    def fake_conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, *,
                  seq_idx: torch.Tensor, activation: str | None) -> torch.Tensor:  # fmt: skip
        assert x.stride(1) == 1 and seq_idx.dtype == torch.int32 and activation == "silu"
        assert b is not None
        calls.append(seq_idx)
        out = torch.empty_like(x)
        for r, s, e in _runs(seq_idx):
            out[r, :, s:e] = _conv_alone(x[r : r + 1, :, s:e], w, b)[0]
        return out

    got = _causal_conv1d_kernel(fake_conv, x, w, bias, lay, "silu")
    want = causal_conv1d_varlen(x, w, bias, lay, activation="silu")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(calls) == 1 and torch.equal(calls[0], lay.segment.int())


def test_the_mamba_kernel_path_hands_the_segments_over_as_seq_idx(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The same for mamba-ssm's mamba_chunk_scan_combined: a stand-in that runs
    # transformers' mamba2_chunk_scan on each run of one seq_idx value alone equals the
    # torch varlen path (on CUDA with mamba-ssm: test_mamba_kernels_equal_the_torch_path).
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    from fanout.ops import varlen_scan
    from fanout.ops.varlen_scan import ssd_varlen

    lay, x, dt, a, bb, cc = _ssd_inputs(5)

    def fake_ssd(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, bb: torch.Tensor,
                 cc: torch.Tensor, chunk: int, *, seq_idx: torch.Tensor) -> torch.Tensor:  # fmt: skip
        assert seq_idx.dtype == torch.int32 and chunk == 16
        out = torch.empty_like(x)
        for r, s, e in _runs(seq_idx):
            out[r : r + 1, s:e] = mamba2_chunk_scan(
                x[r : r + 1, s:e], dt[r : r + 1, s:e], a, bb[r : r + 1, s:e],
                cc[r : r + 1, s:e], chunk_size=chunk,
            )  # fmt: skip
        return out

    class Cuda(torch.Tensor):  # only what ssd_varlen asks of x: is it on CUDA?
        is_cuda = True

    want = ssd_varlen(x, dt, a, bb, cc, lay, chunk=16)
    monkeypatch.setattr(varlen_scan, "_ssd_kernel", lambda: fake_ssd)
    got = ssd_varlen(x.as_subclass(Cuda), dt, a, bb, cc, lay, chunk=16)
    unused = ssd_varlen(x.as_subclass(Cuda), dt, a, bb, cc, lay, chunk=16, kernel=False)
    torch.testing.assert_close(got.as_subclass(torch.Tensor), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(unused.as_subclass(torch.Tensor), want, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_mamba_kernels_equal_the_torch_path() -> None:
    from fanout.ops.varlen_scan import _conv_kernel, _ssd_kernel, ssd_varlen

    if _conv_kernel() is None or _ssd_kernel() is None:
        pytest.skip("causal-conv1d / mamba-ssm are not installed (pip install fanout[mamba])")
    doc, _spans = _doc_ids()
    lay = SegmentLayout.from_document_ids(doc.cuda())
    g = torch.Generator().manual_seed(6)
    x = torch.randn(len(ROWS), T, 64, generator=g).cuda().transpose(1, 2)  # channel-last
    w, bias = torch.randn(64, 4, generator=g).cuda(), torch.randn(64, generator=g).cuda()
    got = causal_conv1d_varlen(x, w, bias, lay, activation="silu")  # the kernel
    want = causal_conv1d_varlen(x, w, bias, lay, activation="silu", kernel=False)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    xs, dt, a, bb, cc = (t.cuda() for t in _ssd_inputs(7, p=64, n=16)[1:])
    got = ssd_varlen(xs, dt, a, bb, cc, lay, chunk=64)
    want = ssd_varlen(xs, dt, a, bb, cc, lay, chunk=64, kernel=False)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_fla_kernel_equals_the_torch_path() -> None:
    from fanout.ops.varlen_scan import _fla_kernel

    if _fla_kernel() is None:
        pytest.skip("flash-linear-attention is not installed (pip install fanout[hybrid])")
    doc, _spans = _doc_ids()
    lay = SegmentLayout.from_document_ids(doc.cuda())
    q, k, v, decay, beta = (x.cuda() for x in _qkv(d=64))
    got = gated_delta_rule_varlen(q, k, v, decay, beta, lay)  # fla's kernel
    want = gated_delta_rule_varlen(q, k, v, decay, beta, lay, kernel=False)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
