"""On-policy vs off-policy drafts on the demo's assets: τ, τ / train EAL, regeneration speed.

    .venv/bin/python benchmarks/onpolicy.py                        # defaults: 1 min per draft
    .venv/bin/python benchmarks/onpolicy.py --minutes 2 --steps 300 --json /tmp/onpolicy.json

What it does, all in one run (same machine, same load for both sides):
1. the demo's tiny trained Qwen3 verifier, tokenizer and corpus (fanout.bench.assets,
   cached under --work/assets); the first --conversations conversations are the corpus;
2. regeneration speed: `--engine hf` batched (`--regen-batch-size`, bucketed by prompt
   length, KV cache) vs the same model's HF `generate` one prompt at a time, greedy, on
   --speed-prompts prompts: `regen_tokens_per_s`, `regen_speedup_vs_sequential`;
3. `fanout regenerate` of the corpus (greedy, --turns all), timed;
4. time to the first published window: `fanout produce --regenerate` (regenerates chunk
   by chunk, --regen-chunk-records, and publishes window 0 after the first chunk) vs
   `fanout regenerate` then `fanout produce` on its output (`streaming_first_window_s`,
   `regenerate_then_produce_first_window_s`); `--first-window-only` runs 1, 3 and 4;
5. the same b8 draft (block 8, same seed, lr, anchors) trained for --steps steps (or
   --minutes, whichever ends first) by a 1-producer/1-trainer run on (a) the original
   corpus and (b) its regeneration, then `fanout eval` of both on --num-prompts held-out
   prompts whose conversations appear in neither (fanout.bench.demo.heldout_prompts).

Keys of --json: `tau.offpolicy`, `tau.onpolicy`, `tau_gain` (on / off; goal ≥ 1.15),
`tau_over_train_eal.offpolicy`, `.onpolicy` (goal ≥ 0.95), `train_eal.*`, `steps.*`,
`regen_tokens_per_s` (batched; `.sequential` beside it), `regen_speedup_vs_sequential`
(goal ≥ 3), `regenerate_s`, `streaming_first_window_s`,
`regenerate_then_produce_first_window_s`, and the hardware, load and sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fanout.bench.assets import ensure_demo_assets, write_jsonl
from fanout.bench.bench import run_bench
from fanout.bench.config import AssetsSpec, BenchConfig, ConsumerSpec, ProducerSpec
from fanout.bench.demo import heldout_prompts
from fanout.data.chat import load_conversations
from fanout.decode.config import EvalConfig
from fanout.decode.eval import evaluate
from fanout.regen.engine import RegenOptions, Request
from fanout.regen.hf import HFEngine
from fanout.regen.regenerate import RegenerateConfig, regenerate
from fanout.train.trainlog import read_train_log

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from record import Recorder, Row  # noqa: E402  (a sibling script)


def speed(assets: Any, corpus: Path, n: int, max_new: int, batch: int) -> dict[str, float]:
    """Tokens/s of the batched hf engine vs HF `generate` one prompt at a time (greedy)."""
    opts = RegenOptions(max_new_tokens=max_new, regen_batch_size=batch)
    engine = HFEngine.load(str(assets.verifier_dir), str(assets.tokenizer_dir), opts, device="cpu")
    convs = load_conversations(corpus)[:n]
    reqs = []
    for k, c in enumerate(convs):
        m = next(i for i, x in enumerate(c.messages) if x["role"] == "assistant")
        reqs.append(Request((k, m), c.messages[:m], None, 0))
    engine.generate(reqs[:2])  # warm-up
    t0 = time.perf_counter()
    batched = sum(a.answer_tokens for a in engine.generate(reqs))
    t_batched = time.perf_counter() - t0
    t0, seq = time.perf_counter(), 0
    with torch.inference_mode():
        for r in reqs:
            ids = torch.tensor([engine.render(r)])
            out = engine.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                do_sample=False, pad_token_id=engine.pad, eos_token_id=engine.eos,
            )  # fmt: skip
            new = out[0, ids.shape[1] :].tolist()
            seq += next((j for j, t in enumerate(new) if t in engine.eos), len(new))
    t_seq = time.perf_counter() - t0
    return {
        "batched": batched / t_batched,
        "sequential": seq / t_seq,
        "batched_tokens": batched,
        "sequential_tokens": seq,
    }


def first_window_s(argv: list[str], run_dir: Path) -> float:
    """Seconds from launching `fanout produce ...` until its first window is published."""
    # The same intra-op threads as this process's own measurements: on a loaded 2-core
    # machine a second OpenMP thread alone makes generation ~3× slower.
    env = os.environ | {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "fanout.cli", "produce", "--run-dir", str(run_dir), *argv,
         "--max-windows", "1", "--no-progress", "--exit-when-idle-s", "0"],
        capture_output=True, text=True, timeout=1800, env=env,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"fanout produce failed:\n{proc.stderr[-3000:]}")
    return time.monotonic() - t0


def train_and_eval(name: str, data: Path, assets: Any, a: argparse.Namespace, held: Path) -> dict:
    work = Path(a.work) / name
    cfg = BenchConfig(
        name=f"onpolicy-{name}",
        assets=AssetsSpec(
            cache_dir=str(Path(a.work) / "assets"),
            verifier_dir=str(assets.verifier_dir),
            tokenizer_dir=str(assets.tokenizer_dir),
            data=[str(data)],
        ),
        producer=ProducerSpec(
            seq_len=256, window_rows=4, max_live_windows=4, epochs=50, num_draft_layers=1
        ),
        consumers=[
            ConsumerSpec(
                id="b8",
                block_size=8,
                max_anchors=16,
                lr=2e-3,
                seed=0,
                max_steps=a.steps,
            )
        ],
        scenarios=["1p1c"],
        scenario_timeout_s=a.minutes * 60 + 600,
    )
    rep = run_bench(cfg, work, stop_after_s=a.minutes * 60, echo=lambda s: None)
    steps = len(read_train_log(work / "1p1c" / "drafts" / "b8"))
    ev = evaluate(
        EvalConfig(
            verifier_name_or_path=str(assets.verifier_dir),
            tokenizer=str(assets.tokenizer_dir),
            data=str(held),
            draft=[str(work / "1p1c" / "drafts" / "b8")],
            num_prompts=a.num_prompts,
            max_new_tokens=a.max_new_tokens,
        ),
        echo=lambda s: None,
    )
    (d,) = ev["drafts"].values()
    return {"tau": d["acceptance_length"], "train_eal": d["train_eal"], "steps": steps,
            "valid": rep["valid"]}  # fmt: skip


def print_table(res: dict, a: argparse.Namespace, off: dict, on: dict, sp: dict, rsum: dict,
                load0: float) -> None:  # fmt: skip
    """The table: hardware and sizes, then τ, train EAL, their ratio, regeneration speed."""
    ratio, regen_s = res["tau_over_train_eal"], res["regenerate_s"]
    print(f"hardware: {res['hardware']}, load {load0:.1f} → {os.getloadavg()[0]:.1f}, torch "
          f"{torch.__version__}; demo verifier; {a.conversations} conversations, b8 draft, "
          f"{a.steps} steps (≤ {a.minutes} min), {a.num_prompts} held-out prompts × "
          f"{a.max_new_tokens} tokens")  # fmt: skip
    print(f"{'':<22} {'off-policy':>11} {'on-policy':>11}")
    print(f"{'steps trained':<22} {off['steps']:>11} {on['steps']:>11}")
    print(
        f"{'τ (served)':<22} {off['tau']:>11.3f} {on['tau']:>11.3f}   gain {res['tau_gain']:.3f} (≥ 1.15)"
    )
    print(f"{'train EAL':<22} {off['train_eal'] or 0:>11.3f} {on['train_eal'] or 0:>11.3f}")
    r0, r1 = ratio["offpolicy"] or 0, ratio["onpolicy"] or 0
    print(f"{'τ / train EAL':<22} {r0:>11.3f} {r1:>11.3f}   (≥ 0.95)")
    print(f"regeneration: batched {sp['batched']:.0f} tok/s vs one at a time {sp['sequential']:.0f} "
          f"tok/s = {res['regen_speedup_vs_sequential']:.2f}× (≥ 3); corpus in {regen_s:.1f} s "
          f"({rsum['kept']}/{rsum['records']} kept)")  # fmt: skip
    if "streaming_first_window_s" in res:
        print(f"first window: produce --regenerate {res['streaming_first_window_s']:.1f} s vs "
              f"regenerate then produce {res['regenerate_then_produce_first_window_s']:.1f} s")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default=str(REPO / "runs" / "onpolicy"), help="working directory")
    ap.add_argument("--minutes", type=float, default=1.0, help="training time cap per draft")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps per draft")
    ap.add_argument("--conversations", type=int, default=400, help="corpus size")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="answers and eval")
    ap.add_argument("--num-prompts", type=int, default=8, help="held-out eval prompts")
    ap.add_argument("--speed-prompts", type=int, default=32)
    ap.add_argument("--regen-batch-size", type=int, default=16)
    ap.add_argument("--skip-first-window", action="store_true", help="skip step 4")
    ap.add_argument("--first-window-only", action="store_true", help="only steps 1, 3, 4")
    ap.add_argument("--regen-chunk-records", type=int, default=64, help="step 4's chunk")
    ap.add_argument("--json", default=None, metavar="OUT")
    a = ap.parse_args()
    rec = Recorder("onpolicy")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    work = Path(a.work)
    assets = ensure_demo_assets(work / "assets")
    lines = [x for x in assets.data_path.read_text().splitlines() if x.strip()][: a.conversations]
    corpus = write_jsonl(work / "corpus.jsonl", [json.loads(x) for x in lines])
    held = heldout_prompts([str(assets.data_path)], work / "heldout.jsonl", n=a.num_prompts)
    load0 = os.getloadavg()[0]

    sp = (
        {}
        if a.first_window_only
        else speed(assets, corpus, a.speed_prompts, a.max_new_tokens, a.regen_batch_size)
    )
    regen_out = work / "regen"
    if regen_out.exists():
        import shutil

        shutil.rmtree(regen_out)
    rcfg = RegenerateConfig(
        verifier_name_or_path=str(assets.verifier_dir), tokenizer=str(assets.tokenizer_dir),
        data=[str(corpus)], out=str(regen_out), device="cpu", turns="all",
        max_new_tokens=a.max_new_tokens, regen_batch_size=a.regen_batch_size, progress=False,
    )  # fmt: skip
    t0 = time.monotonic()
    rsum = regenerate(rcfg)
    regen_s = time.monotonic() - t0
    regen_file = Path(rsum["out"])

    res: dict[str, Any] = {}
    if not a.skip_first_window:
        common = ["--verifier-name-or-path", str(assets.verifier_dir), "--tokenizer",
                  str(assets.tokenizer_dir), "--seq-len", "256", "--window-rows", "4",
                  "--num-draft-layers", "1", "--workers", "1"]  # fmt: skip
        import shutil

        for d in ("fw-stream", "fw-then"):
            shutil.rmtree(work / d, ignore_errors=True)
        res["streaming_first_window_s"] = first_window_s(
            [*common, "--data", str(corpus), "--regenerate", "--turns", "all",
             "--max-new-tokens", str(a.max_new_tokens), "--regen-batch-size",
             str(a.regen_batch_size), "--regen-chunk-records", str(a.regen_chunk_records),
             "--device", "cpu"], work / "fw-stream",
        )  # fmt: skip
        res["regenerate_then_produce_first_window_s"] = regen_s + first_window_s(
            [*common, "--data", str(regen_file)], work / "fw-then"
        )
    if a.first_window_only:
        res |= {"regenerate_s": regen_s, "load_avg_1m": [load0, os.getloadavg()[0]],
                "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                "sizes": vars(a) | {"torch": torch.__version__, "threads": torch.get_num_threads()}}  # fmt: skip
        print(f"hardware: {res['hardware']}, load {load0:.1f} → {os.getloadavg()[0]:.1f}; "
              f"{a.conversations} conversations, chunk {a.regen_chunk_records}; regenerate "
              f"{regen_s:.1f} s; first window: produce --regenerate "
              f"{res.get('streaming_first_window_s', 0):.1f} s vs regenerate then produce "
              f"{res.get('regenerate_then_produce_first_window_s', 0):.1f} s")  # fmt: skip
        rec.write(a.json, record_rows(res, a), raw=res)
        return
    off = train_and_eval("offpolicy", corpus, assets, a, held)
    on = train_and_eval("onpolicy", regen_file, assets, a, held)
    ratio = {k: (r["tau"] / r["train_eal"] if r["train_eal"] else None)
             for k, r in (("offpolicy", off), ("onpolicy", on))}  # fmt: skip
    res |= {
        "tau": {"offpolicy": off["tau"], "onpolicy": on["tau"]},
        "tau_gain": on["tau"] / off["tau"],
        "train_eal": {"offpolicy": off["train_eal"], "onpolicy": on["train_eal"]},
        "tau_over_train_eal": ratio,
        "steps": {"offpolicy": off["steps"], "onpolicy": on["steps"]},
        "regen_tokens_per_s": sp["batched"],
        "regen_tokens_per_s_sequential": sp["sequential"],
        "regen_speedup_vs_sequential": sp["batched"] / sp["sequential"],
        "regenerate_s": regen_s,
        "regenerate_summary": rsum,
        "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "load_avg_1m": [load0, os.getloadavg()[0]],
        "sizes": vars(a) | {"torch": torch.__version__, "threads": torch.get_num_threads()},
    }
    print_table(res, a, off, on, sp, rsum, load0)
    rec.write(a.json, record_rows(res, a), raw=res)


def record_rows(res: dict, a: argparse.Namespace) -> list[Row]:
    """The record's rows (benchmarks/record.py)."""
    size = (f"demo verifier, {a.conversations} conversations, b8 draft, {a.steps} steps, "
            f"{a.num_prompts} held-out prompts × {a.max_new_tokens} tokens")  # fmt: skip
    out = []
    if "tau_gain" in res:
        r = res["tau_over_train_eal"]
        out += [
            Row(stage="eval", name="tau_gain", what="on-policy vs off-policy draft: τ",
                result=res["tau_gain"], unit="×", goal=">= 1.15", met=res["tau_gain"] >= 1.15,
                n=a.num_prompts, n_of="prompts",
                conditions=f"{size}; τ {res['tau']['onpolicy']:.2f} vs {res['tau']['offpolicy']:.2f}"),
            Row(stage="eval", name="tau_over_train_eal", what="on-policy draft: τ ÷ train EAL",
                result=r["onpolicy"], goal=">= 0.95", met=(r["onpolicy"] or 0) >= 0.95,
                n=a.num_prompts, n_of="prompts", conditions=f"{size}; off-policy {r['offpolicy']}"),
            Row(stage="data", name="regen_speedup_vs_sequential",
                what="regenerate (hf engine): batched vs one prompt at a time (tokens/s)",
                result=res["regen_speedup_vs_sequential"], unit="×", goal=">= 3",
                met=res["regen_speedup_vs_sequential"] >= 3,
                conditions=f"demo verifier, batch {a.regen_batch_size}, {a.speed_prompts} prompts"),
        ]  # fmt: skip
    if "streaming_first_window_s" in res:
        out.append(Row(stage="data", name="streaming_first_window_s",
                       what="first window: `produce --regenerate` (streaming)",
                       result=res["streaming_first_window_s"], unit="s",
                       conditions=f"{a.conversations} conversations, chunk "
                       f"{a.regen_chunk_records}; regenerate then produce: "
                       f"{res['regenerate_then_produce_first_window_s']:.1f} s"))  # fmt: skip
    return out


if __name__ == "__main__":
    main()
