"""Producer end to end vs a bare `model(...)` forward loop over the same packed rows.

    .venv/bin/python benchmarks/producer.py                                  # tiny, CPU
    .venv/bin/python benchmarks/producer.py --hidden 1024 --layers 8 --seq-len 2048 \
        --window-rows 8 --windows 16 --json /tmp/producer.json             # GPU if present

One run, one model, the same rows: a random Qwen3 (no downloads) is saved with
`save_pretrained`; chat data (default ../shared/data/chat/fastchat) is prepared
with the Qwen3 tokenizer (cached, not timed); then
- `forward`: for every window, its rows (`stream_rows`) in batches of
  `--capture-batch-rows`, `model(input_ids, attention_mask=<4D document mask>,
  position_ids)` — full `[B, T, vocab]` logits, nothing kept, nothing written;
- `producer`: `Producer.run()` over the same windows — hooks on the target layers,
  chunked greedy ids, window assembly, checksummed fsynced publish, coordinator
  commits, heartbeats (K ≥ windows, so it never waits on a consumer).
`producer_vs_forward` = producer tokens/s ÷ forward tokens/s (goal ≥ 0.9). Tokens
are row tokens (R·T per window, padding included) on both sides. The producer's
own split (capture vs publish seconds) says where its time goes.
`check_vs_capture`: what the capture check (fanout.produce.capture_check) costs, as a
share of the producer's capture seconds in the same run (goal ≤ 2 %): the hooks'
`token_stats` of every captured layer output ([B, T, H] at the compute dtype, on the
verifier's device) into its stats buffer, plus `check_window` on each window's stats,
timed alone over the same windows.

Tensor parallelism (`--tp N`, under torchrun; fanout.produce.tp_capture):

    torchrun --nproc-per-node 2 benchmarks/producer.py --tp 2 --json /tmp/tp.json

rank 0 first produces the windows alone (TP 1), then all N ranks produce the same
windows again as one TP producer; it prints tokens/s at TP N vs 1 and per device,
and checks that the windows match (ids exactly, hidden states within
`torch.testing.assert_close`'s tolerance for the storage dtype).

`--repeats N` runs forward + producer N times (median; the spread is the min–max of the
per-run ratios). `--json` writes benchmarks/record.py's format: a result JSON kept in
benchmarks/results/ (e.g. `producer-h200.json` from the GPU box) appears in docs/numbers.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from fanout.bench.assets import tiny_qwen3_verifier
from fanout.model.layer_types import FULL, PackingRule
from fanout.model.verifier import token_stats
from fanout.produce.capture_check import check_window
from fanout.produce.config import ProducerConfig
from fanout.produce.producer import Producer
from fanout.produce.stream import stream_rows

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))
from record import Recorder, Row, spread  # noqa: E402  (a sibling script)
from window_files import window_names  # noqa: E402  (the tests' helper: fanout needs none)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def forward_loop(p: Producer, windows: int) -> tuple[float, int]:
    """Seconds and row tokens of a bare forward over the producer's first `windows` windows."""
    cfg, v = p.cfg, p.verifier
    model, dev = v.model, v.device
    batches = []
    for w in range(windows):
        idx, _ = stream_rows(w, cfg.window_rows, p.dataset.num_rows, cfg.epochs, cfg.seed)
        rows = p.dataset.rows(idx)  # [R, T] numpy each
        for s in range(0, len(idx), cfg.capture_batch_rows):
            sl = slice(s, s + cfg.capture_batch_rows)
            batches.append(
                tuple(
                    torch.from_numpy(rows[k][sl])
                    for k in ("input_ids", "position_ids", "document_ids")
                )
            )
    tokens = sum(b[0].numel() for b in batches)

    @torch.inference_mode()
    def run(bs: list[tuple[torch.Tensor, ...]]) -> None:
        for ids, pos, doc in bs:
            ids, pos, doc = ids.to(dev, torch.long), pos.to(dev, torch.long), doc.to(dev)
            mask = PackingRule((FULL,)).masks(doc, doc)  # [B, 1, T, T]: full attention
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
            out.logits[:, -1, :1].cpu()  # wait for it, as a consumer of the logits would

    run(batches[:1])  # warm-up
    _sync(dev)
    t0 = time.perf_counter()
    run(batches)
    _sync(dev)
    return time.perf_counter() - t0, tokens


