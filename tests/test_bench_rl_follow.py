"""benchmarks/rl_follow.py: what it reads off a run, and (slow) the run at its smallest.

    .venv/bin/pytest tests/test_bench_rl_follow.py -q -p no:cacheprovider

The benchmark's figures are read from what the producer logs and what it writes, so the
fast tests hold those readers to the real sources: the swap line as
fanout.produce.verifier_follow logs it (through the CLI's log format), the shifted
chat set, the disk halves. The slow one runs the whole loop (policy versions committed
mid-run, `fanout produce --follow --follow-verifier`, `fanout train`, the evals) at sizes
that only show it works and writes a complete record; its goals are the benchmark's run
to report, not checked here.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from conftest import repo_module
from fanout.checkpoints.layout import MARKER
from fanout.checkpoints.versions import CURRENT, VERSIONS
from fanout.filesystem import FileSystem
from fanout.flags import LOG_FORMAT, RoleFormatter
from fanout.produce.verifier_follow import VerifierFollower, version_of

REPO = Path(__file__).resolve().parents[1]


def _bench() -> ModuleType:
    return repo_module("benchmarks", "rl_follow")


def _version(root: Path, n: int) -> Path:
    d = root / VERSIONS / f"v{n:04d}"
    d.mkdir(parents=True)
    (d / MARKER).write_text("")
    FileSystem().point(root / CURRENT, f"{VERSIONS}/{d.name}")
    return d


def test_the_swap_line_the_producer_logs_is_read_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The real follower's swap line, formatted as `fanout produce` writes its log, gives
    the version, the load seconds and the line's wall time; a line in another shape
    gives nothing (so a changed message fails here, not silently in the benchmark)."""
    bench = _bench()
    v1 = version_of(_version(tmp_path, 1))
    assert v1 is not None
    follower = VerifierFollower(v1)
    _version(tmp_path, 2)
    loaded = SimpleNamespace(contract_fields=lambda: {"hidden_size": 64})
    with caplog.at_level(logging.INFO, logger="fanout.produce.verifier_follow"):
        contract = SimpleNamespace(
            hidden_size=64, verifier_weights_fingerprint=follower.fingerprint()
        )
        assert follower.swap(lambda _p: loaded, contract) is loaded
    fmt = RoleFormatter(LOG_FORMAT)
    lines = [fmt.format(r) for r in caplog.records]
    summary = {"windows": 4, "capture_s": 1.0, "publish_s": 0.2}
    log = tmp_path / "producer.log"
    log.write_text("\n".join([*lines, "x verifier version v0002 -> v0003 loading",
                              f"y [produce] fanout.produce.producer producer done: {summary}"]))  # fmt: skip
    got, done = bench.swaps(log)
    assert list(got) == ["v0002"] and done == summary
    assert got["v0002"]["load_s"] >= 0
    assert abs(got["v0002"]["loaded_at"] - caplog.records[-1].created) < 1.0


def test_the_shifted_set_wraps_every_answer_and_nothing_else() -> None:
    bench = _bench()
    conv = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                         {"role": "assistant", "content": "a"}]}  # fmt: skip
    (out,) = bench.shift([conv])
    assert [m["content"] for m in out["messages"]] == [
        "s",
        "q",
        f"{bench.PREAMBLE} a {bench.CLOSING}",
    ]
    assert conv["messages"][2]["content"] == "a"  # the input is left as it was


def test_disk_halves_tell_a_flat_run_from_a_growing_one() -> None:
    bench = _bench()

    def samples(run: list[int]) -> dict:
        return {"disk": [{"t": float(i), "run": b + 7 * i, "stream": b, "wal": 7 * i,
                          "log": 100 * (i + 1)} for i, b in enumerate(run)]}  # fmt: skip

    flat = bench.disk(samples([10, 50, 40, 50, 45, 50, 40, 50]))
    assert flat["flat_ratio"] == 1.0 and flat["log_growth"] == 2.0
    assert flat["run_ratio"] > 1.0  # the WAL grew: shown beside, not in the ratio
    grows = bench.disk(samples([10, 20, 30, 40, 50, 60, 70, 80]))
    assert grows["flat_ratio"] == 2.0
    assert bench.disk(samples([1, 2]))["samples"] == 2  # too few: no ratio claimed


def test_one_version_is_refused() -> None:
    with pytest.raises(SystemExit):
        _bench().parse_args(["--versions", "1"])


SMALLEST = [
    "--asset-conversations", "400", "--asset-steps", "40", "--versions", "2",
    "--first-records", "40", "--records", "40", "--records-per-s", "20", "--every-s", "5",
    "--policy-steps", "5", "--eval-prompts", "4", "--eval-new-tokens", "16",
    "--max-new-tokens", "24", "--seq-len", "128", "--window-rows", "2", "--settle-s", "4",
    "--disk-every-s", "0.5",
]  # fmt: skip


@pytest.mark.slow  # the whole loop (~2 min on 2 loaded cores); the benchmark is the record
def test_smallest_run_writes_a_complete_record(tmp_path: Path) -> None:
    out = tmp_path / "rl_follow.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/rl_follow.py", "--work", str(tmp_path / "w"),
         "--json", str(out), *SMALLEST],
        cwd=REPO, env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "goal >= 1.3: " in proc.stdout  # the table was printed
    rec = json.loads(out.read_text())
    assert repo_module("benchmarks", "record").check(rec, "rl_follow.json") == []
    rows = {r["name"]: r for r in rec["rows"]}
    ratio, followed, frozen = (rows[f"tau_{k}"] for k in ("ratio_rl_follow", "followed_newest",
                                                            "frozen_newest"))  # fmt: skip
    assert ratio["goal"] == ">= 1.3" and ratio["met"] == (ratio["result"] >= 1.3)
    assert ratio["result"] == pytest.approx(followed["result"] / frozen["result"], rel=1e-3)
    assert followed["result"] >= 1 and frozen["result"] >= 1  # τ counts the verifier's token
    raw = rec["raw"]
    assert raw["eval_newest"]["verifier"] == "v0002" and raw["eval_newest"]["lossless"]
    assert raw["eval_first"]["verifier"] == "v0001"
    (swap,) = raw["swaps"]  # v0002: loaded by the producer, and windows captured with it
    assert swap["version"] == "v0002" and 0 <= swap["to_loaded_s"] <= swap["to_first_window_s"]
    assert set(raw["windows_by_version"]) == {"v0001", "v0002"}
    assert raw["steps_by_version"].get("v0002", 0) >= 1
    assert rows["version_swap_s"]["n"] == 1 and "rl_follow_disk_flat" in rows
    # the same-steps control: trained exactly as many steps as the followed draft
    control, same = raw["same_steps"], rows["tau_ratio_rl_follow_same_steps"]
    assert control["steps"] == control["asked"] >= 1 and control["passes"] >= 2
    assert same["result"] == pytest.approx(
        followed["result"] / rows["tau_same_steps_newest"]["result"], rel=1e-3
    )
    assert rec["plots"] and rec["plots"][0]["kind"] == "line"
