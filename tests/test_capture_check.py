"""The capture check: a window with non-finite or degenerate captured layers is never
published; it is captured again once, then the producer stops naming layer and row.

    .venv/bin/pytest tests/test_capture_check.py -x -q

The verifier is tests/tiny_run.py's tiny Qwen3; "loaded wrongly" is the same checkpoint
with every weight zero (a real failure: a loader that maps no tensor names, vLLM
#46301 / speculators #613's all-zero hidden states).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from fanout.bench.assets import generate_corpus
from fanout.coord.coordinator import Coordinator
from fanout.errors import CaptureCheckFailed
from fanout.model.verifier import token_stats
from fanout.produce import capture as capture_mod
from fanout.produce.capture_check import check_window
from fanout.produce.producer import Producer
from fanout.store.store import parse_window_name
from tiny_run import build_tiny_assets, one_thread, tiny_producer_config  # noqa: F401

LAYERS = [1, 2]


def _window(
    r: int = 3, t: int = 10, h: int = 8
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Random layer outputs n × [R, T, H], document ids (last 2 tokens padding), targets."""
    g = torch.Generator().manual_seed(0)
    hidden = [torch.randn(r, t, h, generator=g) for _ in LAYERS]
    docs = torch.zeros(r, t, dtype=torch.long)
    docs[:, -2:] = -1
    targets = torch.randint(0, 50, (r, t), generator=g)
    return hidden, docs, targets


def _check(hidden: list[torch.Tensor], docs: torch.Tensor, targets: torch.Tensor) -> None:
    check_window(torch.stack([token_stats(x) for x in hidden]), docs, targets, LAYERS)


def test_a_good_window_passes() -> None:
    hidden, docs, targets = _window()
    _check(hidden, docs, targets)
    hidden[1][2, -1] = float("nan")  # padding is not looked at
    hidden[0][0, -2:] = 0.0
    _check(hidden, docs, targets)


@pytest.mark.parametrize(
    ("bad", "reason"),
    [("nan", "non-finite"), ("inf", "non-finite"), ("zero", "zero"), ("constant", "the same")],
)
def test_each_degeneracy_names_the_layer_and_row(bad: str, reason: str) -> None:
    hidden, docs, targets = _window()
    x = hidden[1][2]  # layer 2, row 2: [T, H]
    if bad in ("nan", "inf"):
        x[4, 3] = float(bad)
    elif bad == "zero":
        x[:-2] = 0.0  # every document token; padding keeps its values
    else:
        x[:] = x[0].clone()
    with pytest.raises(CaptureCheckFailed) as e:
        _check(hidden, docs, targets)
    assert (e.value.layer, e.value.row) == (2, 2) and reason in str(e.value)
    assert "captured layer 2, row 2" in str(e.value) and "\n" not in str(e.value)


def test_constant_rows_pass_where_the_verifier_is_constant_too() -> None:
    hidden, docs, targets = _window()
    hidden[0][1][:] = hidden[0][1][0].clone()
    targets[1] = 7  # the verifier's own greedy ids do not vary either
    _check(hidden, docs, targets)
    one = docs.clone()
    one[0, 1:] = -1  # a row of one document token is never "constant"
    hidden[0][0][:] = hidden[0][0][0].clone()
    _check(hidden, one, targets)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    build_tiny_assets(root, generate_corpus(60, seed=0))
    return root


def _zeroed(src: Path, dst: Path) -> Path:
    """The verifier checkpoint at `src` with every weight zero, at `dst`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        save_file({k: torch.zeros_like(v) for k, v in load_file(f).items()}, f,
                  metadata={"format": "pt"})  # fmt: skip
    return dst


def _published(run: Path) -> list[int]:
    return sorted(w[0] for n in (run / "windows").iterdir() if (w := parse_window_name(n.name)))


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_verifier_loaded_as_zeros_is_refused(tiny: Path, tmp_path: Path, overlap: str) -> None:
    # Its captures are all zero: the first window is not published and is captured
    # again; the retry fails too and the producer stops, naming window, layer and row.
    # (Overlapped, window 1 is captured while window 0's check runs, so which window
    # fails its second check first depends on scheduling: 0 or 1, never a later one.)
    ver = _zeroed(tiny / "verifier", tmp_path / "zeros")
    run = tmp_path / "run"
    cfg = tiny_producer_config(
        tiny, run, verifier_name_or_path=str(ver), max_windows=3, overlap_publish=overlap,
        cache_dir=str(tiny / "cache"), capture_layer_ids=LAYERS,
    )  # fmt: skip
    p = Producer(cfg)
    with pytest.raises(CaptureCheckFailed) as e:
        p.run()
    msg = str(e.value)
    w = e.value.window
    assert w in ((0,) if overlap == "off" else (0, 1)), msg
    assert e.value.layer == LAYERS[0] and e.value.row == 0, msg
    assert msg.startswith(f"window {w}: captured layer 1, row 0: ") and "zero" in msg
    assert p.stats.bad_captures == 2 and p.stats.windows == 0
    assert _published(run) == []
    with Coordinator.open(run) as c:
        (err,) = c.conn.execute("SELECT last_error FROM windows WHERE window = ?", (w,)).fetchone()
    assert err is not None and "capture check" in err


def test_one_bad_capture_is_captured_again_and_published(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A capture that fails the check once (a transient fault): the retry is published,
    # every window is, and the failure is counted.
    real = capture_mod.check_window
    calls: list[int] = []

    def flaky(*a: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise CaptureCheckFailed(1, 3, "injected")
        real(*a)

    monkeypatch.setattr(capture_mod, "check_window", flaky)
    run = tmp_path / "run"
    cfg = tiny_producer_config(tiny, run, max_windows=3, cache_dir=str(tiny / "cache"))
    summary = Producer(cfg).run()
    assert summary["windows"] == 3 and summary["bad_captures"] == 1
    assert _published(run) == [0, 1, 2] and len(calls) == 4
    # counted where an operator looks: status and /metrics
    from fanout.status.serve import metrics_text
    from fanout.status.snapshot import build

    with Coordinator.open(run) as c:
        snap = build(c)
    assert snap.capture_failures == 1
    assert "fanout_capture_failures_total 1.0" in metrics_text(snap)
