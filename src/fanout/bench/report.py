"""Benchmark reports: numbers from a finished `fanout bench` run → report.json, report.md, PNGs.

    from fanout.bench.report import build_report, write_report, format_table
    report = build_report(cfg, assets, runs, out_dir)   # runs: [(ScenarioRun, telemetry.jsonl)]
    write_report(report, runs, out_dir); print(format_table(report))

Sources: each trainer's `train_log.jsonl` (step times, acked windows), each
producer's `--summary-json`, the coordinator (`fanout.coord.status.snapshot`: windows
produced, recaptures, high-water marks) and the telemetry JSONL. Every number in
report.md is printed beside the hardware, sizes and versions it was measured on,
and the coordinator's database (SQLite, or the PostgreSQL server; `database`).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fanout.bench.telemetry import read_samples, summarize
from fanout.errors import FanoutError

VALIDITY_RULES = [
    "every consumer acked every window of the stream exactly once, in order "
    "(from train_log.jsonl `acked`; a time-limited demo run: a gap-free prefix)",
    "captures per window as the lag policy promises: 1.0 for a shared stream under "
    "hold/detach, one per pair (3.0) for unshared; recaptures are counted",
    "zero failures: every role exited 0 (or was stopped by the harness's own time "
    "limit), no failed publish, corrupt window, detach or lost-process reclaim, no timeout",
    "telemetry valid (>= 2 samples, coverage > 0, memory of every role) or flagged",
]


# What a report reads of a finished bench (fanout.bench.bench's BenchConfig, Assets,
# ScenarioRun and Role satisfy these): typed here so that this module never imports
# the harness that calls it.


class ProducerSpecLike(Protocol):
    @property
    def seq_len(self) -> int: ...
    @property
    def window_rows(self) -> int: ...
    @property
    def max_live_windows(self) -> int: ...
    @property
    def epochs(self) -> int: ...
    @property
    def lag_policy(self) -> str: ...


class ConsumerSpecLike(Protocol):
    @property
    def rows_per_step(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    def model_dump(self) -> dict[str, Any]: ...


class BenchLike(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def description(self) -> str: ...
    @property
    def warmup_steps(self) -> int: ...
    @property
    def threads_per_role(self) -> int | None: ...
    @property
    def database(self) -> str | None: ...
    @property
    def producer(self) -> ProducerSpecLike: ...
    @property
    def consumers(self) -> Sequence[ConsumerSpecLike]: ...
    def model_dump(self) -> dict[str, Any]: ...


class AssetsLike(Protocol):
    @property
    def verifier_dir(self) -> Path: ...
    @property
    def data(self) -> Sequence[str]: ...


class RoleLike(Protocol):
    """One process of a scenario: a producer, or a consumer (save_path and spec set)."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def log(self) -> Path: ...
    @property
    def run_dir(self) -> Path: ...
    @property
    def device(self) -> str: ...
    @property
    def rc(self) -> int | None: ...
    @property
    def stopped_by_us(self) -> bool: ...
    @property
    def save_path(self) -> Path | None: ...
    @property
    def spec(self) -> ConsumerSpecLike | None: ...
    @property
    def summary_path(self) -> Path | None: ...


