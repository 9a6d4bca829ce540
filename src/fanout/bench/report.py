"""Benchmark reports: numbers from a finished `fanout bench` run → report.json, report.md, PNGs.

    from fanout.bench.report import build_report, write_report, format_table
    report = build_report(cfg, assets, runs, out_dir)   # runs: [(ScenarioRun, telemetry.jsonl)]
    write_report(report, runs, out_dir); print(format_table(report))

Each scenario's numbers and validity come from fanout.bench.metrics (trainers'
`train_log.jsonl`, producers' summaries, the coordinator, telemetry), the plots from
fanout.bench.plots. Every number in report.md is printed beside the hardware, sizes
and versions it was measured on, and the coordinator's database (SQLite, or the
PostgreSQL server; `database`).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fanout import package_version
from fanout.bench.config import BenchConfig, scenario_title
from fanout.bench.metrics import VALIDITY_RULES, scenario_metrics
from fanout.bench.plots import write_plots
from fanout.bench.scenario import Assets, ScenarioRun
from fanout.errors import FanoutError

# What a report reads of the bench's assets (fanout.bench.bench's Assets satisfies it).
# The CPU's vector extensions a benchmark names (/proc/cpuinfo `flags`): what decides how
# fast torch's CPU kernels run, so a figure measured with them is not read as holding
# without them (issue #56: one run, 0.72x on a Xeon, 1.10x on an EPYC)
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")  # fmt: skip


def cpu_info() -> tuple[str, list[str]]:
    """The CPU's model name and which of `VECTOR_FLAGS` it has ("unknown", [] where
    /proc/cpuinfo cannot be read)."""
    cpu, flags = "unknown", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return cpu, [f for f in VECTOR_FLAGS if f in flags]


def torch_build() -> dict[str, Any]:
    """torch's version and the vector kernels it dispatches to on this CPU
    (`torch.backends.cpu.get_cpu_capability()`: e.g. AVX512, AVX2; None without torch)."""
    try:
        import torch
    except ImportError:
        return {"torch": None, "torch_cpu_capability": None}
    return {
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def hardware() -> dict[str, Any]:
    """Where a benchmark ran: the CPU (model, its vector extensions), cores, memory, OS,
    load, GPUs and the torch build (every record's `hardware`, benchmarks/record.py)."""
    cpu, vector = cpu_info()
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    hw: dict[str, Any] = {
        "cpu": cpu,
        "cpu_vector_extensions": vector,
        **torch_build(),
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
        out[pkg] = package_version(pkg) or "not installed"
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


def _verifier_sizes(vdir: Path) -> dict[str, Any]:
    c = json.loads((vdir / "config.json").read_text())
    keys = ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")
    out = {k: c.get(k) for k in keys}
    out["weights_bytes"] = sum(f.stat().st_size for f in vdir.glob("*.safetensors"))
    return out


def build_report(
    cfg: BenchConfig, assets: Assets, runs: Sequence[tuple[ScenarioRun, Path]], out: Path
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
        "peak_ready_windows": shared["peak_ready_windows"] if shared else None,
        "max_live_windows": cfg.producer.max_live_windows,
    }
    if shared and shared["producers"]:
        p = next(iter(shared["producers"].values()))
        wb = p.get("window_bytes", 0)
        rep["disk"] = {
            "high_water_bytes": shared["peak_ready_bytes"],
            "all_windows_bytes": wb * shared["unique_windows"],
            "window_bytes": wb,
        }
        if "unshared" in sc:
            rep["verifier_passes_saved_per_window"] = round(
                (sc["unshared"]["captures_per_window"] or 0) - (shared["captures_per_window"] or 0),
                3,
            )
    reasons = [f"{k}: {r}" for k, v in sc.items() for r in v["reasons"]]
    peak, k = rep["peak_ready_windows"], cfg.producer.max_live_windows
    if peak is not None and peak > k:
        reasons.append(f"1p3c: peak ready windows {peak} > K = {k}")
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
        "scenarios: "
        + "; ".join(
            f"{name} = {scenario_title(name, len(sc['consumers']))}"
            for name, sc in rep["scenarios"].items()
        ),
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
            f"captures/window {_f(sc['captures_per_window'])}  peak ready "
            f"{sc['peak_ready_windows']} windows ({_mib(sc['peak_ready_bytes'])})  "
            f"{'ok' if sc['valid'] else 'INVALID'}"
        )
    lines += [
        "",
        f"aggregate_speedup_vs_unshared = {_f(rep['aggregate_speedup_vs_unshared'], 3)}"
        f"{'' if rep['aggregate_speedup_vs_unshared'] else NO_UNSHARED}   "
        f"captures_per_window_1p3c = {_f(rep['captures_per_window_1p3c'])}   "
        f"peak_ready_windows = {rep['peak_ready_windows']} (K = {rep['max_live_windows']})",
    ]
    lines += [f"INVALID: {r}" for r in rep["reasons"]] + [f"flag: {f}" for f in rep["flags"]]
    return "\n".join(lines)


# Why the aggregate speed-up is "-": it needs the `unshared` scenario in the same run
NO_UNSHARED = (
    " (no `unshared` scenario in this run to compare with: `fanout bench` with scenario "
    "unshared, or benchmarks/families.py, measures it)"
)


# Three figures of one draft's acceptance, said once (the demo prints the first and the
# third, report.md shows all three): they measure different things and need not agree.
EAL_NOTE = (
    "**Three acceptance figures, three meanings.** The table's *EAL first→last* is the "
    "train-time expected acceptance length the trainer logs each step (the draft's "
    "predictions on that step's training windows) at the run's first and its last step: "
    "single steps, so noisy. The terminal summary of `fanout demo` shows the same log as "
    "a mean over up to 10 steps at each end, so its two numbers differ from these. *train "
    "EAL* in the eval table is what the checkpoint recorded when saved: the mean over the "
    "steps just before it. *τ* is measured, not estimated: tokens per verifier forward when the "
    "draft really decodes held-out prompts (`fanout eval`), so it may sit below or above "
    "the train-time figures."
)


def _markdown(rep: dict[str, Any], plots: list[str]) -> str:
    out = [f"# fanout benchmark: {rep['name']}", "", rep["description"], ""]
    out += ["```", format_table(rep), "```", ""]
    if rep.get("aggregate_speedup_vs_unshared"):
        n = len(rep["scenarios"].get("1p3c", {}).get("consumers", {})) or "the"
        out.append(
            f"- **Aggregate throughput**: {n} drafts fed by one producer train "
            f"{rep['aggregate_speedup_vs_unshared']:.2f}× as many rows per second as {n} "
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
    out += ["", EAL_NOTE]
    out += ["", "## Validity rules", ""]
    out += [f"{i}. {r}" for i, r in enumerate(rep["validity_rules"], 1)]
    out += ["", f"Result: **{'valid' if rep['valid'] else 'INVALID'}**"]
    out += [f"- invalid: {r}" for r in rep["reasons"]] + [f"- flag: {f}" for f in rep["flags"]]
    out += ["", "## Producers", ""]
    out += producers_markdown(rep["scenarios"])
    if rep.get("eval"):
        out += ["", *eval_markdown(rep["eval"])]
    out += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    out += ["", "## Hardware and versions", "", "```"]
    keys = ("hardware", "versions", "database")
    out += [json.dumps({k: rep[k] for k in keys if k in rep}, indent=2)]
    out += ["```", ""]
    return "\n".join(out)


def producers_markdown(scenarios: dict[str, Any]) -> list[str]:
    """report.md's producers table: a row per producer (each replica of a run with
    several: its own windows/s and windows made), and for a run with replicas a row of
    what they made together (windows/s summed, the stream's windows, captures per
    window, recaptures, claims of lost replicas made again)."""
    out = [
        "| scenario | producer | windows/s | windows made | captures/window | recaptures "
        "| reclaimed claims |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, sc in scenarios.items():
        runs = sc.get("producer_runs", {})
        rows: dict[str, list[str]] = {}
        for pid, p in sc["producers"].items():
            rows.setdefault(p.get("run_dir", ""), []).append(pid)
        for run_dir, pids in rows.items():
            agg = runs.get(run_dir, {})
            alone = len(pids) == 1
            for pid in pids:
                p = sc["producers"][pid]
                run_cols = (
                    f"{_f(agg.get('captures_per_window'))} | {agg.get('recaptures', '-')} | "
                    f"{agg.get('claims_reclaimed', '-')}"
                    if alone
                    else "- | - | -"
                )
                who = pid if alone else f"{pid} (replica {p.get('replica', '?')})"
                out.append(
                    f"| {name} | {who} | {_f(p.get('unique_windows_per_s'), 3)} | "
                    f"{p.get('windows_made', '-')} | {run_cols} |"
                )
            if not alone:
                out.append(
                    f"| {name} | all {len(pids)} replicas | {_f(agg.get('windows_per_s'), 3)} | "
                    f"{agg.get('produced_windows', '-')} | {_f(agg.get('captures_per_window'))} | "
                    f"{agg.get('recaptures', '-')} | {agg.get('claims_reclaimed', '-')} |"
                )
    return out


def eval_markdown(ev: dict[str, Any]) -> list[str]:
    """report.md's `fanout eval` section, from eval.json's greedy (T = 0) keys: per draft
    τ beside its train-time EAL (whose curve is curves.png) and per-position acceptance."""
    verdict = "every output equals greedy" if ev.get("lossless") else "**NOT lossless**"
    if ev.get("lossless") and ev.get("ties"):  # fanout.decode.eval_table.lossless_line says more
        verdict += (
            f" but at {len(ev['ties'])} verifier tie(s) (top two logits within rounding, "
            "broken either way by a one-token vs a multi-token forward)"
        )
    out = [
        "## Speculative decoding (fanout eval)",
        "",
        f"{ev.get('prompts', '?')} held-out prompts, greedy (T = 0): {verdict}. τ = tokens "
        "per verifier forward, measured; train EAL = the checkpoint's train-time expected "
        "acceptance length (its course: curves.png); acceptance at block position k = the "
        "fraction of verify steps that accepted draft k.",
        "",
        "| draft | block | τ | train EAL | τ / train EAL | acceptance at position 1, 2, … |",
        "|---|---|---|---|---|---|",
    ]
    for name, d in ev.get("drafts", {}).items():
        tau, eal = d.get("acceptance_length"), d.get("train_eal")
        ratio = _f(tau / eal) if tau is not None and eal else "-"
        pos = " ".join(f"{a:.2f}" for a in d.get("per_position_acceptance") or [])
        out.append(
            f"| {name} | {d.get('block_size', '-')} | {_f(tau)} | {_f(eal)} | {ratio} | {pos} |"
        )
    return out


def add_eval(out: Path, ev: dict[str, Any]) -> None:
    """Put a `fanout eval` report (eval.json's content) into out/report.json and .md, which
    write_report wrote: the T = 0 figures only (eval.json beside them has the rest)."""
    rep = json.loads((out / "report.json").read_text())
    keep = ("block_size", "acceptance_length", "train_eal", "per_position_acceptance")
    rep["eval"] = {
        "lossless": ev.get("lossless"),
        "prompts": ev.get("prompts"),
        "drafts": {n: {k: d.get(k) for k in keep} for n, d in ev.get("drafts", {}).items()},
    }
    plots = [str(Path(p).relative_to(out)) for p in rep.get("plots", [])]
    (out / "report.json").write_text(json.dumps(rep, indent=2) + "\n")
    (out / "report.md").write_text(_markdown(rep, plots))


def write_report(rep: dict[str, Any], runs: Sequence[tuple[ScenarioRun, Path]], out: Path) -> None:
    plots = write_plots(rep, runs, out)
    rep["plots"] = [str(out / p) for p in plots]
    (out / "report.json").write_text(json.dumps(rep, indent=2) + "\n")
    (out / "report.md").write_text(_markdown(rep, plots))
