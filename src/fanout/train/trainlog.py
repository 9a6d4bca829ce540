"""A trainer's metrics log, `<save-path>/train_log.jsonl`: the one writer and the one reader.

    log = MetricsLog(save_path, rank=0, kind="jsonl"); log.write(rec); log.close()
    recs = read_train_log(save_path)            # one dict per logged step, oldest first

One JSON object per optimizer step (fanout.train.trainer writes `step`, `loss`, `eal`,
`acked`, the fwd/bwd/opt milliseconds, ...), appended by every incarnation of a trainer,
so a resumed trainer's log continues the same file (the chaos checks read its repeats).
Data-parallel rank 0 writes `train_log.jsonl`, rank r > 0 `train_log.rank<r>.jsonl`.
Readers: the bench metrics and plots, the demo, the ranking, the chaos checks and the
benchmarks, all through `read_train_log`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from fanout.tracking import WandbRun

log = logging.getLogger(__name__)

TRAIN_LOG = "train_log.jsonl"


def train_log_path(save_path: str | Path, rank: int = 0) -> Path:
    """Where data-parallel rank `rank` of the trainer saving to `save_path` logs."""
    name = TRAIN_LOG if rank == 0 else f"train_log.rank{rank}.jsonl"
    return Path(save_path) / name


def read_train_log(save_path: str | Path, rank: int = 0) -> list[dict[str, Any]]:
    """The records of a trainer's log, one dict per logged step ([] before its first)."""
    path = train_log_path(save_path, rank)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLog:
    """JSONL metrics (always) + TensorBoard scalars (`kind="tensorboard"`, when installed)
    + a W&B run (`tracker`, fanout.tracking: the trainer opens it on rank 0 for
    `--logger wandb`; closed with this log)."""

    def __init__(
        self,
        save_path: str | Path,
        rank: int = 0,
        kind: str = "jsonl",
        tracker: WandbRun | None = None,
    ) -> None:
        self.tracker = tracker
        path = train_log_path(save_path, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = path.open("a")
        self.tb: Any = None
        if kind == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(path.parent / "tb"))
            except ImportError:
                log.warning("tensorboard not installed; logging JSONL only")

    def write(self, rec: dict[str, Any]) -> None:
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, rec["step"])
        if self.tracker is not None:
            self.tracker.log(rec, step=rec["step"])

    def close(self) -> None:
        self.f.close()
        if self.tb is not None:
            self.tb.close()
        if self.tracker is not None:
            self.tracker.finish()
