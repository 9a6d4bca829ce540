"""Every registered draft family from one capture: τ ranked, fan-out rows/s, step vs speculators.

    .venv/bin/python benchmarks/families.py --json benchmarks/results/families.json  # all
    .venv/bin/python benchmarks/families.py --only step --json /tmp/step.json        # part 3
    .venv/bin/python benchmarks/families.py --only ranking --steps 20 --temperatures 0 1
    .venv/bin/python benchmarks/families.py --config my-bench.json --out runs/fam2  # other assets

Run from the repository root. The families are `fanout.families.registry.FAMILIES`
(seven: dflash, dflash2, dspark, eagle3, mtp, peagle, xpress). Time measured with the
seven on a shared 2-vCPU machine (load average 1.5-3): everything ≈ 9 min = the two
scenarios ≈ 3 min (the first build of the assets included, cached in `runs/assets`
after it), the eval ≈ 5 min, `--only step` ≈ 1 min; the demo-verifier ranking of
benchmarks/results/families-demo-verifier.json (its `command`) ≈ 12 min, most of it
the producer's 50 epochs.

1. τ per family, same stream, same steps. The bench harness (fanout.bench.bench
   `run_bench`) with one consumer per family (`--draft-family` each registered family,
   its block size `Family.block_size_for(8)`: 8 for the DFlash families, 4 = EAGLE-3's
   TTT steps + 1 and MTP's steps + 1, 9 = P-EAGLE's depths + 1; `--anchors` anchors a
   row, `--steps` steps each) and the producer capturing for all of them
   (`--capture-for`), scenarios `1p3c` (the harness's one-producer scenario: one
   producer, one stream, every draft) and `unshared` (one producer per draft). Assets,
   producer and role threads come from `--config` (default
   benchmarks/fanout/cpu-tiny.json: a random h512 × 8-layer Qwen3 verifier, so that
   capture costs what it does next to a real verifier; its greedy text is hard to
   imitate, so τ stays near 1 in a short run — give a config with
   `"use_demo_verifier": true` for drafts that learn, e.g.
   benchmarks/fanout/cpu-demo-families.json). Then `fanout eval` (fanout.decode.eval)
   of the 1p3c drafts on `--prompts` generated conversations that are not in the
   training data (`fanout.bench.demo.heldout_prompts`) at T = 0 (and `--temperatures`),
   lossless checked against greedy, and the drafts ranked (fanout.bench.ranking: τ with
   its 95% interval, train EAL, median train step, parameters, checkpoint size;
   `<out>/tau.png`).
2. Rows/s of the one multi-family run against single-family runs: the harness report's
   aggregate rows/s per scenario (all trainers together, over the window where every
   one is past its warm-up) and `aggregate_speedup_vs_unshared` = 1p3c / unshared
   (goal ≥ 3.0 with seven families: one verifier pass feeds every draft; four gave 2.04).
   The trainers and producers share the machine's cores, so the ratio is bounded by how
   much of the unshared run's CPU time capture took: (7c + 7t) / (c + 7t) for capture c
   and train step t a row. The recorded run uses benchmarks/fanout/cpu-deep.json (a
   32-layer verifier: a real verifier's depth beside 1-layer drafts); cpu-tiny's 8
   layers make c ≈ 1.4 t (1.98×).
3. Each family's train step against speculators 0.9.0's model of it, same config and
   rows. A tiny random Qwen3 verifier (`--step-hidden` × `--step-layers`, vocab
   `--step-vocab`), one fanout draft per family (`Family.build`: 1 layer, the block size
   of part 1, `--step-anchors` anchors, the family's layers of 3 captured ones
   (`Family.draft_layers`: MTP reads the last)), saved with `save_checkpoint` and loaded
   by speculators' class of the family (`speculators.models.<speculators_model_type>`,
   the checkpoint's `architectures`: DFlashDraftModel, DFlash2DraftModel,
   DSparkDraftModel, Eagle3DraftModel, MTPDraftModel, PEagleDraftModel,
   XPressDraftModel; `from_pretrained`, eager attention: its flex attention compiles a
   block mask for CUDA; XPress's unset `causal_tril` buffer filled as
   tests/test_family_xpress.py does). One packed row of `--step-rows` tokens, every
   token supervised, one document; random context states, the verifier's greedy tokens
   of random final states as labels (fanout's `target_ids`; speculators recomputes them
   from the pre-norm states it is given). Loss: `--step-loss` (ce: fanout's default,
   speculators `--loss-fn ce`; kl: `kl_div`), exp decay with fanout's gamma on both,
   speculators' "eager" losses (its fused ones are Triton kernels) as
   `get_trainer_kwargs` resolves them from the draft's recipe (TTT steps, MTP steps and
   step weights, P-EAGLE depths and COD ratios, XPress's CE/TV weights, consistency
   rounds and base anchor). XPress and MTP train their own loss whatever `--step-loss`
   says (XPress CE + TV, MTP step-weighted CE on the data tokens). One step = forward +
   loss, backward, `torch.optim.AdamW(fused=True)` step on both sides (the kernel
   fanout's trainer picks on CPU; no clipping on either). `--warmup` untimed steps
   each, then `--repeats` rounds, fanout and speculators alternating (order swapped
   every round, so drifting load hits both); median, min and max per side, the ratio
   of medians fanout / speculators (goal ≤ 0.8, issue #56; it was 1.0) and its
   per-round min-max. Then one more step a side for its peak memory above the level
   before it (`Peak`: CPU, the process's VmHWM over its VmRSS, freed memory released
   first; CUDA, `torch.cuda.max_memory_allocated`), the ratio fanout / speculators
   (goal ≤ 1.0). `--device cuda` runs this part on the GPU (benchmarks/gpu/checks.sh),
   each part of a step synchronized. The anchors
   (P-EAGLE: COD samples) are drawn at random on both sides (same count; positions do
   not change the work). EAGLE-3's and P-EAGLE's speculators side gets the row as its
   `shift_batch` makes it (state t, token t+1, target t+1) with fanout's step-0 mask;
   MTP's gets the last layer's states final-normed (its data pipeline's), fanout's the
   states before the norm (the capture's). Without speculators installed this part is
   skipped and says so.

`--json OUT` holds every figure: commit (and whether the tree differs from it), date,
hardware, versions, torch threads, load average (`os.getloadavg`) before and after each
part, the sizes, sample sizes and spreads. Keys: `ranking.rows` (fanout.bench.ranking
rows), `ranking.lossless`, `throughput.aggregate_rows_per_s.<scenario>`,
`throughput.aggregate_speedup_vs_unshared`, `throughput.goal_met`,
`step.families.<name>.{fanout,speculators}.{median_ms,min_ms,max_ms,fwd_ms,bwd_ms,
opt_ms,runs,peak_mb}`, `.ratio`, `.ratio_min_max`, `.goal_met`, `.peak_ratio`,
`.peak_goal_met`, `.block_size`, `.target_layer_ids`; `step.skipped` (why) without
speculators. The record's `hardware` names the CPU, its vector extensions and the torch
build (fanout.bench.report.hardware), and its `notes` the load during the step
comparison: a ratio is that CPU's (issue #56: 0.72× on a Xeon was 1.10× on an EPYC).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fanout import package_version
from fanout.bench.config import BenchConfig
from fanout.families.registry import FAMILIES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import Recorder, Row

REPO = Path(__file__).resolve().parents[1]
FAMILY_NAMES = tuple(FAMILIES)  # every registered family
SCENARIOS = ["1p3c", "unshared"]
BLOCK = 8
SPEEDUP_GOAL = 3.0  # aggregate rows/s, 1p3c over unshared, seven families (#44)
STEP_GOAL = 0.8  # fanout step time / speculators' (issue #56; was 1.0)
PEAK_GOAL = 1.0  # fanout step's peak memory / speculators'
SPEC_LOSS = {"ce": "ce", "kl": "kl_div"}  # fanout loss_type -> speculators --loss-fn
# a family whose loss is its own compound (trained as fanout's loss_type ce whatever
# --step-loss says): speculators' --loss-fn for it, its trainer's default
# A family whose loss is its own (trained with fanout's loss_type ce whatever --step-loss
# says): speculators' --loss-fn for it, its trainer's default (MTP: none, its step
# weights are its loss)
SPEC_OWN_LOSS: dict[str, str | None] = {"xpress": '{"ce": 0.1, "tv": 0.9}', "mtp": None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--only", choices=["ranking", "step"], help="run one part (default both)")
    ap.add_argument("--json", type=Path, help="write every figure to this JSON file")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "families", help="work dir")
    ap.add_argument(
        "--config",
        type=Path,
        default=REPO / "benchmarks" / "fanout" / "cpu-tiny.json",
        help="bench config whose assets, producer and thread settings the ranking uses",
    )
    ap.add_argument(
        "--scenarios",
        nargs="+",
        choices=SCENARIOS,
        default=SCENARIOS,
        help="harness scenarios (1p3c: one producer feeding every family's draft; unshared: "
        "one producer per draft); 1p3c alone ranks the drafts without the rows/s comparison",
    )
    ap.add_argument(
        "--scenario-timeout-s",
        type=float,
        help="kill a harness scenario after this many seconds (default: the config's; seven "
        "trainers on two cores take longer than the config's consumers did)",
    )
    ap.add_argument("--steps", type=int, default=40, help="train steps per draft (ranking)")
    ap.add_argument("--anchors", type=int, default=8, help="anchors per row (ranking drafts)")
    ap.add_argument("--prompts", type=int, default=32, help="held-out eval prompts")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="eval tokens per prompt")
    ap.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=[0.0],
        metavar="T",
        help="eval temperatures (T = 0 is always evaluated)",
    )
    ap.add_argument("--step-rows", type=int, default=512, help="T: tokens of the step's row")
    ap.add_argument("--step-anchors", type=int, default=64, help="anchors of the step")
    ap.add_argument("--step-hidden", type=int, default=256, help="step verifier hidden size")
    ap.add_argument("--step-layers", type=int, default=8, help="step verifier layers")
    ap.add_argument("--step-vocab", type=int, default=8192, help="step verifier vocabulary")
    ap.add_argument(
        "--step-loss",
        choices=["ce", "kl"],
        default="ce",
        help="loss of the step (MTP, XPress: their own)",
    )
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side")
    ap.add_argument("--repeats", type=int, default=9, help="timed steps per side")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the step and the eval")
    ap.add_argument(
        "--device",
        default="cpu",
        help="device of the step comparison (cuda: benchmarks/gpu/checks.sh); the ranking "
        "and throughput parts take theirs from --config",
    )
    a = ap.parse_args(argv)
    if a.steps < 4 or a.anchors < 1 or a.prompts < 1 or a.repeats < 1:
        ap.error("--steps >= 4 (warm-up + steady steps), --anchors, --prompts, --repeats >= 1")
    if a.step_rows <= a.step_anchors + BLOCK:
        ap.error("--step-rows must exceed --step-anchors + 8 (anchors < T - block size)")
    return a


def load_avg() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Peak:
    """Peak memory of what runs between `start()` and `stop()`, above the level at start:
    CPU, the process's `VmHWM` (/proc/self/status) minus its `VmRSS` at start (the peak
    reset there through /proc/self/clear_refs, Linux >= 4.0); CUDA,
    `torch.cuda.max_memory_allocated` minus what was allocated at start."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated() / 2**20
        else:
            with contextlib.suppress(OSError):  # resets VmHWM to VmRSS
                Path("/proc/self/clear_refs").write_text("5")
            self.base = _status_mb("VmRSS")

    def stop(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / 2**20 - self.base
        return _status_mb("VmHWM") - self.base


def _release_freed_memory() -> None:
    """Freed memory back to the OS before a measured step (glibc keeps freed heap pages:
    the last side's would hide this side's peak below VmRSS)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# --------------------------------------------------------------------------- parts 1 + 2


def families_config(a: argparse.Namespace) -> BenchConfig:
    """`--config` with one block-8 consumer per family (settings of its first consumer
    otherwise), the producer capturing for all of them, scenarios 1p3c and unshared."""
    base = BenchConfig.load(a.config)
    cache = Path(base.assets.cache_dir)
    assets = base.assets.model_copy(
        update={"cache_dir": str(cache if cache.is_absolute() else REPO / cache)}
    )
    proto = base.consumers[0]
    consumers = [
        proto.model_copy(update={"id": f, "draft_family": f, "block_size": FAMILIES[f].block_size_for(BLOCK),
                                 "max_anchors": a.anchors, "max_steps": a.steps, "seed": i})
        for i, f in enumerate(FAMILY_NAMES)
    ]  # fmt: skip
    return base.model_copy(
        update={
            "name": "families",
            "description": f"one producer capturing for {', '.join(FAMILY_NAMES)} (1p3c) "
            f"vs one producer per family (unshared), {a.steps} steps per draft",
            "assets": assets,
            "producer": base.producer.model_copy(update={"capture_for": list(FAMILY_NAMES)}),
            "consumers": consumers,
            "scenarios": a.scenarios,
            "unshared_producer_devices": None,
            "scenario_timeout_s": a.scenario_timeout_s or base.scenario_timeout_s,
        }
    )


def throughput(rep: dict[str, Any]) -> dict[str, Any]:
    """Part 2 from the harness report: rows/s per scenario and consumer, the speedup."""
    sc = rep["scenarios"]
    speedup = rep["aggregate_speedup_vs_unshared"]
    return {
        "valid": rep["valid"],
        "reasons": rep["reasons"],
        "flags": rep["flags"],
        "aggregate_rows_per_s": rep["aggregate_rows_per_s"],
        "aggregate_window_s": {k: v["aggregate"].get("window_s") for k, v in sc.items()},
        "consumer_rows_per_s": {
            k: {c: m.get("rows_per_s") for c, m in v["consumers"].items()} for k, v in sc.items()
        },
        "consumer_steps": {
            k: {c: m["steps"] for c, m in v["consumers"].items()} for k, v in sc.items()
        },
        "step_ms_p50": {
            k: {c: m.get("step_ms_p50") for c, m in v["consumers"].items()} for k, v in sc.items()
        },
        "captures_per_window": {k: v["captures_per_window"] for k, v in sc.items()},
        "unique_windows": {k: v["unique_windows"] for k, v in sc.items()},
        "wall_s": {k: v["wall_s"] for k, v in sc.items()},
        "aggregate_speedup_vs_unshared": speedup,
        "goal": f">= {SPEEDUP_GOAL}",
        "goal_met": None if speedup is None else speedup >= SPEEDUP_GOAL,
        "sizes": rep["sizes"],
        "warmup_steps": rep["config"]["warmup_steps"],
        "threads_per_role": rep["config"]["threads_per_role"],
        "producer_threads": rep["config"]["producer"]["threads"],
    }


def throughput_lines(t: dict[str, Any]) -> list[str]:
    ver = t["sizes"]["verifier"]
    lines = [
        f"fan-out: verifier h{ver['hidden_size']} × {ver['num_hidden_layers']} layers, vocab "
        f"{ver['vocab_size']}; T={t['sizes']['seq_len']}, R={t['sizes']['window_rows']}, "
        f"K={t['sizes']['max_live_windows']}; {t['threads_per_role']} thread(s) per trainer, "
        f"{t['producer_threads']} per producer; rows/s over the window every trainer is past "
        f"its {t['warmup_steps']} warm-up steps",
        f"{'scenario':<9} {'aggregate rows/s':>16} {'window s':>8} {'captures/window':>15} "
        + " ".join(f"{f + ' rows/s (steps)':>21}" for f in FAMILY_NAMES),
    ]
    for sc, rate in t["aggregate_rows_per_s"].items():
        per = t["consumer_rows_per_s"][sc]
        steps = t["consumer_steps"][sc]
        cells = [f"{_num(per.get(f))} ({steps.get(f, '-')})" for f in FAMILY_NAMES]
        lines.append(
            f"{sc:<9} {_num(rate):>16} {_num(t['aggregate_window_s'][sc]):>8} "
            f"{_num(t['captures_per_window'][sc]):>15} " + " ".join(f"{c:>21}" for c in cells)
        )
    s = t["aggregate_speedup_vs_unshared"]
    verdict = "—" if s is None else ("met" if t["goal_met"] else "NOT met")
    lines.append(
        f"aggregate_speedup_vs_unshared = {_num(s, 3)} (goal ≥ {SPEEDUP_GOAL}: {verdict}); "
        f"run {'valid' if t['valid'] else 'INVALID'}"
    )
    lines += [f"  invalid: {r}" for r in t["reasons"]] + [f"  flag: {f}" for f in t["flags"]]
    return lines


def eval_and_rank(cfg: BenchConfig, out: Path, a: argparse.Namespace) -> dict[str, Any]:
    """`fanout eval` of the 1p3c drafts on held-out prompts, ranked (part 1)."""
    from fanout.bench.assets import torch_threads
    from fanout.bench.bench import resolve_assets
    from fanout.bench.demo import heldout_prompts
    from fanout.bench.ranking import plot_tau, rank_drafts, ranking_lines
    from fanout.decode.config import EvalConfig
    from fanout.decode.eval import evaluate, resolve_draft_dir

    assets = resolve_assets(cfg.assets, out)  # cached by the harness: returns at once
    drafts_dir = out / "1p3c" / "drafts"
    ecfg = EvalConfig(
        verifier_name_or_path=str(assets.verifier_dir),
        tokenizer=str(assets.tokenizer_dir),
        data=str(heldout_prompts(assets.data, out / "heldout.jsonl", n=a.prompts)),
        draft=[str(drafts_dir / f) for f in FAMILY_NAMES],
        num_prompts=a.prompts,
        max_new_tokens=a.max_new_tokens,
        temperature=sorted({0.0, *a.temperatures}),
        json_out=str(out / "eval.json"),
    )
    t0 = time.monotonic()
    with torch_threads(a.threads):
        rep = evaluate(ecfg, echo=lambda s: print(s, flush=True))
    wall = time.monotonic() - t0
    (out / "eval.json").write_text(json.dumps(rep, indent=2) + "\n")
    rows = rank_drafts(
        rep,
        {n: resolve_draft_dir(str(drafts_dir / n)) for n in rep["drafts"]},
        {n: drafts_dir / n for n in rep["drafts"]},
    )
    plot = plot_tau(rows, out / "tau.png")
    gen = rep["generated_tokens"]
    summary = {
        "rows": rows,
        "lossless": rep["lossless"],
        "mismatches": rep["mismatches"],
        "prompts": rep["prompts"],
        "max_new_tokens": a.max_new_tokens,
        "generated_tokens": {"total": sum(gen), "min": min(gen), "max": max(gen)},
        "prompt_tokens": {"min": min(rep["prompt_tokens"]), "max": max(rep["prompt_tokens"])},
        "temperatures": rep["temperatures"],
        "verify_steps": {
            n: {t: f.get("verify_steps") for t, f in d["at_temperature"].items()}
            for n, d in rep["drafts"].items()
        },
        "per_position_acceptance": {
            n: d["per_position_acceptance"] for n, d in rep["drafts"].items()
        },
        "speedup_vs_greedy": {n: d.get("speedup_vs_greedy") for n, d in rep["drafts"].items()},
        "eval_wall_s": round(wall, 1),
        "eval_threads": a.threads,
        "plot": str(plot),
        "eval_report": str(out / "eval.json"),
    }
    summary["lines"] = [
        f"τ on {rep['prompts']} held-out prompts ({summary['prompt_tokens']['min']}–"
        f"{summary['prompt_tokens']['max']} tokens), ≤ {a.max_new_tokens} new tokens, "
        f"T = {', '.join(rep['temperatures'])}; "
        f"lossless at T = 0: {rep['lossless']}; every draft {a.steps} steps on the one "
        "stream (1p3c); step ms = median train step of that run (fwd + bwd + opt):",
        *ranking_lines(rows),
        f"plot: {plot}  eval report: {out / 'eval.json'}",
    ]
    return summary


def run_ranking(a: argparse.Namespace) -> dict[str, Any]:
    from fanout.bench.bench import run_bench

    cfg = families_config(a)
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    before = load_avg()
    t0 = time.monotonic()
    rep = run_bench(cfg, out, echo=lambda s: print(s, flush=True))
    harness_s = time.monotonic() - t0
    mid = load_avg()
    result: dict[str, Any] = {
        "config": str(a.config),
        "work_dir": str(out),
        "steps_per_draft": a.steps,
        "anchors": a.anchors,
        "harness_wall_s": round(harness_s, 1),
        "harness_report": str(out / "report.json"),
        "load_avg_before": before,
        "load_avg_after_harness": mid,
    }
    result["throughput"] = throughput(rep)
    drafts = out / "1p3c" / "drafts"
    missing = [f for f in FAMILY_NAMES if not any(drafts.glob(f"{f}/checkpoint-*/COMMITTED"))]
    if missing:
        result["ranking"] = {"skipped": f"no committed checkpoint of {missing} under {drafts}"}
    else:
        result["ranking"] = eval_and_rank(cfg, out, a)
    result["load_avg_after"] = load_avg()
    return result


# --------------------------------------------------------------------------- part 3


def _speculators() -> dict[str, Any] | None:
    """speculators' model and config class per family (the module of the family's
    `speculators_model_type`, the class its checkpoint's `architectures` name), None when
    speculators is not installed."""
    if package_version("speculators") is None:
        return None
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time deprecations (torch.compile's import)
        for name, fam in FAMILIES.items():
            m = importlib.import_module(f"speculators.models.{fam.speculators_model_type}")
            model_cls = getattr(m, fam.architectures[0])
            out[name] = (model_cls, model_cls.config_class)
    from loguru import logger  # speculators' logger: its INFO lines per verifier file read

    logger.remove()
    logger.add(sys.stderr, level="ERROR")
    return out


def step_verifier(a: argparse.Namespace) -> Path:
    from fanout.bench.assets import tiny_qwen3_verifier

    d = a.out / f"step-verifier-v{a.step_vocab}-h{a.step_hidden}-l{a.step_layers}"
    if not (d / "config.json").is_file():
        tiny_qwen3_verifier(d, a.step_vocab, hidden_size=a.step_hidden, num_layers=a.step_layers,
                            num_heads=4, num_kv_heads=2, head_dim=a.step_hidden // 4,
                            intermediate_size=3 * a.step_hidden)  # fmt: skip
    return d


def step_rows(vdir: Path, layers: list[int], a: argparse.Namespace) -> dict[str, torch.Tensor]:
    """One packed row [1, T]: random context states and tokens, every token supervised,
    one document; labels = the verifier's greedy token of random final states (fanout's
    `target_ids`); `pre` = those states before the final norm (speculators')."""
    from fanout.model.verifier_dir import read_verifier_tensors

    vt = read_verifier_tensors(vdir, ["lm_head.weight", "model.norm.weight"])
    cfg = json.loads((vdir / "config.json").read_text())
    t, h = a.step_rows, a.step_hidden
    g = torch.Generator().manual_seed(0)
    pre = 2.0 * torch.randn(1, t, h, generator=g)  # [1, T, H] before the final norm
    post = F.rms_norm(pre, (h,), vt["model.norm.weight"], eps=cfg["rms_norm_eps"])
    return {
        "hidden_states": torch.randn(1, t, len(layers) * h, generator=g),  # [1, T, n·H]
        "input_ids": torch.randint(0, a.step_vocab - 1, (1, t), generator=g),  # no mask id
        "target_ids": (post @ vt["lm_head.weight"].t()).argmax(-1),  # [1, T]
        "loss_mask": torch.ones(1, t, dtype=torch.long),
        "document_ids": torch.zeros(1, t, dtype=torch.long),
        "position_ids": torch.arange(t)[None],
        "last_hidden_states": post,  # [1, T, H] after it (HF last_hidden_state)
        "pre": pre,
    }


Step = Callable[[], tuple[float, float, float, float]]


def _timed(
    forward: Callable[[], torch.Tensor], opt: torch.optim.Optimizer, cuda: bool = False
) -> Step:
    """One train step split in (forward + loss, backward, optimizer) ms, and the loss
    (`cuda`: each part synchronized, so its time is the device's, not the launches')."""

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def step() -> tuple[float, float, float, float]:
        t0 = now()
        loss = forward()
        t1 = now()
        loss.backward()
        t2 = now()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = now()
        return 1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (t3 - t2), float(loss.detach())

    return step


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)


