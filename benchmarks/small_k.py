"""A slow trainer at a small K: how much of its time it waits for windows, before and after #47.

    .venv/bin/python benchmarks/small_k.py --json benchmarks/results/small_k.json
    .venv/bin/python benchmarks/small_k.py --ks 2 3 --repeats 5 --capture-s 0.1 --step-s 0.3

Run from the repository root; ≈ 2 minutes at the defaults. One run, both rules:
- a producer (a thread) claims, "captures" (sleeps `--capture-s`, standing in for the
  verifier) and publishes real window files through the real coordinator (SQLite)
  and store, at `--max-live-windows` K;
- one trainer (the main thread) reads the stream as fanout.train.consumer does: it
  holds the window it trains on while a prefetch (its own thread and connection)
  acquires the next one, "trains" (sleeps `--step-s`, slower than a capture) and
  acks after the step;
- `after`: the coordinator as it is (the last of the K slots takes the slowest
  consumer's next needed window, fanout.coord.retention.reserved_window); `before`:
  the same run with the rule before issue #47 put back (the slot only for the
  slowest consumer's cursor window queued on demand), the baseline in the same run.

Per K and rule: the trainer's wait as a share of its time, its wait per window in
captures (goal at K = 2: at most one capture per window), and the whole run's time.
Medians over `--repeats` runs (min–max beside them), rules alternating per repeat so a
drifting load hits both. Sleeps stand in for work, so on a loaded machine the figures
move only by scheduling delay; the load average is recorded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from fanout.contract import CaptureContract
from fanout.coord import retention
from fanout.coord.coordinator import Coordinator, RunConfig
from fanout.coord.schema import Sql
from fanout.coord.states import W
from fanout.store.store import RunDir, Store, WindowMeta

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from record import Recorder, Row, spread  # noqa: E402 (benchmarks/ on the path first)


def _before_47(cur: Sql) -> int | None:
    """The reserved window before issue #47: only the slowest consumer's cursor window,
    and only when it was queued on demand (evicted before it read it)."""
    low, _ = retention.cursor_bounds(cur)
    if low is None:
        return None
    row = cur.execute(
        "SELECT window FROM windows WHERE state=? AND demand=1 AND window=?",
        (W.QUEUED.value, low),
    ).fetchone()
    return None if row is None else int(row[0])


@contextmanager
def rule(name: str) -> Iterator[None]:
    """Run with the reserved-slot rule `name` ("after": as it is; "before": pre-#47)."""
    if name == "after":
        yield
        return
    now: Callable[[Sql], int | None] = retention.reserved_window
    setattr(retention, "reserved_window", _before_47)  # noqa: B010 (a module's function)
    try:
        yield
    finally:
        setattr(retention, "reserved_window", now)  # noqa: B010


def _contract() -> CaptureContract:
    return CaptureContract(
        verifier_config_hash="c", verifier_weights_fingerprint="w", verifier_num_layers=2,
        hidden_size=4, vocab_size=8, target_layer_ids=(0,), dataset_fingerprint="d",
        tokenizer_fingerprint="t", seq_len=4, window_rows=2, shuffle_seed=0,
    )  # fmt: skip


def _produce(root: Path, c: CaptureContract, capture_s: float, stop: threading.Event) -> None:
    with Coordinator.open(root) as co:
        store = Store(RunDir(root))
        p = co.register_producer(c)
        while not stop.is_set():
            if not co.wait_for_capacity(p, timeout_s=0.2):
                continue
            cl = co.claim(p)
            if cl is None:
                break  # the finite stream is made
            time.sleep(capture_s)  # the verifier's forward
            t = torch.zeros(2, 4, dtype=torch.int32)
            meta = WindowMeta(c.stream_id, cl.window, cl.generation, 0, *cl.rows)
            co.publish_ready(cl, store.publish({"input_ids": t}, meta))
        co.finish_producer(p, stream_end=None if stop.is_set() else co.config.total_windows)


def one_run(k: int, windows: int, capture_s: float, step_s: float) -> dict[str, float]:
    """One producer and one prefetching trainer over `windows` windows at K = k."""
    with tempfile.TemporaryDirectory(prefix="fanout-small-k-") as tmp:
        rd = RunDir(Path(tmp) / "run").create()
        c = _contract()
        Coordinator.create(rd.root, c, RunConfig(max_live_windows=k, total_windows=windows)).close()
        stop = threading.Event()
        prod = threading.Thread(target=_produce, args=(rd.root, c, capture_s, stop), daemon=True)
        local = threading.local()

        def acquire(w: int) -> Any:
            co = getattr(local, "co", None)
            if co is None:
                co = local.co = Coordinator.open(rd.root)
            return co.acquire(reg, timeout_s=120, window=w)

        with Coordinator.open(rd.root) as co, ThreadPoolExecutor(1) as pool:
            reg = co.register_consumer("slow")
            prod.start()
            t0 = time.monotonic()
            wait = 0.0
            w0 = time.monotonic()
            lease = co.acquire(reg, timeout_s=120)
            wait += time.monotonic() - w0
            while lease is not None:
                ahead = pool.submit(acquire, lease.window + 1)  # the prefetch
                time.sleep(step_s)  # forward, backward, optimizer step
                co.ack(lease)
                w0 = time.monotonic()
                lease = ahead.result()
                wait += time.monotonic() - w0
            total = time.monotonic() - t0
            stop.set()
            pool.submit(lambda: getattr(local, "co", None) and local.co.close()).result()
        prod.join(30)
    return {"wait_share": wait / total, "wait_per_window_captures": wait / windows / capture_s,
            "total_s": total}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument("--capture-s", type=float, default=0.2, help="one window's capture")
    ap.add_argument("--step-s", type=float, default=0.4, help="one window's training")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the record here")
    args = ap.parse_args(argv)
    rec = Recorder("small_k", argv)
    runs: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.repeats):
        for k in args.ks:
            for name in ("before", "after"):
                with rule(name):
                    got = one_run(k, args.windows, args.capture_s, args.step_s)
                runs.setdefault(f"{name}/{k}", []).append(got)
    rows: list[Row] = []
    cond = (f"{args.windows} windows, capture {args.capture_s:g} s, step {args.step_s:g} s "
            "(sleeps), 1 prefetching trainer, SQLite")  # fmt: skip
    print(f"{'K':>3} {'rule':>7} {'wait %':>8} {'wait/window (captures)':>24} {'run s':>7}")
    for k in args.ks:
        for name in ("before", "after"):
            rs = runs[f"{name}/{k}"]
            share = [r["wait_share"] * 100 for r in rs]
            per = [r["wait_per_window_captures"] for r in rs]
            tot = [r["total_s"] for r in rs]
            print(f"{k:>3} {name:>7} {statistics.median(share):>8.1f} "
                  f"{statistics.median(per):>24.2f} {statistics.median(tot):>7.2f}")  # fmt: skip
            goal = "<= 1" if (k == 2 and name == "after") else None
            rows.append(Row(
                stage="coordinator", name=f"wait_per_window_k{k}_{name}",
                what=f"a slow trainer's wait per window at K = {k}, {name} issue #47",
                result=round(statistics.median(per), 3), unit="captures",
                spread=spread(per), n=len(per), goal=goal,
                met=None if goal is None else statistics.median(per) <= 1, conditions=cond,
            ))  # fmt: skip
            rows.append(Row(
                stage="coordinator", name=f"wait_share_k{k}_{name}",
                what=f"a slow trainer's time spent waiting at K = {k}, {name} issue #47",
                result=round(statistics.median(share), 2), unit="%", spread=spread(share),
                n=len(share), conditions=cond,
            ))  # fmt: skip
    rec.write(args.json, rows, raw={"runs": runs, "args": vars(args)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
