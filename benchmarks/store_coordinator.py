"""Store + coordinator benchmark: publish/read vs raw I/O, and lease cycles per second.

    .venv/bin/python benchmarks/store_coordinator.py                       # defaults
    .venv/bin/python benchmarks/store_coordinator.py --size-mib 16 --cycles 500 --json out.json

- publish_vs_raw, read_vs_raw: from benchmarks/store_io.py (bench_publish / bench_read).
- cycles_per_s_1p / cycles_per_s_8p: coordinator acquire+ack cycles per second,
  aggregate, with 1 and with 8 consumer processes (spawned; timed from a common
  start signal, so interpreter start-up is not counted). Windows are metadata-only
  (published rows with no files) and K is large, so this measures the database
  path alone: two BEGIN IMMEDIATE transactions per cycle plus eviction bookkeeping.
- p99_ms_8p: 99th percentile of one acquire+ack cycle with 8 processes.
- lock_errors: "database is locked" (or any coordinator error) seen by a caller; goal 0.

Goal: >= 2,000 cycles/s aggregate with 8 processes on a 2-core machine, 0 lock errors.
On a shared machine expect noise; the load average is printed with the table.
`--rounds N` repeats the 1- and 8-process measurements (median, min–max); `--json` writes
benchmarks/record.py's format.

`--db-path postgresql://…` runs the cycles on a PostgreSQL coordinator instead (each
run in a new schema of that database). There every statement is a round trip to the
server, so expect tens of times fewer cycles/s than SQLite; no goal is set for it:
one cycle moves one window (hundreds of MB), so a few cycles/s already saturate disks.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from fanout.contract import CaptureContract
from fanout.coord.coordinator import Coordinator, RunConfig
from fanout.errors import FanoutError
from fanout.store.store import Published, RunDir, window_name

MiB = 1 << 20


def _contract() -> CaptureContract:
    return CaptureContract(
        verifier_config_hash="bench", verifier_weights_fingerprint="bench",
        verifier_num_layers=36, hidden_size=4096, vocab_size=151936,
        target_layer_ids=(1, 9, 17, 25, 33), dataset_fingerprint="bench",
        tokenizer_fingerprint="bench", seq_len=3072, window_rows=4, shuffle_seed=0,
    )  # fmt: skip


def _consumer(root: str, rank: int, cycles: int, start: Any, out: Any) -> None:
    co = Coordinator.open(root)
    reg = co.register_consumer("bench", dp_rank=rank)
    lat: list[float] = []
    errors = 0
    start.wait()
    t_start = time.perf_counter()
    for _ in range(cycles):
        t0 = time.perf_counter()
        try:
            lease = co.acquire(reg, timeout_s=120)
            assert lease is not None
            co.ack(lease)
        except (FanoutError, sqlite3.OperationalError):  # a driver error would be a bug
            errors += 1
        lat.append(time.perf_counter() - t0)
    out.put((t_start, time.perf_counter(), lat, errors))


def bench_cycles(tmpdir: Path, procs: int, cycles: int, db: str | None = None) -> dict[str, Any]:
    """Aggregate acquire+ack cycles/s of `procs` consumer processes, `cycles` each
    (coordinator in the run dir, or in a new schema of PostgreSQL URL `db`)."""
    rd = RunDir(tmpdir / f"run_{procs}p_{uuid.uuid4().hex[:8]}").create()  # one per round
    c = _contract()
    cfg = RunConfig(max_live_windows=cycles + 2, expected_consumers=procs)
    if db is not None:
        sep = "&" if "?" in db else "?"
        db = f"{db}{sep}schema=bench_{procs}p_{uuid.uuid4().hex[:8]}"
    co = Coordinator.create(rd.root, c, cfg, db_path=db)
    p = co.register_producer(c)
    for _ in range(cycles):
        cl = co.claim(p)
        assert cl is not None
        name = window_name(cl.window, cl.generation)
        co.publish_ready(cl, Published(name, rd.windows / name, 1, "xxh3_128:0"))
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    ps = [
        ctx.Process(target=_consumer, args=(str(rd.root), r, cycles, start, out))
        for r in range(procs)
    ]
    for proc in ps:
        proc.start()
    # Every consumer must be registered before the clock starts (expected_consumers).
    while co.consumers_registered() < procs:
        time.sleep(0.01)
    start.set()
    res = [out.get(timeout=600) for _ in ps]
    for proc in ps:
        proc.join(60)
    wall = max(r[1] for r in res) - min(r[0] for r in res)
    lat = sorted(x for r in res for x in r[2])
    co.close()
    return {
        "procs": procs,
        "cycles_each": cycles,
        "wall_s": wall,
        "cycles_per_s": procs * cycles / wall,
        "p50_ms": 1e3 * statistics.median(lat),
        "p99_ms": 1e3 * lat[int(0.99 * (len(lat) - 1))],
        "lock_errors": sum(r[3] for r in res),
    }


def _postgres_version(url: str) -> str:
    from fanout.coord.postgresdb import PostgresDatabase

    db = PostgresDatabase(url)
    try:
        return db.server_version()
    finally:
        db.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=64, help="window size for publish/read (MiB)")
    ap.add_argument("--reps", type=int, default=3, help="publish/read repetitions (median)")
    ap.add_argument("--cycles", type=int, default=1000, help="acquire+ack cycles per process")
    ap.add_argument("--rounds", type=int, default=1, help="1p + 8p measurements (median)")
    ap.add_argument("--skip-io", action="store_true", help="only the coordinator numbers")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: temp dir)")
    ap.add_argument(
        "--db-path",
        default=None,
        metavar="URL",
        help="run the cycles on this PostgreSQL database (postgresql://..., no ?schema=)",
    )
    ap.add_argument("--json", type=Path, default=None, metavar="OUT", help="write results as JSON")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from record import Recorder, Row, spread  # sibling scripts; store_io imports torch
    from store_io import bench_publish, bench_read, hardware
    from store_io import rows as io_rows

    rec = Recorder("store_coordinator", argv)

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="fanout-coord-") as d:
        hw = hardware(Path(d))
        hw["sqlite"] = sqlite3.sqlite_version
        hw["coordinator"] = f"SQLite {sqlite3.sqlite_version}"
        if args.db_path:
            if "schema=" in args.db_path:
                ap.error("--db-path: leave out ?schema=; each run gets a new schema")
            hw["coordinator"] = _postgres_version(args.db_path)
        hw["loadavg_before"] = os.getloadavg()
        pub = rd = None
        if not args.skip_io:
            pub = bench_publish(d, args.size_mib * MiB, args.reps)
            rd = bench_read(d, args.size_mib * MiB, args.reps)
        ones, eights = [], []
        for _ in range(args.rounds):
            ones.append(bench_cycles(Path(d), 1, args.cycles, args.db_path))
            eights.append(bench_cycles(Path(d), 8, args.cycles, args.db_path))
        hw["loadavg_after"] = os.getloadavg()
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    one = {
        "cycles_per_s": med(ones, "cycles_per_s"),
        "lock_errors": sum(r["lock_errors"] for r in ones),
    }
    eight = {k: med(eights, k) for k in ("cycles_per_s", "p99_ms", "p50_ms")}
    eight["lock_errors"] = sum(r["lock_errors"] for r in eights)
    result = {
        "publish_vs_raw": None if pub is None else pub["publish_vs_raw"],
        "read_vs_raw": None if rd is None else rd["read_vs_raw"],
        "cycles_per_s_1p": one["cycles_per_s"],
        "cycles_per_s_8p": eight["cycles_per_s"],
        "p99_ms_8p": eight["p99_ms"],
        "lock_errors": one["lock_errors"] + eight["lock_errors"],
        "hardware": hw,
        "sizes": {"window_mib": args.size_mib, "reps": args.reps, "cycles_per_proc": args.cycles,
                  "rounds": args.rounds},
        "detail": {"publish": pub, "read": rd, "cycles_1p": ones, "cycles_8p": eights},
    }  # fmt: skip
    print(f"store + coordinator — {hw['cpu']}, {hw['cpus_usable']} CPUs, {hw['ram_GiB']} GiB, "
          f"fs {hw['filesystem']}, coordinator {hw['coordinator']}, "
          f"load {hw['loadavg_before'][0]:.1f}")  # fmt: skip
    print(f"{'metric':<18}{'value':>12}  goal / sizes")
    rows = [
        ("publish_vs_raw", result["publish_vs_raw"], f">= 0.9, {args.size_mib} MiB window"),
        ("read_vs_raw", result["read_vs_raw"], f">= 0.8, {args.size_mib} MiB window"),
        ("cycles_per_s_1p", one["cycles_per_s"], f"1 proc x {args.cycles} acquire+ack"),
        (
            "cycles_per_s_8p",
            eight["cycles_per_s"],
            f"{'>= 2000, ' if args.db_path is None else ''}8 procs x {args.cycles}",
        ),
        ("p99_ms_8p", eight["p99_ms"], f"p50 {eight['p50_ms']:.2f} ms"),
        ("lock_errors", result["lock_errors"], "0"),
    ]
    for name, v, note in rows:
        shown = "skipped" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)
        print(f"{name:<18}{shown:>12}  {note}")
    db = "sqlite" if args.db_path is None else "postgresql"
    on = f"{hw['coordinator']} in {hw['filesystem']}"
    n = {"n": args.rounds, "n_of": "rounds"}
    goal8 = {"goal": ">= 2,000", "met": eight["cycles_per_s"] >= 2000} if db == "sqlite" else {}
    table = [] if pub is None or rd is None else io_rows(pub, rd, args.reps)
    table += [
        Row(stage="coordinator", name=f"cycles_per_s_1p_{db}",
            what=f"coordinator acquire+ack cycles/s, 1 process ({db})",
            result=one["cycles_per_s"], unit="cycles/s",
            spread=spread([r["cycles_per_s"] for r in ones]), **n,
            conditions=f"{args.cycles} cycles; {on}"),
        Row(stage="coordinator", name=f"cycles_per_s_8p_{db}",
            what=f"coordinator acquire+ack cycles/s, 8 processes ({db})",
            result=eight["cycles_per_s"], unit="cycles/s",
            spread=spread([r["cycles_per_s"] for r in eights]), **n, **goal8,
            conditions=f"8 × {args.cycles} cycles; {on}"),
        Row(stage="coordinator", name=f"p99_ms_8p_{db}",
            what=f"one acquire+ack cycle's p99 latency, 8 processes ({db})",
            result=eight["p99_ms"], unit="ms", spread=spread([r["p99_ms"] for r in eights]), **n,
            conditions=f"p50 {eight['p50_ms']:.2f} ms"),
        Row(stage="coordinator", name=f"lock_errors_{db}",
            what=f"lock errors seen by a caller ({db})", result=result["lock_errors"], **n,
            goal="0", met=result["lock_errors"] == 0, conditions="all rounds, 1p and 8p"),
    ]  # fmt: skip
    plot = {"name": f"cycles-{db}", "stage": "coordinator", "kind": "line",
            "title": f"acquire+ack cycles/s by consumer processes ({hw['coordinator']}), "
            f"median of {args.rounds}", "xlabel": "consumer processes",
            "ylabel": "cycles/s (all processes)",
            "series": {db: [[1, one["cycles_per_s"]], [8, eight["cycles_per_s"]]]}}  # fmt: skip
    rec.write(args.json, table, raw=result, plots=[plot])
    return 0


if __name__ == "__main__":
    sys.exit(main())
