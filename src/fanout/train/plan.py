"""How long a trainer's stream is: the steps its LR schedule decays over and the windows
its `--epochs` come to, from the producer's `stream.json`, re-read while not known.

    planner = StreamPlanner(Path("runs/r1"), rows_per_step=2, world=1, epochs=None,
                            max_steps=None)
    plan = planner.read()           # Plan(total_steps=460, settled=True, max_windows=None, ...)
    if not plan.settled and (new := planner.reread_if_changed()) is not None: ...

A finite stream's `stream.json` has its rows (`num_rows`) and windows from the start.
An on-policy stream (`fanout produce --regenerate`) records them only once its last
chunk is regenerated (the producer rewrites the file then, before any window of the
next epoch); until then the total is estimated from the plan in its
`dataset_summary` (planned records × rows per record regenerated so far) and
`settled` is False. Re-reading costs one stat() per step until the plan is settled:
the file is replaced whole (a rename), so a changed one has a new inode or mtime.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fanout.errors import ConfigError
from fanout.store.rundir import RunDir
from fanout.store.streaminfo import StreamInfo, window_count, window_span


@dataclass(frozen=True, slots=True)
class Plan:
    """What the trainer knows of its stream's length now."""

    total_steps: int | None  # the schedule's total; None: not known
    settled: bool  # final (the stream's rows are recorded, or there is nothing to learn)
    max_windows: int | None  # --epochs' windows; None: to the stream's end, or not known yet
    why: str = ""  # where total_steps came from, for the log

    def ints(self) -> list[int]:
        """The numbers rank 0 sends every data-parallel rank (-1: None)."""
        none = -1
        return [
            none if self.total_steps is None else self.total_steps,
            int(self.settled),
            none if self.max_windows is None else self.max_windows,
        ]

    @classmethod
    def from_ints(cls, v: list[int]) -> Plan:
        return cls(v[0] if v[0] >= 0 else None, bool(v[1]), v[2] if v[2] >= 0 else None)


def rank_steps(
    stream_rows: int, window_rows: int, windows: int, world: int, rows_per_step: int
) -> int:
    """Optimizer steps one rank takes over the first `windows` windows of a stream of
    `stream_rows` rows: each rank trains rows // world of every window
    (fanout.train.consumer.row_order), a batch may span windows, and the last batch
    may be partial."""
    full = min(windows, stream_rows // window_rows)  # full windows read
    rows = full * (window_rows // world)
    if windows > full:  # the stream's last, shorter window
        start, stop = window_span(full, window_rows, stream_rows)
        rows += (stop - start) // world
    return -(-rows // rows_per_step)


class StreamPlanner:
    """Reads the stream's plan (`read`), and again when stream.json has changed."""

    def __init__(
        self,
        run_dir: Path,
        *,
        rows_per_step: int,
        world: int,
        epochs: float | None,
        max_steps: int | None,
    ) -> None:
        self.run_dir = RunDir(run_dir)
        self.path = self.run_dir.stream_info
        self.rows_per_step, self.world = rows_per_step, world
        self.epochs, self.max_steps = epochs, max_steps
        self._seen: tuple[int, int, int] | None = None

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def reread_if_changed(self) -> Plan | None:
        """The plan again if stream.json changed since the last read, else None."""
        return self.read() if self._stat() != self._seen else None

    def read(self) -> Plan:
        self._seen = self._stat()
        if self._seen is None:
            if self.epochs is not None:
                raise ConfigError(
                    f"--epochs needs {self.path} (written by the producer); use --max-steps"
                )
            return self._capped(None, True, None, f"no {self.path}")
        info = StreamInfo.read(self.run_dir)
        if info is None:  # removed between the stat and the read
            return self.read()
        return self.plan(info)

    def plan(self, info: StreamInfo) -> Plan:
        """The plan `info` (stream.json) gives."""
        r, n, stream_epochs = info.window_rows, info.num_rows, info.epochs
        if n is not None:
            return self._from_rows(n, r, stream_epochs, True, f"{n} rows")
        est = estimated_rows(info.dataset_summary)
        if est is None:
            why = f"{self.path} records no row count and no regeneration plan"
            return self._capped(None, False, None, why)
        rows, source = est
        return self._from_rows(rows, r, stream_epochs, False, f"~{rows} rows ({source})")

    def _from_rows(self, n: int, r: int, stream_epochs: int, settled: bool, rows: str) -> Plan:
        """The plan of `n` rows per epoch (`rows`: how the log says that number)."""
        stream_rows = n * stream_epochs
        windows = window_count(stream_rows, r)
        max_windows = None
        # the numbers the total is made of: 57 rows x 14 epochs / 2 rows per step = 399
        times = "epoch" if stream_epochs == 1 else "epochs"
        why = f"{rows} per epoch × {stream_epochs} {times} in {self.path}"
        if self.epochs is not None:
            want = max(1, window_count(math.ceil(self.epochs * n), r))
            # an estimate of n cannot end the stream: the windows wait for the real count
            max_windows = want if settled else None
            windows = min(windows, want)
            why += f", --epochs {self.epochs:g}: its first {want} windows of {r} rows"
        why += f", {self.rows_per_step} row{'s' if self.rows_per_step != 1 else ''} per step"
        if self.world > 1:
            why += f" on each of {self.world} ranks"
        steps = rank_steps(stream_rows, r, windows, self.world, self.rows_per_step)
        return self._capped(steps or None, settled, max_windows, why)

    def _capped(self, steps: int | None, settled: bool, max_windows: int | None, why: str) -> Plan:
        """--max-steps caps the total (the trainer stops there); alone, it is the total."""
        if self.max_steps is not None and (steps is None or self.max_steps < steps):
            steps, why = self.max_steps, f"--max-steps {self.max_steps}"
        return Plan(steps, settled, max_windows, why)


def estimated_rows(summary: dict[str, Any]) -> tuple[int, str] | None:
    """An on-policy stream's rows, estimated from its regeneration so far: planned
    records × rows per record regenerated (or, from a producer that does not record the
    planned records, × chunks planned / chunks done), and what it was estimated from;
    None where nothing says."""
    so_far = int(summary.get("rows_so_far") or 0)
    planned, done = summary.get("planned_records"), int(summary.get("records") or 0)
    if so_far and planned and done:
        est = round(so_far * int(planned) / done)
        return est, f"estimated from {so_far} rows of {done}/{planned} records"
    chunks, chunks_done = summary.get("chunks"), int(summary.get("chunks_done") or 0)
    if so_far and chunks and chunks_done:
        est = round(so_far * int(chunks) / chunks_done)
        return est, f"estimated from {so_far} rows of {chunks_done}/{chunks} chunks"
    return None
