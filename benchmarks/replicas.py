"""Producer replicas on the demo's assets: windows/s of M = 1 and 2, and what trainers wait.

    .venv/bin/python benchmarks/replicas.py --json benchmarks/results/replicas.json
    .venv/bin/python benchmarks/replicas.py --only alone --repeats 5 --windows 300

Run from the repository root. On a shared 2-vCPU machine the default run takes ≈ 10
minutes (the first one builds the demo assets too, cached in `--work`/assets).

(a) Replicas alone. The demo's tiny trained Qwen3 verifier, tokenizer and corpus
    (fanout.bench.assets, the demo's settings), `fanout produce` with `--replicas M`,
    M processes (each one thread: OMP_NUM_THREADS=1, torch.set_num_threads), no
    trainer, K larger than the stream (nothing blocks, nothing is evicted),
    `--max-windows --windows`. Aggregate windows/s is measured from the coordinator's
    own record: the windows published after the last replica registered, over the time
    from that registration to the last publish (start-up and imports aside). Each M is
    run `--repeats` times, M = 1 and 2 alternating (so drifting load hits both); the
    median, min and max of each, and `speedup_2_vs_1` = median(M=2) / median(M=1)
    (goal ≥ 1.8 on a 2-core machine), with the ratio's min-max over the paired rounds.
(b) With 3 trainers. The benchmark harness (fanout.bench.bench `run_bench`, scenario
    1p3c) with M replicas (`ProducerSpec.replicas`, one thread each) and three DFlash
    trainers (block 4, 8, 16; one thread each) for `--minutes` each: the trainers'
    wait (percent of their steady time spent waiting for a window), captures per window
    (files published / windows: 1.00 unless windows were recaptured) and the claims of
    lost replicas made again (`claims_reclaimed`: 0 without faults), per M.

`--json OUT` holds every figure: commit (and whether the tree differs from it), date,
hardware, versions, load average (`os.getloadavg`) before and after each part, the
sizes, sample sizes and spreads. Keys: `alone.windows_per_s.<M>.{median,min,max,runs}`,
`alone.speedup_2_vs_1`, `alone.speedup_min_max`, `alone.goal_met`;
`with_trainers.<M>.{wait_pct,wait_pct_mean,captures_per_window,claims_reclaimed,
trainer_rows_per_s,windows_per_s,valid}`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from fanout.bench.assets import ensure_demo_assets
from fanout.bench.bench import run_bench
from fanout.bench.config import AssetsSpec, BenchConfig, ConsumerSpec, ProducerSpec
from fanout.coord.coordinator import Coordinator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import Recorder, Row

REPO = Path(__file__).resolve().parents[1]


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _produce_argv(a: argparse.Namespace, assets: Any, run: Path, m: int) -> list[str]:
    return [
        sys.executable, "-m", "fanout.cli", "produce", "--run-dir", str(run),
        "--verifier-name-or-path", str(assets.verifier_dir), "--tokenizer",
        str(assets.tokenizer_dir), "--data", str(assets.data_path), "--seq-len",
        str(a.seq_len), "--window-rows", str(a.window_rows), "--epochs", "50",
        "--max-windows", str(a.windows), "--max-live-windows", str(a.windows + 1),
        "--num-draft-layers", "1", "--workers", "1", "--device", "cpu",
        "--cache-dir", str(Path(a.work) / "cache"), "--no-progress", "--exit-when-idle-s",
        "0", "--replicas", str(m), "--log-level", "warning",
    ]  # fmt: skip


def alone_once(a: argparse.Namespace, assets: Any, m: int, i: int) -> dict[str, Any]:
    """M replicas over a fresh run dir until --windows windows; their aggregate rate."""
    run = Path(a.work) / "alone" / f"m{m}-{i}"
    if run.exists():
        subprocess.run(["rm", "-rf", str(run)], check=True)
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(_produce_argv(a, assets, run, m), env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(m)
    ]  # fmt: skip
    for p in procs:
        _, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"fanout produce failed ({p.returncode}):\n{err[-3000:]}")
    with Coordinator.open(run) as co:
        starts = [float(r["since_wall"]) for r in co.producer_replicas()]
        made = [int(r["made"]) for r in co.producer_replicas()]
        stamps = co.ready_stamps()
    t0 = max(starts)  # every replica registered: from here on all of them produce
    after = [t for t in stamps if t > t0]
    return {
        "windows_per_s": round(len(after) / (after[-1] - t0), 3),
        "windows_measured": len(after),
        "windows_made_per_replica": made,
    }


def alone(a: argparse.Namespace, assets: Any) -> dict[str, Any]:
    load0 = _load()
    alone_once(a, assets, 1, -1)  # untimed: prepares the data cache, warms the page cache
    runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
    for i in range(a.repeats):
        for m in (1, 2) if i % 2 == 0 else (2, 1):
            runs[m].append(alone_once(a, assets, m, i))
            print(f"  alone M={m} round {i}: {runs[m][-1]['windows_per_s']:.1f} windows/s "
                  f"(made per replica {runs[m][-1]['windows_made_per_replica']})", flush=True)  # fmt: skip
    rates = {m: [r["windows_per_s"] for r in rs] for m, rs in runs.items()}
    ratios = [b / x for x, b in zip(rates[1], rates[2], strict=True)]
    speedup = statistics.median(rates[2]) / statistics.median(rates[1])
    return {
        "windows": a.windows,
        "seq_len": a.seq_len,
        "window_rows": a.window_rows,
        "repeats": a.repeats,
        "load_avg_before": load0,
        "load_avg_after": _load(),
        "windows_per_s": {
            str(m): {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": runs[m]}
            for m, v in rates.items()
        },
        "speedup_2_vs_1": round(speedup, 3),
        "speedup_min_max": [round(min(ratios), 3), round(max(ratios), 3)],
        "goal": 1.8,
        "goal_met": speedup >= 1.8,
    }


def with_trainers(a: argparse.Namespace, m: int) -> dict[str, Any]:
    cfg = BenchConfig(
        name=f"replicas-{m}",
        description=f"{m} producer replica(s), three DFlash trainers, the demo's assets",
        assets=AssetsSpec(cache_dir=str(Path(a.work) / "assets"), use_demo_verifier=True),
        producer=ProducerSpec(
            seq_len=a.seq_len, window_rows=a.window_rows, max_live_windows=a.k, epochs=50,
            num_draft_layers=1, replicas=m, threads=1,
        ),
        consumers=[
            ConsumerSpec(id=f"b{b}", block_size=b, max_anchors=16, lr=2e-3, seed=i)
            for i, b in enumerate((4, 8, 16))
        ],
        scenarios=["1p3c"],
        threads_per_role=1,
        warmup_steps=2,
        scenario_timeout_s=a.minutes * 60 + 600,
    )  # fmt: skip
    load0 = _load()
    rep = run_bench(cfg, Path(a.work) / f"trainers-m{m}", stop_after_s=a.minutes * 60,
                    echo=lambda s: None)  # fmt: skip
    sc = rep["scenarios"]["1p3c"]
    waits = {cid: c.get("window_wait_frac") for cid, c in sc["consumers"].items()}
    (run,) = sc["producer_runs"].values()
    return {
        "minutes": a.minutes,
        "load_avg_before": load0,
        "load_avg_after": _load(),
        "valid": rep["valid"],
        "reasons": rep["reasons"],
        "wait_pct": {k: None if v is None else round(100 * v, 1) for k, v in waits.items()},
        "wait_pct_mean": round(100 * statistics.mean(v for v in waits.values() if v is not None), 1)
        if any(v is not None for v in waits.values())
        else None,
        "captures_per_window": sc["captures_per_window"],
        "claims_reclaimed": run["claims_reclaimed"],
        "windows": sc["unique_windows"],
        "windows_per_s": run["windows_per_s"],
        "trainer_rows_per_s": sc["aggregate"].get("rows_per_s"),
        "report": str(Path(a.work) / f"trainers-m{m}" / "report.md"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="runs/replicas", help="assets, runs and reports go here")
    p.add_argument("--only", choices=["alone", "trainers"], default=None, help="one part")
    p.add_argument("--repeats", type=int, default=3, help="(a): rounds of M = 1 and 2")
    p.add_argument("--windows", type=int, default=240, help="(a): windows per run")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per row T")
    p.add_argument("--window-rows", type=int, default=8, help="rows per window R")
    p.add_argument("--k", type=int, default=6, help="(b): --max-live-windows")
    p.add_argument("--minutes", type=float, default=1.5, help="(b): training time per M")
    p.add_argument("--json", default=None, help="write every figure here")
    a = p.parse_args()
    rec = Recorder("replicas")  # commit, date, hardware, versions, load before
    import torch

    torch.set_num_threads(1)
    assets = ensure_demo_assets(Path(a.work) / "assets")
    res: dict[str, Any] = {
        **rec.head,
        "assets": {"verifier": str(assets.verifier_dir), "data": str(assets.data_path)},
        "load_avg_start": _load(),
    }
    if a.only in (None, "alone"):
        print("(a) replicas alone", flush=True)
        res["alone"] = alone(a, assets)
    if a.only in (None, "trainers"):
        print("(b) with 3 trainers", flush=True)
        res["with_trainers"] = {str(m): with_trainers(a, m) for m in (1, 2)}
    res["load_avg_end"] = _load()
    hw = res["hardware"]
    print(f"\nreplicas on {hw['cpu']}, {hw['usable_cpus']} CPUs, load {res['load_avg_start']} → "
          f"{res['load_avg_end']}; T={a.seq_len} R={a.window_rows}")  # fmt: skip
    if "alone" in res:
        al = res["alone"]
        print(f"{'M':>2} {'windows/s median':>17} {'min':>7} {'max':>7}  (alone, {a.windows} "
              f"windows, {a.repeats} runs each)")  # fmt: skip
        for m, v in al["windows_per_s"].items():
            print(f"{m:>2} {v['median']:>17.2f} {v['min']:>7.2f} {v['max']:>7.2f}")
        print(f"speedup_2_vs_1 {al['speedup_2_vs_1']:.2f} (rounds {al['speedup_min_max']}; goal "
              f"≥ 1.8: {'met' if al['goal_met'] else 'NOT met'})")  # fmt: skip
    if "with_trainers" in res:
        print(f"{'M':>2} {'trainer wait %':>30} {'mean':>6} {'captures/window':>16} "
              f"{'reclaimed':>9} {'rows/s':>7}  (3 trainers, {a.minutes} min each)")  # fmt: skip
        for m, v in res["with_trainers"].items():
            print(f"{m:>2} {json.dumps(v['wait_pct']):>30} {v['wait_pct_mean']!s:>6} "
                  f"{v['captures_per_window']!s:>16} {v['claims_reclaimed']!s:>9} "
                  f"{v['trainer_rows_per_s']!s:>7}")  # fmt: skip
    raw = {k: v for k, v in res.items() if k not in rec.head}
    rec.write(a.json, record_rows(res, a), raw=raw)
    return 0


def record_rows(res: dict[str, Any], a: argparse.Namespace) -> list[Row]:
    """The record's rows (benchmarks/record.py): (a) the speedup of two replicas over one
    alone, (b) the trainers' wait and the captures per window at M = 1 and 2."""
    out = []
    cond = f"demo assets, T {a.seq_len}, R {a.window_rows}, one thread per replica"
    if "alone" in res:
        al = res["alone"]
        w = al["windows_per_s"]
        out.append(Row(stage="producer", name="speedup_2_vs_1",
                       what="two producer replicas vs one, alone (windows/s, medians)",
                       result=al["speedup_2_vs_1"], unit="×", spread=tuple(al["speedup_min_max"]),
                       n=al["repeats"], n_of="rounds (per-round ratio min–max)", goal=">= 1.8",
                       met=bool(al["goal_met"]),
                       conditions=f"{cond}; {al['windows']} windows a run; "
                       f"{w['1']['median']:.2f} vs {w['2']['median']:.2f} windows/s"))  # fmt: skip
    for m, v in (res.get("with_trainers") or {}).items():
        out.append(Row(stage="producer", name=f"trainer_wait_pct.M{m}",
                       what=f"three trainers' mean wait for windows, {m} replica(s)",
                       result=v["wait_pct_mean"], unit="%", n=3, n_of="trainers",
                       conditions=f"{cond}; b4/b8/b16 {a.minutes} min; wait {v['wait_pct']}; "
                       f"{v['trainer_rows_per_s']} rows/s together; captures/window "
                       f"{v['captures_per_window']}, claims reclaimed {v['claims_reclaimed']}; "
                       f"{'valid' if v['valid'] else 'INVALID'}"))  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
