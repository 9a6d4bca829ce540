"""The one format of a benchmark's JSON: where and how it ran, and the rows it measured.

    from record import Recorder, Row                # benchmarks/*.py (run from the repo root)
    rec = Recorder("store_io", argv)                # commit, date, hardware, load before
    rec.write(args.json, [Row(stage="store", name="publish_vs_raw", what="publish vs raw write+fsync",
              result=1.5, spread=(1.4, 1.6), n=5, goal=">= 0.9", unit="×",
              conditions="256 MiB window")], raw=everything_else)

Every benchmark under benchmarks/ writes its `--json OUT` through `Recorder.write`:
`benchmark` (its name: the script's stem; the report groups by it), `commit` (and whether
the tree differed from it), `date` (UTC), `command` (as run), `hardware`
(fanout.bench.report.hardware: CPU, cores, memory, GPUs), `versions`, `load` (the
1/5/15-minute load averages, `os.getloadavg`, before and after: a shared machine's numbers
move with it) and `rows`, each a `Row`: one measured figure with its goal, sample size
and spread, the stage of the data path it belongs to and its conditions. Everything else
the script measured goes under `raw`. `benchmarks/report.py` turns the JSONs kept in
benchmarks/results/ into docs/numbers.md and the README's headline table; nothing in
either is typed by hand.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FORMAT = 1  # of the JSON below; report.py reads this version

# The stages of the data path, in the order docs/numbers.md lists them (a row of another
# stage comes after these, in the order of its name).
STAGES = (
    "data",
    "store",
    "coordinator",
    "producer",
    "training",
    "fan-out",
    "eval",
    "reliability",
    "start-up",
    "tests",
)


@dataclass(frozen=True, kw_only=True)
class Row:
    """One measured figure: `result` (a number, or text for a verdict such as "lossless")
    with its `spread` (low, high) over `n` samples, what `spread_kind` it is ("min–max",
    "95% CI", ...), the `goal` it is held to (text, e.g. ">= 0.9"; None when it has none)
    and whether it `met` it, the `conditions` (sizes, settings) it was measured under."""

    stage: str
    name: str  # stable id within the benchmark (the headline table picks rows by it)
    what: str
    result: float | str
    unit: str = ""
    spread: tuple[float, float] | None = None
    spread_kind: str = "min–max"
    n: int = 1
    n_of: str = "runs"  # what n counts: runs, rounds, prompts, ...
    goal: str | None = None
    met: bool | None = None
    conditions: str = ""


def spread(xs: Sequence[float]) -> tuple[float, float] | None:
    """(min, max) of several samples; None for one (no spread to give)."""
    return (min(xs), max(xs)) if len(xs) > 1 else None


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                           timeout=30, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip()


def _load() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def command(benchmark: str, argv: Sequence[str] | None = None, launcher: str = "python") -> str:
    """The command that reproduces a run, as typed from the repository root."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join([*shlex.split(launcher), f"benchmarks/{benchmark}.py", *args])


class Recorder:
    """Provenance taken when the benchmark starts (the load before it), written with its
    rows when it ends."""

    def __init__(
        self, benchmark: str, argv: Sequence[str] | None = None, launcher: str = "python"
    ) -> None:
        from fanout import package_version
        from fanout.bench.report import hardware, versions

        # A copy on a lent GPU box names its commit in FANOUT_COMMIT: given, it wins (that
        # copy's .git, when one travels, can be a stale snapshot: seen on 2026-12-04)
        given = os.environ.get("FANOUT_COMMIT")
        commit = given or _git("rev-parse", "HEAD")
        status = None if given else _git("status", "--porcelain", "--untracked-files=no")
        self.head: dict[str, Any] = {
            "format": FORMAT,
            "benchmark": benchmark,
            "commit": commit,
            "tree_differs_from_commit": None if status is None else bool(status),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "command": command(benchmark, argv, launcher),
            "hardware": hardware(),
            "versions": versions()
            | {"speculators": package_version("speculators") or "not installed"},
            "load": {"before": _load()},
        }

    def write(
        self,
        path: str | Path | None,
        rows: Sequence[Row],
        raw: Any = None,
        plots: Sequence[dict[str, Any]] = (),
        notes: Sequence[str] = (),
    ) -> dict[str, Any]:
        """The whole record (load after taken now); written to `path` unless it is None.
        `plots`: what report.py draws (see its `write_plots`): {name, stage, title, kind:
        "line" with series {label: [[x, y], ...]}, or "bar" with bars [{label, y,
        interval}], xlabel, ylabel}. `notes`: paragraphs docs/numbers.md prints under
        the run's line (made by the benchmark from what it measured, never typed)."""
        rec = self.head | {
            "load": self.head["load"] | {"after": _load()},
            "rows": [dataclasses.asdict(r) for r in rows],
            "plots": list(plots),
            "raw": raw,
        }
        if notes:
            rec["notes"] = list(notes)
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(rec, indent=2, default=str) + "\n")
        return rec


def check(rec: dict[str, Any], where: str) -> list[str]:
    """What a record lacks (empty when it is complete): report.py and the tests use it."""
    bad = []
    for key in ("benchmark", "commit", "date", "command", "hardware", "load", "rows"):
        if not rec.get(key):
            bad.append(f"{where}: no {key!r}")
    commit = rec.get("commit") or ""
    if commit and (len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit)):
        bad.append(f"{where}: commit {commit!r} is not a git commit id")
    load = rec.get("load") or {}
    if not load.get("before") or not load.get("after"):
        bad.append(f"{where}: load before and after are both needed")
    fields = {f.name for f in dataclasses.fields(Row)}
    for i, row in enumerate(rec.get("rows") or []):
        missing = fields - set(row)
        if missing:
            bad.append(f"{where}: rows[{i}] lacks {sorted(missing)}")
    return bad
