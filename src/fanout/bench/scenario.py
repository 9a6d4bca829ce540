"""What one bench scenario ran: its assets, its processes and their exits, the wall
clock around them. `fanout bench` (fanout.bench.bench) fills these in; its numbers
(fanout.bench.metrics) and its report (fanout.bench.report) read them.

    from fanout.bench.scenario import Role, ScenarioRun
    run = ScenarioRun("1p1c", out / "1p1c", roles, [run_dir], started_wall, ended_wall)
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from fanout.bench.config import ConsumerSpec


@dataclass(frozen=True)
class Assets:
    """The verifier, tokenizer and data a scenario's roles read (resolve_assets)."""

    verifier_dir: Path
    tokenizer_dir: Path
    data: list[str]
    mask_token_id: int | None


@dataclass
class Role:
    """One process of a scenario: a producer, or a consumer (save_path and spec set)."""

    name: str
    kind: Literal["producer", "consumer"]
    cmd: list[str]
    log: Path
    run_dir: Path
    device: str
    proc: subprocess.Popen[bytes] | None = None
    rc: int | None = None
    stopped_by_us: bool = False
    save_path: Path | None = None
    spec: ConsumerSpec | None = None
    summary_path: Path | None = None


@dataclass
class ScenarioRun:
    """One scenario (1p1c, 1p3c, unshared): its roles, run dirs and wall clock."""

    name: str
    dir: Path
    roles: list[Role]
    run_dirs: list[Path]
    started_wall: float = 0.0
    ended_wall: float = 0.0
    timed_out: bool = False
    notes: list[str] = field(default_factory=list)


__all__ = ["Assets", "Role", "ScenarioRun"]
