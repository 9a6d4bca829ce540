"""Do the demo's drafts accelerate real decoding? τ vs train-time EAL, speedup vs greedy.

    .venv/bin/python benchmarks/eval.py                         # reuse runs/demo or train it
    .venv/bin/python benchmarks/eval.py --minutes 2 --retrain --json /tmp/eval.json
    .venv/bin/python benchmarks/eval.py --device cuda --dtype bfloat16   # on a GPU box
    .venv/bin/python benchmarks/eval.py --temperature 0 1 --json /tmp/eval.json  # τ at T=0, 1
    .venv/bin/python benchmarks/eval.py --max-new-tokens 256 --compare-uncached  # draft cache

Reuses the drafts of the last `fanout demo` (one of each registered family:
fanout.bench.demo.demo_config) under `--demo-dir` when they exist, otherwise trains
them with `fanout demo --minutes`.
Then runs `fanout eval` on `--num-prompts` generated conversations that are not in the
demo's training corpus and prints, per draft: the acceptance length τ (tokens per
verifier forward), the checkpoint's train-time EAL, acceptance per block position,
verifier forwards saved and the wall-clock speedup over plain greedy decoding measured
in the same run, at every `--temperature` (T = 0 always). Keys of `--json`: `lossless`,
`drafts.<name>.acceptance_length`, `.train_eal`, `.speedup_vs_greedy`,
`.per_position_acceptance`, `.at_temperature["<T>"]` (as `fanout eval`).

`--compare-uncached` also times the eval itself (`EvalSession.run`, models loaded and
warmed) in three arms at every `--max-new-tokens` given, in `--rounds` interleaved rounds
(cached uncached free, then reversed, so that drifting load hits all): the draft's
context k/v cached (`fanout.model.draft_cache`), the uncached reference loop, and a free
draft (the first cached run's logits replayed: the draft costs nothing). It checks all
give the same tokens and accepted counts and prints per length the uncached / cached
ratios with their per-round min–max — the whole eval, the speculative decodes alone,
the draft loop alone (context `extend` + block `logits`, clocked inside the decode) —,
the ceiling uncached / free (the most any draft speed-up can give: Amdahl, measured) and
the draft's share of speculative decode time. `--turns K` makes each prompt K held-out
conversations in one multi-turn chat (a long context). `--json`:
`eval_wall_s["<N>"].{wall,spec_decode}.{cached,uncached,free,ratio,ratio_min_max,ceiling,
ceiling_min_max}`, `.draft.{cached,uncached,free,ratio,ratio_min_max}`,
`.draft_fraction`, `.verify_steps`, `.same_outputs`; `prompt_tokens`; `draft_block_ms`
(one block at contexts 64…4,096; `--recipe-depth` adds a random 5-layer draft,
DraftRecipe's depth).
`--ci-prefixes N …` prints τ's 95% interval over the first N prompts (how many prompts τ
needs; `tau_ci_by_prompts` in `--json`).

    .venv/bin/python benchmarks/eval.py --num-prompts 1 --max-new-tokens 256 --ignore-eos \
        --compare-uncached --threads 1 --recipe-depth --rounds 4 --turns 30
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch

from fanout.bench.assets import write_jsonl
from fanout.bench.bench import resolve_assets
from fanout.bench.demo import demo_config, heldout_prompts
from fanout.decode.eval import (
    EvalConfig,
    EvalSession,
    evaluate,
    load_drafts,
    tau_interval,
)
from fanout.decode.eval_table import table
from fanout.decode.spec_decode import DecodeResult
from fanout.families.dflash.model import DFlashDraft
from fanout.model.draft import Draft
from fanout.model.draft_config import DraftRecipe

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from record import Recorder, Row  # noqa: E402  (a sibling script)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--demo-dir", default=str(REPO / "runs" / "demo"), help="fanout demo dir")
    ap.add_argument("--minutes", type=float, default=2.0, help="demo training time if trained")
    ap.add_argument("--retrain", action="store_true", help="train new drafts even if present")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        nargs="+",
        default=[96],
        metavar="N",
        help="new tokens per prompt (several: --compare-uncached times each)",
    )
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
    ap.add_argument(
        "--recipe-depth",
        action="store_true",
        help="with --compare-uncached: also a random draft of the real recipe's depth (5 layers)",
    )
    ap.add_argument(
        "--ci-prefixes",
        type=int,
        nargs="+",
        default=[],
        metavar="N",
        help="also τ's 95%% interval over the first N prompts only (how many τ needs)",
    )
    ap.add_argument(
        "--turns",
        type=int,
        default=1,
        metavar="K",
        help="each prompt joins K held-out conversations into one multi-turn chat "
        "(a long context: ≈ 50 tokens per turn on the demo's data)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, help="write results as JSON to this path")
    return ap.parse_args()


def main() -> None:
    a = parse_args()
    rec = Recorder("eval")
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
    held = heldout_prompts(assets.data, out / "heldout-bench.jsonl", n=a.num_prompts * a.turns)
    if a.turns > 1:
        held = joined_turns(held, a.turns)
    ecfg = EvalConfig(
        verifier_name_or_path=str(assets.verifier_dir),
        tokenizer=str(assets.tokenizer_dir),
        data=str(held),
        draft=[str(d) for d in drafts],
        num_prompts=a.num_prompts,
        max_new_tokens=a.max_new_tokens[0],
        device=a.device,
        dtype=a.dtype,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.seed,
        eos_token_id=[-1] if a.ignore_eos else None,  # no token is -1: never stops early
    )
    if a.compare_uncached:
        rep = compare_loops(ecfg, a.rounds, a.max_new_tokens, a.recipe_depth)
    else:
        rep = evaluate(ecfg)
    rep["drafts_reused"] = reused
    rep["threads"] = torch.get_num_threads()
    rep["cpus"] = os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rep["load_avg_1m"] = load
    print(
        f"hardware: {rep['hardware']}, {os.cpu_count()} CPUs, load {load}, torch "
        f"{torch.__version__}; verifier {assets.verifier_dir.name} (demo's tiny Qwen3), "
        f"{rep['prompts']} held-out prompts ({a.turns} conversations each), {'/'.join(map(str, a.max_new_tokens))} new tokens, {a.dtype}; "
        f"drafts {'reused' if reused else 'trained'} from {out}"
    )
    print("\n".join(table(rep)))
    if "eval_wall_s" in rep:
        print("\n".join(loop_lines(rep)))
    if a.ci_prefixes:
        rep["tau_ci_by_prompts"] = ci_by_prompts(rep, a.ci_prefixes)
        for n, by in rep["tau_ci_by_prompts"].items():
            print(
                f"first {n:>4} prompts: "
                + ", ".join(
                    f"{d} τ {c['tau']:.2f} ±{c['half']:.3f} ({c['steps']} steps)"
                    for d, c in by.items()
                )
            )
    rows, plots = record_rows(rep, a)
    rec.write(a.json, rows, raw=rep, plots=plots)


def record_rows(rep: dict, a: argparse.Namespace) -> tuple[list[Row], list[dict]]:
    """The record's rows (benchmarks/record.py): τ of each draft at each temperature with
    its 95% interval, lossless; with --compare-uncached, the whole-eval ratio per length.
    Plot: τ per draft at T = 0."""
    cond = (f"demo drafts ({'reused' if rep['drafts_reused'] else f'{a.minutes}-minute demo'}), "
            f"{rep['prompts']} held-out prompts × {a.turns} turn(s), ≤ {a.max_new_tokens[0]} new "
            f"tokens, {a.device} {a.dtype}, {rep['threads']} thread(s)")  # fmt: skip
    rows, bars = [], []
    if "eval_wall_s" in rep:
        ctx = max(rep["prompt_tokens"]) if rep.get("prompt_tokens") else None
        for n, w in rep["eval_wall_s"].items():
            wall, draft = w["wall"], w["draft"]
            at = f"{n} new tokens, a {ctx}-token prompt ({a.turns} turn(s))"
            rows.append(
                Row(
                    stage="eval",
                    name=f"draft_cache_whole_eval.{n}.turns{a.turns}",
                    what=f"draft context cache: uncached ÷ cached whole eval, {at}",
                    result=wall["ratio"],
                    unit="×",
                    spread=tuple(wall["ratio_min_max"]),
                    n=w["rounds"],
                    n_of="rounds",
                    conditions=f"{cond}; ceiling (uncached ÷ free draft) "
                    f"{wall['ceiling']}×; same outputs in all arms: {w['same_outputs']}",
                )
            )
            rows.append(Row(stage="eval", name=f"draft_cache_draft_loop.{n}.turns{a.turns}",
                            what=f"draft context cache: uncached ÷ cached draft loop, {at}",
                            result=draft["ratio"], unit="×", spread=tuple(draft["ratio_min_max"]),
                            n=w["rounds"], n_of="rounds",
                            conditions=f"{cond}; the draft's share of speculative decoding "
                            f"{w['draft_fraction']}"))  # fmt: skip
        return rows, []
    rows.append(Row(stage="eval", name="lossless", what="speculative output = greedy output",
                    result="lossless" if rep["lossless"] else "MISMATCH", goal="lossless",
                    met=bool(rep["lossless"]), n=rep["prompts"], n_of="prompts",
                    conditions=cond))  # fmt: skip
    for name, d in rep["drafts"].items():
        for t, f in d["at_temperature"].items():
            ci = f.get("acceptance_length_ci95")
            rows.append(Row(stage="eval", name=f"tau.{name}.T{t}",
                            what=f"τ (tokens per verifier forward), {name} ({d['family']}, "
                            f"block {d['block_size']}), T = {t}",
                            result=f["acceptance_length"], spread=tuple(ci) if ci else None,
                            spread_kind="95% CI", n=rep["prompts"], n_of="prompts",
                            conditions=f"train EAL {d['train_eal']}; speed-up vs greedy "
                            f"{f['speedup_vs_greedy']}; {f['verify_steps']} verify steps; {cond}"))  # fmt: skip
            if float(t) == 0.0:
                bars.append({"label": name, "y": f["acceptance_length"], "interval": ci})
    plot = {"name": "tau", "stage": "eval", "kind": "bar", "bars": bars,
            "title": f"τ per draft at T = 0, 95% CI ({rep['prompts']} prompts)",
            "ylabel": "τ (tokens per verifier forward)"}  # fmt: skip
    return rows, [plot] if bars else []


def joined_turns(held: Path, k: int) -> Path:
    """Every k conversations of `held` joined into one multi-turn conversation (the first's
    system message, then each one's user and assistant turns): prompts with a long
    history, where the draft's context is long. Written beside `held`."""
    convs = [json.loads(line) for line in held.read_text().splitlines() if line.strip()]
    joined = []
    for i in range(0, len(convs) - k + 1, k):
        first = convs[i]["messages"]
        msgs = [m for m in first[:1] if m["role"] == "system"]
        for c in convs[i : i + k]:
            msgs += [m for m in c["messages"] if m["role"] != "system"]
        joined.append({"messages": msgs})
    return write_jsonl(held.with_name(f"{held.stem}-{k}turns.jsonl"), joined)


def ci_by_prompts(rep: dict, prefixes: list[int]) -> dict:
    """τ (T = 0) and its printed 95% interval (`tau_interval`, the eval's own) over the
    first n prompts' records, per draft: how the interval narrows with prompts."""
    out: dict = {}
    for n in (k for k in prefixes if k <= rep["prompts"]):
        by: dict = {}
        for name, d in rep["drafts"].items():
            rs = [
                DecodeResult(r["drafts"][name]["0.0"]["tokens"], 0, 0.0,
                             r["drafts"][name]["0.0"]["accepted"], d["block_size"])
                for r in rep["prompt_records"][:n]
            ]  # fmt: skip
            lo, hi = tau_interval(rs) or (float("nan"), float("nan"))
            steps = sum(len(r.accepted) for r in rs)
            tau = sum(a + 1 for r in rs for a in r.accepted) / max(steps, 1)
            by[name] = {"tau": round(tau, 4), "half": round((hi - lo) / 2, 4), "steps": steps}
        out[str(n)] = by
    return out


def loop_lines(rep: dict) -> list[str]:
    """The --compare-uncached table: per length, the uncached / cached ratios with their
    per-round spread, the ceiling (uncached / free draft) and the draft's share."""

    def cell(w: dict, r: str = "ratio", over: str = "cached") -> str:
        lo, hi = w[f"{r}_min_max"]
        return f"{w[r]:.2f}× ({lo:.2f}–{hi:.2f}) {w['uncached']:.0f}/{w[over]:.0f}s"

    lines = [
        "eval time, uncached / cached, models loaded and warm, rounds interleaved "
        "(cached uncached free, then reversed; spread: min–max over rounds); ceiling = "
        "uncached / free (a draft that costs nothing: the most any draft speed-up gives):",
        f"{'new tok':>7} {'rounds':>6} {'steps':>6} {'whole eval':>22} {'ceiling':>22} "
        f"{'spec decode':>22} {'its ceiling':>22} {'draft loop':>22} {'draft share c/u':>15} same",
    ]
    for n, w in rep["eval_wall_s"].items():
        f = w["draft_fraction"]
        cells = [cell(w["wall"]), cell(w["wall"], "ceiling", "free"), cell(w["spec_decode"]),
                 cell(w["spec_decode"], "ceiling", "free"), cell(w["draft"])]  # fmt: skip
        lines.append(
            f"{n:>7} {w['rounds']:>6} {w['verify_steps']:>6} "
            + " ".join(f"{c:>22}" for c in cells)
            + f" {f['cached']:>6.1%}/{f['uncached']:<6.1%}  {w['same_outputs']}"
        )
    toks = rep.get("prompt_tokens", [])
    if toks:
        lines.append(f"  prompts: {len(toks)}, {min(toks)}–{max(toks)} tokens")
    for name, by_p in rep["draft_block_ms"].items():
        for p, ms in by_p.items():
            lines.append(
                f"  one {name} draft block at context {p:>5}: cached {ms['cached']:.2f} ms, "
                f"uncached {ms['uncached']:.2f} ms ({ms['ratio']:.2f}×)"
            )
    return lines


MODES = ("cached", "uncached", "free")


def compare_loops(ecfg: EvalConfig, rounds: int, lengths: list[int], recipe: bool) -> dict:
    """The eval's own wall time with and without the draft cache, interleaved, at every
    length in `lengths`; the draft's own time (context `extend` + block `logits`) is
    clocked inside the decode, so the whole-eval, speculative-decode and draft-loop
    ratios and the draft's share of a decode come from the same runs.

    A third arm, "free", replays the logits the first cached run recorded (a draft that
    costs nothing): uncached / free is the largest ratio any draft speed-up could give
    this eval — the measured Amdahl ceiling for the cache's ratio."""
    _, drafts, eals = load_drafts(ecfg)
    if recipe:  # the real recipe's depth, random weights (τ ≈ 1: cost, not quality)
        drafts["r5-random"], eals["r5-random"] = (
            recipe_depth_draft(next(iter(drafts.values()))),
            None,
        )
    layers = sorted({i for d in drafts.values() for i in d.cfg.target_layer_ids})
    session = EvalSession(ecfg.model_copy(update={"max_new_tokens": lengths[0]}), layers)
    session.warm(drafts)
    out: dict[str, dict] = {}
    rep: dict = {}
    for n in lengths:
        cfg = ecfg.model_copy(update={"max_new_tokens": n})
        arms: dict[str, dict[str, list[float]]] = {
            m: {"wall": [], "spec_decode": [], "draft": []} for m in MODES
        }
        reps: dict[str, dict] = {}
        recorded: dict[tuple, Any] = {}
        session.cfg = cfg.model_copy(update={"cache_draft": True})
        with replayed_draft(recorded, record=True):
            reps["recorded"] = session.run(drafts, eals)  # also this length's first calls
        session.cfg = cfg.model_copy(update={"cache_draft": False})
        session.warm(drafts)  # the uncached loop's first calls at this length, untimed
        fwd, back = list(MODES), list(reversed(MODES))
        for mode in [m for r in range(rounds) for m in (fwd if r % 2 == 0 else back)]:
            session.cfg = cfg.model_copy(update={"cache_draft": mode != "uncached"})
            clock = [0.0]
            replay = replayed_draft(recorded, record=False) if mode == "free" else None
            with replay or contextlib.nullcontext(), timed_draft(clock):
                t0 = time.perf_counter()
                reps[mode] = session.run(drafts, eals)
                arms[mode]["wall"].append(time.perf_counter() - t0)
            arms[mode]["spec_decode"].append(
                sum(d["decode_seconds"] for d in reps[mode]["drafts"].values())
            )
            arms[mode]["draft"].append(clock[0])
        out[str(n)] = loop_figures(arms, reps, rounds)
        rep = reps["cached"]
    rep["eval_wall_s"] = out
    draft = next(iter(drafts.values()))
    hidden = session.verifier.model.config.hidden_size
    rep["prompt_tokens"] = [len(p.ids) for p in session.prompts]
    rep["draft_block_ms"] = {
        name: draft_step_ms(d, hidden)
        for name, d in (
            [("demo", draft), ("r5", recipe_depth_draft(draft))] if recipe else [("demo", draft)]
        )
    }
    return rep


def loop_figures(
    arms: dict[str, dict[str, list[float]]], reps: dict[str, dict], rounds: int
) -> dict:
    """Totals, per-round spread and the ratios (uncached / cached, and the ceiling
    uncached / free) of one length."""
    tot = {m: {k: sum(v) for k, v in a.items()} for m, a in arms.items()}

    def ratio(k: str, over: str = "cached") -> float:
        return round(tot["uncached"][k] / max(tot[over][k], 1e-9), 3)

    def spread(k: str, over: str = "cached") -> list[float]:  # per-round ratio, min and max
        rs = [u / max(c, 1e-9) for u, c in zip(arms["uncached"][k], arms[over][k])]
        return [round(min(rs), 3), round(max(rs), 3)]

    records = reps["recorded"]["prompt_records"]
    return {
        "rounds": rounds,
        "same_outputs": all(reps[m]["prompt_records"] == records for m in MODES),
        "verify_steps": sum(
            f["verify_steps"]
            for d in reps["cached"]["drafts"].values()
            for f in d["at_temperature"].values()
        ),
        **{
            k: {
                **{m: round(tot[m][k], 2) for m in MODES},
                "ratio": ratio(k),
                "ratio_min_max": spread(k),
                # the most any faster draft could give (a draft that costs nothing)
                "ceiling": ratio(k, "free"),
                "ceiling_min_max": spread(k, "free"),
            }
            for k in ("wall", "spec_decode")
        },
        "draft": {
            **{m: round(tot[m]["draft"], 2) for m in MODES},
            "ratio": ratio("draft"),
            "ratio_min_max": spread("draft"),
        },
        # the draft's share of speculative decode time (Amdahl: the most the cache can save)
        "draft_fraction": {
            m: round(tot[m]["draft"] / max(tot[m]["spec_decode"], 1e-9), 3)
            for m in ("cached", "uncached")
        },
        "spec_decode_fraction_of_wall": round(
            tot["uncached"]["spec_decode"] / max(tot["uncached"]["wall"], 1e-9), 3
        ),
    }


class _Wrapped:
    """A family's drafting context (`extend`, `propose`, and any attribute the decoder
    reads, such as DSpark's `proposed_length`) with `propose` replaced or observed."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def extend(self, hidden: torch.Tensor) -> None:
        self.inner.extend(hidden)

    def propose(self, seq: list[int], choose: Any) -> tuple[list[int], torch.Tensor]:
        return cast("tuple[list[int], torch.Tensor]", self.inner.propose(seq, choose))


@contextlib.contextmanager
def drafting_contexts(wrap: Any) -> Iterator[None]:
    """Within: every drafting context `fanout eval` makes — whatever family made it,
    through the one seam it is made by (`Family.drafting_context`, reached through
    `family_of_draft` in fanout.decode.eval) — is `wrap(context, draft)`."""
    import fanout.decode.eval as ev

    saved = ev.family_of_draft

    class Seam:
        def __init__(self, fam: Any) -> None:
            self.fam = fam

        def __getattr__(self, name: str) -> Any:
            return getattr(self.fam, name)

        def drafting_context(self, draft: DFlashDraft, **kw: Any) -> Any:
            return wrap(self.fam.drafting_context(draft, **kw), draft)

    ev.family_of_draft = lambda draft: Seam(saved(draft))  # type: ignore[assignment, return-value]
    try:
        yield
    finally:
        ev.family_of_draft = saved


def _key(draft: DFlashDraft, seq: list[int]) -> tuple:
    return id(draft), len(seq), hash(tuple(seq))


@contextlib.contextmanager
def replayed_draft(store: dict[tuple, Any], record: bool) -> Iterator[None]:
    """Within: every family's drafting context records what it proposes into `store`
    (`record`), or is replaced by one that returns it from `store` without running the
    draft (a draft that costs nothing; the same tokens, as T = 0 proposals are the
    draft's argmax), with the attributes the decoder reads after a proposal."""

    class Recording(_Wrapped):
        def __init__(self, inner: Any, draft: DFlashDraft) -> None:
            super().__init__(inner)
            self.draft = draft

        def propose(self, seq: list[int], choose: Any) -> tuple[list[int], torch.Tensor]:
            out = super().propose(seq, choose)
            store[_key(self.draft, seq)] = (out, getattr(self.inner, "proposed_length", None))
            return out

    class Replay:
        def __init__(self, _inner: Any, draft: DFlashDraft) -> None:
            self.draft = draft
            self.proposed_length: int | None = None

        def extend(self, hidden: torch.Tensor) -> None:
            pass

        def propose(self, seq: list[int], choose: Any) -> tuple[list[int], torch.Tensor]:
            found = store.get(_key(self.draft, seq))
            if found is None:
                raise RuntimeError("free arm: a proposal the recorded run never made")
            out, self.proposed_length = found
            return cast("tuple[list[int], torch.Tensor]", out)

    with drafting_contexts(Recording if record else Replay):
        yield


@contextlib.contextmanager
def timed_draft(clock: list[float]) -> Iterator[None]:
    """Within: every family's drafting context adds its `extend` + `propose` seconds to
    clock[0]."""

    class Timed(_Wrapped):
        def __init__(self, inner: Any, _draft: DFlashDraft) -> None:
            super().__init__(inner)

        def extend(self, hidden: torch.Tensor) -> None:
            t0 = time.perf_counter()
            super().extend(hidden)
            clock[0] += time.perf_counter() - t0

        def propose(self, seq: list[int], choose: Any) -> tuple[list[int], torch.Tensor]:
            t0 = time.perf_counter()
            out = super().propose(seq, choose)
            if out[1].is_cuda:
                torch.cuda.synchronize(out[1].device)
            clock[0] += time.perf_counter() - t0
            return out

    with drafting_contexts(Timed):
        yield


def recipe_depth_draft(like: Draft) -> DFlashDraft:
    """A draft of DraftRecipe's default depth (5 layers) on `like`'s verifier shapes, full
    vocabulary, random weights: what a block costs at the real recipe's depth."""
    cfg = like.cfg.model_copy(
        update={"num_layers": DraftRecipe().num_layers, "draft_vocab_size": None}
    )
    d = DFlashDraft(cfg, like.embed_weight, like.embed_weight if like.d2t is not None else like.lm_head_weight,
                    like.verifier_norm_weight)  # fmt: skip
    return d.to(like.embed_weight.dtype).eval()


def draft_step_ms(draft, hidden: int, lengths=(64, 320, 1024, 4096), reps: int = 10) -> dict:
    """One draft block (propose logits) at context length p, cached vs uncached: median
    ms of `reps` calls each, the two alternating call by call (load hits both alike)."""
    import statistics
    import time

    from fanout.model.draft_cache import DraftCache, UncachedDraft

    out = {}
    width = len(draft.cfg.target_layer_ids) * hidden
    for p in lengths:
        ctx = torch.randn(p, width, dtype=draft.fc.weight.dtype, device=draft.fc.weight.device)
        seq = [1] * (p + 1)
        modes: dict[str, DraftCache | UncachedDraft] = {
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
