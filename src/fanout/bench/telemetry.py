"""Telemetry: a background sampler of GPU (NVML) and host state → JSONL, and its summary.

    python -m fanout.bench.telemetry --out runs/r1/telemetry/t.jsonl --run-dir runs/r1 \
        --pid producer=1234 --pid c1=1250 --seconds 30          # sample for 30 s, print summary

    with Sampler(path, roles={"producer": pid}, run_dirs=[run_dir]) as s:
        ...                                                      # one sample every 0.5 s
    summary = summarize(read_samples(path), start=t0, end=t1, roles=["producer"])

Each JSONL line is one sample: `t_mono` (time.monotonic of this host) and `t_wall`,
host CPU % (/proc/stat), disk read/write bytes (/proc/diskstats), per role process
(and its descendants, e.g. data-prep workers): RSS (/proc/<pid>/status), CPU %
(/proc/<pid>/stat), I/O bytes (/proc/<pid>/io); bytes of window files present in each
run dir; per GPU utilization, memory, power, SM clock and memory of compute processes.

GPUs are read through NVML (`import pynvml`, from nvidia-ml-py), imported lazily and
injectable (`nvml=`): NVML talks to the driver, never creates a CUDA context. No
package, no driver or no GPU → host-only samples, flagged in the summary, no crash.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from fanout.store.rundir import RunDir
from fanout.ticker import Ticker

log = logging.getLogger(__name__)

UNDER_UTIL_PCT = 10.0  # "idle" threshold for the fraction-of-time-under metric
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_SECTOR = 512  # /proc/diskstats counts 512-byte sectors whatever the device's block size


# --------------------------------------------------------------------------- NVML seam


def load_nvml() -> tuple[Any | None, str]:
    """The initialised `pynvml` module, or (None, reason). Never raises."""
    try:
        import pynvml  # nvidia-ml-py
    except Exception as e:  # ImportError, or a broken install
        return None, f"pynvml not importable: {e}"
    try:
        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
    except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded / ...
        return None, f"NVML unavailable: {e}"
    if n == 0:
        return None, "NVML reports no GPU"
    return pynvml, ""


def _gpu_sample(nvml: Any) -> list[dict[str, Any]]:
    out = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        rec: dict[str, Any] = {"index": i}

        # Each reading on its own: a GPU without a power sensor still reports the rest.
        def _one(name: str, h: Any = h) -> Any:
            if name == "util_pct":
                return float(nvml.nvmlDeviceGetUtilizationRates(h).gpu)
            if name == "mem_used":
                return int(nvml.nvmlDeviceGetMemoryInfo(h).used)
            if name == "mem_total":
                return int(nvml.nvmlDeviceGetMemoryInfo(h).total)
            if name == "power_w":
                return nvml.nvmlDeviceGetPowerUsage(h) / 1000.0  # mW → W
            return int(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))

        for k in ("util_pct", "mem_used", "mem_total", "power_w", "sm_clock_mhz"):
            try:
                rec[k] = _one(k)
            except Exception:
                rec[k] = None
        try:
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(h)
            rec["procs"] = {str(p.pid): int(p.usedGpuMemory or 0) for p in procs}
        except Exception:
            rec["procs"] = {}
        out.append(rec)
    return out


# --------------------------------------------------------------------------- /proc readers


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # process gone, no permission, not Linux
        return None


def host_cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies from /proc/stat."""
    text = _read("/proc/stat")
    if not text:
        return None
    v = [int(x) for x in text.split("\n", 1)[0].split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    return sum(v) - idle, sum(v)


def disk_bytes() -> tuple[int, int] | None:
    """(read, written) bytes of whole disks since boot (/proc/diskstats; partitions skipped)."""
    text = _read("/proc/diskstats")
    if text is None:
        return None
    rd = wr = 0
    for line in text.splitlines():
        f = line.split()
        if len(f) < 10 or not os.path.exists(f"/sys/block/{f[2]}"):
            continue  # a partition (counted in its disk) or a malformed line
        rd += int(f[5]) * _SECTOR
        wr += int(f[9]) * _SECTOR
    return rd, wr


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return kids
    for e in entries:
        if not e.isdigit():
            continue
        stat = _read(f"/proc/{e}/stat")
        if stat is None:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # comm may contain spaces
        kids.setdefault(ppid, []).append(int(e))
    return kids


def process_tree(pid: int, kids: dict[int, list[int]]) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def proc_stats(pid: int) -> dict[str, int] | None:
    """RSS bytes, CPU jiffies, I/O bytes of one process, or None if it is gone."""
    status, stat = _read(f"/proc/{pid}/status"), _read(f"/proc/{pid}/stat")
    if status is None or stat is None:
        return None
    rss = 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024  # kB
            break
    f = stat.rsplit(")", 1)[1].split()
    out = {"rss": rss, "jiffies": int(f[11]) + int(f[12]), "read_bytes": 0, "write_bytes": 0}
    io = _read(f"/proc/{pid}/io")  # absent without permission: I/O then reads 0
    for line in (io or "").splitlines():
        k, _, v = line.partition(":")
        if k in ("read_bytes", "write_bytes"):
            out[k] = int(v)
    return out


def dir_bytes(root: Path) -> tuple[int, int]:
    """(files, bytes) of window artifacts present under `root/windows` (0, 0 if absent)."""
    n = total = 0
    try:
        with os.scandir(RunDir(root).windows) as it:
            for e in it:
                try:
                    if e.is_file(follow_symlinks=False):
                        n += 1
                        total += e.stat(follow_symlinks=False).st_size
                except FileNotFoundError:  # evicted between listing and stat
                    continue
    except FileNotFoundError:
        pass
    return n, total


# --------------------------------------------------------------------------- sampler


class Sampler:
    """Background sampler: one JSON line per `interval_s` until `stop()`.

    Args:
        out: JSONL path (parents created; appended to).
        roles: role name → pid (the harness adds roles as it starts them: `add_role`).
        run_dirs: run directories whose live window bytes to record.
        interval_s: seconds between samples.
        nvml: an NVML-like module (tests inject a fake); None = try `pynvml`; False = off.
        probe: optional callable whose dict is stored under `extra` (e.g. coordinator state).
    """

    def __init__(
        self,
        out: str | os.PathLike[str],
        *,
        roles: dict[str, int] | None = None,
        run_dirs: Iterable[str | os.PathLike[str]] = (),
        interval_s: float = 0.5,
        nvml: Any = None,
        probe: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"Sampler.interval_s must be > 0, got {interval_s}")
        self.path = Path(out)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.roles: dict[str, int] = dict(roles or {})
        self.run_dirs = [Path(r) for r in run_dirs]
        self.interval_s = interval_s
        self.probe = probe
        if nvml is False:
            self.nvml, self.gpu_reason = None, "disabled"
        elif nvml is None:
            self.nvml, self.gpu_reason = load_nvml()
        else:
            self.nvml, self.gpu_reason = nvml, ""
        self._lock = threading.Lock()
        self._prev: dict[str, Any] = {}
        # a sample at start, one every interval_s, a closing one at stop()
        self._ticker = Ticker(
            self._write, interval_s, name="fanout-telemetry", at_once=True, at_stop=self._write
        )
        self.samples = 0

    def add_role(self, name: str, pid: int) -> None:
        with self._lock:
            self.roles[name] = pid

    def sample(self) -> dict[str, Any]:
        """Take one sample (also called by the thread); CPU % is relative to the last one."""
        now, wall = time.monotonic(), time.time()
        prev_t = self._prev.get("t")
        dt = now - prev_t if prev_t is not None else None
        rec: dict[str, Any] = {"t_mono": round(now, 4), "t_wall": round(wall, 4)}
        cpu = host_cpu_times()
        pc = self._prev.get("cpu")
        if cpu and pc and cpu[1] > pc[1]:
            rec["host_cpu_pct"] = round(100.0 * (cpu[0] - pc[0]) / (cpu[1] - pc[1]), 2)
        disk = disk_bytes()
        if disk:
            rec["disk_read_bytes"], rec["disk_write_bytes"] = disk
        with self._lock:
            roles = dict(self.roles)
        kids = _children_map() if roles else {}
        procs: dict[str, Any] = {}
        jiff: dict[str, int] = {}
        for name, pid in roles.items():
            tree_pids = process_tree(pid, kids)
            tree = [s for p in tree_pids if (s := proc_stats(p)) is not None]
            if not tree:
                procs[name] = {"pid": pid, "alive": False}
                continue
            agg = {
                k: sum(s[k] for s in tree) for k in ("rss", "jiffies", "read_bytes", "write_bytes")
            }
            p: dict[str, Any] = {
                "pid": pid,
                "alive": True,
                "pids": tree_pids,  # the role's process tree (GPU memory is matched by pid)
                "rss_bytes": agg["rss"],
                "read_bytes": agg["read_bytes"],
                "write_bytes": agg["write_bytes"],
            }
            jiff[name] = agg["jiffies"]
            pj = self._prev.get("jiffies", {}).get(name)
            if dt and pj is not None:
                p["cpu_pct"] = round(100.0 * (agg["jiffies"] - pj) / _CLK_TCK / dt, 1)
            procs[name] = p
        rec["procs"] = procs
        rec["run_dirs"] = {}
        for r in self.run_dirs:
            n, b = dir_bytes(r)
            rec["run_dirs"][str(r)] = {"window_files": n, "bytes": b}
        rec["gpu_available"] = self.nvml is not None
        if self.nvml is not None:
            try:
                rec["gpus"] = _gpu_sample(self.nvml)
            except Exception as e:  # driver went away mid-run: flag, keep sampling the host
                rec["gpu_available"], rec["gpu_error"] = False, str(e)
        if self.probe is not None:
            try:
                rec["extra"] = self.probe()
            except Exception as e:
                rec["extra_error"] = str(e)
        self._prev = {"t": now, "cpu": cpu, "jiffies": jiff}
        return rec

    def _write(self) -> None:
        line = json.dumps(self.sample()) + "\n"
        with self.path.open("a") as f:  # a line at a time: complete once the call returns
            f.write(line)
        self.samples += 1

    def start(self) -> Sampler:
        self._ticker.start()
        return self

    def stop(self) -> None:
        self._ticker.stop()

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def read_samples(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------- summary


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p95": None}
    a = np.asarray(values, dtype=np.float64)
    return {
        "mean": round(float(a.mean()), 2),
        "p50": round(float(np.percentile(a, 50)), 2),
        "p95": round(float(np.percentile(a, 95)), 2),
    }


def summarize(
    samples: list[dict[str, Any]],
    *,
    start: float | None = None,
    end: float | None = None,
    roles: Iterable[str] = (),
    gpu_roles: Iterable[str] = (),
) -> dict[str, Any]:
    """Summary of the samples with `start <= t_mono <= end` (the steady window).

    Invalid (with reasons) if fewer than 2 samples, no coverage, a role in `roles`
    without any RSS reading, or (GPU available) a role in `gpu_roles` whose process
    tree never shows up in NVML's compute processes. No GPU → `host_only: true`
    (a flag, not a reason to reject the host numbers).
    """
    win = [
        s
        for s in samples
        if (start is None or s["t_mono"] >= start) and (end is None or s["t_mono"] <= end)
    ]
    reasons: list[str] = []
    cover = round(win[-1]["t_mono"] - win[0]["t_mono"], 3) if win else 0.0
    if len(win) < 2:
        reasons.append(f"only {len(win)} samples in the steady window (need >= 2)")
    if cover <= 0:
        reasons.append("no coverage: the steady window spans 0 s of samples")
    host_only = not any(s.get("gpu_available") for s in win)
    out: dict[str, Any] = {
        "samples": len(win),
        "coverage_s": cover,
        "host_only": host_only,
        "host_cpu_pct": _stats([s["host_cpu_pct"] for s in win if "host_cpu_pct" in s]),
    }
    disk = [s for s in win if "disk_read_bytes" in s]
    if len(disk) >= 2:
        out["disk_read_bytes"] = disk[-1]["disk_read_bytes"] - disk[0]["disk_read_bytes"]
        out["disk_write_bytes"] = disk[-1]["disk_write_bytes"] - disk[0]["disk_write_bytes"]
    procs: dict[str, Any] = {}
    for role in sorted({r for s in win for r in s.get("procs", {})} | set(roles)):
        recs = [s["procs"][role] for s in win if s.get("procs", {}).get(role, {}).get("alive")]
        rss = [p["rss_bytes"] for p in recs]
        procs[role] = {
            "peak_rss_bytes": max(rss) if rss else None,
            "cpu_pct": _stats([p["cpu_pct"] for p in recs if "cpu_pct" in p]),
        }
        if role in set(roles) and not rss:
            reasons.append(f"no RSS reading for role {role!r} (process memory missing)")
    out["procs"] = procs
    run_dirs: dict[str, int] = {}
    for s in win:
        for r, v in s.get("run_dirs", {}).items():
            run_dirs[r] = max(run_dirs.get(r, 0), v["bytes"])
    out["peak_run_dir_bytes"] = run_dirs
    if host_only:
        reason = next((s.get("gpu_error") for s in win if s.get("gpu_error")), None)
        out["gpu"] = {"available": False, "note": reason or "no NVML/GPU: host-only telemetry"}
    else:
        out["gpu"] = _gpu_summary(win, roles=list(gpu_roles), reasons=reasons)
    out["valid"] = not reasons
    out["reasons"] = reasons
    return out


def _gpu_summary(win: list[dict[str, Any]], *, roles: list[str], reasons: list[str]) -> Any:
    per: dict[int, dict[str, list[float]]] = {}
    proc_peak: dict[str, int] = {}
    role_peak: dict[str, int] = {}
    for s in win:
        pids = {
            str(pid): name
            for name, p in s.get("procs", {}).items()
            if p.get("alive")
            for pid in p.get("pids", [p["pid"]])
        }
        for g in s.get("gpus", []):
            d = per.setdefault(g["index"], {"util": [], "mem": [], "power": [], "mem_total": []})
            for key, src in (("util", "util_pct"), ("mem", "mem_used"), ("power", "power_w")):
                if g.get(src) is not None:
                    d[key].append(g[src])
            if g.get("mem_total"):
                d["mem_total"].append(g["mem_total"])
            for pid, used in g.get("procs", {}).items():
                proc_peak[pid] = max(proc_peak.get(pid, 0), used)
                if pid in pids:
                    role_peak[pids[pid]] = max(role_peak.get(pids[pid], 0), used)
    gpus = {}
    for i, d in sorted(per.items()):
        util = d["util"]
        gpus[str(i)] = {
            "util_pct": _stats(util),
            "frac_under_10pct": round(sum(u < UNDER_UTIL_PCT for u in util) / len(util), 3)
            if util
            else None,
            "peak_mem_bytes": max(d["mem"]) if d["mem"] else None,
            "mem_total_bytes": max(d["mem_total"]) if d["mem_total"] else None,
            "power_w": _stats(d["power"]),
        }
    for r in roles:
        if r not in role_peak:
            reasons.append(f"no GPU process memory for role {r!r}")
    return {
        "available": True,
        "gpus": gpus,
        "peak_mem_by_pid": proc_peak,
        "peak_mem_by_role": role_peak,
    }


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSONL file to append samples to")
    p.add_argument("--run-dir", action="append", default=[], help="run dir to watch (repeatable)")
    p.add_argument("--pid", action="append", default=[], help="ROLE=PID to watch (repeatable)")
    p.add_argument("--interval-s", type=float, default=0.5, help="seconds between samples")
    p.add_argument("--seconds", type=float, default=10.0, help="how long to sample (s)")
    a = p.parse_args(argv)
    roles = {k: int(v) for k, _, v in (x.partition("=") for x in a.pid)}
    with Sampler(a.out, roles=roles, run_dirs=a.run_dir, interval_s=a.interval_s):
        time.sleep(a.seconds)
    print(json.dumps(summarize(read_samples(a.out), roles=roles), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
