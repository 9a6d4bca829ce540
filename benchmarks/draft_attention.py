"""Every family's train step at the real recipe's shape: dense vs block-sparse draft attention vs speculators.

    .venv/bin/python benchmarks/draft_attention.py --rounds 2 --repeats 1 \
        --json benchmarks/results/draft_attention.json     # the saved record
    .venv/bin/python benchmarks/draft_attention.py --families dflash eagle3 --repeats 2
    python3 benchmarks/draft_attention.py --device cuda --hidden 4096 --heads 32 --kv-heads 8 \\
        --head-dim 128 --intermediate 12288 --vocab 32000 --draft-layers 5   # GPU (checks.sh)

Run from the repository root. The saved record's command takes ≈ 10 min on the shared
2-vCPU machine when it is quiet, three times that under the other sessions' load.

The shape is DFlash's recipe (docs/training.md): one packed row of T = `--rows` 3072
tokens (one document, every token supervised), `--anchors` 512 anchors, block
`--block` 16 (each family's own width at it: `Family.block_size_for`, EAGLE-3 its TTT
steps), the draft `--draft-layers` deep; the width is scaled down on the CPU (`--hidden`
256, 4 heads of 64, 2 KV heads; a random tiny Qwen3 verifier of that width, vocabulary
`--vocab`) and full size on a GPU. Rows, checkpoint, speculators' model, its trainer
kwargs and its inputs are benchmarks/families.py's step comparison's (`step_rows`,
`_speculators`, `spec_model`, `step_batches`, `_adamw`, `_timed`), at this shape.

Per family, three sides, each in a fresh subprocess (so one side's allocations never
count in another's peak):
- `dense`: fanout's draft with every attention as the one dense masked SDPA over all
  keys (`fanout.model.draft_attention.dense_reference`: the attention as it was before
  it computed only what the mask allows);
- `sparse`: fanout's draft as it trains (`prefix_attention`: only the allowed blocks);
- `speculators`: speculators 0.9.0's model of the same checkpoint, its attention
  `--spec-attention` (eager on the CPU: torch 2.13's flex attention has no CPU
  backward; on CUDA its default, simple_flex_attention, with a compiled block mask).
One step = forward + loss, backward, AdamW step; `--warmup` untimed steps then
`--repeats` timed, in each of `--rounds` fresh processes per side (the sides' order
reversed every round, so drifting load hits each alike); median and min–max of all
timed steps, the highest peak of the rounds. Peak memory of the step: CPU, the process's
`VmHWM` (/proc/self/status) after the steps minus its `VmRSS` before them (the peak is
reset there through /proc/self/clear_refs); CUDA, `torch.cuda.max_memory_allocated`
over the steps minus what was allocated before them. Goals (issue #44): sparse ≤ 1.0×
speculators' time and ≤ its peak.

`--json OUT` (benchmarks/record.py format): `raw.families.<name>.<side>.{median_ms,
min_ms,max_ms,runs_ms,peak_mb,base_mb,first_loss,rounds}` (or `error`), the ratios and the
sizes; rows `draft_attention.time_vs_speculators.<name>`,
`draft_attention.peak_vs_speculators.<name>`, `draft_attention.sparse_vs_dense.<name>`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from families import Peak, _adamw, _speculators, _timed, spec_model, step_batches, step_rows
from fanout import package_version
from fanout.families.registry import FAMILIES
from record import Recorder, Row

REPO = Path(__file__).resolve().parents[1]
SIDES = ("dense", "sparse", "speculators")
GOAL = 1.0  # sparse / speculators, time and peak memory


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--json", type=Path, help="write the record to this JSON file")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "draft_attention", help="work dir")
    ap.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    ap.add_argument("--rows", type=int, default=3072, help="T: tokens of the row")
    ap.add_argument("--anchors", type=int, default=512, help="anchors (P-EAGLE: chain seeds)")
    ap.add_argument("--block", type=int, default=16, help="block size")
    ap.add_argument("--draft-layers", type=int, default=1, help="draft decoder layers")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size")
    ap.add_argument("--heads", type=int, default=4, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    ap.add_argument("--head-dim", type=int, default=64, help="per-head width")
    ap.add_argument("--intermediate", type=int, default=768, help="draft MLP width")
    ap.add_argument("--vocab", type=int, default=8192, help="verifier vocabulary")
    ap.add_argument("--verifier-layers", type=int, default=8, help="random verifier's layers")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument(
        "--spec-attention",
        default=None,
        help="speculators' attention (default: eager on cpu, its own on cuda)",
    )
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per side and round")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="fresh processes per side, the sides' order reversed every round",
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads (CPU)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per side")
    ap.add_argument("--worker", nargs=2, metavar=("FAMILY", "SIDE"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.rows <= a.anchors + a.block:
        ap.error("--rows must exceed --anchors + --block (anchors < T - block size)")
    if a.spec_attention is None:
        a.spec_attention = "eager" if a.device == "cpu" else "simple_flex_attention"
    return a


# ------------------------------------------------------------------ one side (a subprocess)


def _verifier(a: argparse.Namespace) -> Path:
    from fanout.bench.assets import tiny_qwen3_verifier

    d = a.out / f"verifier-v{a.vocab}-h{a.hidden}-{a.heads}x{a.head_dim}-kv{a.kv_heads}"
    if not (d / "config.json").is_file():  # small verifier MLPs: only the draft's width counts
        tiny_qwen3_verifier(d, a.vocab, hidden_size=a.hidden, num_layers=a.verifier_layers,
                            num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.head_dim,
                            intermediate_size=64)  # fmt: skip
    return d


def _fields(name: str, a: argparse.Namespace, layers: list[int]) -> dict[str, Any]:
    return {
        "target_layer_ids": layers,
        "block_size": FAMILIES[name].block_size_for(a.block),
        "max_anchors": a.anchors,
        "num_layers": a.draft_layers,
        "intermediate_size": a.intermediate,
        "loss_type": "ce",
    }


def run_side(name: str, side: str, a: argparse.Namespace) -> dict[str, Any]:
    """One family's steps on one side, in this process: times and peak memory."""
    from fanout.families.registry import family
    from fanout.model.draft_attention import dense_reference
    from fanout.model.draft_config import default_target_layer_ids

    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    vdir = _verifier(a)
    layers = FAMILIES[name].draft_layers(default_target_layer_ids(a.verifier_layers, 3), vdir)
    rows = step_rows(vdir, layers, _families_args(a))
    torch.manual_seed(0)
    draft = family(name).build(vdir, **_fields(name, a, layers))
    with torch.no_grad():  # bf16-rounded weights: the checkpoint's numbers on both sides
        for p in draft.parameters():
            p.copy_(p.bfloat16().float())
    gen = torch.Generator().manual_seed(0)
    if side in ("dense", "sparse"):
        draft.to(dev)
        batch = {k: v.to(dev) for k, v in rows.items() if k != "pre"}
        if not family(name).needs_last_hidden_states(draft.cfg.model_dump()):
            batch.pop("last_hidden_states")
        if name == "mtp":  # the last layer's states, as step_batches gives them
            batch["hidden_states"] = rows["pre"].to(dev)
        opt = _adamw(draft)

        def forward() -> torch.Tensor:
            if side == "dense":
                with dense_reference():
                    return draft.loss(batch, gen).loss
            return draft.loss(batch, gen).loss
    else:
        forward, opt = _speculators_side(name, draft, rows, vdir, a)
    step = _timed(forward, opt)  # benchmarks/families.py's step: forward + loss, backward, AdamW
    peak = Peak(a.device)
    peak.start()
    losses, runs = [], []
    for i in range(a.warmup + a.repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        *_, loss = step()
        if dev.type == "cuda":  # its split times are launch times there; the total is not
            torch.cuda.synchronize()
        losses.append(loss)
        if i >= a.warmup:
            runs.append(1e3 * (time.perf_counter() - t0))
    return {
        "median_ms": round(statistics.median(runs), 1),
        "min_ms": round(min(runs), 1),
        "max_ms": round(max(runs), 1),
        "runs_ms": [round(x, 1) for x in runs],
        "peak_mb": round(peak.stop(), 1),
        "base_mb": round(peak.base, 1),
        "first_loss": round(losses[0], 4),
    }


def _families_args(a: argparse.Namespace) -> argparse.Namespace:
    """This run's sizes under the names benchmarks/families.py's step helpers read."""
    return argparse.Namespace(step_rows=a.rows, step_hidden=a.hidden, step_vocab=a.vocab,
                              step_anchors=a.anchors, step_loss="ce")  # fmt: skip


def _speculators_side(
    name: str, draft: Any, rows: dict[str, torch.Tensor], vdir: Path, a: argparse.Namespace
) -> tuple[Any, torch.optim.Optimizer]:
    """speculators' model of `draft`'s checkpoint and its forward, as benchmarks/families.py
    builds them (`spec_model`, `step_batches`), with `--spec-attention`."""
    from fanout.checkpoints.save import save_checkpoint

    spec = _speculators()
    assert spec is not None, "speculators is not installed (scripts/install_speculators.sh)"
    ckpt = save_checkpoint(a.out / "ckpt" / name, draft, _adamw(draft), {"step": 0},
                           verifier_name_or_path=str(vdir))  # fmt: skip
    if a.spec_attention == "eager":
        model = spec_model(spec[name], ckpt)
    else:  # spec_model with speculators' own attention (its flex attention on CUDA)
        model_cls, config_cls = spec[name]
        scfg = config_cls.from_pretrained(str(ckpt))
        scfg.transformer_layer_config._attn_implementation = a.spec_attention
        model = model_cls.from_pretrained(str(ckpt), config=scfg, dtype=torch.float32).train()
    model.to(a.device)
    _, spec_rows, kw = step_batches(name, draft, model, rows, _families_args(a))
    spec_rows = {k: v.to(a.device) for k, v in spec_rows.items()}

    def forward() -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            _, loss, _ = model(**spec_rows, **kw)
        return loss

    return forward, _adamw(model)


# ------------------------------------------------------------------ the parent


def _argv_of(a: argparse.Namespace) -> list[str]:
    out = ["--out", str(a.out)]
    for k in ("rows", "anchors", "block", "draft_layers", "hidden", "heads", "kv_heads",
              "head_dim", "intermediate", "vocab", "verifier_layers", "device",
              "spec_attention", "warmup", "repeats", "threads"):  # fmt: skip
        out += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    return out


def spawn(name: str, side: str, a: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", name, side, *_argv_of(a)]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {a.timeout:.0f} s"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:]) | {"wall_s": round(time.monotonic() - t0, 1)}
    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {p.returncode}: " + " | ".join(tail)}


