"""Numbers and validity of one finished bench scenario (see VALIDITY_RULES).

    from fanout.bench.metrics import scenario_metrics
    m = scenario_metrics(cfg, run, telemetry_jsonl)   # after fanout.bench.bench.execute
    m["valid"], m["reasons"], m["aggregate"]["rows_per_s"], m["captures_per_window"]

Sources: each trainer's `train_log.jsonl` (step times, acked windows), each
producer's `--summary-json`, the coordinator (`fanout.status.snapshot.snapshot`: windows
produced, recaptures, high-water marks) and the telemetry JSONL, over the scenario's
steady window (after `warmup_steps`, while every consumer runs). fanout.bench.report
puts these numbers into report.json / report.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from fanout.bench.config import BenchConfig
from fanout.bench.scenario import Role, ScenarioRun
from fanout.bench.telemetry import read_samples, summarize
from fanout.train.trainlog import read_train_log

VALIDITY_RULES = [
    "every consumer acked every window of the stream exactly once, in order "
    "(from train_log.jsonl `acked`; a time-limited demo run: a gap-free prefix)",
    "captures per window as the lag policy promises: 1.0 for a shared stream under "
    "hold/detach, one per pair (3.0) for unshared; recaptures are counted",
    "zero failures: every role exited 0 (or was stopped by the harness's own time "
    "limit), no failed publish, corrupt window, detach or lost-process reclaim, no timeout",
    "telemetry valid (>= 2 samples, coverage > 0, memory of every role) or flagged",
]


def _pct(a: list[float], q: float) -> float | None:
    return round(float(np.percentile(np.asarray(a), q)), 2) if a else None


def _snapshot(run_dir: Path) -> dict[str, Any] | None:
    """`fanout status --json` of a run dir (SQLite or PostgreSQL, as the run dir
    records), None if no producer created it."""
    from fanout.coord.coordinator import Coordinator
    from fanout.status.snapshot import snapshot

    co = Coordinator.open_if_created(run_dir)
    if co is None:
        return None
    with co:
        return snapshot(co)


def scenario_metrics(cfg: BenchConfig, run: ScenarioRun, tel: Path) -> dict[str, Any]:
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
        "producer_runs": prod["runs"],
        "captures": prod["captures"],
        "unique_windows": unique,
        "captures_per_window": cpw,
        "peak_ready_windows": prod["peak_ready_windows"],
        "peak_ready_bytes": prod["peak_ready_bytes"],
        "telemetry": tel_sum,
    }


def _consumer_metrics(
    role: Role, snap: dict[str, Any] | None, warm: int, run: ScenarioRun, reasons: list[str]
) -> tuple[dict[str, Any], tuple[float, float] | None]:
    """One trainer's numbers from its train_log.jsonl (appending to `reasons` the rules
    it broke), and the wall-clock bounds of its steady state (after `warm` steps)."""
    assert role.save_path is not None and role.spec is not None, role.name  # a consumer
    recs = read_train_log(role.save_path)
    total = snap["config"]["total_windows"] if snap else None
    acked = [w for r in recs for w in r.get("acked", [])]
    # A draft with --max-steps that reached them ended on its own, before the stream did.
    own_end = role.spec.max_steps is not None and len(recs) == role.spec.max_steps
    want = list(range(len(acked) if role.stopped_by_us or own_end else (total or 0)))
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
    run: ScenarioRun,
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
                recs = read_train_log(role.save_path)
                n = sum(1 for r in recs if t0 < r["time"] <= t1)
                rows += n * role.spec.rows_per_step
        agg = {"rows_per_s": round(rows / (t1 - t0), 4), "window_s": round(t1 - t0, 3)}
    else:
        agg = {"rows_per_s": round(sum(c["rows_per_s"] for c in consumers.values()), 4)}
        flags.append("consumers' steady windows do not overlap: aggregate = sum of rates")
    agg["steady_wall"] = [t0, t1]
    return agg


def _producer_metrics(
    run: ScenarioRun, snaps: dict[str, dict[str, Any] | None], reasons: list[str]
) -> dict[str, Any]:
    """Each producer's (each replica's) summary, its run dir's coordinator counts, and
    the totals over all of them (appending to `reasons` what breaks a rule): captures,
    unique windows, the peak ready windows / bytes (the coordinator's high water: ready only, a lower bound of what K bounds). `runs`: per run dir, what its
    producers made together (`replicas`, windows/s summed over them, windows, captures
    per window, recaptures, reclaimed claims)."""
    producers: dict[str, Any] = {}
    by_dir: dict[str, list[str]] = {}
    failures = 0
    for role in run.roles:
        if role.kind != "producer":
            continue
        sp = role.summary_path
        summ = json.loads(sp.read_text()) if sp is not None and sp.is_file() else {}
        p: dict[str, Any] = {
            "summary": summ,
            "run_dir": str(role.run_dir),
            "replica": summ.get("replica", 0),
            "windows_made": summ.get("windows"),
        }
        if summ.get("elapsed_s"):
            p["unique_windows_per_s"] = round(summ["windows"] / summ["elapsed_s"], 4)
        failures += int(summ.get("failures", 0))
        producers[role.name] = p
        by_dir.setdefault(str(role.run_dir), []).append(role.name)
    captures = unique = hw_windows = hw_bytes = 0
    streams, runs = set(), {}
    for run_dir, names in by_dir.items():
        snap = snaps[run_dir]
        if not snap:
            reasons.append(f"{names[0]}: no coordinator database in {run_dir}")
            continue
        produced, rec, hw = snap["produced_windows"], snap["recaptures"], snap["high_water"]
        captures += produced + rec
        unique = max(unique, produced)
        streams.add(snap["stream_id"])
        hw_windows, hw_bytes = max(hw_windows, hw["windows"]), max(hw_bytes, hw["bytes"])
        for k in ("corrupt", "detaches", "reclaims"):
            if snap[k]:
                reasons.append(f"{names[0]}: coordinator counted {snap[k]} {k}")
        counts = dict(
            produced_windows=produced,
            recaptures=rec,
            claims_reclaimed=snap.get("claims_reclaimed", 0),
            total_windows=snap["config"]["total_windows"],
            high_water=hw,
            window_bytes=round(hw["bytes"] / max(1, hw["windows"])),
            database=snap["db_path"],
        )
        for n in names:
            producers[n].update(counts)
        rates = [producers[n].get("unique_windows_per_s") for n in names]
        runs[run_dir] = counts | {
            "replicas": len(names),
            "windows_per_s": round(sum(r or 0.0 for r in rates), 4) if all(rates) else None,
            "captures_per_window": round((produced + rec) / produced, 4) if produced else None,
        }
    if failures:
        reasons.append(f"producers reported {failures} failed publishes")
    if len(streams) > 1:
        reasons.append(f"pairs produced different streams {sorted(streams)}: not the same data")
    return {
        "producers": producers,
        "runs": runs,
        "captures": captures,
        "unique_windows": unique,
        "peak_ready_windows": hw_windows,
        "peak_ready_bytes": hw_bytes,
    }


def _telemetry(run: ScenarioRun, tel: Path, steady_wall: list[float] | None) -> dict[str, Any]:
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
