"""`fanout demo`: the README's first command, shortened (builds the demo assets: slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fanout.cli import main as cli_main


@pytest.mark.slow
def test_demo_runs_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["demo", "--minutes", "0.5", "--run-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "captured by one verifier pass each (captures/window 1.0)" in out
    for draft in ("b4", "b8", "b16"):
        assert f"\n{draft} " in out
    assert "disk: high-water" in out
    assert (tmp_path / "last" / "report.md").is_file()
    assert (tmp_path / "last" / "steps.png").is_file()
    assert (tmp_path / "last" / "curves.png").is_file()
    # the closing eval: real speculative decoding of the three drafts, lossless
    assert "lossless: every speculative output equals greedy" in out
    rep = json.loads((tmp_path / "last" / "eval.json").read_text())
    assert rep["lossless"] and set(rep["drafts"]) == {"b4", "b8", "b16"}
    assert all(d["train_eal"] is not None for d in rep["drafts"].values())
    # as many prompts as τ's interval needs: ±0.1 for every draft, or the cap spent
    prec = rep["precision"]
    assert prec["target_half_width"] == 0.1 and rep["prompts"] >= 640, prec
    assert prec["met"] or rep["prompts"] == prec["prompts_available"], prec
    # report.md shows that eval beside curves.png: τ, train EAL, per-position acceptance
    md = (tmp_path / "last" / "report.md").read_text()
    assert "## Speculative decoding (fanout eval)" in md and "![curves.png](curves.png)" in md
    for name, d in rep["drafts"].items():
        row = next(x for x in md.splitlines() if x.startswith(f"| {name} |"))
        assert f"| {d['acceptance_length']:.2f} | {d['train_eal']:.2f} |" in row, row
        assert " ".join(f"{a:.2f}" for a in d["per_position_acceptance"]) in row, row


def test_demo_rejects_nonpositive_minutes(tmp_path: Path) -> None:
    assert cli_main(["demo", "--minutes", "0", "--run-dir", str(tmp_path)]) == 1
