"""Trainer start-up: launch → first step of `fanout train` on a produced run, by part.

    .venv/bin/python benchmarks/startup.py --pairs 5
    git archive HEAD~1 src | tar -x -C /tmp/before      # compare with another checkout:
    .venv/bin/python benchmarks/startup.py --tree before=/tmp/before/src --tree after=src

Builds the tiny test assets (a 512-token BPE tokenizer, a Qwen3 with hidden 32 × 4
layers, tied embeddings) and produces a run (window_rows 4) once, then starts one-step
trainers on it (`--block-size 4 --max-anchors 16 --max-steps 1`, a new consumer id
each), alternating between the `--tree`s (PYTHONPATH = that tree's src) so that every
tree sees the same load. Each trainer logs where its start went with its first step
("first step X s after the process started (interpreter + imports ..., draft +
optimizer ..., ...)"); the table gives the median (min) of each part and of the whole
command, with the load average (`os.getloadavg`) before and after. docs/operations.md,
"Trainer start-up", quotes it.

Then per tree and command (produce, train, eval, promote): how long a flag-only error
takes to come back (`fanout produce --replica-rank 2 --replicas 2 ...`, `fanout train
... --block-size 1`, `fanout eval ... --temperature -1`, `fanout promote --margin -1`:
one line, exit 1; fanout.cli.early_check refuses them before torch is imported), over
`--flag-errors` runs each, goal < 1 s; `--no-trainers` times only those.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PARTS = (
    "interpreter + imports",
    "waiting for the run",
    "draft + optimizer",
    "registering",
    "first window",
    "first step",
)


def build_run(root: Path) -> Path:
    """Tiny assets + a produced run under `root`; returns `root`."""
    from fanout.bench.assets import (
        build_tokenizer,
        generate_corpus,
        tiny_verifier_for_tokenizer,
        write_jsonl,
    )
    from fanout.produce.config import ProducerConfig
    from fanout.produce.producer import Producer

    corpus = generate_corpus(120, seed=0)
    write_jsonl(root / "chat.jsonl", corpus)
    tok = build_tokenizer(root / "tok", corpus, 512)
    tiny_verifier_for_tokenizer(
        root / "verifier", tok, hidden_size=32, num_layers=4, tie_word_embeddings=True
    )
    cfg = ProducerConfig(
        run_dir=str(root / "run"),
        verifier_name_or_path=str(root / "verifier"),
        data=[str(root / "chat.jsonl")],
        tokenizer=str(tok),
        seq_len=96,
        window_rows=4,
        capture_layer_ids=[1, 2],
        workers=1,
        progress=False,
        exit_when_idle_s=0,
        max_live_windows=1000,
        expected_consumers=1000,
    )
    Producer(cfg).run()
    return root


def one_trainer(root: Path, src: str, name: str) -> dict[str, Any]:
    """Launch one trainer with PYTHONPATH=`src`; its parts and the whole command (s)."""
    argv = [
        sys.executable, "-m", "fanout.cli", "train", "--run-dir", str(root / "run"),
        "--consumer-id", name, "--verifier-name-or-path", str(root / "verifier"),
        "--save-path", str(root / "drafts" / name), "--num-layers", "1", "--block-size", "4",
        "--max-anchors", "16", "--max-steps", "1", "--no-progress",
    ]  # fmt: skip
    t0 = time.monotonic()
    r = subprocess.run(
        argv, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=src), check=False
    )
    wall = time.monotonic() - t0
    line = next((x for x in r.stderr.splitlines() if "first step" in x), None)
    if r.returncode or line is None:
        raise RuntimeError(f"trainer {name} ({src}) failed:\n{r.stderr[-2000:]}")
    total = re.search(r"first step ([\d.]+) s after", line)
    found = re.findall(r"([a-z +]+?) ([\d.]+) s", line.split("(", 1)[1])
    out: dict[str, Any] = {k.strip(): float(v) for k, v in found}
    out["command_s"] = round(wall, 3)
    out["first_step_s"] = float(total.group(1)) if total else None
    return out


# command -> (argv, what its one line must say): a flag-only error per command whose
# configs fanout.cli.EARLY checks before the command's module (and torch) is imported
FLAG_ERRORS: dict[str, tuple[list[str], str]] = {
    "produce": (["produce", "--replica-rank", "2", "--replicas", "2", "--run-dir", "r",
                 "--verifier-name-or-path", "v", "--data", "d"],
                "--replica-rank 2 must be below --replicas 2"),
    "train": (["train", "--run-dir", "r", "--consumer-id", "c", "--verifier-name-or-path", "v",
               "--save-path", "s", "--block-size", "1"], "--block-size"),
    "eval": (["eval", "--verifier-name-or-path", "v", "--data", "d", "--tokenizer", "t",
              "--draft", "x", "--temperature", "-1"], "temperatures must be >= 0"),
    "promote": (["promote", "--margin", "-1"], "--margin"),
}  # fmt: skip
FLAG_ERROR_GOAL_S = 1.0  # issue #45: a flag-only error back in under a second


def one_flag_error(src: str, command: str) -> float:
    """Seconds from launch to the exit of `fanout COMMAND` refused for its flags."""
    argv, says = FLAG_ERRORS[command]
    env = {**os.environ, "PYTHONPATH": src}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "fanout.cli", *argv], env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    took = time.perf_counter() - t0
    if r.returncode != 1 or says not in r.stderr or r.stderr.count("\n") != 1:
        raise SystemExit(f"{command}: the flag error did not come back as expected: "
                         f"{r.stderr[-2000:]}")  # fmt: skip
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=SRC",
        help="a source tree to time (its src dir, put on PYTHONPATH); repeat to compare; "
        "default: this checkout's src",
    )
    ap.add_argument("--pairs", type=int, default=5, help="trainers per tree (default 5)")
    ap.add_argument("--workdir", type=Path, help="assets + run dir; default: a temp dir")
    ap.add_argument("--json", type=Path, help="write the results to this JSON file")
    ap.add_argument("--flag-errors", type=int, default=5,
                    help="flag-only errors to time per tree (default 5)")  # fmt: skip
    ap.add_argument("--no-trainers", action="store_true",
                    help="time only the flag errors (no assets, no run)")  # fmt: skip
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from record import Recorder, Row, spread

    rec = Recorder("startup", argv)
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": str(REPO / "src")}
    with tempfile.TemporaryDirectory(prefix="fanout-startup-") as tmp:
        root = args.workdir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        if not args.no_trainers and not (root / "run" / "contract.json").is_file():
            build_run(root)
        load_before = os.getloadavg()
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in trees}
        flag_errors: dict[str, dict[str, list[float]]] = {
            k: {c: [] for c in FLAG_ERRORS} for k in trees
        }
        for i in range(max(args.flag_errors, 0 if args.no_trainers else args.pairs)):
            for k, src in trees.items():
                if i < args.flag_errors:
                    for c in FLAG_ERRORS:
                        flag_errors[k][c].append(one_flag_error(src, c))
                if not args.no_trainers and i < args.pairs:
                    runs[k].append(one_trainer(root, src, f"{k}-{os.getpid()}-{i}"))
        load_after = os.getloadavg()
    cols = ("command_s", "first_step_s", *PARTS)
    print(
        f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"load {load_before[0]:.1f} → {load_after[0]:.1f}; {args.pairs} trainers per tree, "
        "alternating; median (min), s"
    )
    show = print if not args.no_trainers else (lambda *_: None)
    show("| tree | " + " | ".join(cols) + " |")
    show("|---" * (len(cols) + 1) + "|")
    summary: dict[str, dict[str, list[float]]] = {}
    for k, rs in runs.items():
        cells, summary[k] = [], {}
        for c in cols:
            xs = [r[c] for r in rs if r.get(c) is not None]
            summary[k][c] = [statistics.median(xs), min(xs)] if xs else []
            cells.append(f"{statistics.median(xs):.2f} ({min(xs):.2f})" if xs else "-")
        show(f"| {k} | " + " | ".join(cells) + " |")
    rows = []
    for k, rs in runs.items():
        xs = [r["first_step_s"] for r in rs if r.get("first_step_s") is not None]
        if not xs:
            continue
        parts = ", ".join(f"{p} {summary[k][p][0]:.2f}" for p in PARTS if summary[k].get(p))
        rows.append(Row(stage="start-up", name=f"first_step_s.{k}",
                        what=f"trainer launch → first step ({k} tree)", result=statistics.median(xs),
                        unit="s", spread=spread(xs), n=len(xs), n_of="trainers",
                        conditions=f"tiny run (hidden 32 × 4 layers, block 4); median s by part: {parts}"))  # fmt: skip
    print("| tree | command | flag error, s (median (min)) |\n|---|---|---|")
    for k, by_cmd in flag_errors.items():
        for c, xs in by_cmd.items():
            if not xs:
                continue
            med = statistics.median(xs)
            print(f"| {k} | {c} | {med:.2f} ({min(xs):.2f}) |")
            rows.append(Row(stage="start-up", name=f"flag_error_s.{c}.{k}",
                            what=f"a flag-only error of `fanout {c}` ({' '.join(FLAG_ERRORS[c][0][1:])}) "
                            f"→ one line, exit 1 ({k} tree)", result=med, unit="s",
                            spread=spread(xs), n=len(xs), n_of="commands",
                            goal=f"< {FLAG_ERROR_GOAL_S:g}", met=med < FLAG_ERROR_GOAL_S,
                            conditions="checked before torch is imported (fanout.cli.EARLY)"))  # fmt: skip
    out = {"trees": trees, "load": [load_before, load_after], "runs": runs,
           "flag_errors": flag_errors}  # fmt: skip
    rec.write(args.json, rows, raw=out | {"summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