def spec_model(spec: tuple[Any, Any], ckpt: Path) -> torch.nn.Module:
    """speculators' model of a fanout checkpoint, fp32, eager attention, in train mode."""
    model_cls, config_cls = spec
    scfg = config_cls.from_pretrained(str(ckpt))
    scfg.transformer_layer_config._attn_implementation = "eager"  # plain PyTorch on CPU
    model = model_cls.from_pretrained(str(ckpt), config=scfg, dtype=torch.float32)
    for key, buf in model.named_buffers():  # speculators 0.9.0's XPress from_pretrained
        if key.endswith("causal_tril"):  # leaves this non-persistent buffer unset
            buf.copy_(torch.tril(torch.ones_like(buf)))
    model.train()
    return model


# speculators' get_trainer_kwargs keyword <- the fanout draft config field it is read from
SPEC_RECIPE = {
    "ttt_steps": "ttt_steps", "ttt_step_loss_decay": "ttt_step_loss_decay",
    "num_speculative_steps": "mtp_steps", "step_weight_beta": "mtp_step_weight_beta",
    "num_depths": "num_depths", "down_sample_ratio": "down_sample_ratio",
    "down_sample_ratio_min": "down_sample_ratio_min",
    "consistency_weight": "consistency_weight", "consistency_passes": "consistency_passes",
    "base_anchor_weight": "base_anchor_weight",
    "base_anchor_full_weight": "base_anchor_full_weight",
}  # fmt: skip


