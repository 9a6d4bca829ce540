"""Verifier capture on every architecture of the zoo, and on long rows: tokens/s and peak memory.

    .venv/bin/python benchmarks/verifiers.py                              # CPU, a few minutes
    .venv/bin/python benchmarks/verifiers.py --archs qwen3,gemma3_text --lengths 4096,16384 \
        --json /tmp/verifiers.json

1. Per architecture of the verifier zoo (tests/verifier_zoo.py: tiny random models
   of 17 real architectures, hidden 32, 2-4 layers, vocabulary 160, windows of 8):
   - `capture`: `Verifier.capture` over `--rows` packed rows of `--seq-len` tokens
     (documents of 10-80 tokens, so they cross the sliding windows), every layer type's
     rule applied (fanout.model.layer_types);
   - `alone`: the same model in plain transformers (the class it was saved with) run on
     each document by itself, `output_hidden_states=True`: the oracle's path
     (tests/test_verifier_zoo.py), i.e. what a capture without packing costs.
   `capture_vs_alone` = capture tokens/s ÷ alone tokens/s.
2. Long rows (`--lengths`, default T = 4k, 16k, 32k) on a tiny Qwen3 (`--hidden`,
   `--layers`, `--vocab`): one row of documents of `--doc-tokens` tokens, captured
   - `documents`: with no T × T mask (`Verifier.dense_mask_max_bytes = 0`: each
     document runs alone, SDPA `is_causal`), what the default budget picks for long rows;
   - `dense`: today's dense-mask path forced (`dense_mask_max_bytes` huge: one
     [1, 1, T, T] mask, attention over every masked-out pair).
   Goals: the documents path's peak memory grows linearly in T (peak at the longest T
   ÷ peak at the shortest, over the ratio of the Ts: <= 1.25), and its tokens/s at
   T = 16k is >= 2x the dense mask's.

3. Long documents on sliding-window verifiers (`--sliding-archs`, default Mistral with
   `sliding_window` and Gemma-3 text, at `--hidden` / `--vocab`, window `--window`):
   one row that is one document of T tokens (`--lengths`), each document alone
   (`dense_mask_max_bytes = 0`), captured
   - `blocked`: fanout.model.local_attention (query blocks of w tokens against
     [start − w, end), a [w, 2w] mask; full layers SDPA `is_causal`), the default;
   - `masks`: transformers' own attention and masks (`Verifier.local_attention =
     False`): a [1, 1, T, T] sliding mask per document, what long documents cost before.
   Goal: the blocked path's peak memory grows as T does (growth over T's growth
   <= 1.25), where the masks' grow as T².

4. Hybrids (`--hybrid-archs`, default Qwen3.5 text, Qwen3-Next (gated delta rule 3:1 full
   attention), LFM2 (short convolutions 2:1 full attention), Nemotron-H (Mamba-2, MLP,
   attention, MoE) and Falcon-H1 (attention and Mamba-2 in parallel), each tiny: H
   `--hidden`, heads of 16 (Mamba-2: state 16, 2 groups, the released configs' chunk of
   128 / 256 tokens), the zoo's layer counts, vocab `--vocab`): `--hybrid-rows` rows of
   `--hybrid-seq-len` tokens made of documents of `--hybrid-doc-tokens` ± 1/3 tokens,
   captured
   - `packed`: one forward over the rows, the recurrent layers reset at each document
     (fanout.model.varlen_layers), attention in document blocks
     (fanout.model.packed_attention): the default for these verifiers;
   - `documents`: fanout's per-document path (`dense_mask_max_bytes = 0`: documents
     batched by length, one forward per batch), what such rows cost before;
   - `loop`: each document by itself in plain transformers (batch 1), as in part 1.
   Goal: packed >= 3x the per-document path's tokens/s on the CPU. `bound`: the most
   packing can give there, the per-document path's time over the packed capture's time
   outside its recurrent mixers (the FORWARDS entries timed): what both paths run alike
   (projections, MLPs, attention, the head and its argmax) caps the ratio. `scan bd`:
   the same outside only the varlen scans the mixers call (the convolutions, the gated
   delta rule, Mamba-2's SSD): the most any scan implementation can give, the mixers'
   own projections and norms kept.

Peak memory is the process's resident high-water mark during the call above the resident
set before it (Linux: `/proc/self/status` VmHWM, reset through `/proc/self/clear_refs`
before each call; glibc's malloc told to map every allocation of 128 KiB or more on its
own and trimmed before each call, so freed memory does not stay resident): torch's CPU
tensors are allocated outside Python's allocator, where `tracemalloc` does not see them.
That setting makes every large tensor a fresh mapping, page-faulted in on first touch,
which a long-running producer does not pay (glibc raises its mapping threshold to the
largest block freed, up to 32 MiB, and then reuses the heap) and which charged the
packed rows' 2-8 MiB tensors up to half their CPU time, where the loop over single
documents, its tensors mostly under 128 KiB, paid little (part 4, before #53's change:
Qwen3.5 packed 0.60 s, 0.26 s of it in the kernel; loop 0.56 s, 0.07 s in the kernel):
so the timed calls run with glibc's steady state (threshold 32 MiB, trimmed past 64
MiB), after one call under the 128 KiB setting that measures the peak. Every timing is
the best of `--repeats` calls after a warm-up (T >= 16k: one call, no warm-up, timed and
measured under the 128 KiB setting, the dense path takes a minute there). fp32 on the
CPU, torch's default threads, wall time (on a shared, loaded machine `--threads 1
--clock cpu`: one thread, timed by the process's CPU time, measures the code rather than
the scheduler; the hybrids' conditions name both).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import re
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from fanout.bench.assets import tiny_qwen3_verifier
from fanout.model import varlen_layers
from fanout.model.verifier import DENSE_MASK_MAX_BYTES, Verifier, load_verifier

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the zoo
from record import Recorder, Row, spread
from verifier_zoo import HYBRID_AND_SPARSE, VOCAB, ZOO, build, load_oracle

MIB = 1 << 20
# the CPU timings' clock: wall time, or with `--clock cpu` the process's CPU time (on a
# shared, loaded machine: the time the code ran, not the time it waited for a core)
CLOCK: list[Callable[[], float]] = [time.perf_counter]


def _status(field: str) -> int:
    """A `/proc/self/status` size field (VmRSS, VmHWM) in bytes."""
    text = Path("/proc/self/status").read_text()
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    assert m, field
    return int(m.group(1)) * 1024


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def _malloc_for(memory: bool) -> None:
    """glibc's thresholds for a call measured for memory: every allocation of 128 KiB or
    more its own mapping, given back on free (memory under the default, growing threshold
    stays resident once freed), so the resident set follows what is live. For a timed
    call: the steady state glibc's dynamic threshold reaches in a long-running process
    (its maximum, 32 MiB, trimmed past twice that), so no call pays page faults for
    memory a producer would have reused."""
    mmap = 128 << 10 if memory else 32 << 20
    _LIBC.mallopt(M_MMAP_THRESHOLD, mmap)
    _LIBC.mallopt(M_TRIM_THRESHOLD, 2 * mmap)


_malloc_for(memory=True)


def measure(
    fn: Callable[[], Any], repeats: int, warm: bool = True, device: str = "cpu"
) -> tuple[float, int]:
    """(best seconds of `repeats` calls, peak resident bytes above the resident set
    before a call, the largest over the calls). On the CPU with `warm`: a warm-up, one
    call for the peak, then a warm-up and the timed calls under glibc's steady state
    (`_malloc_for`). On CUDA: device memory, the allocator's peak above what was
    allocated before the call, each call synchronised."""
    if warm:
        fn()
    best, peak = float("inf"), 0
    if device.startswith("cuda"):
        for _ in range(repeats):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
            peak = max(peak, torch.cuda.max_memory_allocated() - before)
        return best, peak
    for _ in range(1 if warm else repeats):
        _LIBC.malloc_trim(0)  # freed heap memory back to the OS: RSS = what is live
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status("VmRSS")
        t0 = CLOCK[0]()
        fn()
        if not warm:  # T >= 16k: the one call is timed under the 128 KiB setting too
            best = min(best, CLOCK[0]() - t0)
        peak = max(peak, _status("VmHWM") - before)
    if warm:
        _malloc_for(memory=False)
        try:
            fn()  # the heap grown to what the calls reuse
            for _ in range(repeats):
                t0 = CLOCK[0]()
                fn()
                best = min(best, CLOCK[0]() - t0)
        finally:
            _malloc_for(memory=True)
    return best, peak


def _packed(rows: int, t: int, seed: int) -> tuple[torch.Tensor, ...]:
    """`rows` packed rows of `t` tokens: documents of 10-80 tokens (the last one cut to
    fit), positions restarting per document; returns ids, pos, doc [B, T] and the spans
    (row, start, end) of every document."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, t), generator=g)
    pos = torch.empty(rows, t, dtype=torch.long)
    doc = torch.empty(rows, t, dtype=torch.long)
    spans = []
    for b in range(rows):
        s, k = 0, 0
        while s < t:
            e = min(t, s + int(torch.randint(10, 81, (1,), generator=g)))
            pos[b, s:e], doc[b, s:e] = torch.arange(e - s), k
            spans.append((b, s, e))
            s, k = e, k + 1
    return ids, pos, doc, torch.tensor(spans)


