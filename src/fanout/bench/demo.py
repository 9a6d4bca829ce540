"""`fanout demo`: one producer, one draft of each family, a few minutes on CPU, ranked.

    ./dev.sh demo                                   # = fanout demo (defaults: 2 min, runs/demo)
    fanout demo --minutes 1 --run-dir /tmp/demo

Needs nothing but Python and this repo: it builds its own tiny assets (a BPE
tokenizer, a briefly trained tiny Qwen3 verifier, a generated chat corpus; cached
under `<run-dir>/assets`, so the second run starts at once), then runs the `1p3c`
scenario of the benchmark harness (fanout.bench.bench) with one draft of each
registered family (DFlash, DFlash2, DSpark, EAGLE-3, MTP, P-EAGLE, XPress;
`DEMO_FAMILIES`; block 8, a chain family at its own verify width:
Family.block_size_for) on the one stream for `--minutes` on-policy (the producer runs
with `--regenerate`: the verifier rewrites the corpus's answers chunk by chunk and the
drafts learn from its own text), stops the trainers, and prints: per-draft loss and expected
acceptance length (first → last), windows captured once and read by every draft, the
disk high-water mark against what storing every window would take, and where the
full report and plots are. It ends with `fanout eval` of the drafts at T = 0 and
T = 1 on 640 or more held-out prompts (conversations the stream never trained on;
more, up to 2,560, until every draft's τ interval is ±0.1): real speculative decoding,
checked lossless against plain greedy, and the drafts ranked (fanout.bench.ranking: τ
with its interval at each temperature, train-time EAL, step time, parameters,
checkpoint size; tau.png); report.md gets the T = 0 table (τ, train EAL, per-position
acceptance) next to curves.png.

Its flags are generated from DemoConfig (fanout.flags); `--config FILE` takes the
same fields as JSON, flags win.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fanout.bench.assets import torch_threads
from fanout.bench.bench import run_bench
from fanout.bench.config import (
    AssetsSpec,
    BenchConfig,
    ConsumerSpec,
    ProducerSpec,
    scenario_title,
)
from fanout.families.registry import FAMILIES
from fanout.flags import add_model_flags, model_from_args
from fanout.train.trainlog import read_train_log

# seed of the generated held-out conversations (the assets' corpus uses seed 0)
HELDOUT_SEED = 10_007
# The demo's answers are short (~10 tokens, 3–4 verify steps per prompt and draft), and
# τ's 95% interval half-width falls as 1/sqrt(prompts): measured on a 1.5-minute demo's
# drafts, 64 prompts gave ±0.15 / 0.27 / 0.24 (b4 / b8 / b16), 640 gave ±0.05 / 0.10 /
# 0.09 (docs/eval.md), but another demo's b8 was ±0.145 at 640: the spread between
# prompts differs by draft. So the eval starts with 640 and goes on, up to 2,560, until
# every draft is at ±0.1 (`--tau-half-width`). More prompts, not longer answers: decoding
# past EOS is off the chat distribution the drafts are trained and served on.
DEMO_EVAL_PROMPTS = 640
DEMO_EVAL_MAX_PROMPTS = 2560
DEMO_TAU_HALF_WIDTH = 0.1
# one draft of each registered family on the one stream (captured for all of them:
# --capture-for), block 8 (a chain family at its own width: Family.block_size_for)
DEMO_FAMILIES = tuple(FAMILIES)
DEMO_BLOCK = 8
DEMO_TEMPERATURES = [0.0, 1.0]


class DemoConfig(BaseModel):
    """`fanout demo`: how long to train and where to work."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    minutes: float = Field(2.0, gt=0, allow_inf_nan=False, description="Training time (minutes).")
    run_dir: str = Field(
        "runs/demo",
        min_length=1,
        description="Working directory: assets cache, run, report.",
    )


def demo_config(run_dir: Path, minutes: float) -> BenchConfig:
    consumers = [
        ConsumerSpec(
            id=f,
            draft_family=f,
            block_size=FAMILIES[f].block_size_for(DEMO_BLOCK),
            max_anchors=16,
            lr=2e-3,
            seed=i,
        )
        for i, f in enumerate(DEMO_FAMILIES)
    ]
    blocks = ", ".join(f"{c.draft_family} {c.block_size}" for c in consumers)
    return BenchConfig(
        name="demo",
        description=(
            "fanout demo: one producer (tiny trained Qwen3 verifier) feeding one draft of each "
            f"family through one shared, bounded window stream on CPU; block sizes ({blocks}): "
            f"block {DEMO_BLOCK}, a chain family at its own verify width."
        ),
        assets=AssetsSpec(cache_dir=str(run_dir / "assets"), use_demo_verifier=True),
        # On-policy (issue #21): the producer regenerates the corpus's assistant turns with
        # the verifier itself, chunk by chunk, and captures that text, so the drafts learn
        # what the verifier writes (served τ near train EAL; docs/data.md).
        producer=ProducerSpec(
            seq_len=256,
            window_rows=4,
            max_live_windows=4,
            epochs=50,
            num_draft_layers=1,
            capture_for=list(DEMO_FAMILIES),
            extra_args=["--regenerate", "--turns", "all", "--max-new-tokens", "64"],
        ),
        consumers=consumers,
        scenarios=["1p3c"],
        warmup_steps=2,
        scenario_timeout_s=minutes * 60 + 600,  # + asset-free startup and shutdown slack
    )


