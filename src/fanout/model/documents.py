"""Packed rows taken apart into their documents, for running each document alone.

    from fanout.model.documents import document_batches
    for db in document_batches(input_ids, position_ids, document_ids):  # each [B, T]
        out = text_model(input_ids=db.input_ids, position_ids=db.position_ids)  # [k, L, ...]
        buf[db.rows, db.cols] = db.take(out.last_hidden_state)  # back into [B, T, H]

A document is a maximal run of one document id ≥ 0 in a row; every padding token
(id −1) is a document of its own, so it sees only itself, as under the packed mask
(fanout.model.layer_types). Documents are batched by length: sorted longest first,
a batch takes documents longer than `fill` × its longest and right-pads them to it.

Why right padding is exact: every layer a verifier has is causal (attention with
is_causal, linear attention's recurrence, its causal conv1d; norms, MLPs and MoE
routing are per token), so tokens after a document's end never reach its own tokens.
Why batch by length: one forward per distinct length would be one per document; with
`fill` = 3/4 the padding is under a third of the real tokens, in a handful of
forwards (≈ log_{4/3}(longest / shortest) at most).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DocumentBatch:
    """k documents of one packed batch, right-padded to the longest (L tokens)."""

    input_ids: torch.Tensor  # [k, L] long; 0 past each document's end
    position_ids: torch.Tensor  # [k, L] long; the row's positions, counting on past the end
    src: torch.Tensor  # [N] long: flat index into [k·L] of each document token
    rows: torch.Tensor  # [N] long: its row in the packed batch
    cols: torch.Tensor  # [N] long: its column

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The document tokens of a [k, L, ...] output, [N, ...], in (rows, cols) order.
        An index_select, not a boolean mask, so CUDA never syncs to count them."""
        return x.flatten(0, 1).index_select(0, self.src)


def document_spans(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, start, length), each [D] long on the CPU, for the documents of [B, T] rows."""
    d = document_ids.cpu()  # [B, T]
    b, t = d.shape
    start = torch.ones_like(d, dtype=torch.bool)  # [B, T]: a document starts here
    start[:, 1:] = (d[:, 1:] != d[:, :-1]) | (d[:, 1:] < 0)
    flat = start.flatten().nonzero().squeeze(1)  # [D] flat index of each start
    ends = torch.cat([flat[1:], torch.tensor([b * t])])  # [D]; a row start ends the row before
    return flat // t, flat % t, ends - flat


def document_batches(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    document_ids: torch.Tensor,
    *,
    fill: float = 0.75,
) -> Iterator[DocumentBatch]:
    """The documents of packed rows (each [B, T]), batched by length (see module doc).
    Tensors come on input_ids' device; every token of the rows is in exactly one batch."""
    row, start, length = document_spans(document_ids)  # [D] each, CPU
    order = torch.argsort(length, descending=True, stable=True)  # [D]
    dev = input_ids.device
    t = input_ids.shape[1]
    lens = length[order].tolist()
    i = 0
    while i < len(lens):
        longest = lens[i]
        j = i + 1
        while j < len(lens) and lens[j] > fill * longest:
            j += 1
        pick = order[i:j]
        i = j
        # indices on the CPU (no device sync), then one transfer each
        b, s, n = row[pick], start[pick], length[pick]  # [k] each
        ar = torch.arange(longest)  # [L]
        valid = ar[None, :] < n[:, None]  # [k, L]
        col = (s[:, None] + ar[None, :]).clamp_(max=t - 1)  # [k, L] (clamped past the row)
        src = valid.flatten().nonzero().squeeze(1)  # [N]
        rows, cols = b[:, None].expand_as(valid)[valid], col[valid]  # [N] each
        b, s, n, col, valid, src, rows, cols = (
            _to(x, dev) for x in (b, s, n, col, valid, src, rows, cols)
        )
        ids = input_ids[b[:, None], col].long().masked_fill_(~valid, 0)  # [k, L]
        last = position_ids[b, s + n - 1].long()  # [k] position of each document's last token
        past = last[:, None] + (ar.to(dev)[None, :] - n[:, None] + 1)  # [k, L] past the end
        pos = torch.where(valid, position_ids[b[:, None], col].long(), past)  # [k, L]
        yield DocumentBatch(ids, pos, src, rows, cols)


def _to(x: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A small CPU tensor on `dev`; to CUDA through pinned memory, without a host sync."""
    if dev.type != "cuda":
        return x.to(dev)
    return x.pin_memory().to(dev, non_blocking=True)