class RunLike(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def roles(self) -> Sequence[RoleLike]: ...
    @property
    def run_dirs(self) -> Sequence[Path]: ...
    @property
    def notes(self) -> Sequence[str]: ...
    @property
    def started_wall(self) -> float: ...
    @property
    def ended_wall(self) -> float: ...


def _pct(a: list[float], q: float) -> float | None:
    return round(float(np.percentile(np.asarray(a), q)), 2) if a else None


def hardware() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    hw: dict[str, Any] = {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_bytes": mem,
        "os": f"{platform.system()} {platform.release()}",
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "gpus": [],
    }
    from fanout.bench.telemetry import load_nvml

    nvml, _ = load_nvml()
    if nvml is not None:
        for i in range(nvml.nvmlDeviceGetCount()):
            name = nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(i))
            hw["gpus"].append(name.decode() if isinstance(name, bytes) else str(name))
    return hw


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("fanout", "torch", "transformers", "safetensors", "numpy"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def database(url: str | None) -> dict[str, Any]:
    """Where the scenarios' coordinators were, and that database's version: SQLite in
    each run dir, or a PostgreSQL server (a schema per run dir; the URL without its
    password, which never goes into a report)."""
    if url is None:
        import sqlite3

        return {"kind": "sqlite", "where": "each run dir", "version": sqlite3.sqlite_version}
    from fanout.coord.postgresdb import PostgresDatabase, redact

    out: dict[str, Any] = {"kind": "postgresql", "where": redact(url), "version": None}
    try:
        db = PostgresDatabase(url)
    except FanoutError as e:
        out["version"] = f"unknown: {e}"
        return out
    try:
        out["version"] = db.server_version()
    finally:
        db.close()
    return out


def _train_log(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _snapshot(run_dir: Path) -> dict[str, Any] | None:
    """`fanout status --json` of a run dir (SQLite or PostgreSQL, as the run dir
    records), None if no producer created it."""
    from fanout.coord.coordinator import Coordinator
    from fanout.coord.status import snapshot

    co = Coordinator.open_if_created(run_dir)
    if co is None:
        return None
    with co:
        return snapshot(co)


def scenario_metrics(cfg: BenchLike, run: RunLike, tel: Path) -> dict[str, Any]:
    """Numbers and validity of one finished scenario (see VALIDITY_RULES)."""
    reasons: list[str] = list(run.notes)
    flags: list[str] = []
    snaps = {str(r): _snapshot(r) for r in run.run_dirs}
    consumers: dict[str, Any] = {}
    steady_of: dict[str, tuple[float, float]] = {}
    for role in run.roles:
        if role.rc not in (0, None) and not role.stopped_by_us:
            reasons.append(f"{role.name} exited {role.rc} (log: {role.log})")
        if role.kind == "consumer":
            snap = snaps[str(role.run_dir)]
            c, steady = _consumer_metrics(role, snap, cfg.warmup_steps, run, reasons)
            consumers[role.name] = c
            if steady is not None:
                steady_of[role.name] = steady
    agg = _aggregate(run, consumers, steady_of, flags)
    prod = _producer_metrics(run, snaps, reasons)
    unique = prod["unique_windows"]
    cpw = round(prod["captures"] / unique, 4) if unique else None
    promised = float(len(run.run_dirs))  # one capture per pair's own stream
    if cfg.producer.lag_policy != "recapture" and cpw != promised:
        reasons.append(f"captures per window {cpw} != promised {promised}")
    tel_sum = _telemetry(run, tel, agg.get("steady_wall"))
    if not tel_sum["valid"]:
        flags.append("telemetry invalid: " + "; ".join(tel_sum["reasons"]))
    return {
        "valid": not reasons,
        "reasons": reasons,
        "flags": flags,
        "wall_s": round(run.ended_wall - run.started_wall, 2),
        "consumers": consumers,
        "aggregate": agg,
        "producers": prod["producers"],
        "captures": prod["captures"],
        "unique_windows": unique,
        "captures_per_window": cpw,
        "peak_live_windows": prod["peak_live_windows"],
        "peak_live_bytes": prod["peak_live_bytes"],
        "telemetry": tel_sum,
    }


def _consumer_metrics(
    role: RoleLike, snap: dict[str, Any] | None, warm: int, run: RunLike, reasons: list[str]
) -> tuple[dict[str, Any], tuple[float, float] | None]:
    """One trainer's numbers from its train_log.jsonl (appending to `reasons` the rules
    it broke), and the wall-clock bounds of its steady state (after `warm` steps)."""
    assert role.save_path is not None and role.spec is not None, role.name  # a consumer
    recs = _train_log(role.save_path / "train_log.jsonl")
    total = snap["config"]["total_windows"] if snap else None
    acked = [w for r in recs for w in r.get("acked", [])]
    want = list(range(len(acked) if role.stopped_by_us else (total or 0)))
    if acked != want:
        reasons.append(f"{role.name}: acked windows {_short(acked)} != expected {_short(want)}")
    c: dict[str, Any] = {
        "steps": len(recs),
        "rows_per_step": role.spec.rows_per_step,
        "block_size": role.spec.block_size,
        "windows_acked": len(acked),
        "first_loss": recs[0]["loss"] if recs else None,
        "last_loss": recs[-1]["loss"] if recs else None,
        "first_eal": recs[0]["eal"] if recs else None,
        "last_eal": recs[-1]["eal"] if recs else None,
        "timeline": [(r["time"] - run.started_wall, r["step"]) for r in recs],
    }
    steady = recs[warm:]
    if len(steady) < 2:
        reasons.append(f"{role.name}: {len(recs)} steps, need > warmup_steps + 1 = {warm + 1}")
        return c, None
    t0, t1 = recs[warm - 1]["time"], steady[-1]["time"]
    dts = [(b["time"] - a["time"]) * 1e3 for a, b in zip(recs[warm - 1 :], steady)]
    dur = max(t1 - t0, 1e-9)
    waits = [r["window_wait_ms"] for r in steady]
    c.update(
        steady_s=round(dur, 3),
        steps_per_s=round(len(steady) / dur, 4),
        rows_per_s=round(len(steady) * role.spec.rows_per_step / dur, 4),
        step_ms_p50=_pct(dts, 50),
        step_ms_p95=_pct(dts, 95),
        window_wait_ms_total=round(sum(waits), 1),
        window_wait_frac=round(sum(waits) / 1e3 / dur, 4),
        tokens_per_s=round(sum(r["tokens"] for r in steady) / dur, 1),
    )
    return c, (t0, t1)


def _aggregate(
    run: RunLike,
    consumers: dict[str, Any],
    steady_of: dict[str, tuple[float, float]],
    flags: list[str],
) -> dict[str, Any]:
    """Rows/s of all trainers together, over the window in which every one of them is
    in its steady state (`steady_wall`); the sum of their rates if those do not overlap."""
    if not steady_of or len(steady_of) != len(consumers):
        return {"rows_per_s": None}
    t0 = max(w[0] for w in steady_of.values())
    t1 = min(w[1] for w in steady_of.values())
    agg: dict[str, Any]
    if t1 > t0:
        rows = 0
        for role in run.roles:
            if role.kind == "consumer" and role.save_path is not None and role.spec is not None:
                recs = _train_log(role.save_path / "train_log.jsonl")
                n = sum(1 for r in recs if t0 < r["time"] <= t1)
                rows += n * role.spec.rows_per_step
        agg = {"rows_per_s": round(rows / (t1 - t0), 4), "window_s": round(t1 - t0, 3)}
    else:
        agg = {"rows_per_s": round(sum(c["rows_per_s"] for c in consumers.values()), 4)}
        flags.append("consumers' steady windows do not overlap: aggregate = sum of rates")
    agg["steady_wall"] = [t0, t1]
    return agg


def _producer_metrics(
    run: RunLike, snaps: dict[str, dict[str, Any] | None], reasons: list[str]
) -> dict[str, Any]:
    """Each producer's summary and its coordinator's counts (appending to `reasons`
    what breaks a rule), and the totals over all of them: captures, unique windows
    and the peak live windows / bytes."""
    producers: dict[str, Any] = {}
    captures = unique = hw_windows = hw_bytes = failures = 0
    streams = set()
    for role in run.roles:
        if role.kind != "producer":
            continue
        snap = snaps[str(role.run_dir)]
        sp = role.summary_path
        summ = json.loads(sp.read_text()) if sp is not None and sp.is_file() else {}
        p: dict[str, Any] = {"summary": summ, "run_dir": str(role.run_dir)}
        if summ.get("elapsed_s"):
            p["unique_windows_per_s"] = round(summ["windows"] / summ["elapsed_s"], 4)
        failures += int(summ.get("failures", 0))
        producers[role.name] = p
        if not snap:
            reasons.append(f"{role.name}: no coordinator database in {role.run_dir}")
            continue
        produced, rec, hw = snap["produced_windows"], snap["recaptures"], snap["high_water"]
        captures += produced + rec
        unique = max(unique, produced)
        streams.add(snap["stream_id"])
        hw_windows, hw_bytes = max(hw_windows, hw["windows"]), max(hw_bytes, hw["bytes"])
        for k in ("corrupt", "detaches", "reclaims"):
            if snap[k]:
                reasons.append(f"{role.name}: coordinator counted {snap[k]} {k}")
        p.update(
            produced_windows=produced,
            recaptures=rec,
            total_windows=snap["config"]["total_windows"],
            high_water=hw,
            window_bytes=round(hw["bytes"] / max(1, hw["windows"])),
            database=snap["db_path"],
        )
    if failures:
        reasons.append(f"producers reported {failures} failed publishes")
    if len(streams) > 1:
        reasons.append(f"pairs produced different streams {sorted(streams)}: not the same data")
    return {
        "producers": producers,
        "captures": captures,
        "unique_windows": unique,
        "peak_live_windows": hw_windows,
        "peak_live_bytes": hw_bytes,
    }


def _telemetry(run: RunLike, tel: Path, steady_wall: list[float] | None) -> dict[str, Any]:
    """The telemetry summary over the steady window (fanout.bench.telemetry.summarize)."""
    samples = read_samples(tel) if tel.is_file() else []
    if not samples or not steady_wall:
        return {"valid": False, "reasons": ["no telemetry samples"]}
    off = samples[0]["t_mono"] - samples[0]["t_wall"]
    t0, t1 = steady_wall
    return summarize(
        samples,
        start=t0 + off,
        end=t1 + off,
        roles=[r.name for r in run.roles],
        gpu_roles=[r.name for r in run.roles if r.device.startswith("cuda")],
    )


def _short(ws: list[int]) -> str:
    return str(ws) if len(ws) <= 8 else f"[{ws[0]}, {ws[1]}, …, {ws[-1]}] ({len(ws)})"


def _verifier_sizes(vdir: Path) -> dict[str, Any]:
    c = json.loads((vdir / "config.json").read_text())
    keys = ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")
    out = {k: c.get(k) for k in keys}
    out["weights_bytes"] = sum(f.stat().st_size for f in vdir.glob("*.safetensors"))
    return out


def build_report(
    cfg: BenchLike, assets: AssetsLike, runs: Sequence[tuple[RunLike, Path]], out: Path
) -> dict[str, Any]:
    sc = {run.name: scenario_metrics(cfg, run, tel) for run, tel in runs}
    rate = {k: v["aggregate"].get("rows_per_s") for k, v in sc.items()}
    shared = sc.get("1p3c")
    db = database(cfg.database)
    config = cfg.model_dump()
    config["database"] = db["where"] if cfg.database else None  # no password
    rep: dict[str, Any] = {
        "name": cfg.name,
        "description": cfg.description,
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "hardware": hardware(),
        "versions": versions(),
        "database": db,
        "sizes": {
            "verifier": _verifier_sizes(Path(assets.verifier_dir)),
            "seq_len": cfg.producer.seq_len,
            "window_rows": cfg.producer.window_rows,
            "max_live_windows": cfg.producer.max_live_windows,
            "epochs": cfg.producer.epochs,
            "data": [str(d) for d in assets.data],
            "consumers": [c.model_dump() for c in cfg.consumers],
            "threads_per_role": cfg.threads_per_role,
        },
        "config": config,
        "validity_rules": VALIDITY_RULES,
        "scenarios": sc,
        "aggregate_rows_per_s": rate,
        "aggregate_speedup_vs_unshared": (
            round(rate["1p3c"] / rate["unshared"], 3)
            if rate.get("1p3c") and rate.get("unshared")
            else None
        ),
        "captures_per_window_1p3c": shared["captures_per_window"] if shared else None,
        "captures_per_window_unshared": sc["unshared"]["captures_per_window"]
        if "unshared" in sc
        else None,
        "peak_live_windows": shared["peak_live_windows"] if shared else None,
        "max_live_windows": cfg.producer.max_live_windows,
    }
    if shared and shared["producers"]:
        p = next(iter(shared["producers"].values()))
        wb = p.get("window_bytes", 0)
        rep["disk"] = {
            "high_water_bytes": shared["peak_live_bytes"],
            "all_windows_bytes": wb * shared["unique_windows"],
            "window_bytes": wb,
        }
        if "unshared" in sc:
            rep["verifier_passes_saved_per_window"] = round(
                (sc["unshared"]["captures_per_window"] or 0) - (shared["captures_per_window"] or 0),
                3,
            )
    reasons = [f"{k}: {r}" for k, v in sc.items() for r in v["reasons"]]
    peak, k = rep["peak_live_windows"], cfg.producer.max_live_windows
    if peak is not None and peak > k:
        reasons.append(f"1p3c: peak live windows {peak} > K = {k}")
    rep["valid"] = not reasons
    rep["reasons"] = reasons
    rep["flags"] = [f"{k}: {f}" for k, v in sc.items() for f in v["flags"]]
    return rep


# --------------------------------------------------------------------------- rendering


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def _f(x: Any, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _database_line(db: dict[str, Any] | None) -> str:
    if db is None or db["kind"] == "sqlite":
        version = f" {db['version']}" if db else ""
        return f"coordinator: SQLite{version}, in each run dir"
    return f"coordinator: {db['version']} at {db['where']}, a schema per run dir"


def format_table(rep: dict[str, Any]) -> str:
    hw, v, s = rep["hardware"], rep["versions"], rep["sizes"]
    ver = s["verifier"]
    lines = [
        f"{rep['name']}  ({'VALID' if rep['valid'] else 'INVALID'})",
        f"hardware: {hw['cpu']}, {hw['usable_cpus']}/{hw['logical_cpus']} CPUs, "
        f"load {hw['load_avg_1m']}, GPUs {hw['gpus'] or 'none'}",
        f"versions: python {v['python']}, torch {v['torch']}, transformers {v['transformers']}",
        _database_line(rep.get("database")),
        f"sizes: verifier h{ver['hidden_size']} × {ver['num_hidden_layers']} layers, vocab "
        f"{ver['vocab_size']}; T={s['seq_len']}, R={s['window_rows']}, K={s['max_live_windows']}",
        "",
        f"{'scenario':<9} {'consumer':<10} {'rows/s':>8} {'steps/s':>8} {'p50 ms':>8} "
        f"{'p95 ms':>8} {'wait %':>7} {'EAL':>13}",
    ]
    for name, sc in rep["scenarios"].items():
        for cid, c in sc["consumers"].items():
            wait = c.get("window_wait_frac")
            lines.append(
                f"{name:<9} {cid:<10} {_f(c.get('rows_per_s')):>8} {_f(c.get('steps_per_s')):>8} "
                f"{_f(c.get('step_ms_p50'), 0):>8} {_f(c.get('step_ms_p95'), 0):>8} "
                f"{_f(None if wait is None else 100 * wait, 1):>7} "
                f"{_f(c['first_eal'])}→{_f(c['last_eal'])}".rjust(0)
            )
        lines.append(
            f"{name:<9} {'aggregate':<10} {_f(sc['aggregate'].get('rows_per_s')):>8}   "
            f"captures/window {_f(sc['captures_per_window'])}  peak live "
            f"{sc['peak_live_windows']} windows ({_mib(sc['peak_live_bytes'])})  "
            f"{'ok' if sc['valid'] else 'INVALID'}"
        )
    lines += [
        "",
        f"aggregate_speedup_vs_unshared = {_f(rep['aggregate_speedup_vs_unshared'], 3)}   "
        f"captures_per_window_1p3c = {_f(rep['captures_per_window_1p3c'])}   "
        f"peak_live_windows = {rep['peak_live_windows']} (K = {rep['max_live_windows']})",
    ]
    lines += [f"INVALID: {r}" for r in rep["reasons"]] + [f"flag: {f}" for f in rep["flags"]]
    return "\n".join(lines)


def _markdown(rep: dict[str, Any], plots: list[str]) -> str:
    out = [f"# fanout benchmark: {rep['name']}", "", rep["description"], ""]
    out += ["```", format_table(rep), "```", ""]
    if rep.get("aggregate_speedup_vs_unshared"):
        out.append(
            f"- **Aggregate throughput**: three drafts fed by one producer train "
            f"{rep['aggregate_speedup_vs_unshared']:.2f}× as many rows per second as three "
            "unshared producer+trainer pairs on the same hardware."
        )
    if rep.get("verifier_passes_saved_per_window") is not None:
        out.append(
            f"- **Verifier passes saved**: {rep['verifier_passes_saved_per_window']:.1f} "
            "per window (captures per window 1p3c vs unshared)."
        )
    if rep.get("disk"):
        d = rep["disk"]
        out.append(
            f"- **Disk high-water**: {_mib(d['high_water_bytes'])} live at most, vs "
            f"{_mib(d['all_windows_bytes'])} to store every window of the stream "
            f"({d['window_bytes'] / 2**20:.2f} MiB per window)."
        )
    out += ["", "## Validity rules", ""]
    out += [f"{i}. {r}" for i, r in enumerate(rep["validity_rules"], 1)]
    out += ["", f"Result: **{'valid' if rep['valid'] else 'INVALID'}**"]
    out += [f"- invalid: {r}" for r in rep["reasons"]] + [f"- flag: {f}" for f in rep["flags"]]
    out += ["", "## Producers", "", "| scenario | producer | windows/s | captures | recaptures |"]
    out.append("|---|---|---|---|---|")
    for name, sc in rep["scenarios"].items():
        for pid, p in sc["producers"].items():
            out.append(
                f"| {name} | {pid} | {_f(p.get('unique_windows_per_s'), 3)} | "
                f"{p.get('produced_windows', '-')} | {p.get('recaptures', '-')} |"
            )
    out += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    out += ["", "## Hardware and versions", "", "```"]
    keys = ("hardware", "versions", "database")
    out += [json.dumps({k: rep[k] for k in keys if k in rep}, indent=2)]
    out += ["```", ""]
    return "\n".join(out)


def write_plots(rep: dict[str, Any], runs: Sequence[tuple[RunLike, Path]], out: Path) -> list[str]:
    """steps.png, live.png, util.png, curves.png (Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(runs)
    figs: dict[str, Any] = {k: plt.subplots(1, n, figsize=(5 * n, 3.6), squeeze=False) for k in ("steps", "live", "util")}  # fmt: skip
    for i, (run, tel) in enumerate(runs):
        sc = rep["scenarios"][run.name]
        ax = figs["steps"][1][0][i]
        for cid, c in sc["consumers"].items():
            if c["timeline"]:
                ts, steps = zip(*c["timeline"])
                ax.plot(ts, steps, label=cid)
        ax.set(title=f"{run.name}: steps", xlabel="s since start", ylabel="step")
        if ax.get_legend_handles_labels()[0]:  # nothing plotted: no empty legend
            ax.legend(fontsize=7)
        samples = read_samples(tel) if tel.is_file() else []
        t = [x["t_wall"] - run.started_wall for x in samples]
        ax = figs["live"][1][0][i]
        ax2 = ax.twinx()
        for r in run.run_dirs:
            ready = [x.get("extra", {}).get(str(r), {}).get("ready_windows", 0) for x in samples]
            live = [x.get("run_dirs", {}).get(str(r), {}).get("bytes", 0) / 2**20 for x in samples]
            ax.step(t, ready, where="post", label=f"{r.name} windows")
            ax2.plot(t, live, ":", alpha=0.6)
        ax.set(title=f"{run.name}: live windows (— ready, ·· MiB)", xlabel="s", ylabel="windows")
        ax2.set_ylabel("MiB on disk")
        ax = figs["util"][1][0][i]
        ax.plot(t, [x.get("host_cpu_pct") for x in samples], label="host CPU %")
        for g in range(max((len(x.get("gpus", [])) for x in samples), default=0)):
            ax.plot(t, [(x.get("gpus") or [{}] * (g + 1))[g].get("util_pct") for x in samples], label=f"GPU {g} %")  # fmt: skip
        ax.set(title=f"{run.name}: utilization", xlabel="s", ylabel="%", ylim=(0, 105))
        if ax.get_legend_handles_labels()[0]:  # nothing plotted: no empty legend
            ax.legend(fontsize=7)
    figs["curves"] = _learning_curves(plt, runs)
    names = []
    for k, (fig, _) in figs.items():
        fig.tight_layout()
        fig.savefig(out / f"{k}.png", dpi=80)
        plt.close(fig)
        names.append(f"{k}.png")
    return names


def _learning_curves(plt: Any, runs: Sequence[tuple[RunLike, Path]]) -> Any:
    """curves.png: loss and EAL against step, one line per draft, one row per scenario
    (the drafts step at the same pace, so a steps-over-time plot cannot tell them apart)."""
    fig, axes = plt.subplots(len(runs), 2, figsize=(10, 3.6 * len(runs)), squeeze=False)
    for i, (run, _) in enumerate(runs):
        for role in run.roles:
            if role.kind != "consumer" or role.save_path is None:
                continue
            recs = _train_log(role.save_path / "train_log.jsonl")
            if not recs:
                continue
            k = max(1, len(recs) // 50)  # moving mean over ~2% of the run: single steps are noisy
            for j, key in enumerate(("loss", "eal")):
                ys = [float(r[key]) for r in recs]
                smooth = [sum(ys[max(0, n - k + 1) : n + 1]) / len(ys[max(0, n - k + 1) : n + 1]) for n in range(len(ys))]  # fmt: skip
                axes[i][j].plot([r["step"] for r in recs], smooth, label=role.name)
        for j, key in enumerate(("loss", "EAL (train-time)")):
            ax = axes[i][j]
            ax.set(title=f"{run.name}: {key}", xlabel="step", ylabel=key)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    return fig, axes


def write_report(rep: dict[str, Any], runs: Sequence[tuple[RunLike, Path]], out: Path) -> None:
    plots = write_plots(rep, runs, out)
    rep["plots"] = [str(out / p) for p in plots]
    (out / "report.json").write_text(json.dumps(rep, indent=2) + "\n")
    (out / "report.md").write_text(_markdown(rep, plots))
