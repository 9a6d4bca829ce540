"""Verifier capture vs a bare HF forward over the same packed rows.

    .venv/bin/python benchmarks/verifier_forward.py                       # tiny Qwen3, CPU
    .venv/bin/python benchmarks/verifier_forward.py --hidden 1024 --layers 8 --vocab 151669 \
        --rows 4 --seq-len 1024 --json /tmp/verifier_forward.json          # bigger, GPU if present

Builds a random Qwen3 (no downloads) and times, over identical packed rows with the
same 4D document mask:
- `forward`: `model(input_ids, attention_mask, position_ids).logits` (full [B, T, vocab]
  logits, what a naive capture would do, without hidden states);
- `capture`: `Verifier.capture` — hooks on the target layers into one [B, T, H]
  buffer per layer, base model only, chunked lm_head argmax for `target_ids`.
`capture_vs_forward` = capture tokens/s ÷ forward tokens/s (≥ 1 means capture costs
nothing extra over the forward it replaces).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from fanout.bench.assets import tiny_qwen3_verifier
from fanout.model.layer_types import FULL, PackingRule
from fanout.model.verifier import Verifier, load_verifier

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import Recorder, Row


def _rows(b: int, t: int, vocab: int, docs: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    cut = t // docs
    doc = (torch.arange(t) // cut).clamp(max=docs - 1).expand(b, t).contiguous()
    pos = (torch.arange(t) - doc[0] * cut).expand(b, t).contiguous()
    return ids, pos, doc


def _time(fn: object, repeats: int, device: torch.device) -> float:
    """The best of `repeats` timed calls after a warm-up."""
    assert callable(fn)
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=128, help="hidden size H")
    p.add_argument("--layers", type=int, default=6, help="decoder layers L")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    p.add_argument("--rows", type=int, default=4, help="packed rows per forward (B)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per row (T)")
    p.add_argument("--docs", type=int, default=4, help="documents per packed row")
    p.add_argument("--draft-layers", type=int, default=2, help="layers captured (DFlash rule)")
    p.add_argument("--chunk-tokens", type=int, default=1024, help="lm_head chunk (tokens)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (best of)")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", default=None, help="write results as JSON to this path")
    a = p.parse_args()
    rec = Recorder("verifier_forward")

    with tempfile.TemporaryDirectory() as tmp:
        heads = max(1, a.hidden // 32)
        d = tiny_qwen3_verifier(
            os.path.join(tmp, "v"),
            a.vocab,
            hidden_size=a.hidden,
            num_layers=a.layers,
            num_heads=heads,
            num_kv_heads=max(1, heads // 2),
            head_dim=32,
            intermediate_size=3 * a.hidden,
        )
        v: Verifier = load_verifier(
            d, device=a.device, num_draft_layers=a.draft_layers, chunk_tokens=a.chunk_tokens
        )
    ids, pos, doc = (x.to(v.device) for x in _rows(a.rows, a.seq_len, a.vocab, a.docs))
    tokens = a.rows * a.seq_len

    @torch.inference_mode()
    def forward() -> None:
        mask = PackingRule((FULL,)).masks(doc, doc)  # [B, 1, T, T]: full attention
        out = v.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
        assert out.logits.shape[-1] == a.vocab  # the full [B, T, vocab] logits exist

    def capture() -> None:
        v.capture(ids, pos, doc)

    t_fwd = _time(forward, a.repeats, v.device)
    t_cap = _time(capture, a.repeats, v.device)
    hw = torch.cuda.get_device_name(v.device) if v.device.type == "cuda" else platform.processor()
    res = {
        "hardware": f"{v.device.type}: {hw or platform.machine()}, torch threads {torch.get_num_threads()}",
        "torch": torch.__version__,
        "sizes": {
            "B": a.rows,
            "T": a.seq_len,
            "H": a.hidden,
            "L": a.layers,
            "vocab": a.vocab,
            "capture_layer_ids": v.capture_layer_ids,
            "dtype": str(v.dtype),
        },
        "forward_tokens_per_s": tokens / t_fwd,
        "capture_tokens_per_s": tokens / t_cap,
        "capture_vs_forward": t_fwd / t_cap,
    }
    print(f"hardware: {res['hardware']}, torch {res['torch']}")
    print(f"sizes:    {res['sizes']}")
    print(f"{'path':<10}{'seconds':>10}{'tokens/s':>14}")
    print(f"{'forward':<10}{t_fwd:>10.4f}{tokens / t_fwd:>14.0f}")
    print(f"{'capture':<10}{t_cap:>10.4f}{tokens / t_cap:>14.0f}")
    print(f"capture_vs_forward = {res['capture_vs_forward']:.3f}")
    z = res["sizes"]
    rec.write(a.json, [
        Row(stage="producer", name="capture_vs_forward",
            what="verifier capture (hooks + chunked argmax) vs a bare forward (tokens/s)",
            result=res["capture_vs_forward"], unit="×", goal=">= 1", met=res["capture_vs_forward"] >= 1,
            n=a.repeats, n_of="runs (best)",
            conditions=f"{v.device.type} {z['dtype'].removeprefix('torch.')}, H {z['H']} × "
            f"{z['L']} layers, vocab {z['vocab']:,}, B {z['B']} × T {z['T']}"),
    ], raw=res)  # fmt: skip


if __name__ == "__main__":
    main()
