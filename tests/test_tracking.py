"""W&B tracking (fanout.tracking), checked against what W&B itself writes offline.

.venv/bin/pytest tests/test_tracking.py -x -q
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fanout.errors import ConfigError
from fanout.tracking import TrackingOptions, WandbRun, check_available, group_for

pytest.importorskip("wandb")
from wandb_offline import read_offline_runs


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_a_run_holds_its_group_job_metrics_and_summary(tmp_path: Path) -> None:
    run = WandbRun.start(
        TrackingOptions(wandb_project="drafts"), name="b16:dp0", group="run1",
        job_type="train", config={"block_size": 16}, dir=tmp_path,
    )  # fmt: skip
    for step in range(1, 4):
        run.log({"step": step, "loss": 4.0 - step, "note": "text is left out"}, step=step)
    run.finish({"checkpoint": "drafts/b16/step-3", "steps": 3, "nested": {"no": 1}})
    (got,) = read_offline_runs(tmp_path)
    assert (got.project, got.group, got.job_type, got.name) == (
        "drafts",
        "run1",
        "train",
        "b16:dp0",
    )
    assert got.config["block_size"] == 16
    assert [(h["step"], h["loss"]) for h in got.history] == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert all("note" not in h for h in got.history)
    assert got.summary["checkpoint"] == "drafts/b16/step-3" and got.summary["steps"] == 3
    assert "nested" not in got.summary


def test_the_group_defaults_to_the_run_dirs_name(tmp_path: Path) -> None:
    assert group_for(tmp_path / "run7", None) == "run7"
    assert group_for(tmp_path / "run7", "mine") == "mine"
    assert group_for(None, None) is None


def test_wandb_missing_is_one_line_naming_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"^--logger wandb: needs the wandb package"):
        check_available("--logger wandb")
