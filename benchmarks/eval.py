"""Do the demo's drafts accelerate real decoding? τ vs train-time EAL, speedup vs greedy.

    .venv/bin/python benchmarks/eval.py                         # reuse runs/demo or train it
    .venv/bin/python benchmarks/eval.py --minutes 2 --retrain --json /tmp/eval.json
    .venv/bin/python benchmarks/eval.py --device cuda --dtype bfloat16   # on a GPU box
    .venv/bin/python benchmarks/eval.py --temperature 0 1 --json /tmp/eval.json  # τ at T=0, 1
    .venv/bin/python benchmarks/eval.py --max-new-tokens 256 --compare-uncached  # draft cache

Reuses the three drafts (block sizes 4 / 8 / 16) of the last `fanout demo` under
`--demo-dir` when they exist, otherwise trains them with `fanout demo --minutes`.
Then runs `fanout eval` on `--num-prompts` generated conversations that are not in the
demo's training corpus and prints, per draft: the acceptance length τ (tokens per
verifier forward), the checkpoint's train-time EAL, acceptance per block position,
verifier forwards saved and the wall-clock speedup over plain greedy decoding measured
in the same run, at every `--temperature` (T = 0 always). Keys of `--json`: `lossless`,
`drafts.<name>.acceptance_length`, `.train_eal`, `.speedup_vs_greedy`,
`.per_position_acceptance`, `.at_temperature["<T>"]` (as `fanout eval`).

`--compare-uncached` also times the eval itself (`EvalSession.run`, models loaded and
warmed) with the draft's context k/v cached (`fanout.model.draft_cache`) against the
uncached reference loop, in `--rounds` interleaved rounds (A B B A …, so that drifting
load hits both), checks both give the same tokens and τ, and prints the wall-time ratio
(`eval_wall_s.cached`, `.uncached`, `.ratio` in `--json`).
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
from fanout.train.eval import EvalConfig, EvalSession, evaluate, load_drafts, table

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
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0], metavar="T")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare-uncached", action="store_true", help="time the draft cache")
    ap.add_argument(
        "--ignore-eos", action="store_true", help="decode all --max-new-tokens (timing)"
    )
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per loop")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, help="write results as JSON to this path")
    a = ap.parse_args()
    if a.threads:  # on a loaded shared CPU, 1 thread avoids stalls between threads
        torch.set_num_threads(a.threads)

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
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.seed,
        eos_token_id=[-1] if a.ignore_eos else None,  # no token is -1: never stops early
    )
    rep = compare_loops(ecfg, a.rounds) if a.compare_uncached else evaluate(ecfg)
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
    if "eval_wall_s" in rep:
        w = rep["eval_wall_s"]
        print(
            f"eval wall time ({a.rounds} interleaved rounds each, models loaded and warm): "
            f"cached {w['cached']:.1f} s, uncached {w['uncached']:.1f} s, ratio "
            f"{w['ratio']:.2f}×; same tokens and τ: {w['same_outputs']}"
        )
        for p, ms in w["draft_block_ms"].items():
            print(
                f"  one draft block at context {p:>5}: cached {ms['cached']:.2f} ms, "
                f"uncached {ms['uncached']:.2f} ms ({ms['ratio']:.2f}×)"
            )
    if a.json:
        Path(a.json).write_text(json.dumps(rep, indent=2) + "\n")


def compare_loops(ecfg: EvalConfig, rounds: int) -> dict:
    """The eval's own wall time with and without the draft cache, interleaved."""
    import time

    _, drafts, eals = load_drafts(ecfg)
    layers = sorted({i for d in drafts.values() for i in d.cfg.target_layer_ids})
    session = EvalSession(ecfg, layers)
    session.warm(drafts)
    secs = {True: 0.0, False: 0.0}
    reps: dict[bool, dict] = {}
    order = [c for r in range(rounds) for c in ((True, False) if r % 2 == 0 else (False, True))]
    for i, cached in enumerate(order):
        session.cfg = ecfg.model_copy(update={"cache_draft": cached})
        if i == 1:
            session.warm(drafts)  # the uncached loop's own first calls, untimed
        t0 = time.perf_counter()
        reps[cached] = session.run(drafts, eals)
        secs[cached] += time.perf_counter() - t0
    same = reps[True]["prompt_records"] == reps[False]["prompt_records"]
    draft = next(iter(drafts.values()))
    step_ms = draft_step_ms(draft, session.verifier.model.config.hidden_size)
    rep = reps[True]
    rep["eval_wall_s"] = {
        "cached": round(secs[True], 2),
        "uncached": round(secs[False], 2),
        "ratio": round(secs[False] / max(secs[True], 1e-9), 3),
        "same_outputs": same,
        "rounds": rounds,
        "draft_block_ms": step_ms,
    }
    return rep


def draft_step_ms(draft, hidden: int, lengths=(64, 320, 1024, 4096), reps: int = 10) -> dict:
    """One draft block (propose logits) at context length p, cached vs uncached: median
    ms of `reps` calls each, the two alternating call by call (load hits both alike)."""
    import statistics
    import time

    from fanout.model.draft_cache import DraftCache, DraftContext, UncachedDraft

    out = {}
    width = len(draft.cfg.target_layer_ids) * hidden
    for p in lengths:
        ctx = torch.randn(p, width, dtype=draft.fc.weight.dtype, device=draft.fc.weight.device)
        seq = [1] * (p + 1)
        modes: dict[str, DraftContext] = {
            "cached": DraftCache(draft),
            "uncached": UncachedDraft(draft),
        }
        times: dict[str, list[float]] = {name: [] for name in modes}
        for c in modes.values():
            c.extend(ctx)
            c.logits(seq)  # first call untimed
        for _ in range(reps):
            for name, c in modes.items():
                t0 = time.perf_counter()
                c.logits(seq)
                times[name].append(time.perf_counter() - t0)
        ms = {name: round(1e3 * statistics.median(t), 3) for name, t in times.items()}
        ms["ratio"] = round(ms["uncached"] / max(ms["cached"], 1e-9), 2)
        out[str(p)] = ms
    return out


if __name__ == "__main__":
    main()
