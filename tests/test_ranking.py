"""fanout.bench.ranking: drafts of several families ranked from an eval report, their
checkpoints and train logs (the demo's and benchmarks/families.py's table)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fanout.bench.assets import tiny_qwen3_verifier
from fanout.bench.ranking import checkpoint_params, plot_tau, rank_drafts, ranking_lines, step_ms
from fanout.checkpoints.save import save_checkpoint
from fanout.families.registry import FAMILIES, family
from fanout.train.trainlog import MetricsLog
from tiny_run import one_thread  # noqa: F401 (autouse)


def _save(name: str, ver: Path, root: Path, **kw: Any) -> tuple[Path, int]:
    torch.manual_seed(0)
    # MTP reads the verifier's last layer only (the layers its trainer picks)
    layers = family(name).draft_layers([1, 2], ver) if name == "mtp" else [1, 2]
    fields = {"target_layer_ids": layers, "block_size": 4, "max_anchors": 8, "num_layers": 1}
    d = family(name).build(ver, **(fields | kw))
    path = save_checkpoint(
        root, d, torch.optim.SGD(d.parameters(), lr=0.1), {"step": 1},
        verifier_name_or_path=str(ver),
    )  # fmt: skip
    return path, sum(p.numel() for p in d.parameters() if p.requires_grad)


def _fig(tau: float, lo: float, hi: float) -> dict[str, Any]:
    return {"acceptance_length": tau, "acceptance_length_ci95": [lo, hi]}


def test_ranked_best_first_with_the_checkpoint_and_step_figures(tmp_path: Path) -> None:
    ver = tiny_qwen3_verifier(tmp_path / "v", 128, hidden_size=32, num_layers=4)
    ids = torch.arange(0, 128, 2)
    a, n_a = _save("dflash", ver, tmp_path / "a", draft_vocab_size=64, draft_vocab_ids=ids)
    b, n_b = _save("dspark", ver, tmp_path / "b")
    # trainable parameters only: not the reduced head, d2t or t2d the file also holds
    assert checkpoint_params(a) == (n_a, (a / "model.safetensors").stat().st_size)
    assert checkpoint_params(b)[0] == n_b
    # every family: the count is the model's own trainable parameters (EAGLE-3's file also
    # holds the verifier's frozen embedding)
    for name in FAMILIES:  # each at the block its family drafts at width 4 (eagle3: ttt 3)
        bs = family(name).block_size_for(4)
        path, count = _save(name, ver, tmp_path / f"all-{name}", block_size=bs)
        assert checkpoint_params(path)[0] == count, name
    logs = {}
    for n, ms in (("a", [50.0, 40.0, 3.0, 4.0, 5.0]), ("b", [9.0, 9.0, 7.0, 8.0, 30.0])):
        logs[n] = tmp_path / n
        metrics = MetricsLog(logs[n])
        for x in ms:
            metrics.write({"step": 1, "fwd_ms": x, "bwd_ms": 1.0, "opt_ms": 0.5})
        metrics.close()
    assert step_ms(logs["a"]) == 5.5  # median of 4.5, 5.5, 6.5: the first two left out
    report = {
        "drafts": {
            "a": {"family": "dflash", "block_size": 4, "train_eal": 1.5,
                  "at_temperature": {"0.0": _fig(1.4, 1.3, 1.5), "1.0": _fig(1.2, 1.1, 1.3)}},
            "b": {"family": "dspark", "block_size": 4, "train_eal": None,
                  "proposed_length": 0.5,
                  "at_temperature": {"0.0": _fig(1.9, 1.8, 2.0), "1.0": _fig(1.7, 1.6, 1.8)}},
        }
    }  # fmt: skip
    rows = rank_drafts(report, {"a": a, "b": b}, logs)
    assert [r["draft"] for r in rows] == ["b", "a"]  # best τ at T = 0 first
    assert rows[0]["tau"]["1.0"] == {"tau": 1.7, "ci95": [1.6, 1.8]}
    assert rows[0]["proposed_length"] == 0.5 and rows[1]["step_ms"] == 5.5
    lines = ranking_lines(rows)
    assert "τ T=0.0 (95% CI)" in lines[0] and "τ T=1.0 (95% CI)" in lines[0]
    assert lines[1].split()[:4] == ["1", "b", "dspark", "4"]
    assert "1.90 (1.80–2.00)" in lines[1] and "1.40 (1.30–1.50)" in lines[2]
    assert f"{n_b:,}" in lines[1] and " — " in lines[1]  # no train EAL recorded
    out = plot_tau(rows, tmp_path / "tau.png")
    assert out.is_file() and out.read_bytes()[:4] == b"\x89PNG"
