"""Streaming best-fit packing of tokenized conversations into fixed `T`-token rows.

    from fanout.data.packing import Packer, Doc
    packer = Packer(seq_len=4096, lookahead=64, over_length="split", pad_id=151643)
    for doc in docs:                       # Doc(ids int32 [L], mask uint8 [L], source)
        if (batch := packer.add(doc)) is not None: ...  # [n, T] arrays: rows it closed
    last = packer.flush()                  # the rows still open (None: none)

Best fit with a bounded look-ahead: up to `lookahead` rows are open at once; each
document goes into the open row with the least free space that still fits it (a
new row if none does); when more than `lookahead` rows are open, the fullest is
emitted, and a row is emitted at once when its free space drops below
`close_below` tokens (default T/128: nothing useful fits there). Memory is
O(lookahead · T), whatever the input size, and the output depends only on the
document order, so it is deterministic (`shuffled` gives a seeded, per-epoch order
with a bounded buffer).

Per row: `input_ids` (pad = pad_id), `loss_mask` (0 on padding), `document_ids`
(0..k-1 in placement order, -1 on padding), `position_ids` (restart at 0 for
each document, 0 on padding). Over-length documents (L > T): `split` cuts them
into T-token pieces (each piece is a document of its own, positions restart,
mask preserved), `drop` counts them, `error` raises BadRow naming the row.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from fanout.errors import BadRow, ConfigError
from fanout.rows import DOCUMENT_IDS, INPUT_IDS, LOSS_MASK, POSITION_IDS

OverLength = Literal["split", "drop", "error"]
SPLIT_SOURCES_KEPT = 32  # split documents whose source a report names (the rest counted)


@dataclass(frozen=True, slots=True)
class Doc:
    ids: np.ndarray  # int32 [L]
    mask: np.ndarray  # uint8 [L]
    source: tuple[str, int]  # (file, line) for error messages


class _Row:
    __slots__ = ("docs", "free")

    def __init__(self, seq_len: int) -> None:
        self.docs: list[Doc] = []
        self.free = seq_len


class Packer:
    """Best-fit packer; `add` / `flush` return completed rows as a batch dict (or None)."""

    def __init__(
        self,
        seq_len: int,
        lookahead: int = 64,
        over_length: OverLength = "split",
        pad_id: int = 0,
        close_below: int | None = None,
        track_rows: bool = False,
    ) -> None:
        if seq_len < 2:
            raise ConfigError(f"seq_len: must be >= 2, got {seq_len}")
        if lookahead < 1:
            raise ConfigError(f"lookahead: must be >= 1, got {lookahead}")
        if over_length not in ("split", "drop", "error"):
            raise ConfigError(f"over_length: must be split|drop|error, got {over_length!r}")
        self.seq_len = seq_len
        self.lookahead = lookahead
        self.over_length = over_length
        self.pad_id = pad_id
        self.close_below = seq_len // 128 if close_below is None else close_below
        self._open: list[_Row] = []
        # Report counters.
        self.rows = 0
        self.documents = 0  # documents placed (a split document counts once per piece)
        self.tokens = 0
        self.masked_tokens = 0
        self.dropped = 0
        self.split = 0
        # where the first SPLIT_SOURCES_KEPT split documents came from ([file, line]): a
        # follower names each one's place in its source (fanout.produce.follow)
        self.split_sources: list[list[str | int]] = []
        # with `track_rows`, each emitted row's source lines and real tokens, in row order:
        # a follower carries the records of a short row into its next chunk
        # (fanout.produce.follow); off for a whole dataset (two lists per row)
        self.track_rows = track_rows
        self.row_lines: list[list[int]] = []
        self.row_tokens: list[int] = []

    def add(self, doc: Doc) -> dict[str, np.ndarray] | None:
        """Place one document; returns rows that closed because of it (or None)."""
        T = self.seq_len
        L = int(doc.ids.shape[0])
        if L == 0:
            return None
        done: list[_Row] = []
        if L > T:
            if self.over_length == "drop":
                self.dropped += 1
                return None
            if self.over_length == "error":
                file, line = doc.source
                raise BadRow(file, line, "<tokens>", f"{L} tokens > seq_len {T} (--over-length)")
            self.split += 1
            if len(self.split_sources) < SPLIT_SOURCES_KEPT:
                self.split_sources.append([doc.source[0], int(doc.source[1])])
            full = L // T * T
            for s in range(0, full, T):  # full pieces are rows of their own
                row = _Row(T)
                self._put(row, Doc(doc.ids[s : s + T], doc.mask[s : s + T], doc.source))
                done.append(row)
            if full == L:
                return self._emit(done)
            doc = Doc(doc.ids[full:], doc.mask[full:], doc.source)
            L = L - full
        best: _Row | None = None
        for row in self._open:  # lookahead is small (tens): a scan beats a heap here
            if row.free >= L and (best is None or row.free < best.free):
                best = row
        if best is None:
            best = _Row(T)
            self._open.append(best)
        self._put(best, doc)
        if best.free < self.close_below or best.free == 0:
            self._open.remove(best)
            done.append(best)
        elif len(self._open) > self.lookahead:
            fullest = min(self._open, key=lambda r: r.free)
            self._open.remove(fullest)
            done.append(fullest)
        return self._emit(done) if done else None

    def flush(self) -> dict[str, np.ndarray] | None:
        """Emit every open row (fullest first); call once at the end of the input."""
        rows = sorted(self._open, key=lambda r: r.free)
        self._open = []
        return self._emit(rows) if rows else None

    def _put(self, row: _Row, doc: Doc) -> None:
        row.docs.append(doc)
        row.free -= int(doc.ids.shape[0])
        self.documents += 1
        self.tokens += int(doc.ids.shape[0])
        self.masked_tokens += int(doc.mask.sum())

    def _emit(self, rows: list[_Row]) -> dict[str, np.ndarray]:
        n, T = len(rows), self.seq_len
        out: dict[str, np.ndarray] = {
            INPUT_IDS: np.full((n, T), self.pad_id, np.int32),  # [n, T]
            LOSS_MASK: np.zeros((n, T), np.uint8),  # [n, T]
            DOCUMENT_IDS: np.full((n, T), -1, np.int32),  # [n, T]
            POSITION_IDS: np.zeros((n, T), np.int32),  # [n, T]
        }
        ar = np.arange(T, dtype=np.int32)
        for r, row in enumerate(rows):
            at = 0
            for d, doc in enumerate(row.docs):
                L = doc.ids.shape[0]
                out[INPUT_IDS][r, at : at + L] = doc.ids
                out[LOSS_MASK][r, at : at + L] = doc.mask
                out[DOCUMENT_IDS][r, at : at + L] = d
                out[POSITION_IDS][r, at : at + L] = ar[:L]
                at += L
            if self.track_rows:
                self.row_lines.append([int(doc.source[1]) for doc in row.docs])
                self.row_tokens.append(at)
        self.rows += n
        return out

    def report(self) -> dict[str, Any]:
        cap = self.rows * self.seq_len
        return {
            "rows": self.rows,
            "documents": self.documents,
            "tokens": self.tokens,
            "masked_tokens": self.masked_tokens,
            "fill": self.tokens / cap if cap else 0.0,
            "dropped_over_length": self.dropped,
            "split_over_length": self.split,
            "split_sources": self.split_sources,
            **({"row_lines": self.row_lines, "row_tokens": self.row_tokens}
               if self.track_rows else {}),
        }  # fmt: skip


def shuffled(docs: Iterable[Doc], buffer: int, seed: int, epoch: int = 0) -> Iterator[Doc]:
    """Seeded shuffle with a bounded buffer (memory O(buffer)); buffer <= 1 keeps order."""
    if buffer <= 1:
        yield from docs
        return
    rng = random.Random(seed * 1_000_003 + epoch)
    buf: list[Doc] = []
    for d in docs:
        buf.append(d)
        if len(buf) >= buffer:
            i = rng.randrange(len(buf))
            buf[i], buf[-1] = buf[-1], buf[i]
            yield buf.pop()
    rng.shuffle(buf)
    yield from buf
