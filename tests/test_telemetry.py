"""fanout.bench.telemetry: host-only sampling, a fake NVML through the seam, summary validity."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fanout.bench.telemetry import Sampler, dir_bytes, proc_stats, read_samples, summarize


class FakeNVML:
    """Two GPUs; GPU 1 runs `pid` with 3 GiB; GPU 0 has no power sensor."""

    NVML_CLOCK_SM = 1

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.calls = 0

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        self.calls += 1
        return SimpleNamespace(gpu=5 if h == 0 else 80 + self.calls % 10)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(used=(1 + h) * 2**30, total=80 * 2**30)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        if h == 0:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 350_000  # mW

    def nvmlDeviceGetClockInfo(self, h: int, kind: int) -> int:
        return 1980

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return [SimpleNamespace(pid=self.pid, usedGpuMemory=3 * 2**30)] if h == 1 else []


@pytest.fixture
def child() -> Any:
    """A live process with a child of its own (role trees include descendants)."""
    code = "import subprocess,sys,time; subprocess.Popen([sys.executable,'-c','import time; time.sleep(30)']); time.sleep(30)"
    p = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(0.5)
    yield p
    p.kill()
    p.wait()


def _take(s: Sampler, n: int, gap: float = 0.05) -> list[dict[str, Any]]:
    out = []
    for _ in range(n):
        out.append(s.sample())
        time.sleep(gap)
    return out


def test_host_only_sampler_reads_proc_and_run_dir(tmp_path: Path, child: Any) -> None:
    run = tmp_path / "run"
    (run / "windows").mkdir(parents=True)
    (run / "windows" / "0.g1.safetensors").write_bytes(b"x" * 1000)
    (run / "windows" / "1.g1.safetensors").write_bytes(b"x" * 500)
    s = Sampler(tmp_path / "t.jsonl", roles={"c1": child.pid}, run_dirs=[run], nvml=False)
    recs = _take(s, 3)
    assert all(r["gpu_available"] is False for r in recs)
    assert recs[-1]["run_dirs"][str(run)] == {"window_files": 2, "bytes": 1500}
    p = recs[-1]["procs"]["c1"]
    assert p["alive"] and p["rss_bytes"] > 1_000_000  # a Python interpreter is > 1 MB
    assert len(p["pids"]) == 2  # the child and its grandchild
    # The tree's RSS is the sum of its processes' (checked against a direct read).
    direct = sum(st["rss"] for pid in p["pids"] if (st := proc_stats(pid)))
    assert abs(p["rss_bytes"] - direct) < 0.2 * direct
    assert "cpu_pct" in p and "host_cpu_pct" in recs[-1]
    summ = summarize(recs, roles=["c1"])
    assert summ["host_only"] is True and summ["valid"], summ["reasons"]
    assert summ["samples"] == 3 and summ["coverage_s"] > 0
    assert summ["peak_run_dir_bytes"][str(run)] == 1500


def test_background_thread_writes_jsonl_with_both_clocks(tmp_path: Path) -> None:
    path = tmp_path / "tel" / "t.jsonl"
    with Sampler(path, roles={"me": os.getpid()}, interval_s=0.05, nvml=False) as s:
        time.sleep(0.4)
    recs = read_samples(path)
    assert len(recs) == s.samples >= 3
    monos = [r["t_mono"] for r in recs]
    assert monos == sorted(monos)
    assert abs(recs[-1]["t_wall"] - time.time()) < 5


def test_fake_nvml_through_the_seam(tmp_path: Path, child: Any) -> None:
    nv = FakeNVML(child.pid)
    s = Sampler(tmp_path / "t.jsonl", roles={"producer": child.pid}, nvml=nv)
    recs = _take(s, 4)
    g = recs[0]["gpus"]
    assert [x["index"] for x in g] == [0, 1]
    assert g[0]["power_w"] is None and g[1]["power_w"] == 350.0
    assert g[1]["procs"] == {str(child.pid): 3 * 2**30}
    summ = summarize(recs, roles=["producer"], gpu_roles=["producer"])
    assert summ["valid"], summ["reasons"]
    gpu = summ["gpu"]
    assert gpu["available"] and not summ["host_only"]
    assert gpu["gpus"]["0"]["frac_under_10pct"] == 1.0
    assert gpu["gpus"]["1"]["frac_under_10pct"] == 0.0
    assert 80 <= gpu["gpus"]["1"]["util_pct"]["p50"] <= 90
    assert gpu["gpus"]["1"]["peak_mem_bytes"] == 2 * 2**30
    assert gpu["peak_mem_by_role"] == {"producer": 3 * 2**30}


def test_fake_nvml_missing_process_memory_is_invalid(tmp_path: Path, child: Any) -> None:
    nv = FakeNVML(pid=1)  # NVML sees some other process, not our role
    s = Sampler(tmp_path / "t.jsonl", roles={"producer": child.pid}, nvml=nv)
    summ = summarize(_take(s, 3), roles=["producer"], gpu_roles=["producer"])
    assert not summ["valid"]
    assert any("GPU process memory" in r and "producer" in r for r in summ["reasons"])


def test_broken_nvml_degrades_to_host_only(tmp_path: Path) -> None:
    class Broken(FakeNVML):
        def nvmlDeviceGetCount(self) -> int:
            raise RuntimeError("driver gone")

    s = Sampler(tmp_path / "t.jsonl", roles={"me": os.getpid()}, nvml=Broken(0))
    recs = _take(s, 2)
    assert all("gpu_error" in r for r in recs)
    summ = summarize(recs, roles=["me"])
    assert summ["host_only"] and "driver gone" in summ["gpu"]["note"] and summ["valid"]


def test_summary_validity_rules(tmp_path: Path) -> None:
    s = Sampler(tmp_path / "t.jsonl", roles={"me": os.getpid()}, nvml=False)
    recs = _take(s, 4)
    one = summarize(recs[:1], roles=["me"])
    assert not one["valid"] and any("only 1 samples" in r for r in one["reasons"])
    assert any("no coverage" in r for r in one["reasons"])
    none = summarize(recs, start=recs[-1]["t_mono"] + 1, roles=["me"])
    assert not none["valid"] and none["samples"] == 0
    missing = summarize(recs, roles=["me", "ghost"])
    assert not missing["valid"] and any("'ghost'" in r for r in missing["reasons"])
    # The steady window selects by monotonic time, inclusive at both ends.
    mid = summarize(recs, start=recs[1]["t_mono"], end=recs[2]["t_mono"], roles=["me"])
    assert mid["samples"] == 2 and mid["valid"]


def test_dead_role_and_missing_run_dir(tmp_path: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    s = Sampler(
        tmp_path / "t.jsonl", roles={"gone": p.pid}, run_dirs=[tmp_path / "nope"], nvml=False
    )
    r = s.sample()
    assert r["procs"]["gone"] == {"pid": p.pid, "alive": False}
    assert dir_bytes(tmp_path / "nope") == (0, 0)
