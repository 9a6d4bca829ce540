"""The on-policy stream of `fanout produce --regenerate`: regenerate by chunks, capture as it goes.

    fanout produce --regenerate --regen-chunk-records 64 --run-dir runs/r1 \\
        --verifier-name-or-path VERIFIER_DIR --data chats.jsonl --seq-len 512 --window-rows 8

    from fanout.produce.onpolicy import OnPolicyStream
    s = OnPolicyStream.open(prep, cfg, verifier, run_dir)  # RUN_DIR/regen; regenerates chunk 0
    s.reach(window=5)          # regenerates chunks until window 5's rows exist; total or OPEN
    idx, epoch = s.window_rows_of(5)   # its rows (global row numbers of s.rows), its epoch

Chunk c is shard c of the regeneration directory (fanout.regen.shards: input records
[c·P, (c+1)·P), P = --regen-chunk-records), regenerated with the producer's verifier
(hf engine) or a server (openai) and then prepared on its own, so its packed rows
depend only on its own records. Rows are numbered across chunks in chunk order.

Which rows window w holds (a deterministic function of the saved shards and the
contract, so a restart or a recapture gives the same rows):
- epoch 0 walks the chunks in order, each chunk's rows shuffled by (seed, 0, c);
- epoch e ≥ 1 is a permutation of all N rows seeded by (seed, e), as in
  fanout.produce.stream, once every chunk is done;
- window w holds stream positions [w·R, (w+1)·R); the last one may be shorter.
The number of windows, ceil(N·epochs / R), is known once the last chunk is done; until
then the run is open-ended (RunConfig.total_windows None) and the producer ends it
with its recorded stream end. The saved shards are the source of truth: a restarted
producer finds them done and regenerates only what is missing. When the last chunk is
done the joined `regenerated.jsonl` is written, reusable through `--data`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from itertools import islice
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from fanout.data.cache import PackedDataset
from fanout.data.chat import ChatFormat
from fanout.data.prepare import PrepareConfig, prepare
from fanout.errors import ConfigError
from fanout.hashing import hasher, labelled
from fanout.regen.engine import RegenOptions
from fanout.regen.regenerate import (
    Item,
    RegenerateConfig,
    Regenerator,
    count_items,
    fingerprints,
    identity,
    iter_items,
    make_engine,
    producer_config,
)
from fanout.regen.shards import OutDir
from fanout.store.store import RunDir

log = logging.getLogger(__name__)

REGEN_DIR = "regen"  # under the run directory
LAYOUT = "fanout-onpolicy-1"  # the row order above; in the dataset fingerprint
# The producer's total_windows while the stream is open: no window number reaches it,
# so its claims and end-of-stream checks need no special case.
OPEN = 1 << 62


class OnPolicyOptions(BaseModel):
    """`fanout produce`'s on-policy fields (the engine and sampling ones are RegenOptions')."""

    regenerate: bool = Field(
        False,
        description="capture the verifier's own answers: --data is regenerated chunk by "
        "chunk into RUN_DIR/regen while windows stream (fanout regenerate's "
        "--engine/--temperature/... flags; resumable, with provenance; reusable through "
        "--data RUN_DIR/regen/regenerated.jsonl)",
    )
    regen_chunk_records: int = Field(
        64,
        ge=1,
        description="--regenerate: input records per regeneration chunk (fanout "
        "regenerate's --records-per-shard); the first window waits for one chunk",
    )


class ChunkRows:
    """The prepared rows of the chunks done so far, numbered across chunks in order:
    `rows(idx)` as PackedDataset's (what fanout.produce.capture reads)."""

    def __init__(self) -> None:
        self.parts: list[PackedDataset | None] = []  # None: a chunk with no rows
        self.starts = [0]  # global row number of each chunk's first row, then the total
        self.fingerprint = ""  # the contract's dataset fingerprint (OnPolicyStream.open)
        self.summary: dict[str, Any] = {}  # stream.json's dataset summary, so far

    @property
    def num_rows(self) -> int:
        return self.starts[-1]

    def add(self, part: PackedDataset | None) -> None:
        self.parts.append(part)
        self.starts.append(self.starts[-1] + (part.num_rows if part is not None else 0))

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_rows):
            raise IndexError(f"row index out of range [0, {self.num_rows}) of the chunks done")
        starts = np.asarray(self.starts, dtype=np.int64)
        chunk = np.searchsorted(starts, idx, side="right") - 1  # [n]
        out: dict[str, np.ndarray] = {}
        for c in np.unique(chunk):
            sel = np.flatnonzero(chunk == c)
            part = self.parts[int(c)]
            assert part is not None  # a chunk without rows owns no row number
            got = part.rows(idx[sel] - starts[c])  # dict of [k, T]
            for key, a in got.items():
                if key not in out:
                    out[key] = np.empty((idx.size, *a.shape[1:]), a.dtype)  # [n, T]
                out[key][sel] = a
        return out

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.first.tokenizer_fingerprint

    @property
    def first(self) -> PackedDataset:
        """The first chunk with rows (its tokenizer fingerprint, its token counts)."""
        return next(p for p in self.parts if p is not None)