def step_batches(
    name: str, draft: Any, model: Any, rows: dict[str, torch.Tensor], a: argparse.Namespace
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """The one row as fanout's draft reads it, as speculators' model reads it (after its
    data pipeline), and speculators' training kwargs of the draft's recipe
    (`get_trainer_kwargs`, the eager losses)."""
    c = draft.cfg.model_dump()
    loss_fn = SPEC_OWN_LOSS.get(name, SPEC_LOSS[a.step_loss])
    if name == "xpress":  # its compound loss at the draft's weights
        loss_fn = json.dumps({"ce": c["xpress_ce_weight"], "tv": c["xpress_tv_weight"]})
    eagle = "ttt_steps" in c or "num_depths" in c  # EAGLE-3's rows (EAGLE-3, P-EAGLE)
    kw, _ = model.get_trainer_kwargs(
        loss_fn=loss_fn,
        loss_implementation="eager",  # the fused losses are Triton kernels
        max_anchors=a.step_anchors,
        dflash_decay_gamma=None if eagle else draft.cfg.resolved_gamma,
        per_position_loss_weight="fixed-exp-decay",
        ce_from_data=c.get("label_source") == "input_ids",
        **{k: c[f] for k, f in SPEC_RECIPE.items() if f in c},
    )
    batch = {k: v for k, v in rows.items() if k != "pre"}
    if not FAMILIES[name].needs_last_hidden_states(c):
        batch.pop("last_hidden_states")
    spec_rows = {
        "hidden_states": rows["hidden_states"],
        "input_ids": rows["input_ids"],
        "loss_mask": rows["loss_mask"],
        "verifier_last_hidden_states": rows["pre"],
        "document_ids": rows["document_ids"],
        "position_ids": rows["position_ids"],
    }
    if name == "mtp":
        # MTP reads one layer, the verifier's last (before its final norm: `pre`);
        # speculators' MTP is given it final-normed (its data pipeline's hidden states)
        batch["hidden_states"] = rows["pre"]
        spec_rows = {k: spec_rows[k] for k in ("input_ids", "loss_mask", "position_ids")}
        with torch.no_grad():
            spec_rows["hidden_states"] = draft.fuse(rows["pre"])
    elif eagle:
        # EAGLE-3 (speculators' shift_batch): row t = state t, token t+1, target t+1;
        # the mask fanout's step 0 reads (the predicted token t+2, all supervised here)
        spec_rows = {
            "hidden_states": rows["hidden_states"][:, :-1],
            "input_ids": rows["input_ids"][:, 1:],
            "loss_mask": torch.cat([rows["loss_mask"][:, 2:], rows["loss_mask"][:, :1] * 0], 1),
            "verifier_last_hidden_states": rows["pre"][:, 1:],
            "document_ids": rows["document_ids"][:, 1:],
            "position_ids": rows["position_ids"][:, 1:],
        }
    return batch, spec_rows, kw


def family_step(
    name: str, spec: tuple[Any, Any], vdir: Path, rows: dict[str, torch.Tensor],
    layers: list[int], a: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """Time one family's fanout draft against speculators' model of the same checkpoint."""
    from fanout.checkpoints.save import save_checkpoint

    torch.manual_seed(0)
    fam = FAMILIES[name]
    draft = fam.build(vdir, target_layer_ids=fam.draft_layers(layers, vdir),
                               block_size=fam.block_size_for(BLOCK),
                               max_anchors=a.step_anchors, num_layers=1,
                               loss_type="ce" if name in SPEC_OWN_LOSS else a.step_loss)  # fmt: skip
    # Weights rounded to bf16 first: model.safetensors is bf16, so both hold the same numbers.
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(p.bfloat16().float())
    ckpt = save_checkpoint(a.out / "step" / name, draft, _adamw(draft), {"step": 0},
                           verifier_name_or_path=str(vdir))  # fmt: skip
    model = spec_model(spec, ckpt)
    dev = torch.device(a.device)
    draft.to(dev)
    model.to(dev)
    fopt, sopt = _adamw(draft), _adamw(model)
    rows = {k: v.to(dev) for k, v in rows.items()}
    batch, spec_rows, kw = step_batches(name, draft, model, rows, a)
    gen = torch.Generator().manual_seed(0)

    def spec_forward() -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers on speculators' kwargs
            _, loss, _ = model(**spec_rows, **kw)
        return loss

    cuda = dev.type == "cuda"
    sides: dict[str, Step] = {
        "fanout": _timed(lambda: draft.loss(batch, gen).loss, fopt, cuda),
        "speculators": _timed(spec_forward, sopt, cuda),
    }
    runs: dict[str, list[tuple[float, float, float, float]]] = {s: [] for s in sides}
    first_loss = {}
    for s, step in sides.items():
        for i in range(a.warmup):
            loss = step()[3]
            if i == 0:
                first_loss[s] = round(loss, 4)
    order = list(sides)
    for r in range(a.repeats):
        for s in order if r % 2 == 0 else order[::-1]:
            runs[s].append(sides[s]())
    peak_mb = {}
    for s in order:  # one more step a side, its peak above the level before it (`Peak`)
        _release_freed_memory()
        peak = Peak(a.device)
        peak.start()
        sides[s]()
        peak_mb[s] = peak.stop()
    trainable = {
        "fanout": sum(p.numel() for p in draft.parameters() if p.requires_grad),
        "speculators": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    res: dict[str, Any] = {}
    for s, rs in runs.items():
        tot = [f + b + o for f, b, o, _ in rs]
        res[s] = {
            "median_ms": round(statistics.median(tot), 2),
            "min_ms": round(min(tot), 2),
            "max_ms": round(max(tot), 2),
            "fwd_ms": round(statistics.median(r[0] for r in rs), 2),
            "bwd_ms": round(statistics.median(r[1] for r in rs), 2),
            "opt_ms": round(statistics.median(r[2] for r in rs), 2),
            "runs_ms": [round(x, 2) for x in tot],
            "runs": len(rs),
            "first_loss": first_loss[s],
            "trainable_parameters": trainable[s],
            "peak_mb": round(peak_mb[s], 1),
        }
    per_round = [
        (f[0] + f[1] + f[2]) / (s[0] + s[1] + s[2])
        for f, s in zip(runs["fanout"], runs["speculators"])
    ]
    ratio = res["fanout"]["median_ms"] / res["speculators"]["median_ms"]
    peak_ratio = peak_mb["fanout"] / max(peak_mb["speculators"], 1e-9)
    res |= {
        "ratio": round(ratio, 3),
        "ratio_min_max": [round(min(per_round), 3), round(max(per_round), 3)],
        "goal_met": ratio <= STEP_GOAL,
        "peak_ratio": round(peak_ratio, 3),
        "peak_goal_met": peak_ratio <= PEAK_GOAL,
        "speculators_class": type(model).__name__,
        "block_size": draft.cfg.block_size,
        "target_layer_ids": list(draft.cfg.target_layer_ids),
        "speculators_loss_fn": kw.get("loss_config") and sorted(kw["loss_config"]),
        "gamma": kw.get("gamma", kw.get("dflash_decay_gamma")),
    }
    return res


def run_step(a: argparse.Namespace) -> dict[str, Any]:
    """Part 3 (module docstring); `skipped` says why when speculators is missing."""
    from transformers.utils import logging as hf_logging

    from fanout.bench.assets import torch_threads
    from fanout.model.draft_config import default_target_layer_ids

    hf_logging.disable_progress_bar()  # its weight loading/writing bars, per checkpoint
    base: dict[str, Any] = {"load_avg_before": load_avg()}
    spec = _speculators()
    if spec is None:
        return base | {"skipped": "speculators is not installed (scripts/install_speculators.sh)"}
    a.out.mkdir(parents=True, exist_ok=True)
    vdir = step_verifier(a)
    layers = default_target_layer_ids(a.step_layers, 3)
    rows = step_rows(vdir, layers, a)
    sizes = {
        "verifier": {"hidden_size": a.step_hidden, "num_layers": a.step_layers,
                     "vocab_size": a.step_vocab, "heads": 4, "kv_heads": 2,
                     "head_dim": a.step_hidden // 4},
        "draft": {"num_layers": 1, "block_size": f"Family.block_size_for({BLOCK})",
                  "max_anchors": a.step_anchors, "captured_layer_ids": layers,
                  "target_layer_ids": "Family.draft_layers(captured)", "loss": a.step_loss,
                  "own_loss": sorted(SPEC_OWN_LOSS), "weighting": "exp"},
        "rows": {"T": a.step_rows, "batch": 1, "documents": 1, "supervised": "all"},
        "dtype": "float32",
        "device": a.device,
        "optimizer": "torch.optim.AdamW(fused=True, lr=1e-4, weight_decay=0.01) on both sides",
        "speculators_loss": "eager (get_trainer_kwargs loss_implementation='eager')",
        "speculators_attention": "eager",
    }  # fmt: skip
    fams: dict[str, Any] = {}
    with torch_threads(a.threads):
        for name in FAMILY_NAMES:
            print(f"step: {name} …", flush=True)
            fams[name] = family_step(name, spec[name], vdir, rows, layers, a)
    return base | {
        "sizes": sizes,
        "threads": a.threads,
        "warmup": a.warmup,
        "repeats": a.repeats,
        "order": "interleaved per round, fanout first on even rounds, speculators on odd",
        "peak": "one more step a side after the timed rounds, freed memory released first: "
        + (
            "torch.cuda.max_memory_allocated above the allocated level before it"
            if a.device.startswith("cuda")
            else "the process's VmHWM above its VmRSS before it (reset via /proc/self/clear_refs)"
        ),
        "families": fams,
        "goal": f"fanout / speculators <= {STEP_GOAL} (time), <= {PEAK_GOAL} (peak memory)",
        "load_avg_after": load_avg(),
    }


def step_lines(st: dict[str, Any]) -> list[str]:
    if "skipped" in st:
        return [f"train step vs speculators: SKIPPED — {st['skipped']}"]
    s = st["sizes"]
    v, d = s["verifier"], s["draft"]
    lines = [
        f"train step vs speculators {_spec_version()}: verifier h{v['hidden_size']} × "
        f"{v['num_layers']} layers, vocab {v['vocab_size']}; draft {d['num_layers']} layer, "
        f"{d['max_anchors']} anchors, layers {d['captured_layer_ids']} captured, "
        f"{d['loss']} + exp decay ({', '.join(d['own_loss'])}: their own loss); one row "
        f"T={s['rows']['T']}, all "
        f"supervised; fp32, {st['threads']} thread(s); AdamW(fused) both sides; "
        f"{st['warmup']} warm-up + {st['repeats']} interleaved runs each; load "
        f"{st['load_avg_before']} → {st['load_avg_after']}",
        f"{'family':<8} {'block':>5} {'layers':>9} {'params':>9} "
        f"{'fanout ms med (min–max)':>25} {'fwd/bwd/opt':>17} "
        f"{'speculators ms med (min–max)':>30} {'fwd/bwd/opt':>17} {'ratio (per-run)':>20} "
        f"{'peak MB f/s':>13} {'peak ratio':>10} goal (≤ {STEP_GOAL}, ≤ {PEAK_GOAL})",
    ]
    for name, r in st["families"].items():
        f, p = r["fanout"], r["speculators"]
        lo, hi = r["ratio_min_max"]
        lines.append(
            f"{name:<8} {r['block_size']:>5} {','.join(map(str, r['target_layer_ids'])):>9} "
            f"{f['trainable_parameters']:>9,} {_ms(f):>25} {_split(f):>17} "
            f"{_ms(p):>30} {_split(p):>17} {r['ratio']:>7.2f} ({lo:.2f}–{hi:.2f}) "
            f"{f['peak_mb']:>6.0f}/{p['peak_mb']:<6.0f} {r['peak_ratio']:>10.2f} "
            f"{'met' if r['goal_met'] and r['peak_goal_met'] else 'NOT met'}"
        )
    return lines


def _ms(r: dict[str, Any]) -> str:
    return f"{r['median_ms']:.0f} ({r['min_ms']:.0f}–{r['max_ms']:.0f})"


def _split(r: dict[str, Any]) -> str:
    return f"{r['fwd_ms']:.0f}/{r['bwd_ms']:.0f}/{r['opt_ms']:.0f}"


def _spec_version() -> str:
    return package_version("speculators") or "(not installed)"


def _num(x: Any, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    a.out = a.out.resolve()
    rec = Recorder("families", argv)
    result: dict[str, Any] = dict(rec.head)
    result["torch_threads_default"] = torch.get_num_threads()
    result["load_avg_start"] = load_avg()
    t0 = time.monotonic()
    if a.only in (None, "ranking"):
        result["ranking"] = run_ranking(a)
    if a.only in (None, "step"):
        result["step"] = run_step(a)
    result["load_avg_end"] = load_avg()
    result["wall_s"] = round(time.monotonic() - t0, 1)
    hw = result["hardware"]
    print(
        f"\nhardware: {hw['cpu']}, {hw['usable_cpus']}/{hw['logical_cpus']} CPUs, load "
        f"{result['load_avg_start']} → {result['load_avg_end']}; torch "
        f"{result['versions']['torch']}, speculators {result['versions']['speculators']}; "
        f"commit {(result['commit'] or '?')[:12]}"
        f"{' (tree differs)' if result['tree_differs_from_commit'] else ''}; {result['wall_s']} s"
    )
    if "ranking" in result:
        r = result["ranking"]
        print("\n" + "\n".join(throughput_lines(r["throughput"])))
        rk = r["ranking"]
        print("\n" + "\n".join(rk.get("lines", [f"ranking SKIPPED — {rk.get('skipped')}"])))
    if "step" in result:
        print("\n" + "\n".join(step_lines(result["step"])))
    raw = {k: v for k, v in result.items() if k not in rec.head}
    rec.write(a.json, record_rows(result, a), raw=raw, notes=record_notes(result))
    if a.json:
        print(f"\njson: {a.json}")
    return 0


def _f(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def record_rows(result: dict[str, Any], a: argparse.Namespace) -> list[Row]:
    """The record's rows (benchmarks/record.py): the fan-out ratio of the families run,
    lossless, and each family's step time against speculators'."""
    out = []
    if "ranking" in result:
        t = result["ranking"]["throughput"]
        z, v = t["sizes"], t["sizes"]["verifier"]
        size = (f"{Path(a.config).name}: verifier h {v['hidden_size']} × "
                f"{v['num_hidden_layers']} layers, T {z['seq_len']}, R {z['window_rows']}; one "
                f"draft per family ({', '.join(t['consumer_rows_per_s']['1p3c'])}), "
                f"{a.steps} steps each; {'valid' if t['valid'] else 'INVALID'}")  # fmt: skip
        s = t["aggregate_speedup_vs_unshared"]
        if s is not None:
            rate = t["aggregate_rows_per_s"]
            cap = t["captures_per_window"]
            out.append(Row(stage="fan-out", name="aggregate_speedup_vs_unshared",
                           what="every family from one capture vs one producer per family "
                           "(aggregate rows/s)", result=s, unit="×", goal=f">= {SPEEDUP_GOAL}",
                           met=s >= SPEEDUP_GOAL,
                           conditions=f"{size}; {rate['1p3c']:.2f} vs {rate['unshared']:.2f} "
                           f"rows/s; captures/window {cap['1p3c']} vs {cap['unshared']}"))  # fmt: skip
        rk = result["ranking"]["ranking"]
        if "lossless" in rk:
            out.append(Row(stage="eval", name="families_lossless",
                           what="families run: speculative output = greedy output",
                           result="lossless" if rk["lossless"] else "MISMATCH", goal="lossless",
                           met=bool(rk["lossless"]), n=rk["prompts"], n_of="prompts",
                           conditions=size))  # fmt: skip
        for r in rk.get("rows", []):  # τ per family and temperature, with its interval
            for temp, f in r["tau"].items():
                ci = f["ci95"]
                out.append(Row(stage="eval", name=f"tau.{r['family']}.T{temp}",
                               what=f"{r['family']} τ at T = {temp} (tokens per verifier "
                               "forward, same stream and steps as the other families)",
                               result=f["tau"], spread=tuple(ci) if ci else None,
                               spread_kind="95% CI", n=rk["prompts"], n_of="prompts",
                               conditions=f"{size}; block {r['block_size']}, train EAL "
                               f"{_f(r['train_eal'], '.2f')}, step {_f(r['step_ms'], '.0f')} "
                               f"ms, {r['parameters']:,} parameters, ≤ {rk['max_new_tokens']} "
                               "new tokens"))  # fmt: skip
    st = result.get("step") or {}
    for name, r in (st.get("families") or {}).items():
        f, p = r["fanout"], r["speculators"]
        z = st["sizes"]
        out.append(Row(stage="training", name=f"step_vs_speculators.{name}",
                       what=f"{name} train step vs speculators {_spec_version()}'s model "
                       "(time ratio)", result=r["ratio"], unit="×",
                       spread=tuple(r["ratio_min_max"]), n=st["repeats"], n_of="rounds",
                       goal=f"<= {STEP_GOAL}", met=bool(r["goal_met"]),
                       conditions=f"h {z['verifier']['hidden_size']}, vocab "
                       f"{z['verifier']['vocab_size']:,}, 1 layer, block {r['block_size']}, "
                       f"{z['draft']['max_anchors']} anchors, T {z['rows']['T']}, "
                       f"{'own loss' if name in SPEC_OWN_LOSS else z['draft']['loss']}, "
                       f"AdamW, {st['threads']} thread, {z.get('device', 'cpu')}; "
                       f"{f['median_ms']:.0f} vs {p['median_ms']:.0f} ms"))  # fmt: skip
        if "peak_ratio" in r:
            out.append(Row(stage="training", name=f"step_peak_vs_speculators.{name}",
                           what=f"{name} train step's peak memory vs speculators "
                           f"{_spec_version()}'s model", result=r["peak_ratio"], unit="×",
                           goal=f"<= {PEAK_GOAL}", met=bool(r["peak_goal_met"]),
                           conditions=f"as the time ratio's; {f['peak_mb']:.0f} vs "
                           f"{p['peak_mb']:.0f} MB above the level before the step"))  # fmt: skip
    return out


def record_notes(result: dict[str, Any]) -> list[str]:
    """What docs/numbers.md prints under the run: the machine's load during the step
    comparison (its wall-clock ratios move with it) and the CPU the ratios hold for."""
    st = result.get("step") or {}
    if not st.get("families"):
        return []
    hw = result["hardware"]
    ext = ", ".join(hw.get("cpu_vector_extensions") or []) or "none recorded"
    return [
        f"Step comparison: load average (1, 5, 15 min) {st['load_avg_before']} before, "
        f"{st['load_avg_after']} after, on {hw['usable_cpus']} CPUs; "
        f"{st['repeats']} interleaved rounds, so both sides ran under the same load. "
        f"Measured on {hw['cpu']} (vector extensions: {ext}; torch {hw.get('torch')}, "
        f"kernels {hw.get('torch_cpu_capability')}), device {st['sizes'].get('device', 'cpu')}: "
        "the ratios are this CPU's and are not claimed for another CPU kind."
    ]


if __name__ == "__main__":
    sys.exit(main())
