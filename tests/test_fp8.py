"""fp8 storage: the per-token quantiser's error bound, and fp8 windows end to end
(verifier hooks → producer → window file → trainer)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fanout.bench.assets import generate_corpus
from fanout.ops.fp8 import FP8, FP8_MAX, dequantize, quantize_into
from fanout.produce.producer import Producer
from fanout.produce.stream import stream_rows
from fanout.store.store import Store, WindowReader
from fanout.store.windowfile import hidden_name, scale_name
from fanout.train.consumer import Batch
from fanout.train.trainlog import read_train_log
from tiny_run import build_tiny_assets, tiny_producer_config
from window_files import window_names

LAYERS = (1, 2)  # tiny_producer_config's captured layers


def _side_by_side(r: WindowReader, fp8: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A window's layers side by side ([R, T, n·H]) and, for fp8, their scales ([R, T, n]):
    what a consumer of all captured layers hands its trainer."""
    hidden = torch.cat([r.get(hidden_name(i)) for i in LAYERS], -1)
    if not fp8:
        return hidden, None
    return hidden, torch.stack([r.get(scale_name(i)) for i in LAYERS], -1)


def _bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest error round-to-nearest e4m3 may make, per element: half an ulp, i.e.
    2⁻⁴ relative for normal values, 2⁻¹⁰·scale (half the subnormal step) below."""
    return torch.maximum(x.abs() * 2.0**-4, scale[..., None] * 2.0**-10) * (1 + 1e-6)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(1, 12),
    h=st.integers(1, 40),
    log_mag=st.floats(-20, 20),
    outlier=st.floats(0, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantize_error_is_within_half_an_ulp(
    tokens: int, h: int, log_mag: float, outlier: float, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    mags = torch.exp(torch.randn(tokens, 1, generator=g) * 3 + log_mag)  # tokens differ a lot
    x = torch.randn(tokens, h, generator=g) * mags
    x[:, 0] *= 10**outlier  # an outlier channel, as LLM hidden states have
    if tokens > 1:
        x[1] = 0.0  # an all-zero token (padding) stays exactly zero
    q = torch.empty(tokens, h, dtype=FP8)
    scale = torch.empty(tokens)
    quantize_into(x.to(torch.bfloat16), q, scale)
    xb = x.to(torch.bfloat16).float()  # what the hook receives
    back = dequantize(q, scale[:, None])
    assert back.dtype == torch.float32 and not back.isnan().any()
    # the slow reference: each token's largest |value| maps to 448
    torch.testing.assert_close(scale, (xb.abs().amax(-1) / FP8_MAX).clamp(min=1e-38))
    assert ((back - xb).abs() <= _bound(xb, scale)).all()
    if tokens > 1:
        assert (back[1] == 0).all()


def test_quantize_writes_into_strided_layer_slices_and_dequantize_checks_shapes() -> None:
    n, h = 3, 8
    layers = [torch.randn(2, 5, h) * (j + 1) ** 3 for j in range(n)]  # [B, T, H] each
    q = torch.empty(2, 5, n * h, dtype=FP8)
    scales = torch.empty(2, 5, n)
    for j, x in enumerate(layers):
        quantize_into(x, q[:, :, j * h : (j + 1) * h], scales[:, :, j])
    back = dequantize(q, scales)  # [2, 5, n·H]
    for j, x in enumerate(layers):
        part = back[:, :, j * h : (j + 1) * h]
        assert ((part - x).abs() <= _bound(x, scales[:, :, j])).all(), j
    with pytest.raises(ValueError, match="do not match scales"):
        dequantize(q, scales[:, :4])
    with pytest.raises(ValueError, match="do not match scales"):
        dequantize(q[..., :-1], scales)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fp8")
    data, tok, ver = build_tiny_assets(root, generate_corpus(60, seed=0))
    return {"root": root, "data": data, "tok": tok, "ver": ver}


def _produce(assets: dict[str, Any], name: str, storage: str) -> Producer:
    root = assets["root"]
    cfg = tiny_producer_config(
        root,
        root / name,
        capture_batch_rows=2,
        max_live_windows=64,
        storage_dtype=storage,
        store_last_hidden_states=True,
        max_windows=3,
        cache_dir=str(root / "cache"),
    )
    p = Producer(cfg)
    assert p.run()["windows"] == 3
    return p


def test_fp8_windows_hold_the_quantised_capture_at_about_half_the_bytes(
    assets: dict[str, Any],
) -> None:
    p8 = _produce(assets, "run-fp8", "float8_e4m3fn")
    p32 = _produce(assets, "run-fp32", "float32")
    assert p8.contract.storage_dtype == "float8_e4m3fn"
    assert p8.contract.stream_id != p32.contract.stream_id  # another contract, another run
    s8, s32 = Store(p8.run_dir), Store(p32.run_dir)
    for a, b in zip(window_names(s8), window_names(s32), strict=True):
        with s8.open(a) as r8, s32.open(b) as r32:
            q, scale = _side_by_side(r8, fp8=True)
            assert scale is not None
            for i in LAYERS:  # one tensor per layer, values and scales
                assert r8.get(hidden_name(i)).dtype == FP8
                assert r8.get(scale_name(i)).shape == r8.get(hidden_name(i)).shape[:2]
            assert q.dtype == FP8 and scale.dtype == torch.float32
            assert tuple(scale.shape) == (*q.shape[:2], 2)
            ref, _ = _side_by_side(r32, fp8=False)  # the same rows captured in fp32
            ref_scale = (ref.unflatten(-1, (2, 32)).abs().amax(-1) / FP8_MAX).clamp(min=1e-38)
            torch.testing.assert_close(scale, ref_scale, rtol=1e-5, atol=0)
            err = (dequantize(q, scale) - ref).unflatten(-1, (2, 32)).abs()
            assert (err <= _bound(ref.unflatten(-1, (2, 32)), ref_scale)).all()
            assert r8.get("last_hidden_states").dtype == torch.bfloat16
            assert torch.equal(r8.get("target_ids"), r32.get("target_ids"))
            idx, _ = stream_rows(r8.meta.window, 4, p8.dataset.num_rows, 1, 0)
            np.testing.assert_array_equal(
                r8.get("input_ids").numpy(), p8.dataset.rows(idx)["input_ids"]
            )
            hid8 = q.numel() * 1 + scale.numel() * 4
            assert hid8 < 0.3 * ref.numel() * 4  # fp32 → fp8 + scales: about a quarter


def test_a_trainer_learns_from_fp8_windows(assets: dict[str, Any]) -> None:
    from fanout.train.config import TrainConfig
    from fanout.train.trainer import Trainer

    p = _produce(assets, "run-fp8-train", "float8_e4m3fn")
    cfg = TrainConfig(
        run_dir=str(p.run_dir.root),
        consumer_id="fp8",
        verifier_name_or_path=str(assets["ver"]),
        num_layers=1,
        block_size=4,
        max_anchors=16,
        rows_per_step=2,
        max_steps=6,
        save_path=str(assets["root"] / "draft-fp8"),
        lr=1e-2,
        warmup_ratio=0.0,
        scheduler_type="constant",
    )
    t = Trainer(cfg)
    # What the draft sees of an fp8 window: float32, dequantised with the scales.
    with p.store.open(window_names(p.store)[0]) as r:
        q, scale = _side_by_side(r, fp8=True)
        assert scale is not None
        ids = r.get("input_ids")
        seen = t._to_device(Batch({"hidden_states": q, "hidden_states_scale": scale,
                                   "input_ids": ids}, [], [], (0, 0), 0.0))  # fmt: skip
    assert set(seen) == {"hidden_states", "input_ids"}
    assert torch.equal(seen["hidden_states"], dequantize(q, scale))
    assert not torch.equal(seen["hidden_states"], q.float())
    out = t.run()
    assert out["steps"] == 6
    log = read_train_log(cfg.save_path)
    assert len(log) == 6 and all(math.isfinite(r["loss"]) for r in log)
    assert log[-1]["loss"] < log[0]["loss"]
