"""Layer sweep: one capture of a layer superset for three trainers vs one run per layer set.

    .venv/bin/python benchmarks/layer_sweep.py --json /tmp/layer_sweep.json   # ~2 min, 2 cores
    .venv/bin/python benchmarks/layer_sweep.py --skip-throughput               # bytes only

Three drafts that differ only in their verifier layers (`--sets`, default [1,4,7],
[2,5] and [1..7] of an 8-layer tiny random Qwen3, H 512, on CPU) train on the same
rows two ways, every role its own process (fanout.bench.bench's harness: `fanout produce`,
`fanout train`, telemetry, validity rules):
- `sweep`: one producer captures the union (`--capture-layer-ids`), three trainers
  each read their own set (`--draft-layer-ids`) from the one stream;
- `separate`: three producer + trainer pairs, each producer capturing one set.
`sweep_speedup_vs_separate` = aggregate trainer rows/s (all three, over the window in
which all three are in their steady state) of `sweep` ÷ that of `separate` (goal
≥ 2.0); `captures_per_window` counts verifier passes per window (1.0 vs 3.0).

Bytes: a third phase captures `--bytes-windows` windows of the union (nothing
evicted) and reads them once per set through `fanout.train.consumer.ConsumerStream`, the
trainers' own reader, page-cache-cold: before each consumer every window file is
dropped from the page cache with `posix_fadvise(POSIX_FADV_DONTNEED)` (checked with
`mincore`: nothing left resident). Afterwards `mincore` says which pages of each
file the read brought in.

On a shared machine other jobs take cores from the roles and the ratio drops (1.6-1.9
while another agent's tests ran here, 2.1-2.2 idle): check the load it prints. The
ratio is bounded by the costs per row: with capture c_p and a trainer c_t it is at most
(3 c_p + 3 c_t) / (c_p + 3 c_t) on saturated cores, so it reaches 2 only while c_p ≥ 3 c_t
(here c_p ≈ 0.15 s and c_t ≈ 0.03 s per row on one core; a real verifier is far
more expensive than its drafts). `bytes_read_fraction` = hidden-state bytes resident ÷ all
hidden-state bytes of the windows, against the consumer's k/n; kernel readahead past
the end of a read range shows up as the excess. `disk_read_bytes` is the process's
`read_bytes` from /proc/self/io over the same read (all tensors, page granular).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import mmap
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))  # window_files (imported where used: it loads torch)
from record import Recorder, Row  # noqa: E402  (a sibling script)

DEFAULT_SETS = "1,4,7 2,5 1,2,3,4,5,6,7"


# --------------------------------------------------------------------------- page cache


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return libc


def resident_bytes(path: Path, ranges: list[tuple[int, int]]) -> list[int]:
    """Bytes of each [start, end) range of `path` that are in the page cache (mincore of a
    fresh read-only shared mapping, which itself reads nothing)."""
    libc, page = _libc(), mmap.PAGESIZE
    size = path.stat().st_size
    npages = (size + page - 1) // page
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            vec = (ctypes.c_ubyte * npages)()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    out = []
    for a, b in ranges:
        n = 0
        for p in range(a // page, (b + page - 1) // page):
            if vec[p] & 1:
                n += min(b, (p + 1) * page) - max(a, p * page)
        out.append(n)
    return out


def drop_cache(path: Path) -> None:
    """Ask the kernel to drop `path`'s clean pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_bytes() -> int | None:
    """Bytes this process caused to be read from storage (/proc/self/io), None if unknown."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


# --------------------------------------------------------------------------- phases


def _bench_config(a: argparse.Namespace, sets: list[list[int]]) -> Any:
    from fanout.bench.config import AssetsSpec, BenchConfig, ConsumerSpec, ProducerSpec

    consumers = [
        ConsumerSpec(
            id=_cid(s),
            block_size=a.block_size,
            max_anchors=a.max_anchors,
            lr=3e-4,
            seed=0,
            rows_per_step=a.rows_per_step,
            extra_args=["--draft-layer-ids", *map(str, s)],
        )
        for s in sets
    ]
    return BenchConfig(
        name="layer-sweep",
        description="one capture of a layer superset vs one run per layer set",
        assets=AssetsSpec(
            cache_dir=str(a.assets),
            demo_conversations=2000,
            demo_train_steps=1,
            conversations=a.conversations,
            verifier_hidden_size=a.hidden,
            verifier_num_layers=a.layers,
            verifier_intermediate_size=4 * a.hidden,
        ),
        producer=ProducerSpec(
            seq_len=a.seq_len,
            window_rows=a.window_rows,
            max_live_windows=4,
            epochs=1,
            capture_batch_rows=4,
            device="cpu",
            workers=1,
            threads=2,
        ),
        consumers=consumers,
        scenarios=["1p3c", "unshared"],
        warmup_steps=3,
        telemetry_interval_s=0.5,
        scenario_timeout_s=a.timeout_s,
        threads_per_role=1,
    )


def _cid(layers: list[int]) -> str:
    return "L" + "-".join(map(str, layers))


def throughput(a: argparse.Namespace, sets: list[list[int]], work: Path) -> dict[str, Any]:
    """The `sweep` and `separate` scenarios; their fanout.bench.metrics numbers."""
    from fanout.bench.bench import execute, plan, resolve_assets
    from fanout.bench.metrics import scenario_metrics
    from fanout.contract import CaptureContract

    cfg = _bench_config(a, sets)
    assets = resolve_assets(cfg.assets, work)
    union = sorted({i for s in sets for i in s})
    by_id = {_cid(s): s for s in sets}
    out: dict[str, Any] = {"assets": {"verifier": str(assets.verifier_dir), "data": assets.data}}
    scenarios: tuple[tuple[Literal["1p3c", "unshared"], str], ...] = (
        ("1p3c", "sweep"),
        ("unshared", "separate"),
    )
    for scenario, label in scenarios:
        run = plan(cfg, scenario, assets, work)
        for role in run.roles:  # the layers each producer captures
            if role.kind == "producer":
                s = union if scenario == "1p3c" else by_id[role.name.removeprefix("producer-")]
                role.cmd += ["--capture-layer-ids", *map(str, s)]
        print(f"layer_sweep: {label} ({len(run.roles)} processes) …", flush=True)
        tel = execute(cfg, run, echo=lambda m: print(m, flush=True))
        m = scenario_metrics(cfg, run, tel)
        if scenario == "unshared":
            # by design the pairs' contracts differ in their layers, and only there
            contracts = [CaptureContract.load(d / "contract.json") for d in run.run_dirs]
            diffs = {f for c in contracts[1:] for f in contracts[0].diff(c)}
            m["reasons"] = [r for r in m["reasons"] if not r.startswith("pairs produced")]
            if not diffs <= {"target_layer_ids"}:
                m["reasons"].append(f"separate runs differ in more than layers: {sorted(diffs)}")
            m["valid"] = not m["reasons"]
        m.pop("telemetry", None)
        for c in m["consumers"].values():
            c.pop("timeline", None)
        out[label] = m
    rs, rp = out["sweep"]["aggregate"]["rows_per_s"], out["separate"]["aggregate"]["rows_per_s"]
    out["sweep_speedup_vs_separate"] = round(rs / rp, 3) if rs and rp else None
    return out


def bytes_read(a: argparse.Namespace, sets: list[list[int]], work: Path) -> dict[str, Any]:
    """Capture windows of the union once, then read them page-cache-cold per layer set."""
    from fanout.bench.bench import resolve_assets
    from fanout.produce.config import ProducerConfig
    from fanout.produce.producer import Producer
    from fanout.store.store import RunDir, Store
    from fanout.store.windowfile import HIDDEN, hidden_name
    from fanout.store.windowreader import WindowReader
    from fanout.train.consumer import ConsumerConfig, ConsumerStream
    from window_files import tensor_byte_range, window_names

    cfg = _bench_config(a, sets)
    assets = resolve_assets(cfg.assets, work)
    union = sorted({i for s in sets for i in s})
    run = work / "bytes" / "run"
    shutil.rmtree(run.parent, ignore_errors=True)
    pcfg = ProducerConfig(
        run_dir=str(run),
        verifier_name_or_path=str(assets.verifier_dir),
        tokenizer=str(assets.tokenizer_dir),
        data=assets.data,
        seq_len=a.seq_len,
        window_rows=a.window_rows,
        capture_layer_ids=union,
        max_windows=a.bytes_windows,
        max_live_windows=10_000,
        expected_consumers=10_000,
        workers=1,
        progress=False,
        exit_when_idle_s=0,
        cache_dir=str(work / "cache"),
        device="cpu",
    )
    Producer(pcfg).run()
    store = Store(RunDir(run))
    files = [store.path(n) for n in window_names(store)]
    ranges: dict[Path, dict[str, tuple[int, int]]] = {}
    for f in files:
        with WindowReader(f, verify=False) as r:
            ranges[f] = {k: tensor_byte_range(f, k) for k in r.names()}
    hidden_total = sum(
        b - a_ for f in files for k, (a_, b) in ranges[f].items() if k.startswith(HIDDEN + ".")
    )
    file_total = sum(f.stat().st_size for f in files)
    out: dict[str, Any] = {
        "windows": len(files),
        "window_bytes": file_total // max(1, len(files)),
        "captured_layers": union,
        "hidden_bytes_per_window": hidden_total // max(1, len(files)),
        "consumers": {},
    }
    for s in sets:
        gc.collect()  # no tensor of an earlier read may keep a window mapped
        for f in files:
            drop_cache(f)
        left = sum(sum(resident_bytes(f, [(0, f.stat().st_size)])) for f in files)
        io0, t0 = read_bytes(), time.perf_counter()
        ccfg = ConsumerConfig(
            run_dir=str(run),
            consumer_id=_cid(s),
            draft_layer_ids=s,
            max_windows=len(files),
            heartbeat_s=1.0,
        )
        rows = 0
        with ConsumerStream(ccfg) as stream:
            for b in stream.batches(a.rows_per_step):
                float(b.tensors["hidden_states"].float().sum())  # use every byte handed out
                rows += len(b.rows)
                stream.ack(b)
            del b
        dt, io1 = time.perf_counter() - t0, read_bytes()
        gc.collect()
        mine = {hidden_name(i) for i in s}
        got_mine = got_other = mine_total = 0
        for f in files:
            names = [k for k in ranges[f] if k.startswith(HIDDEN + ".")]
            res = dict(zip(names, resident_bytes(f, [ranges[f][k] for k in names]), strict=True))
            for k in names:
                size = ranges[f][k][1] - ranges[f][k][0]
                if k in mine:
                    got_mine += res[k]
                    mine_total += size
                else:
                    got_other += res[k]
        k_over_n = len(s) / len(union)
        frac = (got_mine + got_other) / hidden_total
        out["consumers"][_cid(s)] = {
            "layers": s,
            "k": len(s),
            "n": len(union),
            "k_over_n": round(k_over_n, 4),
            "bytes_read_fraction": round(frac, 4),
            "vs_k_over_n": round(frac / k_over_n, 4),
            "own_layers_resident_fraction": round(got_mine / max(1, mine_total), 4),
            "other_layers_resident_bytes": got_other,
            "resident_before_read_bytes": left,
            "disk_read_bytes": None if io0 is None or io1 is None else io1 - io0,
            "disk_read_fraction_of_files": None
            if io0 is None or io1 is None
            else round((io1 - io0) / file_total, 4),
            "rows": rows,
            "read_s": round(dt, 3),
        }
    return out


# --------------------------------------------------------------------------- main


def _table(rep: dict[str, Any]) -> str:
    hw = rep["hardware"]
    lines = [
        f"layer_sweep  {hw['cpu']}  {hw['usable_cpus']} cpus  load {hw['load_avg_1m']}  "
        f"torch {rep['torch']}  python {rep['python']}",
        f"verifier: random Qwen3 H {rep['settings']['hidden']} x {rep['settings']['layers']} "
        f"layers, CPU; T {rep['settings']['seq_len']}, R {rep['settings']['window_rows']}, "
        f"sets {rep['settings']['sets']}",
    ]
    tp = rep.get("throughput")
    if tp:
        lines += ["", f"{'scenario':<9} {'consumer':<16} {'rows/s':>8} {'steps':>6}   valid"]
        for label in ("sweep", "separate"):
            m = tp[label]
            for cid, c in m["consumers"].items():
                lines.append(
                    f"{label:<9} {cid:<16} {c.get('rows_per_s', 0) or 0:>8.2f} {c['steps']:>6}"
                )
            lines.append(
                f"{label:<9} {'aggregate':<16} {m['aggregate']['rows_per_s'] or 0:>8.2f} "
                f"{'':>6}   {m['valid']} {'; '.join(m['reasons'])}  captures/window "
                f"{m['captures_per_window']}"
            )
        lines.append(
            f"sweep_speedup_vs_separate = {rep['sweep_speedup_vs_separate']} (goal >= 2.0)   "
            f"captures_per_window = {rep['captures_per_window']}"
        )
    by = rep.get("bytes")
    if by:
        lines += [
            "",
            f"bytes: {by['windows']} windows of {by['window_bytes'] / 2**20:.2f} MiB "
            f"({by['hidden_bytes_per_window'] / 2**20:.2f} MiB hidden states, "
            f"{len(by['captured_layers'])} layers), page-cache-cold reads",
            f"{'consumer':<16} {'k/n':>6} {'read frac':>9} {'÷ k/n':>6} {'own':>5} "
            f"{'disk MiB':>9} {'s':>6}",
        ]
        for cid, c in by["consumers"].items():
            disk = c["disk_read_bytes"]
            lines.append(
                f"{cid:<16} {c['k_over_n']:>6.3f} {c['bytes_read_fraction']:>9.3f} "
                f"{c['vs_k_over_n']:>6.2f} {c['own_layers_resident_fraction']:>5.2f} "
                f"{'-' if disk is None else f'{disk / 2**20:.2f}':>9} {c['read_s']:>6.2f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--sets",
        default=DEFAULT_SETS,
        help=f"layer sets, space-separated, each comma-separated (default: '{DEFAULT_SETS}')",
    )
    ap.add_argument("--hidden", type=int, default=512, help="random verifier hidden size")
    ap.add_argument("--layers", type=int, default=8, help="random verifier layers")
    ap.add_argument("--conversations", type=int, default=1000, help="conversations of data")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per packed row T")
    ap.add_argument("--window-rows", type=int, default=4, help="rows per window R")
    ap.add_argument("--block-size", type=int, default=8, help="draft block size")
    ap.add_argument("--max-anchors", type=int, default=8, help="anchors per row per step")
    ap.add_argument("--rows-per-step", type=int, default=2, help="rows per optimizer step")
    ap.add_argument("--bytes-windows", type=int, default=8, help="windows of the bytes phase")
    ap.add_argument("--timeout-s", type=float, default=900, help="per scenario (s)")
    ap.add_argument("--assets", default=str(REPO / "runs" / "assets"), help="assets cache")
    ap.add_argument("--out", default=None, help="work dir (default: runs/layer-sweep-<time>)")
    ap.add_argument("--skip-throughput", action="store_true", help="bytes phase only")
    ap.add_argument("--json", default=None, help="write the results here (JSON)")
    a = ap.parse_args(argv)
    import torch

    from fanout.bench.report import hardware

    rec = Recorder("layer_sweep", argv)
    sets = [[int(x) for x in s.split(",")] for s in a.sets.split()]
    work = Path(a.out or REPO / "runs" / f"layer-sweep-{time.strftime('%Y%m%d-%H%M%S')}")
    work.mkdir(parents=True, exist_ok=True)
    rep: dict[str, Any] = {
        "hardware": hardware(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "settings": {k: v for k, v in vars(a).items() if k not in ("json", "out")} | {"sets": sets},
    }
    if not a.skip_throughput:
        rep["throughput"] = throughput(a, sets, work)
        rep["sweep_speedup_vs_separate"] = rep["throughput"]["sweep_speedup_vs_separate"]
        rep["captures_per_window"] = rep["throughput"]["sweep"]["captures_per_window"]
        rep["captures_per_window_separate"] = rep["throughput"]["separate"]["captures_per_window"]
        rep["valid"] = (
            rep["throughput"]["sweep"]["valid"] and rep["throughput"]["separate"]["valid"]
        )
    rep["bytes"] = bytes_read(a, sets, work)
    rep["bytes_read_fraction"] = {
        cid: c["bytes_read_fraction"] for cid, c in rep["bytes"]["consumers"].items()
    }
    rep["k_over_n"] = {cid: c["k_over_n"] for cid, c in rep["bytes"]["consumers"].items()}
    rep["hardware"]["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    print(_table(rep))
    rec.write(a.json, record_rows(rep), raw=rep)
    return 0 if rep.get("valid", True) else 1


def record_rows(rep: dict[str, Any]) -> list[Row]:
    """The record's rows (benchmarks/record.py): the sweep's speed-up and the bytes each
    consumer reads against its share of the layers."""
    st = rep["settings"]
    size = (f"verifier h {st['hidden']} × {st['layers']} layers, CPU; T {st['seq_len']}, R "
            f"{st['window_rows']}; layer sets {st['sets']}")  # fmt: skip
    out = []
    if "sweep_speedup_vs_separate" in rep:
        s = rep["sweep_speedup_vs_separate"]
        out.append(Row(stage="fan-out", name="sweep_speedup_vs_separate",
                       what="layer sweep: one capture of the union for 3 trainers vs 3 runs "
                       "(aggregate rows/s)", result=s, unit="×", goal=">= 2.0",
                       met=s is not None and s >= 2.0,
                       conditions=f"{size}; captures/window {rep['captures_per_window']} vs "
                       f"{rep['captures_per_window_separate']}; "
                       f"{'valid' if rep['valid'] else 'INVALID'}"))  # fmt: skip
    for cid, c in rep["bytes"]["consumers"].items():
        out.append(Row(stage="fan-out", name=f"bytes_read_fraction.{cid}",
                       what=f"layer sweep: hidden-state bytes read ÷ captured, {cid}",
                       result=c["bytes_read_fraction"], goal=f"≈ k/n = {c['k_over_n']:.3f}",
                       n=rep["bytes"]["windows"], n_of="windows",
                       conditions=f"{size}; page-cache-cold reads"))  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
