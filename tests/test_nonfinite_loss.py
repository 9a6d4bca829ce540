"""A trainer skips a step whose loss is not finite, counts it, and stops after a bound.

    .venv/bin/pytest tests/test_nonfinite_loss.py -x -q

A tiny run (tests/tiny_run.py); the draft's loss is made NaN / inf on chosen steps by
wrapping `Draft.loss`, as a bad window or a diverging draft would make it.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from fanout.errors import FanoutError, NonFiniteLoss, TrainerStopped
from fanout.train.config import TrainConfig
from fanout.train.ending import Ending
from fanout.train.trainer import Trainer
from fanout.train.trainlog import read_train_log
from tiny_run import one_thread, produced_run  # noqa: F401


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nonfinite")
    return produced_run(root, max_live_windows=1000, expected_consumers=1000)


def _trainer(root: Path, name: str, bad: set[int], **kw: Any) -> Trainer:
    """A trainer whose loss is NaN (odd steps) or inf (even ones) on the steps in `bad`
    (1-based); every other step is the draft's own."""
    cfg = TrainConfig(
        run_dir=str(root / "run"), consumer_id=name, verifier_name_or_path=str(root / "verifier"),
        num_layers=1, block_size=4, max_anchors=16, rows_per_step=2,
        save_path=str(root / "drafts" / name), lr=1e-2, warmup_ratio=0.0,
        scheduler_type="constant", heartbeat_s=0.5, **kw,
    )  # fmt: skip
    t = Trainer(cfg)
    own = t.draft.loss

    def loss(*a: Any, **k: Any) -> Any:
        out = own(*a, **k)
        step = t.state["step"] + 1
        if step not in bad:
            return out
        return dataclasses.replace(out, loss=out.loss * (math.nan if step % 2 else math.inf))

    t.draft.loss = loss  # type: ignore[method-assign]
    return t


def test_a_step_with_a_non_finite_loss_is_skipped_and_counted(run: Path) -> None:
    t = _trainer(run, "skips", bad={3, 4})
    weights: dict[int, list[torch.Tensor]] = {}
    after = t._after_step

    def keep(rec: dict[str, Any]) -> None:
        weights[rec["step"]] = [p.detach().clone() for p in t.draft.parameters()]
        after(rec)

    t._after_step = keep  # type: ignore[method-assign]
    t.cfg = t.cfg.model_copy(update={"max_steps": 6})
    out = t.run()
    assert out["steps"] == 6
    recs = {r["step"]: r for r in read_train_log(t.cfg.save_path)}
    assert [s for s, r in recs.items() if r.get("skipped")] == [3, 4]
    assert recs[4]["nonfinite_steps"] == 2 and recs[6]["nonfinite_steps"] == 2
    assert "nonfinite_steps" not in recs[2]
    for p2, p4 in zip(weights[2], weights[4], strict=True):  # no update on steps 3, 4
        assert torch.equal(p2, p4)
    assert all(torch.isfinite(p).all() for p in weights[6])
    assert any(not torch.equal(a, b) for a, b in zip(weights[4], weights[5], strict=True))
    assert t.nonfinite_steps == 2 and t.nonfinite_streak == 0


def test_too_many_in_a_row_stop_the_trainer_naming_them(run: Path) -> None:
    t = _trainer(run, "stops", bad=set(range(2, 100)), max_nonfinite_steps=3, max_steps=20)
    # NonFiniteLoss ends the loop; like every failure it is re-raised as TrainerStopped
    # naming it and the checkpoint saved at the last step (fanout.train.ending)
    raised: list[FanoutError] = []
    end_failed = Ending.failed

    def failed(self: Ending, e: FanoutError) -> None:
        raised.append(e)
        end_failed(self, e)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Ending, "failed", failed)
        with pytest.raises(TrainerStopped) as e:
            t.run()
    assert [type(x) for x in raised] == [NonFiniteLoss]
    msg = str(e.value)
    assert "3 steps in a row (2-4)" in msg and "--max-nonfinite-steps" in msg and "\n" not in msg
    assert t.state["step"] == 4 and t.nonfinite_steps == 3
