"""Trainer-side benchmarks: fused linear CE vs naive, fused vs foreach AdamW, DFlash step.

    .venv/bin/python benchmarks/trainer.py --json out/trainer.json          # full sizes
    .venv/bin/python benchmarks/trainer.py --rows 512 --vocabs 32000 --only ce   # quick look

Linear CE: rows x H inputs against a [vocab, H] head, fp32, forward + backward, in the
DFlash configuration (frozen head, `reduction="none"` per-row losses times per-row
weights). Each variant runs in a fresh process: peak extra memory = `ru_maxrss` after one
fwd+bwd minus `ru_maxrss` once the inputs exist; time = median of the following runs.
Variants: `naive` (F.linear + F.cross_entropy), `chunked` (fanout's autograd.Function,
what `backend="auto"` picks here), `torch` (F.linear_cross_entropy with
LinearCrossEntropyOptions). Keys: `ce_mem_vs_naive`, `ce_time_vs_naive` (chunked / naive
at the largest vocab), `adamw_speedup` (foreach ms / fused ms, ~50M params),
`dflash_step_ms` (fwd+bwd+AdamW at the tiny config printed in the table). `--json`
writes benchmarks/record.py's format (goals: memory <= 0.2 and time <= 1.1 of naive).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]


def _maxrss_bytes() -> int:
    """Peak RSS since the last `_reset_peak` (Linux VmHWM), else the process maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _reset_peak() -> None:
    """Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0), so import
    and setup transients do not hide the op's own peak."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def ce_worker(variant: str, rows: int, hidden: int, vocab: int, repeats: int) -> dict[str, Any]:
    """One variant in this (fresh) process; returns peak extra bytes and median ms."""
    from fanout.ops.linear_ce import linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=g).requires_grad_(True)
    w = torch.randn(vocab, hidden, generator=g) * 0.02  # frozen head
    t = torch.randint(0, vocab, (rows,), generator=g)
    rw = torch.rand(rows, generator=g)
    x.grad = torch.zeros_like(x)  # the grad buffer exists in every variant's baseline

    def run() -> None:
        if variant == "naive":
            loss = F.cross_entropy(F.linear(x, w), t, reduction="none")
        else:
            loss = linear_cross_entropy(x, w, t, reduction="none", backend=variant)  # type: ignore[arg-type]
        (loss * rw).sum().backward()

    _reset_peak()
    base = _maxrss_bytes()
    run()
    peak = _maxrss_bytes() - base
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"peak_extra_bytes": peak, "ms": statistics.median(times), "ms_all": times}


def bench_ce(
    rows: int, hidden: int, vocabs: list[int], repeats: int, variants: list[str]
) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for vocab in vocabs:
        for variant in variants:
            cmd = [
                sys.executable,
                __file__,
                "--_ce-worker",
                variant,
                str(rows),
                str(hidden),
                str(vocab),
                str(repeats),
            ]
            env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            res[f"{variant}@{vocab}"] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"  ce {variant:8s} vocab={vocab}: {res[f'{variant}@{vocab}']}", flush=True)
    return res


def bench_adamw(n_layers: int = 48, width: int = 1024, steps: int = 10) -> dict[str, Any]:
    from fanout.ops.adamw import make_optimizer

    out: dict[str, Any] = {}
    for backend in ("fused", "foreach"):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(width, width) * 0.02) for _ in range(n_layers)]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt, chosen = make_optimizer(
            params,
            lr=1e-4,
            weight_decay=0.01,
            backend=backend,
            max_grad_norm=1.0,
        )
        for _ in range(3):
            opt.step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            opt.step()
            times.append((time.perf_counter() - t0) * 1e3)
        out[chosen] = statistics.median(times)
        out[f"{chosen}_all"] = times
    out["params"] = n_layers * width * width
    return out


def bench_dflash(steps: int = 5) -> dict[str, Any]:
    from fanout.families.dflash.model import DFlashDraft
    from fanout.model.draft_config import DraftConfig
    from fanout.ops.adamw import make_optimizer

    cfg = DraftConfig(
        hidden_size=256,
        intermediate_size=768,
        num_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=32000,
        block_size=8,
        max_anchors=64,
        mask_token_id=31999,
        target_layer_ids=[1, 5, 9],
    )
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.02
    draft = DFlashDraft(cfg, embed, embed, torch.ones(cfg.hidden_size))
    opt, _ = make_optimizer(draft.parameters(), lr=1e-4, max_grad_norm=1.0)
    b, t = 2, 1024
    batch = {
        "hidden_states": torch.randn(b, t, 3 * cfg.hidden_size, generator=g).bfloat16(),
        "input_ids": torch.randint(0, 32000, (b, t), generator=g),
        "target_ids": torch.randint(0, 32000, (b, t), generator=g),
        "loss_mask": torch.ones(b, t, dtype=torch.uint8),
        "document_ids": (torch.arange(t) // 256).expand(b, t),
        "position_ids": (torch.arange(t) % 256).expand(b, t),
    }
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        out = draft.loss(batch, g)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    config = {
        "rows": b,
        "T": t,
        "max_anchors": 64,
        "block_size": 8,
        "hidden": 256,
        "layers": 1,
        "vocab": 32000,
        "n_ctx_layers": 3,
        "dtype": "fp32 (bf16 inputs)",
    }
    return {"ms": statistics.median(times), "ms_all": times, "config": config}


def hardware() -> dict[str, Any]:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpus_usable": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096, help="linear CE rows (default 4096)")
    ap.add_argument("--hidden", type=int, default=1024, help="linear CE width H (default 1024)")
    ap.add_argument("--vocabs", default="151936,32000", help="comma list of vocab sizes")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per CE variant")
    ap.add_argument(
        "--ce-variants",
        default="naive,chunked,torch",
        help="linear CE variants to run (naive and chunked are needed for the keys)",
    )
    ap.add_argument(
        "--only",
        action="append",
        choices=["ce", "adamw", "dflash"],
        help="run only these parts (repeatable; default all)",
    )
    ap.add_argument("--json", type=Path, help="write results to this JSON file")
    ap.add_argument("--_ce-worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._ce_worker:
        v, r, h, voc, rep = args._ce_worker
        print(json.dumps(ce_worker(v, int(r), int(h), int(voc), int(rep))))
        return 0
    sys.path.insert(0, str(REPO / "benchmarks"))
    from record import Recorder

    rec = Recorder("trainer", argv)
    parts = args.only or ["ce", "adamw", "dflash"]
    result: dict[str, Any] = {"hardware": hardware()}
    rows_out: list[tuple[str, str]] = []
    if "ce" in parts:
        vocabs = [int(v) for v in args.vocabs.split(",")]
        ce = bench_ce(args.rows, args.hidden, vocabs, args.repeats, args.ce_variants.split(","))
        result["ce"] = {"rows": args.rows, "hidden": args.hidden, "results": ce}
        top = max(vocabs)
        result["ce_mem_vs_naive"] = ce[f"chunked@{top}"]["peak_extra_bytes"] / max(
            ce[f"naive@{top}"]["peak_extra_bytes"], 1
        )
        result["ce_time_vs_naive"] = ce[f"chunked@{top}"]["ms"] / ce[f"naive@{top}"]["ms"]
        for k, v in ce.items():
            rows_out.append(
                (
                    f"linear CE {k} (rows={args.rows}, H={args.hidden}, fp32)",
                    f"{v['ms']:.0f} ms, peak +{v['peak_extra_bytes'] / 2**20:.0f} MiB",
                )
            )
        rows_out.append(("ce_mem_vs_naive", f"{result['ce_mem_vs_naive']:.3f}"))
        rows_out.append(("ce_time_vs_naive", f"{result['ce_time_vs_naive']:.3f}"))
    if "adamw" in parts:
        ad = bench_adamw()
        result["adamw"] = ad
        result["adamw_speedup"] = ad["foreach"] / ad["fused"]
        rows_out.append(
            (f"AdamW step fused ({ad['params'] / 1e6:.0f}M params)", f"{ad['fused']:.1f} ms")
        )
        rows_out.append(("AdamW step foreach", f"{ad['foreach']:.1f} ms"))
        rows_out.append(("adamw_speedup", f"{result['adamw_speedup']:.2f}x"))
    if "dflash" in parts:
        df = bench_dflash()
        result["dflash"] = df
        result["dflash_step_ms"] = df["ms"]
        rows_out.append(("dflash_step_ms (fwd+bwd+AdamW, config below)", f"{df['ms']:.0f} ms"))
    hw = result["hardware"]
    print(
        f"\nhardware: {hw['cpu']}, {hw['cpus_usable']} usable CPUs, torch {hw['torch']}, "
        f"{hw['torch_threads']} threads, cuda={hw['cuda']}"
    )
    width = max(len(a) for a, _ in rows_out) if rows_out else 10
    for a, b in rows_out:
        print(f"{a:<{width}}  {b}")
    if "dflash" in result:
        print(f"dflash config: {result['dflash']['config']}")
    rec.write(args.json, record_rows(result, args), raw=result)
    return 0


def record_rows(result: dict[str, Any], args: argparse.Namespace) -> list[Any]:
    """The record's rows (benchmarks/record.py)."""
    from record import Row, spread

    out = []
    threads = f"{result['hardware']['torch_threads']} torch threads"
    if "ce" in result:
        top = max(int(v) for v in args.vocabs.split(","))
        ce = result["ce"]["results"]
        size = f"rows {args.rows}, H {args.hidden}, vocab {top:,}, fp32, fwd + bwd; {threads}"
        naive, chunked = ce[f"naive@{top}"], ce[f"chunked@{top}"]
        out += [
            Row(
                stage="training",
                name="ce_memory_vs_naive",
                what="fused linear CE vs naive: peak extra memory",
                result=result["ce_mem_vs_naive"],
                unit="×",
                goal="<= 0.2",
                met=result["ce_mem_vs_naive"] <= 0.2,
                conditions=f"{size}; {chunked['peak_extra_bytes'] / 2**20:,.0f} vs "
                f"{naive['peak_extra_bytes'] / 2**20:,.0f} MiB",
            ),
            Row(
                stage="training",
                name="ce_time_vs_naive",
                what="fused linear CE vs naive: time",
                result=result["ce_time_vs_naive"],
                unit="×",
                n=len(chunked["ms_all"]),
                spread=spread([c / n for c, n in zip(chunked["ms_all"], naive["ms_all"])]),
                goal="<= 1.1",
                met=result["ce_time_vs_naive"] <= 1.1,
                conditions=f"{size}; median {chunked['ms']:,.0f} vs {naive['ms']:,.0f} ms",
            ),
        ]
    if "adamw" in result:
        ad = result["adamw"]
        out.append(
            Row(
                stage="training",
                name="adamw_speedup",
                what="fused vs foreach AdamW step (speed-up)",
                result=result["adamw_speedup"],
                unit="×",
                n=len(ad["fused_all"]),
                n_of="steps",
                spread=spread([f / g for f, g in zip(ad["foreach_all"], ad["fused_all"])]),
                conditions=f"{ad['params'] / 1e6:.0f}M params, CPU, clipping folded in; {threads}",
            )
        )
    if "dflash" in result:
        df = result["dflash"]
        c = df["config"]
        out.append(
            Row(
                stage="training",
                name="dflash_step_ms",
                what="DFlash draft step (fwd + bwd + AdamW)",
                result=df["ms"],
                unit="ms",
                spread=spread(df["ms_all"]),
                n=len(df["ms_all"]),
                n_of="steps",
                conditions=f"rows {c['rows']} × T {c['T']}, {c['max_anchors']} anchors, "
                f"block {c['block_size']}, H {c['hidden']}, {c['layers']} layer, vocab "
                f"{c['vocab']:,}; {threads}",
            )
        )
    return out  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
