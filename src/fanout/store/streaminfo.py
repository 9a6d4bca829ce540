"""The stream's shape: how many windows it has, which rows each holds, and stream.json.

    from fanout.store.streaminfo import StreamInfo, window_count, window_span, windows_per_step
    window_count(stream_rows=1000, window_rows=16)    # 63 windows
    window_span(3, window_rows=16, stream_rows=1000)  # (48, 64): stream rows of window 3
    windows_per_step(rows_per_step=6, rows_per_window=4)  # 2: a step holds 2 windows
    StreamInfo(stream_id=..., num_rows=500, window_rows=16, epochs=2).write(run_dir, fs)
    info = StreamInfo.read(run_dir)                   # None until a producer wrote it

Window w holds the stream rows [w·R, (w+1)·R), the last window of a finite stream
fewer (DESIGN.md "Stream"): `window_span` and `window_count` are that rule, the one
place every part (the producer's row plan, the on-policy stream, the coordinator's
claims and leases, the trainers' schedule) computes it.

`stream.json` (fanout.store.rundir.RunDir.stream_info) is what a trainer needs to turn
`--epochs` into windows and steps; the producer writes it (replaced whole, durably),
trainers and tools read it, both through `StreamInfo`. An on-policy stream
(`fanout produce --regenerate`) records `num_rows` and `total_windows` only once its
last chunk is regenerated (null until then).
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fanout.errors import ConfigError
from fanout.filesystem import FileSystem
from fanout.store.rundir import RunDir


def window_count(stream_rows: int, window_rows: int) -> int:
    """Windows in a stream of `stream_rows` rows: ceil(stream_rows / window_rows)."""
    return -(-stream_rows // window_rows)


def window_span(window: int, window_rows: int, stream_rows: int | None = None) -> tuple[int, int]:
    """Stream rows [start, stop) of window `window`; `stream_rows` (a finite stream's
    length) shortens its last window, None (open-ended) never does."""
    start, stop = window * window_rows, (window + 1) * window_rows
    return (start, stop if stream_rows is None else min(stop, stream_rows))


def windows_per_step(rows_per_step: int, rows_per_window: int) -> int:
    """The most windows one step of `rows_per_step` rows holds at once, for a reader
    that gets `rows_per_window` rows of each window (a data-parallel rank: its share)
    and takes its steps back to back from a window's start. Step k reads that reader's
    rows [k·S, (k+1)·S); its first row sits at k·S mod R, a multiple of g = gcd(S, R)
    and at most R − g, so its last row reaches (R − g + S − 1) // R windows further.
    The producer's K must be at least this (fanout.coord.retention: the slowest
    consumer's windows fill K), else the step waits for a window that only its own
    ack could make room for."""
    if rows_per_window < 1:
        raise ValueError(f"rows_per_window must be >= 1, got {rows_per_window}")
    g = math.gcd(rows_per_step, rows_per_window)
    return (rows_per_window - g + rows_per_step - 1) // rows_per_window + 1


class StreamInfo(BaseModel):
    """stream.json: the stream a run's producer makes, as trainers plan against it."""

    model_config = ConfigDict(extra="ignore")  # read files from newer producers too

    stream_id: str = Field(description="the capture contract's hash (fanout.contract)")
    num_rows: int | None = Field(
        description="rows in one pass over the data; None while an on-policy stream is open"
    )
    window_rows: int = Field(ge=1, description="rows per window R")
    epochs: int = Field(1, ge=1, description="passes over the data the stream holds")
    total_windows: int | None = Field(
        None, description="windows in the stream; None while it is open"
    )
    dataset_summary: dict[str, Any] = Field(
        default_factory=dict, description="the data stage's (or the regeneration's) counts"
    )
    # what the run was captured with, as the producer was given it (absolute): `fanout
    # promote --run-dir` decodes with them unless told otherwise (None: an older run)
    verifier: str | None = Field(None, description="the producer's --verifier-name-or-path")
    tokenizer: str | None = Field(
        None, description="the producer's --tokenizer (the verifier's when it gave none)"
    )

    @classmethod
    def of(
        cls,
        stream_id: str,
        num_rows: int | None,
        window_rows: int,
        epochs: int,
        dataset_summary: dict[str, Any] | None = None,
        verifier: str | None = None,
        tokenizer: str | None = None,
    ) -> StreamInfo:
        """The record of a stream of `num_rows` rows × `epochs` (None: still open),
        captured with `verifier` and `tokenizer` (directories)."""
        total = None if num_rows is None else window_count(num_rows * epochs, window_rows)
        return cls(
            stream_id=stream_id, num_rows=num_rows, window_rows=window_rows, epochs=epochs,
            total_windows=total, dataset_summary=dataset_summary or {},
            verifier=verifier, tokenizer=tokenizer,
        )  # fmt: skip

    def write(self, run_dir: RunDir, fs: FileSystem | None = None) -> None:
        """Replace stream.json whole or not at all, durably (FileSystem.write_atomic)."""
        text = json.dumps(self.model_dump(mode="json"), indent=2) + "\n"
        (fs or FileSystem()).write_atomic(run_dir.stream_info, text.encode())

    @classmethod
    def read(cls, run_dir: RunDir) -> StreamInfo | None:
        """stream.json, or None when no producer wrote it yet; ConfigError naming the file
        when it is unreadable."""
        path = run_dir.stream_info
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the stream's plan: {e}") from None
        try:
            return cls.model_validate_json(text)
        except ValidationError as e:
            raise ConfigError(f"{path}: not a stream plan: {e.errors()[0]['msg']}") from None
