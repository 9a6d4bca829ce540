"""benchmarks/drift.py at its smallest: the live loop runs end to end and writes a complete record.

    .venv/bin/pytest tests/test_bench_drift.py -x -q

The whole benchmark (verifier built on the two real chat sets, appender, `fanout
produce --follow`, `fanout train`, `fanout promote`, the switch, the evals after it) at
sizes that only show it works; its goal (served ≥ 1.2 × frozen) is the benchmark's
run to report, not checked here. What is checked: the record's format
(benchmarks/record.py `check`), its rows, and that the raw figures agree with each other
(ratio = τ served / τ frozen, the last eval point's figures are the rows', every
promotion's latency is a checkpoint written before it was served).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from conftest import repo_module

REPO = Path(__file__).resolve().parents[1]
EVAL_PROMPTS = 4
SMALLEST = [
    "--a-conversations", "24", "--b-conversations", "32", "--b-passes", "1",
    "--eval-prompts", str(EVAL_PROMPTS), "--eval-points", "2", "--verifier-steps", "20",
    "--vocab-size", "512", "--max-new-tokens", "16", "--records-per-s", "20",
    "--idle-s", "15", "--seq-len", "128", "--window-rows", "2", "--k", "3",
    "--checkpoint-every", "5", "--checkpoint-every-s", "10", "--poll-s", "2",
    "--promote-prompts", "4", "--holdout-fraction", "0.2", "--chunk-records", "8",
    "--catch-up-s", "240",
]  # fmt: skip


def _bench(name: str) -> ModuleType:
    return repo_module("benchmarks", name)


def test_quick_sets_small_sizes_and_flags_still_win() -> None:
    drift = _bench("drift")
    q = drift.parse_args(["--quick", "--eval-prompts", "5"])
    full = drift.parse_args([])
    assert q.eval_prompts == 5  # given: kept
    assert q.a_conversations < full.a_conversations and q.verifier_steps < full.verifier_steps


@pytest.mark.slow  # the whole live loop (~45 s); the benchmark itself is the record
@pytest.mark.skipif(
    not (REPO.parent / "shared" / "data" / "chat").is_dir(), reason="no shared data"
)
def test_smallest_run_writes_a_complete_record(tmp_path: Path) -> None:
    out = tmp_path / "drift.json"
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "benchmarks/drift.py", "--work", str(tmp_path / "work"),
         "--json", str(out), *SMALLEST],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "served / frozen on new traffic" in proc.stdout  # the table was printed
    rec = json.loads(out.read_text())
    assert _bench("record").check(rec, "drift.json") == []
    assert rec["benchmark"] == "drift" and rec["load"]["before"] and rec["load"]["after"]
    rows = {r["name"]: r for r in rec["rows"]}
    assert {"tau_ratio_new_traffic", "tau_served_new_traffic", "tau_frozen_new_traffic"} <= set(
        rows
    )
    ratio, served, frozen = (rows[f"tau_{k}_new_traffic"] for k in ("ratio", "served", "frozen"))
    assert ratio["goal"] == ">= 1.2" and ratio["met"] == (ratio["result"] >= 1.2)
    assert ratio["n"] == served["n"] == EVAL_PROMPTS and ratio["n_of"] == "prompts"
    assert served["result"] >= 1 and frozen["result"] >= 1  # τ counts the verifier's token
    assert ratio["result"] == pytest.approx(served["result"] / frozen["result"], rel=1e-3)
    raw = rec["raw"]
    live = raw["live"]
    assert len(live["points"]) == 2 and live["points"][-1]["served"]["tau"] == served["result"]
    assert all(p["lossless"] for p in live["points"])
    assert live["switch"]["frozen_step"] >= 1 and live["steps"] > live["switch"]["frozen_step"]
    assert live["decisions"][0]["promoted"]  # the first checkpoint: nothing served yet
    assert live["promotion_latency_s"] and all(x >= 0 for x in live["promotion_latency_s"])
    assert rows["promotion_latency_s"]["n"] == len(live["promotion_latency_s"])
    assert len(raw["load_avg_1m"]) == 2 and raw["sizes"]["eval_prompts"] == EVAL_PROMPTS
    assert rec["plots"] and rec["plots"][0]["kind"] == "line"
