"""Does fp8 window storage change what a draft learns? bf16 vs fp8 windows, same everything.

    .venv/bin/python benchmarks/storage_dtype.py                       # demo's tiny Qwen3, CPU
    .venv/bin/python benchmarks/storage_dtype.py --verifier /models/Qwen3-8B \
        --tokenizer /models/Qwen3-8B --data chats.jsonl --capture-layer-ids 1 9 17 25 33 \
        --seq-len 2048 --windows 200 --steps 2000 --device cuda --json /tmp/fp8.json

For each storage dtype: one producer captures the same `--windows` windows, then one
draft trains `--steps` steps on them with the same seed. Printed per dtype: bytes per
token on disk, and the draft's mean loss and EAL over the last quarter of its steps.
`eal_fp8_vs_bf16` = fp8 EAL ÷ bf16 EAL (1.0 = no loss of acceptance). Defaults use
the demo's self-made assets (a briefly trained tiny Qwen3), so no downloads.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from fanout.bench.assets import ensure_demo_assets
from fanout.produce.config import ProducerConfig
from fanout.produce.producer import Producer
from fanout.train.config import TrainConfig
from fanout.train.trainer import Trainer
from fanout.train.trainlog import read_train_log

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from record import Recorder, Row  # noqa: E402  (a sibling script)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--verifier", default=None, help="verifier dir (default: demo assets)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir (default: demo assets)")
    ap.add_argument("--data", nargs="+", default=None, help="chat files (default: demo assets)")
    # --target-layer-ids: the older name, as `fanout produce` still accepts it
    ap.add_argument(
        "--capture-layer-ids", "--target-layer-ids", type=int, nargs="+", default=[1, 3, 4]
    )
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per packed row T")
    ap.add_argument("--window-rows", type=int, default=8, help="rows per window R")
    ap.add_argument("--windows", type=int, default=100, help="windows captured per dtype")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per draft")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--rows-per-step", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--device", default="cpu", help="verifier and trainer device")
    ap.add_argument("--json", default=None, help="write results as JSON to this path")
    a = ap.parse_args()
    rec = Recorder("storage_dtype")
    mask_token_id = None
    if a.verifier is None:
        demo = ensure_demo_assets(REPO / "runs" / "assets")
        a.verifier, a.tokenizer = str(demo.verifier_dir), str(demo.tokenizer_dir)
        a.data, mask_token_id = [str(demo.data_path)], demo.mask_token_id
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for storage in ("bfloat16", "float8_e4m3fn"):
            run = Path(tmp) / storage
            summary = Producer(
                ProducerConfig(
                    run_dir=str(run),
                    verifier_name_or_path=a.verifier,
                    data=a.data,
                    tokenizer=a.tokenizer,
                    seq_len=a.seq_len,
                    window_rows=a.window_rows,
                    max_live_windows=a.windows + 1,
                    expected_consumers=1000,  # keep every window: the draft reads them after
                    capture_layer_ids=a.capture_layer_ids,
                    storage_dtype=storage,
                    max_windows=a.windows,
                    device=a.device,
                    cache_dir=os.path.join(tmp, "cache"),
                    progress=False,
                    exit_when_idle_s=0,
                )
            ).run()
            cfg = TrainConfig(
                run_dir=str(run),
                consumer_id="draft",
                verifier_name_or_path=a.verifier,
                num_layers=1,
                block_size=a.block_size,
                max_anchors=64,
                rows_per_step=a.rows_per_step,
                max_steps=a.steps,
                save_path=str(Path(tmp) / f"draft-{storage}"),
                lr=a.lr,
                mask_token_id=mask_token_id,
                checkpoint_every=10**9,
                device=a.device,
            )
            Trainer(cfg).run()
            log = read_train_log(cfg.save_path)
            tail = log[-max(1, len(log) // 4) :]
            results[storage] = {
                "bytes_per_token": summary["bytes"] / max(1, summary["rows"] * a.seq_len),
                "loss": sum(r["loss"] for r in tail) / len(tail),
                "eal": sum(r["eal"] for r in tail) / len(tail),
            }
    dev = torch.device(a.device)
    hw = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.machine()
    out: dict[str, Any] = {
        "hardware": f"{dev.type}: {hw}, {os.cpu_count()} CPUs",
        "sizes": {k: getattr(a, k) for k in ("seq_len", "window_rows", "windows", "steps")}
        | {"capture_layer_ids": a.capture_layer_ids, "verifier": a.verifier},
        "results": results,
        "eal_fp8_vs_bf16": results["float8_e4m3fn"]["eal"] / results["bfloat16"]["eal"],
        "bytes_fp8_vs_bf16": results["float8_e4m3fn"]["bytes_per_token"]
        / results["bfloat16"]["bytes_per_token"],
    }
    print(f"hardware: {out['hardware']}, torch {torch.__version__}")
    print(f"sizes:    {out['sizes']}")
    print(f"{'storage':<16}{'bytes/token':>12}{'loss (last 1/4)':>17}{'EAL (last 1/4)':>16}")
    for k, r in results.items():
        print(f"{k:<16}{r['bytes_per_token']:>12.1f}{r['loss']:>17.4f}{r['eal']:>16.3f}")
    print(
        f"eal_fp8_vs_bf16 = {out['eal_fp8_vs_bf16']:.3f}, "
        f"bytes_fp8_vs_bf16 = {out['bytes_fp8_vs_bf16']:.3f}"
    )
    size = (f"{'demo verifier' if mask_token_id is not None else a.verifier}, "
            f"{a.device}; layers {a.capture_layer_ids}, T {a.seq_len}, R {a.window_rows}, "
            f"{a.windows} windows, {a.steps} steps, block {a.block_size}; last quarter of steps")  # fmt: skip
    rec.write(a.json, [
        Row(stage="store", name="eal_fp8_vs_bf16",
            what="fp8 vs bf16 window storage: the draft's EAL", result=out["eal_fp8_vs_bf16"],
            unit="×", goal="≈ 1.0", conditions=f"{size}; EAL "
            f"{results['float8_e4m3fn']['eal']:.3f} vs {results['bfloat16']['eal']:.3f}"),
        Row(stage="store", name="bytes_fp8_vs_bf16",
            what="fp8 vs bf16 window storage: bytes per token", result=out["bytes_fp8_vs_bf16"],
            unit="×", conditions=size),
    ], raw=out)  # fmt: skip


if __name__ == "__main__":
    main()