def zoo_rows(a: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    out = []
    ids, pos, doc, spans = (x.to(a.device) for x in _packed(a.rows, a.seq_len, 0))
    tokens = a.rows * a.seq_len
    for arch in a.archs:
        path = build(arch, root / arch)
        v = load_verifier(path, device=a.device, dtype="float32", num_draft_layers=None,
                          capture_layer_ids=[0, 1])  # fmt: skip
        oracle = load_oracle(arch, path).to(a.device)

        def capture(v: Verifier = v) -> None:
            v.capture(ids, pos, doc)

        @torch.inference_mode()
        def alone(m: Any = oracle) -> None:
            for b, s, e in spans.tolist():
                m(input_ids=ids[b : b + 1, s:e], use_cache=False, output_hidden_states=True)

        t_cap, m_cap = measure(capture, a.repeats, device=a.device)
        t_alone, m_alone = measure(alone, a.repeats, device=a.device)
        out.append({
            "arch": arch, "model_class": ZOO[arch].model_class, "layers": v.num_layers,
            "runs_alone": v.runs_alone(a.rows, a.seq_len), "documents": len(spans),
            "capture_tokens_per_s": tokens / t_cap, "alone_tokens_per_s": tokens / t_alone,
            "capture_vs_alone": t_alone / t_cap,
            "capture_peak_mib": m_cap / MIB, "alone_peak_mib": m_alone / MIB,
        })  # fmt: skip
        r = out[-1]
        print(f"{arch:<20}{'documents' if r['runs_alone'] else 'masked':>10}"
              f"{r['capture_tokens_per_s']:>12.0f}{r['alone_tokens_per_s']:>12.0f}"
              f"{r['capture_vs_alone']:>8.2f}{r['capture_peak_mib']:>10.1f}"
              f"{r['alone_peak_mib']:>10.1f}", flush=True)  # fmt: skip
    return out


def long_rows(a: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    heads = max(1, a.hidden // 16)
    path = tiny_qwen3_verifier(
        root / "qwen3-long", a.vocab, hidden_size=a.hidden, num_layers=a.layers,
        num_heads=heads, num_kv_heads=max(1, heads // 2), head_dim=16,
        intermediate_size=2 * a.hidden,
    )  # fmt: skip
    v = load_verifier(path, device=a.device, dtype="float32",
                      capture_layer_ids=[1, a.layers - 2], num_draft_layers=None)  # fmt: skip
    out = []
    for t in a.lengths:
        g = torch.Generator().manual_seed(t)
        ids = torch.randint(1, a.vocab, (1, t), generator=g)  # [1, T]
        doc = (torch.arange(t) // a.doc_tokens)[None]  # [1, T]
        pos = (torch.arange(t) % a.doc_tokens)[None]
        v.dense_mask_max_bytes = DENSE_MASK_MAX_BYTES
        default = "documents" if v.runs_alone(1, t) else "dense"
        long = t >= 16384
        row: dict[str, Any] = {"T": t, "documents_per_row": int(doc.max()) + 1,
                               "default_path": default}  # fmt: skip
        for name, budget in (("documents", 0), ("dense", 1 << 62)):
            v.dense_mask_max_bytes = budget
            assert v.runs_alone(1, t) == (name == "documents")

            def capture(
                ids: torch.Tensor = ids, pos: torch.Tensor = pos, doc: torch.Tensor = doc
            ) -> None:
                v.capture(ids, pos, doc)

            sec, peak = measure(capture, 1 if long else a.repeats, warm=not long,
                                device=a.device)  # fmt: skip
            row[f"{name}_tokens_per_s"] = t / sec
            row[f"{name}_peak_mib"] = peak / MIB
        row["speedup"] = row["documents_tokens_per_s"] / row["dense_tokens_per_s"]
        out.append(row)
        print(f"{t:>8}{row['documents_tokens_per_s']:>12.0f}{row['dense_tokens_per_s']:>12.0f}"
              f"{row['speedup']:>9.2f}{row['documents_peak_mib']:>12.1f}"
              f"{row['dense_peak_mib']:>12.1f}  {default}", flush=True)  # fmt: skip
    v.dense_mask_max_bytes = DENSE_MASK_MAX_BYTES
    return out


def sliding_rows(a: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    out = []
    heads = max(2, a.hidden // 16)
    for arch in a.sliding_archs:
        over: dict[str, Any] = {
            "hidden_size": a.hidden, "intermediate_size": 2 * a.hidden, "head_dim": 16,
            "num_attention_heads": heads, "num_key_value_heads": heads // 2,
            "vocab_size": a.vocab, "sliding_window": a.window,
            "max_position_embeddings": 2 * max(a.lengths),
        }  # fmt: skip
        path = build(arch, root / f"{arch}-long", **over)
        v = load_verifier(path, device=a.device, dtype="float32", capture_layer_ids=[0, 1],
                          num_draft_layers=None)  # fmt: skip
        v.dense_mask_max_bytes = 0  # each document alone
        for t in a.lengths:
            ids = torch.randint(1, a.vocab, (1, t), generator=torch.Generator().manual_seed(t))
            pos, doc = torch.arange(t)[None], torch.zeros(1, t, dtype=torch.long)  # one document
            row: dict[str, Any] = {"arch": arch, "T": t, "window": a.window,
                                   "layer_types": list(v.rule.layer_types)}  # fmt: skip
            for name, on in (("blocked", True), ("masks", False)):
                v.local_attention = on

                def capture(
                    ids: torch.Tensor = ids,
                    pos: torch.Tensor = pos,
                    doc: torch.Tensor = doc,
                    v: Verifier = v,
                ) -> None:
                    v.capture(ids, pos, doc)

                long = t >= 16384
                sec, peak = measure(capture, 1 if long else a.repeats, warm=not long,
                                    device=a.device)  # fmt: skip
                row[f"{name}_tokens_per_s"] = t / sec
                row[f"{name}_peak_mib"] = peak / MIB
            v.local_attention = True
            row["speedup"] = row["blocked_tokens_per_s"] / row["masks_tokens_per_s"]
            out.append(row)
            print(f"{arch:<16}{t:>8}{row['blocked_tokens_per_s']:>12.0f}"
                  f"{row['masks_tokens_per_s']:>12.0f}{row['speedup']:>9.2f}"
                  f"{row['blocked_peak_mib']:>12.1f}{row['masks_peak_mib']:>12.1f}",
                  flush=True)  # fmt: skip
    return out


def sliding_records(a: argparse.Namespace, sliding: list[dict[str, Any]]) -> list[Row]:
    rows = []
    for arch in a.sliding_archs:
        rs = [r for r in sliding if r["arch"] == arch]
        if len(rs) < 2:
            continue
        lo, hi = rs[0], rs[-1]
        grow_t = hi["T"] / lo["T"]
        growth = hi["blocked_peak_mib"] / lo["blocked_peak_mib"] / grow_t
        old = hi["masks_peak_mib"] / max(lo["masks_peak_mib"], 1e-9) / grow_t
        cond = (f"{a.device} fp32, {ZOO[arch].model_class} H {a.hidden} x {len(lo['layer_types'])} "
                f"layers ({', '.join(sorted(set(lo['layer_types'])))}), sliding window "
                f"{a.window}, vocab {a.vocab}, 1 row = 1 document")  # fmt: skip
        rows.append(Row(
            stage="producer", name=f"long_document_sliding_peak_memory_growth_{arch}",
            what=f"peak memory of the capture, one document of T = {lo['T']:,} -> {hi['T']:,} "
            f"tokens, over the growth of T (1 = linear; transformers' own masks: {old:.1f}); "
            f"peak {hi['blocked_peak_mib']:.0f} MiB vs {hi['masks_peak_mib']:.0f} MiB with "
            f"transformers' masks at T = {hi['T']:,}",
            result=round(growth, 2), unit="×", goal="<= 1.25", met=growth <= 1.25,
            conditions=cond,
        ))  # fmt: skip
        rows.append(Row(
            stage="producer", name=f"long_document_sliding_blocked_vs_masks_{arch}",
            what=f"capture of one {hi['T']:,}-token document: blocked local attention vs "
            "transformers' own sliding masks (tokens/s)",
            result=round(hi["speedup"], 2), unit="×", conditions=cond,
        ))  # fmt: skip
    return rows


HYBRIDS = ("qwen3_5_text", "qwen3_next", "lfm2", "nemotron_h", "falcon_h1")


# per hybrid: the zoo entry's config fields scaled to --hidden (heads of 16)
def _hybrid_sizes(arch: str, hidden: int, vocab: int, t: int) -> dict[str, Any]:
    heads = max(2, hidden // 16)
    over: dict[str, Any] = {
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "vocab_size": vocab,
        "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
        "head_dim": 16, "max_position_embeddings": 2 * t,
    }  # fmt: skip
    if arch in ("qwen3_5_text", "qwen3_next"):  # the gated delta rule's heads
        over |= {"linear_key_head_dim": 16, "linear_value_head_dim": 16,
                 "linear_num_key_heads": max(1, heads // 2), "linear_num_value_heads": heads}  # fmt: skip
    elif arch == "nemotron_h":  # Mamba-2 heads of 16 (its released chunk: 128)
        over |= {"mamba_num_heads": heads, "mamba_head_dim": 16, "ssm_state_size": 16,
                 "n_groups": 2, "chunk_size": 128, "moe_intermediate_size": hidden,
                 "moe_shared_expert_intermediate_size": hidden}  # fmt: skip
    elif arch == "falcon_h1":  # Mamba-2 heads of 16 (its released chunk: 256)
        over |= {"mamba_d_ssm": hidden, "mamba_n_heads": heads, "mamba_d_head": 16,
                 "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_chunk_size": 256}  # fmt: skip
    return over


def _documents(rows: int, t: int, mean: int, seed: int) -> tuple[torch.Tensor, ...]:
    """`rows` rows of `t` tokens of documents of mean ± mean/3 tokens (the last one cut
    to fit): ids, pos, doc [B, T] and the spans (row, start, end)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 1000, (rows, t), generator=g)
    pos = torch.empty(rows, t, dtype=torch.long)
    doc = torch.empty(rows, t, dtype=torch.long)
    spans = []
    for b in range(rows):
        s, k = 0, 0
        while s < t:
            n = int(torch.randint(mean - mean // 3, mean + mean // 3 + 1, (1,), generator=g))
            e = min(t, s + n)
            pos[b, s:e], doc[b, s:e] = torch.arange(e - s), k
            spans.append((b, s, e))
            s, k = e, k + 1
    return ids, pos, doc, torch.tensor(spans)


def hybrid_rows(a: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    out = []
    b, t = a.hybrid_rows, a.hybrid_seq_len
    ids, pos, doc, spans = _documents(b, t, a.hybrid_doc_tokens, 0)
    ids = ids % a.vocab
    ids, pos, doc = (x.to(a.device) for x in (ids, pos, doc))
    for arch in a.hybrid_archs:
        path = build(arch, root / f"{arch}-hybrid", **_hybrid_sizes(arch, a.hidden, a.vocab, t))
        v = load_verifier(path, device=a.device, dtype="float32", capture_layer_ids=[0, 1],
                          num_draft_layers=None)  # fmt: skip
        oracle = load_oracle(arch, path).to(a.device)
        row: dict[str, Any] = {"arch": arch, "layer_types": list(v.rule.layer_types),
                               "rows": b, "T": t, "documents": len(spans)}  # fmt: skip
        for name, budget in (("packed", DENSE_MASK_MAX_BYTES), ("documents", 0)):
            v.dense_mask_max_bytes = budget
            assert v.runs_alone(b, t) == (name == "documents"), (arch, name)

            def capture(v: Verifier = v) -> None:
                v.capture(ids, pos, doc)

            sec, peak = measure(capture, a.repeats, device=a.device)
            row[f"{name}_tokens_per_s"], row[f"{name}_peak_mib"] = b * t / sec, peak / MIB
        v.dense_mask_max_bytes = DENSE_MASK_MAX_BYTES
        mixers_s, scans_s, whole_s = _mixer_split(partial(v.capture, ids, pos, doc), a.repeats)
        # what packing can give at most: the per-document path's time over the packed
        # capture's time outside its recurrent mixers (the ratio were they free), and
        # outside only their scans (were the scans free: no scan implementation can do
        # better, since the mixers' own projections and norms stay)
        documents_s = b * t / row["documents_tokens_per_s"]
        row["packed_mixers_share"] = mixers_s / whole_s
        row["packed_scans_share"] = scans_s / whole_s
        row["bound_vs_documents"] = documents_s / (whole_s - mixers_s)
        row["scan_bound_vs_documents"] = documents_s / (whole_s - scans_s)

        @torch.inference_mode()
        def loop(m: Any = oracle) -> None:
            for r, s, e in spans.tolist():
                m(input_ids=ids[r : r + 1, s:e], use_cache=False, output_hidden_states=True)

        sec, peak = measure(loop, a.repeats, device=a.device)
        row["loop_tokens_per_s"], row["loop_peak_mib"] = b * t / sec, peak / MIB
        row["vs_documents"] = row["packed_tokens_per_s"] / row["documents_tokens_per_s"]
        row["vs_loop"] = row["packed_tokens_per_s"] / row["loop_tokens_per_s"]
        out.append(row)
        print(f"{arch:<16}{row['packed_tokens_per_s']:>12.0f}{row['documents_tokens_per_s']:>12.0f}"
              f"{row['loop_tokens_per_s']:>12.0f}{row['vs_documents']:>9.2f}"
              f"{row['bound_vs_documents']:>7.2f}{row['scan_bound_vs_documents']:>9.2f}{row['vs_loop']:>9.2f}{row['packed_peak_mib']:>10.1f}{row['documents_peak_mib']:>10.1f}",
              flush=True)  # fmt: skip
    return out


# the varlen scans each mixer calls (fanout.model.varlen_layers reads them by these names)
SCANS = ("causal_conv1d_varlen", "gated_delta_rule_varlen", "ssd_varlen")


def _mixer_split(fn: Callable[[], Any], repeats: int) -> tuple[float, float, float]:
    """(seconds in the recurrent mixers' packed forwards (varlen_layers.FORWARDS), seconds
    in the varlen scans they call (SCANS: the convolutions and the chunked recurrences,
    without the mixers' projections and norms), seconds of the whole call) for the
    fastest of `repeats` calls of `fn` with each timed, at glibc's steady state."""
    spent = {"mixers": 0.0, "scans": 0.0}
    saved = dict(varlen_layers.FORWARDS)
    saved_scans = {name: getattr(varlen_layers, name) for name in SCANS}

    def timed(f: Callable[..., Any], key: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = CLOCK[0]()
            try:
                return f(*args, **kwargs)
            finally:
                spent[key] += CLOCK[0]() - t0

        return run

    varlen_layers.FORWARDS.update({k: timed(f, "mixers") for k, f in saved.items()})
    for name, f in saved_scans.items():
        setattr(varlen_layers, name, timed(f, "scans"))
    _malloc_for(memory=False)
    best = (float("inf"), 0.0, 0.0)
    try:
        fn()
        for _ in range(repeats):
            spent.update(mixers=0.0, scans=0.0)
            t0 = CLOCK[0]()
            fn()
            best = min(best, (CLOCK[0]() - t0, spent["mixers"], spent["scans"]))
    finally:
        varlen_layers.FORWARDS.update(saved)
        for name, f in saved_scans.items():
            setattr(varlen_layers, name, f)
        _malloc_for(memory=True)
    return best[1], best[2], best[0]


def hybrid_records(a: argparse.Namespace, hybrid: list[dict[str, Any]]) -> list[Row]:
    return [row for r in hybrid for row in _hybrid_arch_records(a, r)]


def _hybrid_arch_records(a: argparse.Namespace, r: dict[str, Any]) -> list[Row]:
    """One hybrid's rows: packed vs per-document (the goal), its two bounds, vs the loop."""
    arch = r["arch"]
    cls = (ZOO | HYBRID_AND_SPARSE)[arch].model_class
    cond = (f"{a.device} fp32, {torch.get_num_threads()} threads, {a.clock} clock"
            f"{', glibc malloc at steady state' if a.device == 'cpu' else ''}, {cls} H {a.hidden} x "
            f"{len(r['layer_types'])} layers "
            f"({', '.join(r['layer_types'])}), heads of 16, vocab {a.vocab}, {r['rows']} rows "
            f"x {r['T']:,} tokens, {r['documents']} documents of {a.hybrid_doc_tokens} "
            f"± {a.hybrid_doc_tokens // 3} tokens")  # fmt: skip

    def ratio(name: str, what: str, key: str, **goal: Any) -> Row:
        return Row(stage="producer", name=f"{name}_{arch}", what=f"{cls}: {what}",
                   result=round(r[key], 2), unit="×", n=a.repeats, n_of="runs (best)",
                   conditions=cond, **goal)  # fmt: skip

    return [
        ratio("hybrid_packed_vs_documents",
              "capture of packed rows (recurrent layers reset per document) vs fanout's "
              "per-document path (documents batched by length) (tokens/s; peak "
              f"{r['packed_peak_mib']:.0f} vs {r['documents_peak_mib']:.0f} MiB)",
              "vs_documents", goal=">= 3", met=r["vs_documents"] >= 3),
        ratio("hybrid_packing_bound",
              "the most packing can give over the per-document path: its time over the "
              "packed capture's time outside the recurrent mixers (the ratio were they "
              f"free; they take {100 * r['packed_mixers_share']:.0f} % of the packed "
              "capture; the rest, projections, MLPs, attention and the head, both paths "
              "run)", "bound_vs_documents"),
        ratio("hybrid_scan_bound",
              "the most any scan implementation can give over the per-document path: its "
              "time over the packed capture's time outside the varlen scans (the "
              "convolutions and chunked recurrences the mixers call, "
              f"{100 * r['packed_scans_share']:.0f} % of the packed capture; the mixers' "
              "own projections and norms stay)", "scan_bound_vs_documents"),
        ratio("hybrid_packed_vs_loop",
              "capture of packed rows vs each document by itself in plain transformers "
              "(tokens/s)", "vs_loop"),
    ]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--archs", default=",".join(ZOO), help="zoo architectures, comma-separated")
    p.add_argument("--rows", type=int, default=2, help="packed rows per capture (part 1)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per packed row (part 1)")
    p.add_argument("--lengths", default="4096,16384,32768", help="row lengths T (part 2)")
    p.add_argument("--doc-tokens", type=int, default=2048, help="tokens per document (part 2)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the long-row Qwen3")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the long-row Qwen3")
    p.add_argument("--vocab", type=int, default=1000, help="vocabulary of the long-row Qwen3")
    p.add_argument(
        "--sliding-archs",
        default="mistral_sliding,gemma3_text",
        help="zoo architectures with sliding layers for part 3 ('' skips it)",
    )
    p.add_argument("--window", type=int, default=1024, help="sliding window (part 3), tokens")
    p.add_argument(
        "--hybrid-archs",
        default=",".join(HYBRIDS),
        help="zoo hybrids for part 4 ('' skips it)",
    )
    p.add_argument("--hybrid-rows", type=int, default=2, help="packed rows per capture (part 4)")
    p.add_argument("--hybrid-seq-len", type=int, default=4096, help="tokens per row (part 4)")
    p.add_argument("--hybrid-doc-tokens", type=int, default=300, help="mean document (part 4)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls (best of)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall",
        help="CPU timings: wall time, or the process's CPU time (a loaded, shared machine)",
    )  # fmt: skip
    p.add_argument("--device", default="cpu", help="cpu, or cuda on a lent GPU (checks.sh)")
    p.add_argument("--json", default=None, help="write the record (benchmarks/record.py) here")
    a = p.parse_args()
    a.archs = [x for x in a.archs.split(",") if x]
    a.lengths = sorted(int(x) for x in a.lengths.split(",") if x)
    a.sliding_archs = [x for x in a.sliding_archs.split(",") if x]
    a.hybrid_archs = [x for x in a.hybrid_archs.split(",") if x]
    unknown = sorted((set(a.archs) | set(a.sliding_archs)) - set(ZOO))
    if unknown:
        p.error(f"--archs: unknown {unknown}; the zoo has {', '.join(ZOO)}")
    if bad := sorted(set(a.hybrid_archs) - set(HYBRIDS)):
        p.error(f"--hybrid-archs: unknown {bad}; {', '.join(HYBRIDS)}")
    if a.threads < 0:
        p.error(f"--threads: {a.threads} (0: torch's default)")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.clock == "cpu":
        CLOCK[0] = time.process_time
    rec = Recorder("verifiers")
    hw = rec.head["hardware"]
    print(f"hardware: {hw}; torch {torch.__version__}, {torch.get_num_threads()} threads, fp32")
    print(f"part 1: zoo models (H 32, 2-4 layers, vocab {VOCAB}), {a.rows} rows x "
          f"{a.seq_len} tokens, documents of 10-80 tokens")  # fmt: skip
    print(f"{'arch':<20}{'path':>10}{'capture/s':>12}{'alone/s':>12}{'ratio':>8}"
          f"{'cap MiB':>10}{'alone MiB':>10}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        zoo = zoo_rows(a, Path(tmp))
        print(f"part 2: tiny Qwen3 H {a.hidden} x {a.layers} layers, vocab {a.vocab}, one row "
              f"of documents of {a.doc_tokens} tokens")  # fmt: skip
        print(f"{'T':>8}{'docs tok/s':>12}{'dense tok/s':>12}{'speedup':>9}{'docs MiB':>12}"
              f"{'dense MiB':>12}  default path")  # fmt: skip
        long = long_rows(a, Path(tmp))
        print(f"part 3: one document per row, sliding window {a.window}, H {a.hidden}, "
              f"vocab {a.vocab}: blocked local attention vs transformers' masks")  # fmt: skip
        print(f"{'arch':<16}{'T':>8}{'blk tok/s':>12}{'mask tok/s':>12}{'speedup':>9}"
              f"{'blk MiB':>12}{'mask MiB':>12}")  # fmt: skip
        sliding = sliding_rows(a, Path(tmp))
        print(f"part 4: hybrids H {a.hidden}, vocab {a.vocab}, {a.hybrid_rows} rows x "
              f"{a.hybrid_seq_len} tokens, documents of {a.hybrid_doc_tokens} ± "
              f"{a.hybrid_doc_tokens // 3} tokens")  # fmt: skip
        print(f"{'arch':<16}{'packed/s':>12}{'docs/s':>12}{'loop/s':>12}{'vs docs':>9}"
              f"{'bound':>7}{'scan bd':>9}{'vs loop':>9}{'pk MiB':>10}{'docs MiB':>10}")  # fmt: skip
        hybrid = hybrid_rows(a, Path(tmp))

    rows = []
    cond = (
        f"{a.device} fp32, zoo sizes (H 32), {a.rows} rows x {a.seq_len} tokens, docs 10-80 tokens"
    )
    for r in zoo:
        rows.append(Row(
            stage="producer", name=f"capture_vs_alone_{r['arch']}",
            what=f"{r['model_class']}: capture of packed rows vs each document alone in "
            f"plain transformers (tokens/s; peak {r['capture_peak_mib']:.0f} vs "
            f"{r['alone_peak_mib']:.0f} MiB)",
            result=round(r["capture_vs_alone"], 2), unit="×", n=a.repeats, n_of="runs (best)",
            conditions=f"{cond}; capture path {'documents' if r['runs_alone'] else 'masked'}",
        ))  # fmt: skip
    lcond = (f"{a.device} fp32, Qwen3 H {a.hidden} x {a.layers} layers, vocab {a.vocab}, 1 row, "
             f"documents of {a.doc_tokens} tokens")  # fmt: skip
    by_t = {r["T"]: r for r in long}
    if 16384 in by_t:
        s = by_t[16384]["speedup"]
        rows.append(Row(
            stage="producer", name="long_row_documents_vs_dense_16k",
            what="capture of a 16k-token row: no T×T mask (documents alone) vs the dense "
            "mask forced (tokens/s)", result=round(s, 2), unit="×", goal=">= 2", met=s >= 2,
            conditions=lcond,
        ))  # fmt: skip
    if len(long) > 1:
        lo, hi = long[0], long[-1]
        growth = (hi["documents_peak_mib"] / lo["documents_peak_mib"]) / (hi["T"] / lo["T"])
        dense = (hi["dense_peak_mib"] / max(lo["dense_peak_mib"], 1e-9)) / (hi["T"] / lo["T"])
        rows.append(Row(
            stage="producer", name="long_row_peak_memory_growth",
            what=f"peak memory of the capture, T = {lo['T']:,} -> {hi['T']:,}, over the "
            f"growth of T (1 = linear; the dense mask's: {dense:.1f}); peak "
            f"{hi['documents_peak_mib']:.0f} MiB vs dense {hi['dense_peak_mib']:.0f} MiB "
            f"at T = {hi['T']:,}",
            result=round(growth, 2), unit="×", goal="<= 1.25", met=growth <= 1.25,
            conditions=lcond,
        ))  # fmt: skip
    rows += sliding_records(a, sliding)
    rows += hybrid_records(a, hybrid)
    plots = [{
        "name": "long_row_peak_memory" + ("" if a.device == "cpu" else "_gpu"),
        "stage": "producer", "kind": "line",
        "title": f"capture peak memory vs row length ({a.device}, fp32)",
        "xlabel": "T (tokens per row)", "ylabel": "peak MiB above resident",
        "series": {k: [[r["T"], r[f"{k}_peak_mib"]] for r in long] for k in ("documents", "dense")},
    }] if long else []  # fmt: skip
    for arch in a.sliding_archs:
        rs = [r for r in sliding if r["arch"] == arch]
        plots += [{
            "name": f"long_document_sliding_peak_memory_{arch}" + ("" if a.device == "cpu" else "_gpu"),
            "stage": "producer", "kind": "line",
            "title": f"{ZOO[arch].model_class}, one document, window {a.window}: peak memory "
            f"({a.device}, fp32)",
            "xlabel": "T (tokens per document)", "ylabel": "peak MiB above resident",
            "series": {k: [[r["T"], r[f"{k}_peak_mib"]] for r in rs] for k in ("blocked", "masks")},
        }] if rs else []  # fmt: skip
    raw = {"sizes": vars(a), "zoo": zoo, "long_rows": long, "sliding_documents": sliding,
           "hybrids": hybrid,
           "spread_capture_vs_alone": spread([r["capture_vs_alone"] for r in zoo])}  # fmt: skip
    rec.write(a.json, rows, raw=raw, plots=plots)


if __name__ == "__main__":
    main()
