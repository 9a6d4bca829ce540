"""Do the demo's drafts accelerate real decoding? τ vs train-time EAL, speedup vs greedy.

    .venv/bin/python benchmarks/eval.py                         # reuse runs/demo or train it
    .venv/bin/python benchmarks/eval.py --minutes 2 --retrain --json /tmp/eval.json
    .venv/bin/python benchmarks/eval.py --device cuda --dtype bfloat16   # on a GPU box

Reuses the three drafts (block sizes 4 / 8 / 16) of the last `fanout demo` under
`--demo-dir` when they exist, otherwise trains them with `fanout demo --minutes`.
Then runs `fanout eval` on `--num-prompts` generated conversations that are not in the
demo's training corpus and prints, per draft: the acceptance length τ (tokens per
verifier forward), the checkpoint's train-time EAL, acceptance per block position,
verifier forwards saved and the wall-clock speedup over plain greedy decoding measured
in the same run. Keys of `--json`: `lossless`, `drafts.<name>.acceptance_length`,
`.train_eal`, `.speedup_vs_greedy`, `.per_position_acceptance` (as `fanout eval`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from fanout.bench.bench import resolve_assets
from fanout.bench.demo import demo_config, heldout_prompts
from fanout.train.eval import EvalConfig, evaluate, table

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--demo-dir", default=str(REPO / "runs" / "demo"), help="fanout demo dir")
    ap.add_argument("--minutes", type=float, default=2.0, help="demo training time if trained")
    ap.add_argument("--retrain", action="store_true", help="train new drafts even if present")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--json", default=None, help="write results as JSON to this path")
    a = ap.parse_args()

    root = Path(a.demo_dir)
    cfg = demo_config(root, a.minutes)
    out = root / "last"
    drafts = [out / "1p3c" / "drafts" / c.id for c in cfg.consumers]
    reused = not a.retrain and all(any(d.glob("checkpoint-*/COMMITTED")) for d in drafts)
    if not reused:
        cmd = [sys.executable, "-m", "fanout.cli", "demo", "--minutes", str(a.minutes)]
        subprocess.run([*cmd, "--run-dir", str(root)], check=True)
    assets = resolve_assets(cfg.assets, out)
    held = heldout_prompts(assets.data, out / "heldout-bench.jsonl", n=a.num_prompts)
    ecfg = EvalConfig(
        verifier_name_or_path=str(assets.verifier_dir),
        tokenizer=str(assets.tokenizer_dir),
        data=str(held),
        draft=[str(d) for d in drafts],
        num_prompts=a.num_prompts,
        max_new_tokens=a.max_new_tokens,
        device=a.device,
        dtype=a.dtype,
    )
    rep = evaluate(ecfg)
    rep["drafts_reused"] = reused
    rep["threads"] = torch.get_num_threads()
    rep["cpus"] = os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rep["load_avg_1m"] = load
    print(
        f"hardware: {rep['hardware']}, {os.cpu_count()} CPUs, load {load}, torch "
        f"{torch.__version__}; verifier {assets.verifier_dir.name} (demo's tiny Qwen3), "
        f"{rep['prompts']} held-out prompts, {a.max_new_tokens} new tokens, {a.dtype}; "
        f"drafts {'reused' if reused else 'trained'} from {out}"
    )
    print("\n".join(table(rep)))
    if a.json:
        Path(a.json).write_text(json.dumps(rep, indent=2) + "\n")


if __name__ == "__main__":
    main()
