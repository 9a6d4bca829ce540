"""The capture check: a window's captured layers are looked at before it is published.

    from fanout.produce.capture_check import check_window
    check_window(cap_stats, document_ids, target_ids, layer_ids)  # CaptureCheckFailed if bad

A capture can be silently useless (vLLM #46301 / speculators #613: all-zero hidden
states captured from hybrid models; training looked fine and acceptance was ~0), and
checksums do not see it. So before a window is published (fanout.produce.publisher),
each captured layer's rows are checked, on the document tokens (document id ≥ 0):

- non-finite: a NaN or inf anywhere (a broken kernel, fp16 overflow, bad weights);
- all zero: every token of the row is the zero vector (a hook that wrote nothing, a
  verifier whose weights loaded as zeros);
- constant: every token of the row has the same vector, while the verifier's own
  greedy ids (`target_ids`) differ between them, which a real forward cannot give (a
  constant layer makes every later layer, and so the logits, constant too).

The input is the per-token min, max and sum over H that `Verifier.capture` takes from
each layer output before storage (`layer_stats`, fanout.model.verifier.token_stats):
equal vectors have equal triples, and NaN / inf propagate into them, so the check reads
3 floats per token and layer instead of the window's hidden states. What a failure
does (not published, captured again once, then the producer stops) is the
publisher's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fanout.errors import CaptureCheckFailed


def check_window(
    stats: torch.Tensor,
    document_ids: torch.Tensor,
    target_ids: torch.Tensor,
    layer_ids: Sequence[int],
) -> None:
    """Raise CaptureCheckFailed for the first bad (layer, row) of a window, else None.

    stats: [n, R, T, 3] float32 min, max, sum per token of each captured layer;
    document_ids, target_ids: [R, T]; layer_ids: the n captured layers, in order.
    """
    if stats.shape[0] != len(layer_ids):
        raise ValueError(f"stats hold {stats.shape[0]} layers; {len(layer_ids)} captured")
    valid = document_ids >= 0  # [R, T] document tokens
    if not bool(valid.any()):
        return
    ok = torch.isfinite(stats).all(-1) | ~valid  # [n, R, T]
    if not bool(ok.all()):
        j, r, t = (int(i) for i in (~ok).nonzero()[0])
        _fail(layer_ids[j], r, f"non-finite values (token {t})")
    has = valid.any(1)  # [R] rows with a document token
    first = valid.int().argmax(1)  # [R] each row's first document token
    zero = (stats[..., 0] == 0) & (stats[..., 1] == 0)  # [n, R, T] min = max = 0
    all_zero = (zero | ~valid).all(-1) & has  # [n, R]
    if bool(all_zero.any()):
        j, r = (int(i) for i in all_zero.nonzero()[0])
        _fail(layer_ids[j], r, "every token's hidden state is zero")
    rows = torch.arange(valid.shape[0])
    ref = stats[:, rows, first]  # [n, R, 3] each row's first document token
    same = (stats == ref[:, :, None]).all(-1) | ~valid  # [n, R, T]
    targets = target_ids[rows, first]  # [R]
    differ = ((target_ids != targets[:, None]) & valid).any(1)  # [R] the verifier varies
    constant = same.all(-1) & (valid.sum(1) > 1) & differ  # [n, R]
    if bool(constant.any()):
        j, r = (int(i) for i in constant.nonzero()[0])
        _fail(
            layer_ids[j], r, "every token's hidden state is the same, while the verifier's "
            "greedy ids differ between them",
        )  # fmt: skip


def _fail(layer: int, row: int, reason: str) -> None:
    raise CaptureCheckFailed(layer, row, reason)