class OnPolicyStream:
    """Regenerates chunks on demand and says which rows each window holds (module doc)."""

    def __init__(
        self, prep: PrepareConfig, cfg: RegenerateConfig, regen: Regenerator, out: OutDir
    ) -> None:
        self.prep, self.cfg, self.regen, self.out = prep, cfg, regen, out
        self.planned_records = count_items(cfg)  # in stream.json: trainers estimate from it
        self.num_chunks = -(-self.planned_records // cfg.records_per_shard)
        self.rows = ChunkRows()
        self._items: Iterator[Item] = iter_items(cfg)
        self._totals: dict[str, int] = {}
        self.epochs, self.window_rows, self.seed = 1, 1, 0

    @classmethod
    def open(
        cls,
        prep: PrepareConfig,
        opts: Any,
        verifier: Any,
        run_dir: RunDir,
        tp: Any = None,
    ) -> OnPolicyStream:
        """Open (or resume) RUN_DIR/regen with the producer's settings `opts` (a ProducerConfig:
        RegenOptions, seed, epochs, window_rows, regen_chunk_records) and regenerate up
        to the first chunk that has rows."""
        if tp is not None and opts.engine == "hf":
            raise ConfigError(
                "--regenerate with --engine hf does not run under tensor parallelism yet: "
                "use --engine openai, or run `fanout regenerate` first and pass its output "
                "as --data"
            )
        cfg = producer_config(
            prep,
            RegenOptions(**opts.regen_options()),
            seed=int(opts.seed),  # the producer's --seed seeds the answers too
            verifier_dir=str(verifier.config.path),
            out=run_dir.root / REGEN_DIR,
            records_per_shard=int(opts.regen_chunk_records),
        )
        ver, tok = fingerprints(cfg)
        engine = make_engine(cfg, verifier if cfg.engine == "hf" else None)
        ident = identity(cfg, engine.describe(), ver, tok)
        out = OutDir(cfg.out).open(ident)
        s = cls(prep, cfg, Regenerator(engine, cfg, cfg.seed, ver), out)
        s.epochs, s.window_rows, s.seed = int(opts.epochs), int(opts.window_rows), int(opts.seed)
        while s.rows.num_rows == 0:
            if s.done:
                raise ConfigError(
                    f"--regenerate: no usable rows in any regenerated record ({s._totals}); "
                    f"see {cfg.out}/shards/*.json"
                )
            s._next_chunk()
        h = hasher(json.dumps({"layout": LAYOUT, "regen": ident}, sort_keys=True).encode())
        h.update(json.dumps(prep.output_options(), sort_keys=True, default=str).encode())
        h.update(s.rows.first.tokenizer_fingerprint.encode())
        s.rows.fingerprint = labelled(h)
        return s

    @property
    def counted(self) -> PackedDataset:
        """The rows the run's token counts are over: the first chunk with rows (the same
        on every restart; the whole data is not known before the last chunk)."""
        return self.rows.first

    @property
    def done(self) -> bool:
        """Every chunk regenerated and prepared."""
        return len(self.rows.parts) >= self.num_chunks

    @property
    def total_windows(self) -> int:
        """ceil(N·epochs / R) once every chunk is done; OPEN while the stream is open."""
        if not self.done:
            return OPEN
        return -(-self.rows.num_rows * self.epochs // self.window_rows)

    def reach(self, window: int) -> int:
        """Regenerate chunks until window `window`'s rows exist or every chunk is done;
        returns total_windows (OPEN while open)."""
        need = (window + 1) * self.window_rows  # stream positions it needs, all of epoch 0
        while not self.done and self.rows.num_rows < need:
            self._next_chunk()
        return self.total_windows

    def window_rows_of(self, window: int) -> tuple[np.ndarray, int]:
        """Global row numbers of window `window` (int64 [<= R]) and the epoch of its first
        row; its chunks must be done (`reach`)."""
        n = self.rows.num_rows
        start = window * self.window_rows
        stop = start + self.window_rows
        if self.done:
            stop = min(stop, n * self.epochs)
        elif stop > n:
            raise IndexError(f"window {window} needs chunks not regenerated yet")
        s = np.arange(start, stop, dtype=np.int64)  # stream positions
        epoch_of = s // max(n, 1)
        out = np.empty_like(s)
        for e in np.unique(epoch_of):
            sel = epoch_of == e
            out[sel] = self._epoch_rows(int(e), s[sel] % n)
        return out, int(start // max(n, 1))

    def _epoch_rows(self, epoch: int, pos: np.ndarray) -> np.ndarray:
        """Rows at positions `pos` (within one epoch) of epoch `epoch`."""
        if epoch > 0:  # every chunk is done: one permutation over all rows
            return np.random.default_rng([self.seed, epoch]).permutation(self.rows.num_rows)[pos]
        starts = np.asarray(self.rows.starts, dtype=np.int64)
        chunk = np.searchsorted(starts, pos, side="right") - 1
        out = np.empty_like(pos)
        for c in np.unique(chunk):
            sel = chunk == c
            lo, size = int(starts[c]), int(starts[c + 1] - starts[c])
            perm = np.random.default_rng([self.seed, 0, int(c)]).permutation(size)
            out[sel] = lo + perm[pos[sel] - lo]
        return out

    def _next_chunk(self) -> None:
        """Regenerate (or find saved) the next chunk, prepare it, add its rows; after
        the last one, join the shards into regenerated.jsonl."""
        c = len(self.rows.parts)
        items = list(islice(self._items, self.cfg.records_per_shard))
        summary = self.out.done(c)
        if summary is None:
            result = self.regen.shard(items)
            self.out.write_shard(c, result.records, result.summary)
            summary = result.summary
            log.info("regenerated chunk %d/%d: %s", c + 1, self.num_chunks, summary)
        for k, v in summary.items():
            if isinstance(v, int):
                self._totals[k] = self._totals.get(k, 0) + v
        part = None
        if summary.get("kept", 0):
            fmt = ChatFormat().model_dump()  # regenerated shards are in the openai shape
            prep = self.prep.model_copy(update=fmt | {"data": [str(self.out.data_path(c))]})
            part = prepare(prep)
            part = part if part.num_rows else None
        self.rows.add(part)
        self.rows.summary = self.summary()
        if self.done and not (self.out.manifest() or {}).get("complete"):
            self.out.finish(self.num_chunks, self._totals)

    def summary(self) -> dict[str, Any]:
        """stream.json's dataset summary: the regeneration's counts so far."""
        return {
            "onpolicy": LAYOUT,
            "chunks_done": len(self.rows.parts),
            "chunks": self.num_chunks,
            "planned_records": self.planned_records,
            "rows_so_far": self.rows.num_rows,
            **self._totals,
        }
