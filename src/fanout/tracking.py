"""Experiment tracking in Weights & Biases: trainers' metrics, the producer's and eval's summaries, one group per run.

    scripts/train.py ... --logger wandb --wandb-project drafts     # per-step metrics
    fanout produce ... --wandb-project drafts                       # its summary at exit
    fanout eval ... --wandb-project drafts --wandb-group run1       # τ per draft, the table

    run = WandbRun.start(TrackingOptions(wandb_project="drafts"), name="b16:dp0",
                         group="run1", job_type="train", config={...}, dir=save_path)
    run.log({"loss": 1.2, "eal": 2.1}, step=3)
    run.finish({"checkpoint": "drafts/b16/step-400"})

W&B is the tracker most draft-training users already use (speculators, SpecForge and
the EAGLE/DFlash reference trainers log to it), so a fanout run lands beside theirs:
every process of one run dir shares a group (`--wandb-group`, by default the run dir's
name), a trainer is one W&B run named after its consumer id, the producer replicas
and eval one each. W&B's own environment settings apply as usual: `WANDB_MODE=offline`
(no network; `wandb sync` later), `WANDB_DIR`, `WANDB_ENTITY`, `WANDB_API_KEY`.

`wandb` is optional (`pip install 'fanout[wandb]'`): asking for it without the package is
one ConfigError line before anything starts. Only data-parallel rank 0 of a trainer
logs (the others' metrics are in their own JSONL, fanout.train.trainlog).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fanout.errors import ConfigError


class TrackingOptions(BaseModel):
    """Where a command's W&B run goes (`fanout produce`, `fanout eval` and the trainer
    inherit these fields, one flag each)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    wandb_project: str | None = Field(
        None,
        description="W&B project to log to (a trainer: with --logger wandb, default 'fanout'; "
        "produce / eval: their summaries, only when given); WANDB_MODE=offline works "
        "without network",
    )
    wandb_group: str | None = Field(
        None,
        description="W&B group: every process of one run shares it (default: the run "
        "dir's name; eval: none unless given)",
    )


def wandb_missing(what: str) -> str | None:
    """Why `what` (the flag that asked for W&B) cannot run: the package is not
    installed; None when it is. Checked with the flags, before anything starts."""
    if importlib.util.find_spec("wandb") is None:
        return f"{what}: needs the wandb package: pip install 'fanout[wandb]'"
    return None


def check_available(what: str) -> None:
    """ConfigError (`wandb_missing`'s line) when W&B was asked for and is not installed."""
    if why := wandb_missing(what):
        raise ConfigError(why)


def group_for(run_dir: str | Path | None, given: str | None) -> str | None:
    """The W&B group: `given`, else the run dir's name (every process of one run)."""
    if given:
        return given
    return None if run_dir is None else Path(run_dir).resolve().name


def _scalars(rec: dict[str, Any]) -> dict[str, float | int]:
    """The numbers of a record (W&B charts numbers; text and lists stay in the JSONL)."""
    return {k: v for k, v in rec.items() if isinstance(v, int | float) and not isinstance(v, bool)}


class WandbRun:
    """One W&B run (see the module docstring); `start` opens it."""

    def __init__(self, run: Any) -> None:
        self.run = run

    @classmethod
    def start(
        cls,
        options: TrackingOptions,
        *,
        name: str,
        group: str | None,
        job_type: str,
        config: dict[str, Any],
        dir: str | Path,
        default_project: str | None = None,
    ) -> WandbRun:
        """Open a W&B run; a trainer resumed into the same `dir` continues its run (the
        id is derived from the group and name, so a restart finds it)."""
        check_available(f"W&B logging ({job_type})")
        import wandb

        project = options.wandb_project or default_project or "fanout"
        Path(dir).mkdir(parents=True, exist_ok=True)
        run_id = re.sub(r"[^A-Za-z0-9_-]", "-", f"{group or 'fanout'}-{name}")[:128]
        run = wandb.init(
            project=project,
            group=group,
            name=name,
            id=run_id,
            resume="allow",
            job_type=job_type,
            config=config,
            dir=str(dir),
            reinit="create_new",
        )
        return cls(run)

    def log(self, rec: dict[str, Any], step: int | None = None) -> None:
        """A record's numbers at `step` (W&B's own step when None)."""
        self.run.log(_scalars(rec), step=step)

    def finish(self, summary: dict[str, Any] | None = None) -> None:
        """Put `summary`'s numbers and short texts in the run's summary, then close it."""
        for k, v in (summary or {}).items():
            if isinstance(v, int | float | str | bool) or v is None:
                self.run.summary[k] = v
        self.run.finish()
