"""`fanout demo`: the README's first command, shortened (builds the demo assets: slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fanout.bench.demo import DEMO_FAMILIES
from fanout.cli import main as cli_main


@pytest.mark.slow
def test_demo_runs_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["demo", "--minutes", "0.5", "--run-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "captured by one verifier pass each (captures/window 1.0)" in out
    for draft in DEMO_FAMILIES:
        assert f"\n{draft} " in out
    assert "disk: high-water" in out
    assert (tmp_path / "last" / "report.md").is_file()
    assert (tmp_path / "last" / "steps.png").is_file()
    assert (tmp_path / "last" / "curves.png").is_file()
    # the closing eval: real speculative decoding of one draft per family, lossless
    assert "lossless: every speculative output equals greedy" in out
    rep = json.loads((tmp_path / "last" / "eval.json").read_text())
    assert rep["lossless"] and set(rep["drafts"]) == set(DEMO_FAMILIES)
    assert {d["family"] for d in rep["drafts"].values()} == set(DEMO_FAMILIES)
    assert set(rep["temperatures"]) == {"0.0", "1.0"}
    # ranked side by side: every draft once, best τ at T = 0 first; tau.png beside it
    rows = json.loads((tmp_path / "last" / "ranking.json").read_text())
    taus = [r["tau"]["0.0"]["tau"] for r in rows]
    assert sorted(r["draft"] for r in rows) == sorted(DEMO_FAMILIES) and taus == sorted(taus)[::-1]
    assert all(r["parameters"] > 0 and r["checkpoint_bytes"] > 0 for r in rows)
    assert (tmp_path / "last" / "tau.png").is_file()
    assert "![tau.png](tau.png)" in (tmp_path / "last" / "report.md").read_text()
    assert "the drafts ranked" in out
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


def test_the_opening_line_names_every_stage_and_how_long(tmp_path: Path) -> None:
    from fanout.bench.demo import demo_config, opening_line

    line = opening_line(demo_config(tmp_path, 2.0), tmp_path, 2.0)
    n = len(DEMO_FAMILIES)
    for part in ("[1] prepare", f"[2] produce → {n} drafts", "2 min", "[3] eval", "min on 2 CPU"):
        assert part in line, (part, line)


def test_dev_sh_says_it_installs_before_the_long_install() -> None:
    """A fresh clone's `./dev.sh demo` is not silent for minutes: a line before the
    install, and pip's own progress (no -q on the installs)."""
    dev = (Path(__file__).parent.parent / "dev.sh").read_text()
    installs = [x for x in dev.splitlines() if '/bin/pip" install' in x and "--dry-run" not in x]
    assert len(installs) == 3 and not any(" -q " in x for x in installs), installs
    assert dev.index("(a few minutes)") < dev.index(installs[0].strip())
    assert "creating $VENV" in dev
