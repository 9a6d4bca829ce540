"""benchmarks/hosts.py at its smallest: its own PostgreSQL, the latency proxy, real clients.

    .venv/bin/pytest tests/test_bench_hosts.py -x -q

Four consumers and two producer replicas for a few seconds (issue 55 item 5's
benchmark, shrunk): what is checked is that the record is complete (benchmarks/record.py
`check`), that every figure the report and docs/numbers.md read is there and consistent
(counts ≥ 1 where something ran, p50 ≤ p99, statements counted), that the load was
recorded at the start and the end, and that no client saw an error. Its goal (p99
acquire ≤ 100 ms at 256 consumers) is the benchmark's run to report, not checked here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from conftest import _postgres_bin, repo_module

REPO = Path(__file__).resolve().parents[1]
SMALLEST = ["--consumers", "4", "--replicas", "2", "--rates", "3", "--seconds", "6",
            "--warmup-s", "1", "--workers", "2", "--proxies", "1", "--start-spread-s", "0.5"]  # fmt: skip


def _record() -> ModuleType:
    return repo_module("benchmarks", "record")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "benchmarks/hosts.py", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def test_hosts_benchmark_writes_a_complete_record(tmp_path: Path) -> None:
    pytest.importorskip("psycopg")
    if _postgres_bin("initdb") is None or _postgres_bin("pg_ctl") is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not found")
    out = tmp_path / "hosts.json"
    r = _run(*SMALLEST, "--dir", str(tmp_path), "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert _record().check(rec, "hosts.json") == []
    raw = rec["raw"]
    assert "load average" in raw["uptime_start"] and "load average" in raw["uptime_end"]
    rtt = raw["rtt"]["1"]  # the proxy holds each chunk 1 ms each way: a round trip ≥ 2 ms
    assert rtt["proxied_ms"] >= 2 and rtt["direct_ms"] > 0
    (p,) = raw["points"]
    assert (p["consumers"], p["replicas"], p["error_count"]) == (4, 2, 0), p["errors"]
    assert p["windows_measured"] >= 1 and p["windows_per_s"] > 0
    for call in ("acquire", "ack", "heartbeat", "claim", "publish"):
        s = p[call]
        assert s["n"] >= 1 and 0 <= s["p50_ms"] <= s["p99_ms"] <= s["max_ms"], (call, s)
    assert p["statements_per_window"] > 0 and p["write_tx_per_s"] > 0
    assert sum(s["calls"] for s in p["top_statements"]) <= p["statements"]
    assert any("pg_advisory_xact_lock" in s["query"] for s in p["top_statements"])
    assert 0 <= p["write_lock_held_frac"] <= 1 and p["lock_samples"] >= 1
    assert (
        all(x >= 0 for x in p["worker_cpu_of_one_core"]) and len(p["worker_cpu_of_one_core"]) == 2
    )
    names = {row["name"] for row in rec["rows"]}
    assert names == {"hosts_acquire_p99_ms_4c_3wps_1ms", "hosts_statements_per_window_4c_3wps_1ms"}
    assert rec["notes"] and "1 ms each way, 3 windows/s: p99 acquire" in rec["notes"][1]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["--consumers", "16,x"],
            "hosts.py: --consumers '16,x': expected numbers separated by commas",
        ),
        (["--latency-ms", "-1"], "hosts.py: --latency-ms '-1': expected numbers, 0 or more"),
        (["--pg-set", "fsync"], "hosts.py: --pg-set 'fsync': expected NAME=VALUE"),
        (
            ["--redo-from", "nowhere.json"],
            "hosts.py: --redo-from nowhere.json: not a hosts.py record",
        ),
    ],
)
def test_a_bad_flag_is_one_line(tmp_path: Path, args: list[str], says: str) -> None:
    r = _run(*args, "--json", str(tmp_path / "x.json"))
    assert r.returncode == 1
    assert r.stderr.startswith(says) and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "x.json").exists()


def test_a_baseline_run_is_compared_point_by_point() -> None:
    """`--baseline-src`: each point's figures before → after, in one note."""
    import argparse

    hosts = repo_module("benchmarks", "hosts")

    def point(p99: float | None, n: int, hb: float) -> dict[str, object]:
        return {"consumers": 256, "rate_target": 3.0, "latency_ms": 1.0,
                "acquire": {"p99_ms": p99, "n": n}, "ack": {"p99_ms": 7.0},
                "heartbeat": {"p99_ms": hb}, "write_tx_per_s": 40.0,
                "write_lock_hold_ms_mean": 2.5, "windows_per_s": 3.0}  # fmt: skip

    a = argparse.Namespace(baseline_src="/tmp/base/src")
    text = hosts.compare([point(None, 0, 9000.0)], [point(80.0, 900, 12.0)], a)
    assert "--baseline-src /tmp/base/src" in text
    assert "N = 256, 3 windows/s, 1 ms: acquire p99 none done → 80.0 ms (n 0 → 900)" in text
    assert "heartbeat p99 9000.0 ms → 12.0 ms" in text
