"""Does the fan-out pay? 1P3C vs three unshared producer/trainer pairs, as a record.

    python benchmarks/fanout_1p3c.py --json benchmarks/results/fanout_1p3c.json   # ≈ 4 min
    python benchmarks/fanout_1p3c.py --config benchmarks/fanout/qwen3-8b-1p3c.json --out runs/b8

Runs the bench harness (`fanout bench`, fanout.bench.bench: every scenario of the config,
default benchmarks/fanout/cpu-tiny.json: 1p1c, 1p3c, unshared) and records its report's
figures in benchmarks/record.py's format: the aggregate rows/s of 1p3c over unshared
(goal >= 2.0: one verifier pass feeds three drafts), captures per window in each, the
peak of live windows against K, and whether the run was valid (docs/benchmarks.md,
"Validity rules"). The harness's own report (report.md, plots) stays under `--out`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from record import REPO, Recorder, Row

GOAL = 2.0


def rows(rep: dict[str, Any], config: str) -> list[Row]:
    z = rep["sizes"]
    v = z["verifier"]
    drafts = ", ".join(f"b{c['block_size']}" for c in z["consumers"])
    size = (f"{Path(config).name}: verifier h {v['hidden_size']} × {v['num_hidden_layers']} "
            f"layers, T {z['seq_len']}, R {z['window_rows']}, K {z['max_live_windows']}; "
            f"drafts {drafts}; {'valid' if rep['valid'] else 'INVALID: ' + '; '.join(rep['reasons'])}")  # fmt: skip
    rate = rep["aggregate_rows_per_s"]
    out = []
    if rep.get("aggregate_speedup_vs_unshared") is not None:
        s = rep["aggregate_speedup_vs_unshared"]
        out.append(Row(stage="fan-out", name="aggregate_speedup_vs_unshared",
                       what="1P3C aggregate rows/s vs three unshared producer/trainer pairs",
                       result=s, unit="×", goal=f">= {GOAL}", met=s >= GOAL,
                       conditions=f"{size}; {rate['1p3c']:.2f} vs {rate['unshared']:.2f} rows/s"))  # fmt: skip
    if rep.get("captures_per_window_1p3c") is not None:
        out.append(Row(stage="fan-out", name="captures_per_window",
                       what="verifier captures per window, 1P3C (unshared in conditions)",
                       result=rep["captures_per_window_1p3c"], goal="1.0",
                       met=rep["captures_per_window_1p3c"] == 1.0,
                       conditions=f"unshared {rep['captures_per_window_unshared']}; {size}"))  # fmt: skip
    if rep.get("peak_ready_windows") is not None:
        k = rep["max_live_windows"]
        out.append(Row(stage="fan-out", name="peak_ready_windows",
                       what="peak ready windows on disk, 1P3C", result=rep["peak_ready_windows"],
                       goal=f"<= K = {k}", met=rep["peak_ready_windows"] <= k, conditions=size))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "benchmarks/fanout/cpu-tiny.json"))
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench-1p3c", help="work dir")
    ap.add_argument("--json", type=Path, help="write the record here")
    a = ap.parse_args(argv)
    from fanout.bench.bench import run_bench
    from fanout.bench.config import BenchConfig
    from fanout.bench.report import format_table

    rec = Recorder("fanout_1p3c", argv)
    rep = run_bench(BenchConfig.load(a.config), a.out)
    print(format_table(rep))
    rec.write(a.json, rows(rep, a.config), raw=rep)
    return 0 if rep["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