def check_cost(p: Producer, windows: int) -> float:
    """Seconds the capture check takes over the producer's first `windows` windows (see
    the module doc): per batch and captured layer `token_stats` into a stats buffer, per
    window `check_window`; layer outputs are random at the verifier's dtype and device."""
    cfg, v = p.cfg, p.verifier
    n, b, dev = len(v.capture_layer_ids), cfg.capture_batch_rows, v.device
    x = torch.randn(b, cfg.seq_len, v.hidden_size, dtype=v.dtype, device=dev)  # [B, T, H]
    seconds = 0.0
    for w in range(windows):
        idx, _ = stream_rows(w, cfg.window_rows, p.dataset.num_rows, cfg.epochs, cfg.seed)
        rows = p.dataset.rows(idx)
        docs = torch.from_numpy(rows["document_ids"]).long()  # [R, T]
        targets = torch.from_numpy(rows["input_ids"]).long()  # [R, T]: ids that vary
        r = docs.shape[0]
        stats = torch.empty(n, r, cfg.seq_len, 3, dtype=torch.float32, device=dev)
        _sync(dev)
        t0 = time.perf_counter()
        for s in range(0, r, b):
            for j in range(n):
                k = min(b, r - s)
                stats[j, s : s + k].copy_(token_stats(x[:k]))
        host = stats.cpu()
        check_window(host, docs, targets, v.capture_layer_ids)
        seconds += time.perf_counter() - t0
    return seconds


@contextmanager
def _profiled(out_dir: str | None, name: str) -> Iterator[None]:
    """torch.profiler around one loop when --profile is given: top ops + a Chrome trace."""
    if out_dir is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts) as prof:
        yield
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(Path(out_dir) / f"{name}.trace.json"))
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25)
    (Path(out_dir) / f"{name}.top.txt").write_text(table + "\n")
    print(f"--- {name}: top operators by {key}\n{table}")


