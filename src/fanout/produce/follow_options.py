"""`fanout produce`'s flags for a live source (`--follow`), and what it refuses before anything is created.

    from fanout.produce.follow_options import FollowOptions, check_follow
    check_follow(cfg)   # ConfigError, one line, naming the flag

The stream itself is fanout.produce.follow's (FollowStream); these are its options,
kept apart so that module stays one noun.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from fanout.errors import ConfigError


class FollowOptions(BaseModel):
    """`fanout produce`'s fields for a live source (fanout.produce.follow)."""

    follow: str | None = Field(
        None,
        description="capture a growing source: a JSONL file or a directory of JSONL files a "
        "gateway appends to (chat records or OpenAI request/response log pairs); the "
        "stream stays open (RUN_DIR/follow holds its chunks and held-out set)",
    )
    follow_idle_s: float | None = Field(
        None, gt=0, description="--follow: end the stream after this long without a new record"
    )
    follow_chunk_records: int = Field(
        64, ge=1, description="--follow: records per chunk (prepared and packed together)"
    )
    follow_flush_s: float = Field(
        15.0,
        gt=0,
        description="--follow: the most seconds a record waits to be packed with later "
        "records into full rows; after that its short row is captured as it is",
    )
    holdout_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="--follow: fraction of conversations (by content hash) that never enter "
        "a window; the newest --holdout-keep are RUN_DIR/follow/heldout.jsonl",
    )
    holdout_keep: int = Field(256, ge=1, description="--follow: held-out conversations kept")
    follow_keep_windows: int = Field(
        32,
        ge=0,
        description="--follow: a chunk's file and prepared rows are removed once every "
        "consumer is this many windows past its last window (a trainer resumed from a "
        "checkpoint up to this far back still has them captured again)",
    )


def check_follow(opts: Any) -> None:
    """What --follow refuses, in one line each, before anything is created."""
    if opts.follow is None:
        return
    root = Path(opts.follow)
    if not root.exists():
        raise ConfigError(f"--follow {root}: no such file or directory")
    if not os.access(root, os.R_OK | (os.X_OK if root.is_dir() else 0)):
        raise ConfigError(f"--follow {root}: not readable")
    if opts.replicas > 1:
        raise ConfigError(
            "--follow with --replicas: the replicas would all have to cut the same chunks "
            "from one moving source; run one producer per source"
        )
    if opts.regenerate:
        raise ConfigError("--follow with --regenerate: follow served traffic, which is "
                          "already the verifier's own answers")  # fmt: skip
    if opts.epochs != 1:
        raise ConfigError(f"--follow with --epochs {opts.epochs}: a live stream has one epoch")