def _pooled(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's rounds as one: the median and range of all their timed steps, the
    highest peak (an error of any round is the side's)."""
    if bad := [r for r in rounds if "error" in r]:
        return bad[0]
    runs = [x for r in rounds for x in r["runs_ms"]]
    return {
        "median_ms": round(statistics.median(runs), 1),
        "min_ms": min(runs),
        "max_ms": max(runs),
        "runs_ms": runs,
        "peak_mb": max(r["peak_mb"] for r in rounds),
        "base_mb": max(r["base_mb"] for r in rounds),
        "first_loss": rounds[0]["first_loss"],
        "rounds": rounds,
    }


def _ratio(x: dict[str, Any], y: dict[str, Any], key: str) -> float | None:
    if key in x and key in y and y[key] > 0:
        return round(x[key] / y[key], 3)
    return None


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.worker:
        name, side = a.worker
        print("RESULT " + json.dumps(run_side(name, side, a)), flush=True)
        return 0
    rec = Recorder("draft_attention", argv)
    _verifier(a)  # built once, before the timed subprocesses
    fams: dict[str, Any] = {}
    for name in a.families:
        fams[name] = {}
        for i in range(a.rounds):  # drifting load hits every side alike
            for side in a.sides if i % 2 == 0 else a.sides[::-1]:
                print(f"{name} {side} (round {i + 1}) …", flush=True)
                fams[name].setdefault(side, []).append(spawn(name, side, a))
        r = fams[name] = {side: _pooled(res) for side, res in fams[name].items()}
        if "sparse" in r and "speculators" in r:
            r["time_vs_speculators"] = _ratio(r["sparse"], r["speculators"], "median_ms")
            r["peak_vs_speculators"] = _ratio(r["sparse"], r["speculators"], "peak_mb")
        if "sparse" in r and "dense" in r:
            r["time_vs_dense"] = _ratio(r["sparse"], r["dense"], "median_ms")
            r["peak_vs_dense"] = _ratio(r["sparse"], r["dense"], "peak_mb")
    sizes = {
        "T": a.rows, "anchors": a.anchors, "block": a.block, "draft_layers": a.draft_layers,
        "hidden": a.hidden, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
        "intermediate": a.intermediate, "vocab": a.vocab, "device": a.device,
        "dtype": "float32", "rows": "one row, one document, every token supervised",
        "speculators_attention": a.spec_attention, "threads": a.threads,
        "warmup": a.warmup, "repeats": a.repeats, "rounds": a.rounds,
    }  # fmt: skip
    lines = table(rec.head, sizes, fams)
    print("\n" + "\n".join(lines))
    rec.write(a.json, record_rows(sizes, fams), raw={"sizes": sizes, "families": fams})
    if a.json:
        print(f"\njson: {a.json}")
    return 0


def _cell(r: dict[str, Any]) -> str:
    if "error" in r:
        return "error"
    return f"{r['median_ms']:.0f} ({r['min_ms']:.0f}–{r['max_ms']:.0f}) {r['peak_mb']:.0f} MB"


def table(head: dict[str, Any], s: dict[str, Any], fams: dict[str, Any]) -> list[str]:
    hw = head["hardware"]
    lines = [
        f"hardware: {hw.get('cpu')}, {hw.get('usable_cpus')}/{hw.get('logical_cpus')} CPUs, "
        f"GPUs {hw.get('gpus') or 'none'}; torch {head['versions']['torch']}, speculators "
        f"{package_version('speculators') or 'not installed'}; load {head['load']['before']}",
        f"shape: T {s['T']}, {s['anchors']} anchors, block {s['block']}, {s['draft_layers']} "
        f"draft layer(s), h {s['hidden']} ({s['heads']}×{s['head_dim']}, {s['kv_heads']} kv), "
        f"MLP {s['intermediate']}, vocab {s['vocab']}; {s['device']} fp32, {s['threads']} "
        f"thread(s); speculators attention {s['speculators_attention']}; {s['rounds']} round(s) "
        f"per side, each a fresh process of {s['warmup']} warm-up + {s['repeats']} timed steps",
        f"{'family':<8} {'dense ms med (min–max) peak':>30} {'sparse':>30} "
        f"{'speculators':>30} {'time/spec':>9} {'peak/spec':>9} {'time/dense':>10}",
    ]
    for name, r in fams.items():
        cells = [_cell(r[x]) if x in r else "-" for x in SIDES]
        ts, ps, td = (r.get(k) for k in ("time_vs_speculators", "peak_vs_speculators",
                                         "time_vs_dense"))  # fmt: skip
        lines.append(
            f"{name:<8} {cells[0]:>30} {cells[1]:>30} {cells[2]:>30} "
            f"{_num(ts):>9} {_num(ps):>9} {_num(td):>10}"
        )
    errors = [f"{n} {x}: {r[x]['error']}" for n, r in fams.items() for x in SIDES
              if x in r and "error" in r[x]]  # fmt: skip
    return lines + errors


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def record_rows(s: dict[str, Any], fams: dict[str, Any]) -> list[Row]:
    cond = (f"T {s['T']}, {s['anchors']} anchors, block {s['block']}, {s['draft_layers']} "
            f"draft layer(s), h {s['hidden']}, vocab {s['vocab']}, {s['device']} fp32, "
            f"speculators {s['speculators_attention']}")  # fmt: skip
    out = []
    for name, r in fams.items():
        sp, de, spec = r.get("sparse", {}), r.get("dense", {}), r.get("speculators", {})
        if r.get("time_vs_speculators") is not None:
            out.append(Row(stage="training", name=f"draft_attention.time_vs_speculators.{name}",
                           what=f"{name} train step at the recipe's shape vs speculators' "
                           "(time ratio)", result=r["time_vs_speculators"], unit="×",
                           n=len(sp["runs_ms"]), n_of="steps", goal=f"<= {GOAL}",
                           met=r["time_vs_speculators"] <= GOAL,
                           conditions=f"{cond}; {sp['median_ms']:.0f} vs "
                           f"{spec['median_ms']:.0f} ms"))  # fmt: skip
        if r.get("peak_vs_speculators") is not None:
            out.append(Row(stage="training", name=f"draft_attention.peak_vs_speculators.{name}",
                           what=f"{name} train step's peak memory vs speculators'",
                           result=r["peak_vs_speculators"], unit="×", goal=f"<= {GOAL}",
                           met=r["peak_vs_speculators"] <= GOAL,
                           conditions=f"{cond}; {sp['peak_mb']:.0f} vs {spec['peak_mb']:.0f} "
                           "MB above the process's level before the steps"))  # fmt: skip
        if r.get("time_vs_dense") is not None:
            out.append(Row(stage="training", name=f"draft_attention.sparse_vs_dense.{name}",
                           what=f"{name} train step, block-sparse vs dense masked attention "
                           "(time ratio)", result=r["time_vs_dense"], unit="×",
                           n=len(sp["runs_ms"]), n_of="steps",
                           conditions=f"{cond}; {sp['median_ms']:.0f} vs {de['median_ms']:.0f} "
                           f"ms, peak {sp['peak_mb']:.0f} vs {de['peak_mb']:.0f} MB"))  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