def _verifier(a: argparse.Namespace, tmp: str) -> Path:
    """The random Qwen3 of the sizes asked for, saved under `tmp` (at least --tp heads)."""
    heads = max(a.tp, a.hidden // 32)
    return tiny_qwen3_verifier(
        os.path.join(tmp, "verifier"),
        a.vocab,
        hidden_size=a.hidden,
        num_layers=a.layers,
        num_heads=heads,
        num_kv_heads=max(a.tp, heads // 2),
        head_dim=32,
        intermediate_size=3 * a.hidden,
    )


def _config(a: argparse.Namespace, tmp: str, ver: Path, run: str, **kw: Any) -> ProducerConfig:
    return ProducerConfig(
        run_dir=os.path.join(tmp, run),
        verifier_name_or_path=str(ver),
        data=a.data,
        tokenizer=a.tokenizer,
        seq_len=a.seq_len,
        window_rows=a.window_rows,
        max_live_windows=a.windows + 1,  # every window fits (K - 1 for the stream)
        num_draft_layers=a.num_draft_layers,
        capture_batch_rows=a.capture_batch_rows,
        device=a.device,
        dtype=a.dtype,
        storage_dtype=a.storage_dtype,
        max_windows=a.windows,
        epochs=1000,  # endless enough: max_windows ends the run
        cache_dir=os.path.join(tmp, "cache"),
        progress=False,
        exit_when_idle_s=0,
        **kw,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=64, help="verifier hidden size H")
    ap.add_argument("--layers", type=int, default=6, help="verifier decoder layers L")
    ap.add_argument("--vocab", type=int, default=151669, help="vocab (>= tokenizer's 151,669)")
    ap.add_argument("--num-draft-layers", type=int, default=3, help="target layers (DFlash rule)")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per packed row T")
    ap.add_argument("--window-rows", type=int, default=4, help="rows per window R")
    ap.add_argument("--windows", type=int, default=8, help="windows to produce")
    ap.add_argument("--capture-batch-rows", type=int, default=4, help="rows per forward")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU) | ...")
    ap.add_argument(
        "--storage-dtype", default="bfloat16", help="window hidden states: bfloat16 | float8_e4m3fn"
    )
    ap.add_argument(
        "--data", nargs="+", default=[str(SHARED / "chat/fastchat/dummy_conversation.json")]
    )
    ap.add_argument("--tokenizer", default=str(SHARED / "tokenizers/qwen3"))
    ap.add_argument("--workdir", default=None, help="run dir parent (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write results as JSON to this path")
    ap.add_argument(
        "--profile",
        default=None,
        help="directory: run both loops under torch.profiler instead of plain timing, print "
        "each one's top operators and write Chrome traces there (numbers are then inflated)",
    )
    ap.add_argument("--tp", type=int, default=1, help="> 1: TP N vs 1 under torchrun")
    ap.add_argument("--repeats", type=int, default=1, help="forward + producer runs (median)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if a.tp > 1:
        tp_main(a)
        return

    rec = Recorder("producer")
    fwds: list[float] = []
    prods: list[float] = []
    checks: list[float] = []  # capture check seconds ÷ the run's capture seconds
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        ver = _verifier(a, tmp)
        for i in range(a.repeats):  # forward, then producer, `--repeats` times
            p = Producer(_config(a, tmp, ver, f"run{i}"))  # prepare + load: not timed
            with _profiled(a.profile, "forward"):
                t_fwd, tokens = forward_loop(p, a.windows)
            p.verifier.capture(  # warm-up of the capture path, at the batch shape it will run
                *(torch.zeros(a.capture_batch_rows, a.seq_len, dtype=torch.long) for _ in range(3))
            )
            _sync(p.verifier.device)
            with _profiled(a.profile, "producer"):
                t0 = time.perf_counter()
                summary: dict[str, Any] = p.run()
                _sync(p.verifier.device)
                t_prod = time.perf_counter() - t0
            assert summary["windows"] == a.windows, summary
            assert summary["bad_captures"] == 0, summary
            fwds.append(t_fwd)
            prods.append(t_prod)
            checks.append(check_cost(p, a.windows) / summary["capture_s"])
        t_fwd, t_prod = statistics.median(fwds), statistics.median(prods)
        dev = p.verifier.device
        hw = (
            torch.cuda.get_device_name(dev)
            if dev.type == "cuda"
            else (platform.processor() or platform.machine())
        )
        res = {
            "hardware": f"{dev.type}: {hw}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}",
            "torch": torch.__version__,
            "sizes": {
                "H": a.hidden,
                "L": a.layers,
                "vocab": a.vocab,
                "capture_layer_ids": p.verifier.capture_layer_ids,
                "T": a.seq_len,
                "R": a.window_rows,
                "windows": a.windows,
                "capture_batch_rows": a.capture_batch_rows,
                "dtype": str(p.verifier.dtype),
                "storage": str(p.verifier.storage_dtype),
            },
            "repeats": a.repeats,
            "forward_s": t_fwd,
            "producer_s": t_prod,
            "forward_s_all": fwds,
            "producer_s_all": prods,
            "forward_tokens_per_s": tokens / t_fwd,
            "tokens_per_s": tokens / t_prod,
            "bytes_per_s": summary["bytes"] / t_prod,
            "bytes_per_token": summary["bytes"] / tokens,
            "producer_vs_forward": t_fwd / t_prod,
            "producer_capture_s": summary["capture_s"],
            "producer_publish_s": summary["publish_s"],
            "check_vs_capture": statistics.median(checks),
            "check_vs_capture_all": checks,
        }
    print(f"hardware: {res['hardware']}, torch {res['torch']}")
    print(f"sizes:    {res['sizes']}")
    print(f"{'path':<10}{'seconds':>10}{'tokens/s':>14}{'MB/s written':>14}")
    print(f"{'forward':<10}{t_fwd:>10.3f}{res['forward_tokens_per_s']:>14.0f}{'-':>14}")
    print(
        f"{'producer':<10}{t_prod:>10.3f}{res['tokens_per_s']:>14.0f}{res['bytes_per_s'] / 1e6:>14.1f}"
    )
    print(
        f"producer split: capture {res['producer_capture_s']:.3f} s, publish {res['producer_publish_s']:.3f} s"
    )
    print(f"producer_vs_forward = {res['producer_vs_forward']:.3f}  (goal >= 0.9)")
    print(f"check_vs_capture = {100 * res['check_vs_capture']:.2f} %  (goal <= 2 %)")
    if a.profile is None:  # profiled numbers are inflated: never a record
        rec.write(a.json, [_row(res, dev.type), _check_row(res, dev.type)], raw=res)


def _sizes(res: dict[str, Any], device: str) -> str:
    z = res["sizes"]
    return (f"{device} {z['dtype'].removeprefix('torch.')}, H {z['H']} × {z['L']} layers, vocab "
            f"{z['vocab']:,}, T {z['T']}, R {z['R']}, {z['windows']} windows, "
            f"{z['storage'].removeprefix('torch.')} storage")  # fmt: skip


def _row(res: dict[str, Any], device: str) -> Row:
    ratios = [f / p for f, p in zip(res["forward_s_all"], res["producer_s_all"])]
    return Row(stage="producer", name="producer_vs_forward",
               what="producer vs a bare verifier forward (tokens/s)",
               result=res["producer_vs_forward"], unit="×", spread=spread(ratios),
               n=res["repeats"], goal=">= 0.9", met=res["producer_vs_forward"] >= 0.9,
               conditions=f"{_sizes(res, device)}; {res['tokens_per_s']:,.0f} tok/s, "
               f"{res['bytes_per_s'] / 1e6:,.1f} MB/s written")  # fmt: skip


def _check_row(res: dict[str, Any], device: str) -> Row:
    share = res["check_vs_capture"]
    return Row(stage="producer", name="check_vs_capture",
               what="capture check's cost, share of capture time",
               result=100 * share, unit="%", spread=spread([100 * c for c in res["check_vs_capture_all"]]),
               n=res["repeats"], goal="<= 2 %", met=share <= 0.02,
               conditions=_sizes(res, device))  # fmt: skip


def _timed_run(p: Producer) -> tuple[float, dict[str, Any]]:
    forward = p.tp.capture if p.tp else p.verifier.capture  # under TP every rank runs it
    forward(  # warm-up of the capture path, at the batch shape it will run
        *(torch.zeros(p.cfg.capture_batch_rows, p.cfg.seq_len, dtype=torch.long) for _ in range(3))
    )
    _sync(p.verifier.device)
    t0 = time.perf_counter()
    summary = p.run()
    _sync(p.verifier.device)
    return time.perf_counter() - t0, summary


def _match(a: Path, b: Path) -> dict[str, Any]:
    """Windows of runs `a` and `b`: largest float difference, and whether they match
    (ids exactly; floats per `torch.testing.assert_close`'s defaults for their dtype)."""
    from fanout.store.store import RunDir, Store

    sa, sb = Store(RunDir(a)), Store(RunDir(b))
    worst, ok, windows = 0.0, True, 0
    for na, nb in zip(window_names(sa), window_names(sb), strict=True):
        with sa.open(na) as ra, sb.open(nb) as rb:
            windows += 1
            ok &= ra.meta.window == rb.meta.window and ra.names() == rb.names()
            for k in ra.names():
                x, y = ra.get(k), rb.get(k)
                if not x.is_floating_point():
                    ok &= bool(torch.equal(x, y))
                    continue
                worst = max(worst, (x.float() - y.float()).abs().max().item())
                try:
                    torch.testing.assert_close(x, y)
                except AssertionError:
                    ok = False
    return {"windows_compared": windows, "windows_match": ok, "max_abs_diff": worst}


def tp_main(a: argparse.Namespace) -> None:
    """`--tp N` under torchrun: TP 1 on rank 0 alone, then TP N on every rank."""
    import torch.distributed as dist

    from fanout.model.verifier import load_verifier
    from fanout.produce.tp_capture import Leader, follow, start_process_group

    rank, control = start_process_group(a.device, timeout_s=3600)  # rank 0 runs TP 1 alone
    rec = Recorder("producer", launcher=f"torchrun --nproc-per-node {a.tp}")
    tmp = a.workdir or os.path.join(tempfile.gettempdir(), "fanout-bench-tp")
    if rank == 0:
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for old in ("run-tp1", f"run-tp{a.tp}"):
            shutil.rmtree(Path(tmp) / old, ignore_errors=True)
        ver = _verifier(a, tmp)
        one = Producer(_config(a, tmp, ver, "run-tp1"))
        t1, s1 = _timed_run(one)
        del one
    dist.barrier(group=control)
    ver = Path(tmp) / "verifier"
    cfg = _config(a, tmp, ver, f"run-tp{a.tp}", tp=a.tp)
    verifier = load_verifier(ver, capture_layer_ids=None, **cfg.verifier_options())
    if rank != 0:
        follow(verifier, control, 3600)
        dist.destroy_process_group()
        return
    leader = Leader(verifier, control, 3600)
    try:
        tn, sn = _timed_run(Producer(cfg, tp=leader))
    finally:
        leader.close(0)
    dist.destroy_process_group()
    tok1, tokn = s1["rows"] * a.seq_len / t1, sn["rows"] * a.seq_len / tn
    dev = verifier.device
    hw = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.machine()
    res = {
        "hardware": f"{dev.type}: {hw}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}",
        "torch": torch.__version__,
        "sizes": {"H": a.hidden, "L": a.layers, "vocab": a.vocab, "T": a.seq_len,
                  "R": a.window_rows, "windows": a.windows, "tp": a.tp,
                  "capture_batch_rows": a.capture_batch_rows, "dtype": str(verifier.dtype),
                  "storage": a.storage_dtype},
        "tp1_s": t1, "tpn_s": tn, "tp1_tokens_per_s": tok1, "tpn_tokens_per_s": tokn,
        "tpn_vs_tp1": tokn / tok1, "tpn_tokens_per_s_per_device": tokn / a.tp,
        **_match(Path(tmp) / "run-tp1", Path(cfg.run_dir)),
    }  # fmt: skip
    print(f"hardware: {res['hardware']}, torch {res['torch']}")
    print(f"sizes:    {res['sizes']}")
    print(f"{'TP':<4}{'seconds':>10}{'tokens/s':>12}{'tokens/s/device':>18}")
    print(f"{1:<4}{t1:>10.3f}{tok1:>12.0f}{tok1:>18.0f}")
    print(f"{a.tp:<4}{tn:>10.3f}{tokn:>12.0f}{tokn / a.tp:>18.0f}")
    print(f"tp{a.tp}_vs_tp1 = {res['tpn_vs_tp1']:.3f} (tokens/s); per device "
          f"{res['tpn_tokens_per_s_per_device'] / tok1:.3f}")  # fmt: skip
    print(f"windows match: {res['windows_match']} ({res['windows_compared']} windows, "
          f"max |diff| {res['max_abs_diff']:.3g})")  # fmt: skip
    sizes = {"dtype": str(verifier.dtype), "storage": a.storage_dtype, "H": a.hidden,
             "L": a.layers, "vocab": a.vocab, "T": a.seq_len, "R": a.window_rows,
             "windows": a.windows}  # fmt: skip
    match = "match" if res["windows_match"] else "DIFFER"
    rec.write(a.json, [
        Row(stage="producer", name=f"tp{a.tp}_vs_tp1",
            what=f"tensor-parallel capture: TP {a.tp} vs TP 1 (tokens/s)",
            result=res["tpn_vs_tp1"], unit="×",
            conditions=f"{_sizes({'sizes': sizes}, dev.type)}; windows {match} "
            f"(max abs diff {res['max_abs_diff']:.3g}); {torch.get_num_threads()} threads/rank"),
    ], raw=res)  # fmt: skip
    if not res["windows_match"]:
        raise SystemExit("TP windows differ from the 1-process windows")


if __name__ == "__main__":
    main()
