"""CUDA-only paths: fused AdamW on CUDA, bf16 capture of packed rows, a bf16 DFlash step and
every draft family's bf16 step (against its fp32 CPU loss),
NVML telemetry on a real GPU. Every test skips without CUDA; run them on a GPU box with
`pytest -m gpu tests/test_gpu.py`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fanout.families.registry import FAMILY_FOLDERS

IDS_POS_DOC = ("input_ids", "position_ids", "document_ids")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


def test_fused_adamw_on_cuda_matches_reference() -> None:
    from fanout.ops.adamw import make_optimizer

    torch.manual_seed(0)
    ref = [torch.randn(64, 32, device="cuda", requires_grad=True) for _ in range(3)]
    mine = [p.detach().clone().requires_grad_(True) for p in ref]
    opt, backend = make_optimizer(mine, lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)
    assert backend == "fused"
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(5):
        grads = [torch.randn_like(p) * (step + 1) for p in ref]
        for p, q, g in zip(ref, mine, grads):
            p.grad, q.grad = g.clone(), g.clone()
        torch.nn.utils.clip_grad_norm_(ref, 0.5)
        ref_opt.step()
        opt.step()
    for p, q in zip(ref, mine):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_bf16_capture_packed_equals_unpacked(tmp_path: Path) -> None:
    from fanout.bench.assets import tiny_qwen3_verifier
    from fanout.model.verifier import load_verifier

    vdir = tiny_qwen3_verifier(tmp_path / "v", 512, hidden_size=64, num_layers=6)
    v = load_verifier(vdir, device="cuda", dtype="bfloat16", num_draft_layers=2)
    assert v.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 512, (1, 40), generator=g), torch.randint(0, 512, (1, 24), generator=g)
    ids = torch.cat([a, b], 1)  # [1, 64]: two documents packed in one row
    pos = torch.cat([torch.arange(40), torch.arange(24)])[None]
    doc = torch.cat([torch.zeros(40), torch.ones(24)]).long()[None]
    packed = v.capture(ids, pos, doc)
    alone_b = v.capture(b, torch.arange(24)[None], torch.zeros(1, 24, dtype=torch.long))
    torch.testing.assert_close(
        packed.hidden_states[:, 40:].float(), alone_b.hidden_states.float(), rtol=0.05, atol=0.05
    )
    agree = (packed.target_ids[:, 40:] == alone_b.target_ids).float().mean()
    assert agree > 0.9  # bf16 ties may flip a few argmaxes


def test_bf16_dflash_step_on_cuda(tmp_path: Path) -> None:
    from fanout.bench.assets import tiny_qwen3_verifier
    from fanout.families.dflash.model import DFlashDraft
    from fanout.ops.adamw import make_optimizer

    vdir = tiny_qwen3_verifier(tmp_path / "v", 512, hidden_size=64, num_layers=6)
    draft = DFlashDraft.from_verifier(
        vdir, device="cuda", block_size=4, max_anchors=8, target_layer_ids=[1, 3]
    )
    opt, backend = make_optimizer(draft.parameters(), lr=1e-3)
    assert backend == "fused"
    b, t = 2, 64
    batch = {
        "hidden_states": torch.randn(b, t, 128, device="cuda"),
        "target_ids": torch.randint(0, 512, (b, t), device="cuda"),
        "input_ids": torch.randint(0, 512, (b, t), device="cuda"),
        "loss_mask": torch.ones(b, t, dtype=torch.long, device="cuda"),
        "document_ids": torch.zeros(b, t, dtype=torch.long, device="cuda"),
        "position_ids": torch.arange(t, device="cuda").expand(b, t).contiguous(),
    }
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = draft.loss(batch, gen)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_nvml_telemetry_on_real_gpu(tmp_path: Path) -> None:
    import os

    from fanout.bench.telemetry import Sampler, read_samples, summarize

    out = tmp_path / "t.jsonl"
    x = torch.randn(4096, 4096, device="cuda")
    with Sampler(out, roles={"me": os.getpid()}, interval_s=0.1):
        for _ in range(200):
            x = x @ x.T / 4096
        torch.cuda.synchronize()
    recs = read_samples(out)
    summ = summarize(recs, roles=["me"], gpu_roles=["me"])
    assert summ["gpu"]["available"] and not summ["host_only"], summ


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
def test_producer_async_device_copies_equal_a_synchronous_capture(
    tmp_path: Path, storage: str
) -> None:
    """The CUDA producer queues device→host copies on a side stream and publishes from a
    second thread; a missing wait or a reused buffer would show up as windows that
    differ from a plain, synchronous capture of the same rows (fp8: their scales too)."""
    from fanout.bench.assets import (
        build_tokenizer,
        generate_corpus,
        tiny_verifier_for_tokenizer,
        write_jsonl,
    )
    from fanout.ops.fp8 import dequantize
    from fanout.produce.config import ProducerConfig
    from fanout.produce.producer import Producer
    from fanout.produce.stream import stream_rows
    from fanout.store.store import parse_window_name
    from fanout.store.windowfile import hidden_name, scale_name

    corpus = generate_corpus(80, seed=0)
    data = write_jsonl(tmp_path / "chat.jsonl", corpus)
    tok = build_tokenizer(tmp_path / "tok", corpus, 512)
    ver = tiny_verifier_for_tokenizer(tmp_path / "v", tok, hidden_size=64, num_layers=4)
    cfg = ProducerConfig(
        run_dir=str(tmp_path / "run"),
        verifier_name_or_path=str(ver),
        data=[str(data)],
        tokenizer=str(tok),
        seq_len=128,
        window_rows=4,
        capture_batch_rows=1,  # four batches, four queued copies per window
        max_live_windows=64,
        capture_layer_ids=[1, 2],
        store_last_hidden_states=True,
        storage_dtype=storage,
        overlap_publish="on",
        max_windows=6,  # both buffer slots reused twice
        device="cuda",
        workers=1,
        progress=False,
        exit_when_idle_s=0,
    )
    p = Producer(cfg)
    assert p.run()["windows"] == 6
    names = sorted(n for n in os.listdir(tmp_path / "run" / "windows") if parse_window_name(n))
    assert len(names) == 6
    for name in names:
        with p.store.open(name) as r:
            idx, _ = stream_rows(r.meta.window, 4, p.dataset.num_rows, cfg.epochs, cfg.seed)
            rows = p.dataset.rows(idx)
            for i in range(r.rows):
                want = p.verifier.capture(
                    *(torch.from_numpy(rows[k][i : i + 1]) for k in IDS_POS_DOC)
                )
                layers = [r.get(hidden_name(j))[i : i + 1] for j in (1, 2)]  # [1, T, H] each
                got, ref = torch.cat(layers, -1), want.hidden_states.cpu()  # [1, T, 2·H]
                if want.hidden_scales is not None:  # fp8: compare what a trainer sees
                    scales = [r.get(scale_name(j))[i : i + 1] for j in (1, 2)]  # [1, T] each
                    got = dequantize(got, torch.stack(scales, -1))
                    ref = dequantize(ref, want.hidden_scales.cpu())
                torch.testing.assert_close(
                    got.float(),
                    ref.float(),
                    rtol=0.02,
                    atol=0.02,
                    msg=f"{name} row {i}: hidden_states differ",
                )
                assert want.last_hidden_states is not None
                torch.testing.assert_close(
                    r.get("last_hidden_states")[i : i + 1].float(),
                    want.last_hidden_states.cpu().float(),
                    rtol=0.02,
                    atol=0.02,
                )
                agree = (r.get("target_ids")[i : i + 1] == want.target_ids.cpu()).float().mean()
                assert agree > 0.98, (name, i, float(agree))


def test_bf16_linear_kl_on_cuda_matches_fp32() -> None:
    import torch.nn.functional as F

    from fanout.ops.linear_kl import linear_kl_div_and_argmax

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 256, device="cuda", generator=g)
    t = torch.randn(300, 256, device="cuda", generator=g)
    w = torch.randn(32000, 256, device="cuda", generator=g) / 16
    xb = x.bfloat16().requires_grad_(True)
    kl, _ = linear_kl_div_and_argmax(xb, t.bfloat16(), w.bfloat16(), chunk_rows=64)
    kl.sum().backward()
    assert xb.grad is not None
    x32 = xb.detach().float().requires_grad_(True)
    log_pd = F.log_softmax(x32 @ w.bfloat16().float().t(), -1)
    log_pt = F.log_softmax(t.bfloat16().float() @ w.bfloat16().float().t(), -1)
    ref = F.kl_div(log_pd, log_pt, log_target=True, reduction="none").sum(-1)
    ref.sum().backward()
    assert x32.grad is not None
    torch.testing.assert_close(kl, ref.detach(), rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(xb.grad.float(), x32.grad, rtol=5e-2, atol=5e-3)


def _family_step_on(device: str, name: str, vdir: Path) -> tuple[float, float, list[float]]:
    """(fp32 CPU loss, `device` bf16-autocast loss) of the same draft on the same batch,
    then the `device` losses of 10 fused-AdamW steps."""
    import copy

    from fanout.families.registry import family
    from fanout.ops.adamw import make_optimizer

    torch.manual_seed(0)
    fam = family(name)
    layers = fam.draft_layers([1, 3], vdir)  # a chain family's own (MTP: the last one)
    draft = fam.build(vdir, target_layer_ids=layers, block_size=fam.block_size_for(8),
                      max_anchors=8, num_layers=1)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    b, t = 2, 64
    batch = {
        "hidden_states": torch.randn(b, t, len(layers) * 64, generator=g),  # [B, T, layers·H]
        "target_ids": torch.randint(0, 511, (b, t), generator=g),
        "input_ids": torch.randint(0, 511, (b, t), generator=g),
        "loss_mask": torch.ones(b, t, dtype=torch.long),
        "document_ids": torch.zeros(b, t, dtype=torch.long),
        "position_ids": torch.arange(t).expand(b, t).contiguous(),
        "last_hidden_states": torch.randn(b, t, 64, generator=g),  # [B, T, H]
    }
    ref = float(draft.loss(batch, torch.Generator().manual_seed(2)).loss.detach())
    dev = copy.deepcopy(draft).to(device)
    dbatch = {k: v.to(device) for k, v in batch.items()}
    opt, _ = make_optimizer(dev.parameters(), lr=3e-3)
    losses = []
    for _ in range(11):
        with torch.autocast(device, dtype=torch.bfloat16):
            out = dev.loss(dbatch, torch.Generator().manual_seed(2))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
    return ref, losses[0], losses[1:]


@pytest.mark.parametrize("name", FAMILY_FOLDERS)
def test_bf16_family_step_on_cuda(tmp_path: Path, name: str) -> None:
    """Every draft family trains on CUDA in bf16: its first loss is the fp32 CPU loss of the
    same weights and batch (within bf16's error), and ten fused-AdamW steps lower it."""
    from fanout.bench.assets import tiny_qwen3_verifier

    vdir = tiny_qwen3_verifier(tmp_path / "v", 512, hidden_size=64, num_layers=6)
    ref, first, after = _family_step_on("cuda", name, vdir)
    assert abs(first - ref) <= 0.03 * abs(ref) + 0.02, (name, ref, first)
    assert all(torch.isfinite(torch.tensor(after))) and after[-1] < first, (name, first, after)