def eval_minutes(cfg: BenchConfig) -> str:
    """The eval's rough length: 1–2 min per draft on a busy 2-core CPU (measured: ~7 min
    for 4 drafts, issue #45), less with cores to spare."""
    n = len(cfg.consumers)
    return f"roughly {n}–{2 * n} min on 2 CPU cores"


def opening_line(cfg: BenchConfig, root: Path, minutes: float) -> str:
    """What the demo does, stage by stage, and roughly how long each takes."""
    fams = ", ".join(c.draft_family for c in cfg.consumers)
    return (
        f"fanout demo, 3 stages: [1] prepare: build the tiny assets under {root / 'assets'} "
        f"(a few minutes the first time, cached after); [2] produce → "
        f"{len(cfg.consumers)} drafts: {minutes:g} min of 1 producer feeding one draft of "
        f"each family ({fams}); [3] eval: speculative decoding of every draft on held-out "
        f"prompts, ranked ({eval_minutes(cfg)}) …"
    )


def _ends(save_path: Path, key: str) -> tuple[float | None, float | None, int]:
    """Mean of `key` over the first and the last few steps (single steps are noisy)."""
    vals = [r[key] for r in read_train_log(save_path)]
    if not vals:
        return None, None, 0
    k = max(1, min(10, len(vals) // 4))
    return sum(vals[:k]) / k, sum(vals[-k:]) / k, len(vals)


def summary_lines(rep: dict[str, Any], out: Path) -> list[str]:
    sc = rep["scenarios"]["1p3c"]
    what = scenario_title("1p3c", len(sc["consumers"]))
    lines = [
        f"fanout demo: {'valid' if rep['valid'] else 'INVALID'} run of {what}, "
        f"{sc['wall_s']:.0f} s (EAL: train-time estimate, mean of the first and last steps)"
    ]
    w = max([6, *map(len, sc["consumers"])])
    lines.append(f"{'draft':<{w}} {'steps':>6} {'loss first → last':>20} {'EAL first → last':>20}")
    rose = []
    for cid in sc["consumers"]:
        log = out / "1p3c" / "drafts" / cid
        l0, l1, n = _ends(log, "loss")
        e0, e1, _ = _ends(log, "eal")
        if e0 is None or e1 is None or l0 is None or l1 is None:
            lines.append(f"{cid:<{w}} {n:>6}  (no steps logged)")
            continue
        rose.append(e1 > e0)
        lines.append(f"{cid:<{w}} {n:>6} {l0:>9.3f} → {l1:<8.3f} {e0:>9.2f} → {e1:<8.2f}")
    if rose and not all(rose):
        lines.append("warning: EAL did not rise for every draft (run longer: --minutes)")
    p: dict[str, Any] = next(iter(sc["producers"].values()), {})
    acked = [c["windows_acked"] for c in sc["consumers"].values()]
    lines.append(
        f"windows: {sc['unique_windows']} captured by one verifier pass each "
        f"(captures/window {sc['captures_per_window']}), read by "
        f"{len(acked)} drafts ({', '.join(map(str, acked))} windows acked)"
    )
    d = rep.get("disk")
    if d:
        wb = p.get("window_bytes", 0)
        total = p.get("total_windows")
        # an on-policy stream's length is known only once its regeneration is done
        whole = (
            f"{wb * total / 2**20:.0f} MiB for the whole {total}-window stream"
            if total
            # --regenerate rewrites the corpus chunk by chunk as it is captured; the
            # demo stops its trainers before the last chunk exists
            else "the whole stream's length not known: an on-policy stream is regenerated "
            "while it is captured, and its length is known only with its last chunk"
        )
        lines.append(
            f"disk: high-water {d['high_water_bytes'] / 2**20:.1f} MiB "
            f"(≤ {rep['max_live_windows']} windows) vs {d['all_windows_bytes'] / 2**20:.1f} MiB "
            f"to keep the {sc['unique_windows']} windows produced, {whole}"
        )
    lines.append(f"report: {out / 'report.md'}  plots: {', '.join(rep.get('plots', []))}")
    lines += [f"invalid: {r}" for r in rep["reasons"]]
    return lines


def heldout_prompts(train_data: list[str], out: Path, n: int = 8) -> Path:
    """`n` generated conversations that are not in the training data (the stream never
    trained on them), written to `out`: the demo's eval prompts."""
    from fanout.bench.assets import generate_corpus, write_jsonl

    seen: set[str] = set()
    for f in train_data:
        with open(f) as fh:
            seen.update(json.dumps(json.loads(line), sort_keys=True) for line in fh if line.strip())
    fresh = [
        c
        for c in generate_corpus(8 * n, seed=HELDOUT_SEED)
        if json.dumps(c, sort_keys=True) not in seen
    ]
    return write_jsonl(out, fresh[:n])


def eval_drafts(cfg: BenchConfig, out: Path) -> list[str]:
    """`fanout eval` of the drafts on held-out prompts at T = 0 and T = 1, ranked."""
    from fanout.bench.bench import resolve_assets
    from fanout.bench.ranking import plot_tau, rank_drafts, ranking_lines
    from fanout.bench.report import add_eval
    from fanout.decode.config import EvalConfig
    from fanout.decode.eval import evaluate, resolve_draft_dir
    from fanout.decode.eval_table import table

    assets = resolve_assets(cfg.assets, out)  # cached: returns at once
    drafts = [out / "1p3c" / "drafts" / c.id for c in cfg.consumers]
    ecfg = EvalConfig(
        verifier_name_or_path=str(assets.verifier_dir),
        tokenizer=str(assets.tokenizer_dir),
        # enough verify steps for τ's printed 95% interval to be ±0.1 or tighter
        data=str(heldout_prompts(assets.data, out / "heldout.jsonl", n=DEMO_EVAL_MAX_PROMPTS)),
        draft=[str(d) for d in drafts if d.is_dir()],
        num_prompts=DEMO_EVAL_PROMPTS,
        tau_half_width=DEMO_TAU_HALF_WIDTH,
        max_prompts=DEMO_EVAL_MAX_PROMPTS,
        max_new_tokens=128,
        temperature=DEMO_TEMPERATURES,
        # the served rule only: what the ranking compares (the sampled-draft rule would
        # add a third decode per draft and prompt)
        sampled_draft=False,
        json_out=str(out / "eval.json"),
    )
    # a second thread gains nothing idle (13.0–13.7 vs 12.5 s for 64 prompts)
    with torch_threads(1):  # its opening line, then a bar per prompt on stderr
        rep = evaluate(ecfg, echo=lambda s: print(s, flush=True), progress=True)
    (out / "eval.json").write_text(json.dumps(rep, indent=2) + "\n")
    add_eval(out, rep)  # report.md: the τ table beside curves.png
    drafts_dir = out / "1p3c" / "drafts"
    rows = rank_drafts(
        rep,
        {n: resolve_draft_dir(str(drafts_dir / n)) for n in rep["drafts"]},
        {n: drafts_dir / n for n in rep["drafts"]},
    )
    (out / "ranking.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot = plot_tau(rows, out / "tau.png")
    with (out / "report.md").open("a") as md:  # the ranking beside the eval's table
        md.write(
            "\n## The families ranked (one stream, one verifier pass)\n\n```\n"
            + "\n".join(ranking_lines(rows))
            + f"\n```\n\n![{plot.name}]({plot.name})\n"
        )
    return ["", f"speculative decoding on {rep['prompts']} held-out prompts (fanout eval; τ = tokens per "
            "verifier forward, train EAL = the checkpoint's train-time estimate):",
            *table(rep), "", "the drafts ranked (one stream, one verifier pass; best τ at T = 0 first):",
            *ranking_lines(rows), f"eval report: {out / 'eval.json'}  ranking: "
            f"{out / 'ranking.json'}  plot: {plot}"]  # fmt: skip


def add_arguments(p: argparse.ArgumentParser, name: str = "demo") -> None:
    add_model_flags(p, DemoConfig)


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """DemoConfig from `--config FILE` and flags (flags win)."""
    return model_from_args(DemoConfig, args)


def run(args: argparse.Namespace, name: str = "demo") -> int:
    return run_demo(config_from_args(args))


def run_demo(dcfg: DemoConfig) -> int:
    """The whole demo: train for `dcfg.minutes`, print the summary, eval the drafts."""
    root = Path(dcfg.run_dir)
    out = root / "last"
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time; assets stay cached
    cfg = demo_config(root, dcfg.minutes)
    t0 = time.monotonic()
    print(opening_line(cfg, root, dcfg.minutes), flush=True)
    print(f"[1-2/3] prepare, then produce → {len(cfg.consumers)} drafts:", flush=True)
    rep = run_bench(cfg, out, stop_after_s=dcfg.minutes * 60, echo=lambda s: print(s, flush=True))
    print("\n".join(summary_lines(rep, out)))
    if rep["valid"]:
        print(f"\n[3/3] eval: speculative decoding of each draft ({eval_minutes(cfg)}) …",
              flush=True)  # fmt: skip
        print("\n".join(eval_drafts(cfg, out)), flush=True)
    print(f"(total {time.monotonic() - t0:.0f} s)")
    return 0 if rep["valid"] else 1
