"""Read back what W&B wrote in offline mode (WANDB_MODE=offline): the oracle of the tracking tests.

    runs = read_offline_runs(save_path)   # one OfflineRun per offline-run-* directory
    runs[0].group, runs[0].history        # "run1", [{"step": 1, "loss": 2.3, ...}, ...]

W&B's Python package has no reader for its `.wandb` files in this version, so this reads
the format its writer uses (a LevelDB-style log: a 7-byte header `:W&B` + magic +
version, then 32 KiB blocks of records, each a 7-byte header — crc32, length, type
FULL/FIRST/MIDDLE/LAST — and a chunk of a `wandb_internal_pb2.Record` protobuf) and
parses the records with W&B's own protobuf classes. Nothing here imports fanout.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7  # the file's, and each record's
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    run_id: str = ""
    project: str = ""
    group: str = ""
    job_type: str = ""
    name: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


def _records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B log"
    pos, buf, out = HEADER, b"", []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail is padding
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and n == 0:
            break  # preallocated zeros past the last record
        buf += data[pos + HEADER : pos + HEADER + n]
        pos += HEADER + n
        if kind in (FULL, LAST):
            rec = pb.Record()  # type: ignore[attr-defined]  # generated protobuf class
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def _key(item: Any) -> str:
    return item.key or ".".join(item.nested_key)


def _finished_records(path: Path, wait_s: float) -> list[Any]:
    """The records of a run's log once it holds the run's `exit` record. `run.finish()`
    can return before W&B's writer process has flushed the log (seen in CI: a log of its
    header alone), so this waits up to `wait_s` for the writer, then returns what is there
    (a test's assertions then say what is missing)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            recs = _records(path)
        except Exception:  # a record half written: read again
            recs = None
        done = recs is not None and any(r.WhichOneof("record_type") == "exit" for r in recs)
        if done or time.monotonic() > deadline:
            return recs if recs is not None else _records(path)
        time.sleep(0.2)


def read_offline_runs(root: str | Path, wait_s: float = 120.0) -> list[OfflineRun]:
    """Every offline run W&B wrote under `root` (its `wandb/` directory), oldest first,
    each read once its log is complete (waiting up to `wait_s` for W&B's writer)."""
    runs = []
    for path in sorted(Path(root).glob("wandb/offline-run-*/run-*.wandb")):
        run = OfflineRun()
        for rec in _finished_records(path, wait_s):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                r = rec.run
                run.run_id, run.project, run.group = r.run_id, r.project, r.run_group
                run.job_type, run.name = r.job_type, r.display_name
                run.config |= {_key(u): json.loads(u.value_json) for u in r.config.update}
            elif kind == "history":
                row = {_key(i): json.loads(i.value_json) for i in rec.history.item}
                run.history.append({k: v for k, v in row.items() if not k.startswith("_")})
            elif kind == "summary":
                run.summary |= {_key(u): json.loads(u.value_json) for u in rec.summary.update}
        runs.append(run)
    return runs
