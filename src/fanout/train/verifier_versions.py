"""A trainer on a run whose verifier changes (`fanout produce --follow-verifier`): which
version each step trains against, what is too old to train on, and how old rows weigh.

    python scripts/train.py --run-dir runs/rl --verifier-name-or-path /ckpt/policy \
        --max-verifier-lag 2 --verifier-age-decay 0.5 ...     # /ckpt/policy: versions/vNNNN

Given a versioned --verifier-name-or-path (fanout.checkpoints.versions), the trainer
builds its draft from the live version and then, step by step, follows the version the
rows it trains on were captured with (a batch never mixes versions:
fanout.train.consumer): before a step on rows of another version, the draft's frozen
verifier tensors (embedding, `lm_head`, final norm: `Draft.load_verifier_tensors`) are
read from that version's directory. A version that is gone from the directory (its
writer pruned it) leaves the tensors as they are, with one warning.

`--max-verifier-lag N`: a batch captured more than N versions before the newest (the
version the run captures with now, as the coordinator records it: rank 0 reads it, every
rank follows) is acknowledged without training: counted (`fanout status` shows each
consumer's count, the log record of the next step carries it) and logged once per
window. `--verifier-age-decay D`: a step's loss is scaled by D^k for rows captured k
versions before the newest (under AdamW this scales that step's update about as much);
off by default. Both do nothing on a run whose windows record no version.

No torch at import: `fanout train`'s flags are read before torch is.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from fanout.checkpoints.versions import Version, current_version, is_versioned, version_dir
from fanout.errors import ConfigError

log = logging.getLogger("fanout.train.trainer")


class VersionOptions(BaseModel):
    """`fanout train`'s fields for a verifier that changes while the run is produced."""

    max_verifier_lag: int | None = Field(
        None,
        ge=0,
        description="with a versioned --verifier-name-or-path (produce --follow-verifier): "
        "acknowledge without training the windows captured more than N verifier versions "
        "before the newest, counted in `fanout status` and the log; default: train on all",
    )
    verifier_age_decay: float | None = Field(
        None,
        gt=0,
        le=1,
        description="with a versioned --verifier-name-or-path: scale a step's loss by D^k for "
        "rows captured k versions before the newest (e.g. 0.5); default: off (every row "
        "weighs 1)",
    )


def live_version(verifier_dir: str) -> Version | None:
    """The live version of a versioned --verifier-name-or-path, None for a plain model
    directory (ConfigError for a versioned one without a committed version)."""
    if not is_versioned(verifier_dir):
        return None
    v = current_version(verifier_dir)
    if v is None:
        raise ConfigError(
            f"--verifier-name-or-path {verifier_dir}: a versioned directory without a "
            "committed version yet (versions/vNNNN with its COMMITTED marker)"
        )
    return v


class VersionFollower:
    """Which verifier version the draft's frozen tensors are from, and what a batch of
    another version needs (see the module docstring)."""

    def __init__(self, root: str, start: Version, opts: VersionOptions) -> None:
        self.root = Path(root)
        self.loaded = start.number  # the draft was built from this version
        self.path = start.path  # ... and this directory (checkpoints name it)
        self.opts = opts
        self.skipped_windows = 0
        self.skipped_rows = 0
        self.reloads = 0
        self._gone: set[int] = set()  # versions warned about once

    def lag(self, version: int | None, newest: int | None) -> int:
        """Versions between a batch's and the newest (0 when either is unknown)."""
        if version is None or newest is None:
            return 0
        return max(0, newest - version)

    def too_old(self, lag: int) -> bool:
        """Whether a batch `lag` versions behind is acknowledged without training."""
        bound = self.opts.max_verifier_lag
        return bound is not None and lag > bound

    def weight(self, lag: int) -> float:
        """The loss scale of a batch `lag` versions behind (--verifier-age-decay)."""
        d = self.opts.verifier_age_decay
        return 1.0 if d is None else float(d**lag)

    @property
    def reads_newest(self) -> bool:
        """Whether a step needs the newest version (--max-verifier-lag, --verifier-age-decay)."""
        return self.opts.max_verifier_lag is not None or self.opts.verifier_age_decay is not None

    def check(self, stream: Any, batch: Any, dp: Any) -> tuple[int, bool]:
        """(lag, skipped) of `batch`: how many versions before the newest its rows were
        captured (rank 0 reads the newest from the coordinator, every rank of `dp`
        follows), and whether it was acknowledged without training (--max-verifier-lag:
        acked, counted in the coordinator and here, a warning per window it ends)."""
        if batch.verifier_version is None or not self.reads_newest:
            return 0, False
        newest = stream.coord.newest_verifier_version() if dp.is_main else None
        got = dp.from_main([-1 if newest is None else newest])[0]
        lag = self.lag(batch.verifier_version, None if got < 0 else got)
        if not self.too_old(lag):
            return lag, False
        stream.ack(batch)
        stream.coord.count_lag_skipped(stream.reg, len(batch.completes))
        self.skipped([ow.window for ow in batch.completes], len(batch.rows), batch, lag)
        return lag, True

    def skipped(self, windows: list[int], rows: int, batch: Any, lag: int) -> None:
        """Count a batch acknowledged without training (a warning per window it ends)."""
        version = batch.verifier_version
        self.skipped_rows += rows
        self.skipped_windows += len(windows)
        for w in windows:
            log.warning(
                "window %d: captured with verifier version %d, %d versions before the "
                "newest (--max-verifier-lag %s): acknowledged without training (%d so far)",
                w, version, lag, self.opts.max_verifier_lag, self.skipped_windows,
            )  # fmt: skip

    def follow(self, draft: Any, version: int | None) -> bool:
        """Load version `version`'s frozen tensors into `draft` when they are not the
        ones it has; True when it did."""
        if version is None or version == self.loaded:
            return False
        path = version_dir(self.root, version)
        if path is None:
            if version not in self._gone:
                self._gone.add(version)
                log.warning(
                    "verifier version %d is not in %s (pruned, or never committed): its rows "
                    "train against version %d's embedding, head and norm",
                    version, self.root, self.loaded,
                )  # fmt: skip
            return False
        draft.load_verifier_tensors(path)
        self.loaded, self.path = version, path
        self.reloads += 1
        log.info("verifier tensors of version %d loaded (%s)", version, path)
        return True

    def prepare(self, draft: Any, batch: Any, lag: int) -> float:
        """Before a step on `batch` (`lag` versions behind the newest): its version's
        frozen tensors in `draft` (`follow`); returns its loss weight (`weight`)."""
        self.follow(draft, batch.verifier_version)
        return self.weight(lag)

    def record(self, lag: int) -> dict[str, Any]:
        """What a step's log record says of versions: the version its tensors are from,
        how far behind the newest its rows were, what was skipped so far."""
        out: dict[str, Any] = {"verifier_version": self.loaded, "verifier_lag": lag}
        if self.skipped_windows:
            out["lag_skipped_windows"] = self.skipped_windows
            out["lag_skipped_rows"] = self.skipped_rows
        return out
