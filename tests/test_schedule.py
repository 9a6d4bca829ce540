"""The trainer's defaults hold on real runs: the LR schedule's total from the stream, a
block that cannot fit refused at start, steps without supervised tokens ended.

    .venv/bin/pytest tests/test_schedule.py -q

Runs come from the real producer in this process (finite, and on-policy: `produce
--regenerate`); `scripts/train.py` runs as a user runs it. Nothing depends on timing:
an on-policy stream's length is recorded (stream.json rewritten) between building a
trainer and running it, which the trainer learns at its first step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fanout.bench.assets import generate_corpus
from fanout.checkpoints.layout import latest_checkpoint
from fanout.contract import LayersNotCaptured
from fanout.coord.coordinator import Coordinator
from fanout.coord.reads import consumer_states
from fanout.errors import TrainerStopped
from fanout.produce.producer import Producer
from fanout.train.config import TrainConfig
from fanout.train.consumer import ConsumerConfig, ConsumerStream
from fanout.train.plan import StreamPlanner
from fanout.train.trainer import NO_TOKEN_STEPS, Trainer
from fanout.train.trainlog import read_train_log
from test_train import repetitive_corpus
from tiny_run import (  # noqa: F401 (one_thread: an autouse fixture)
    build_tiny_assets,
    config_flags,
    one_thread,
    tiny_producer_config,
)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train.py"
SEQ_LEN = 96  # tiny_producer_config's


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("schedule")
    corpus = repetitive_corpus(40, seed=0)
    build_tiny_assets(root, corpus, corpus + generate_corpus(50, seed=1))
    return root


@pytest.fixture(scope="module")
def run(assets: Path) -> Path:
    """A finite run whose last window is short: 18 rows × 3 epochs in 4-row windows."""
    run = assets / "run"
    cfg = tiny_producer_config(
        assets, run, epochs=3, max_live_windows=1000, expected_consumers=1000
    )
    Producer(cfg).run()
    info = json.loads((run / "stream.json").read_text())
    assert info["num_rows"] * 3 % 4, info  # the last window is shorter
    return run


def _cfg(assets: Path, run: Path, name: str, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        run_dir=str(run),
        consumer_id=name,
        verifier_name_or_path=str(assets / "verifier"),
        num_layers=1,
        block_size=4,
        max_anchors=16,
        save_path=str(assets / "drafts" / name),
        heartbeat_s=0.5,
    )
    return TrainConfig(**(base | kw))


def _log(cfg: TrainConfig) -> list[dict[str, Any]]:
    return read_train_log(cfg.save_path)


def _cosine(k: int, n: int) -> float:
    """Cosine decay's factor k steps into n."""
    return 0.5 * (1 + math.cos(math.pi * k / n))


def _script(*argv: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, env=env, timeout=600
    )


def test_documented_command_warms_up_then_decays_to_zero_at_the_stream_end(
    assets: Path, run: Path
) -> None:
    """No --max-steps, no --epochs (the README's and docs/training.md's commands): the
    default cosine with 5% warm-up over the steps the stream makes, ending at 0."""
    cfg = _cfg(assets, run, "documented", rows_per_step=1)
    r = _script(*config_flags(cfg))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["finished_stream"] and summary["state"] == "finished"
    # a normal finish names its checkpoint in its last lines, stdout's and stderr's (45.4)
    saved = latest_checkpoint(cfg.save_path)
    assert saved is not None and summary["checkpoint"] == str(saved)
    last = r.stderr.strip().splitlines()[-1]
    assert f"documented: finished at step {summary['steps']}; saved a checkpoint" in last
    assert last.endswith(str(saved)), last
    lrs = [rec["lr"] for rec in _log(cfg)]
    steps = len(lrs)
    warm = int(0.05 * steps)
    assert warm >= 2
    n = json.loads((run / "stream.json").read_text())["num_rows"]
    assert (
        f"lr schedule: cosine, {warm} warm-up steps, decaying to 0 at step {steps} "
        f"({n} rows per epoch × 3 epochs in {run / 'stream.json'}, 1 row per step)"
    ) in r.stderr
    # each step logs the lr it used: step k uses the factor of k - 1
    assert lrs[:warm] == sorted(lrs[:warm]) and lrs[0] == pytest.approx(cfg.lr / warm)  # rises
    assert lrs[warm - 1] == pytest.approx(cfg.lr)  # to the peak
    after = lrs[warm - 1 :]
    assert after == sorted(after, reverse=True) and after[len(after) // 2] < 0.75 * cfg.lr
    # the last step is the schedule's last: the one after it would have lr 0
    assert lrs[-1] == pytest.approx(cfg.lr * _cosine(steps - 1 - warm, steps - warm))
    assert 0 < lrs[-1] < 0.01 * cfg.lr


@pytest.mark.parametrize(
    ("world", "rows_per_step", "epochs"), [(1, 2, None), (1, 3, None), (2, 3, None), (1, 2, 0.5)]
)
def test_the_plan_counts_the_steps_the_consumer_stream_yields(
    run: Path, world: int, rows_per_step: int, epochs: float | None
) -> None:
    plan = StreamPlanner(
        run, rows_per_step=rows_per_step, world=world, epochs=epochs, max_steps=None
    ).read()
    assert plan.settled
    counted = set()
    for rank in range(world):
        ccfg = ConsumerConfig(
            run_dir=str(run),
            consumer_id=f"count-{world}-{rows_per_step}-{epochs}",
            dp_rank=rank,
            dp_world_size=world,
            max_windows=plan.max_windows,
        )
        with ConsumerStream(ccfg) as s:
            counted.add(sum(1 for _ in s.batches(rows_per_step)))
    assert counted == {plan.total_steps}
    # the log's reason names the numbers the total is made of (issue 45.6)
    n = json.loads((run / "stream.json").read_text())["num_rows"]
    assert plan.why.startswith(f"{n} rows per epoch × 3 epochs in {run / 'stream.json'}")
    ranks = f" on each of {world} ranks" if world > 1 else ""
    assert plan.why.endswith(f", {rows_per_step} rows per step{ranks}"), plan.why
    assert ("--epochs 0.5: its first" in plan.why) == (epochs is not None), plan.why


def test_unknown_total_warns_holds_the_peak_and_decays_once_the_end_is_recorded(
    assets: Path, run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """stream.json saying nothing of the stream's length: a warning at start, warm-up
    over a fixed number of steps, the peak held; once the length is recorded, a
    continuous decay to 0 at the stream's end."""
    info = run / "stream.json"
    real = info.read_text()
    blank = json.loads(real) | {"num_rows": None, "total_windows": None, "dataset_summary": {}}
    info.write_text(json.dumps(blank))
    try:
        cfg = _cfg(assets, run, "unknown", warmup_ratio=0.05, checkpoint_every=1000)
        with caplog.at_level(logging.INFO, logger="fanout.train.trainer"):
            t = Trainer(cfg)
            assert t.curve.total is None and t.curve.warmup == 100
        assert "the cosine lr schedule has no total steps yet" in caplog.text
        assert "total unknown: constant until the stream end is recorded" in caplog.text
        factors = [t.curve(k) for k in range(130)]
        assert factors[0] == 0.01 and factors[99:] == [1.0] * 31
        # the producer records the length; the trainer sees it after its first step
        info.write_text(real)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fanout.train.trainer"):
            t.run()
    finally:
        info.write_text(real)
    lrs = [rec["lr"] for rec in _log(cfg)]
    n = len(lrs)
    assert f"lr schedule from step 1: cosine, 1 warm-up steps, decaying to 0 at step {n}" in (
        caplog.text
    )
    # warm-up steps 1 and 2 of 100, then (the stream is shorter) a decay from there
    assert lrs[:2] == pytest.approx([0.01 * cfg.lr, 0.02 * cfg.lr])
    assert lrs[1:] == sorted(lrs[1:], reverse=True)
    assert lrs[-1] == pytest.approx(0.02 * cfg.lr * _cosine(n - 2, n - 1))


def test_block_size_of_the_rows_length_is_refused_before_registering(
    assets: Path, run: Path
) -> None:
    """`--block-size T` (the run's seq_len): one line naming the flag, T and the largest
    block that can train, exit 1, and no consumer registered (nothing holds the run)."""
    cfg = _cfg(assets, run, "too-big", block_size=SEQ_LEN)
    r = _script(*config_flags(cfg))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines[-1].startswith(f"fanout train: error: --block-size {SEQ_LEN} does not fit")
    assert f"T = {SEQ_LEN} tokens" in lines[-1]
    assert f"the largest block that can train is {SEQ_LEN - 1}" in lines[-1]
    with Coordinator.open(run) as co:
        assert not [c for c in consumer_states(co.conn) if c.startswith("too-big")]
    assert not Path(cfg.save_path).exists()  # refused before --save-path was taken


def test_steps_without_supervised_tokens_warn_then_stop_the_trainer_saving_nothing(
    assets: Path, run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The largest block that fits (T - 1) leaves anchors only at position 0, never
    supervised here: every step has no token. One warning, then NoSupervisedTokens
    after NO_TOKEN_STEPS steps; no checkpoint of a draft that learned nothing."""
    cfg = _cfg(assets, run, "no-tokens", block_size=SEQ_LEN - 1, max_anchors=2, checkpoint_every=5)
    with (
        caplog.at_level(logging.WARNING, logger="fanout.train.trainer"),
        pytest.raises(TrainerStopped) as e,
    ):
        Trainer(cfg).run()
    msg = str(e.value)
    assert f"{NO_TOKEN_STEPS} steps in a row (1-{NO_TOKEN_STEPS}) had no supervised token" in msg
    assert "--block-size" in msg and "recorded 'stopped'" in msg
    assert "so it saved no checkpoint" in msg
    assert caplog.text.count("had no supervised token: no anchor fit its rows") == 1
    assert [r["tokens"] for r in _log(cfg)] == [0] * NO_TOKEN_STEPS
    assert latest_checkpoint(cfg.save_path) is None
    with Coordinator.open(run) as co:
        assert consumer_states(co.conn)["no-tokens:dp0"] == "stopped"


def test_the_trainers_layer_error_names_its_own_flag(assets: Path, run: Path) -> None:
    with pytest.raises(LayersNotCaptured) as e:
        Trainer(_cfg(assets, run, "layers", draft_layer_ids=[3]))
    assert "--draft-layer-ids" in str(e.value) and "--target-layer-ids" not in str(e.value)
    assert "it captured [1, 2]" in str(e.value)


# ---- on-policy: the stream's length is known only once its regeneration is done ------

REGEN = dict(regenerate=True, temperature=1.0, keep_truncated=True, max_new_tokens=6)


def test_onpolicy_epochs_are_planned_from_the_estimate_and_follow_the_recorded_length(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`--epochs` on a `produce --regenerate` run still regenerating: not refused; the
    schedule's total is estimated from the plan (planned records × rows per record so
    far); once the producer records the length, the trainer reads --epochs' windows and
    decays continuously to 0 at their end."""
    root = tmp_path / "assets"
    build_tiny_assets(root, generate_corpus(12, 3))
    run = tmp_path / "run"
    pcfg = tiny_producer_config(
        root, run, **REGEN, regen_chunk_records=2, max_live_windows=64, epochs=2, seq_len=48,
        expected_consumers=10,
    )  # fmt: skip
    Producer(pcfg.model_copy(update={"max_windows": 1})).run()
    early = json.loads((run / "stream.json").read_text())
    assert early["num_rows"] is None  # still regenerating
    s = early["dataset_summary"]
    est_rows = round(s["rows_so_far"] * s["planned_records"] / s["records"])
    est_steps = -(-est_rows // 4) * 4 // 2  # --epochs 1 of ~est_rows in 4-row windows, 2 a step
    cfg = _cfg(root, run, "onpolicy", rows_per_step=2, epochs=1.0)
    with caplog.at_level(logging.INFO, logger="fanout.train.trainer"):
        t = Trainer(cfg)
    assert (t.curve.total, t.curve.settled, t.max_windows) == (est_steps, False, None)
    assert f"decaying to 0 at step {est_steps} (not final" in caplog.text
    Producer(pcfg).run()  # regenerates the rest, rewrites stream.json with the rows
    info = json.loads((run / "stream.json").read_text())
    windows = -(-info["num_rows"] // 4)
    assert windows * 4 // 2 != est_steps  # the estimate was off: the total moves
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fanout.train.trainer"):
        out = t.run()
    assert out["state"] == "finished" and out["cursor"] == windows
    assert f"--epochs: reading windows [0, {windows})" in caplog.text
    lrs = [rec["lr"] for rec in _log(cfg)]
    n = len(lrs)
    assert n == windows * 4 // 2
    # the estimate's decay (no warm-up at 5% of a few steps) until step 1, then from
    # that factor down to 0 at the real end: continuous, never rising
    assert lrs[:2] == pytest.approx([cfg.lr, cfg.lr * _cosine(1, est_steps)])
    assert lrs == sorted(lrs, reverse=True)
    assert lrs[-1] == pytest.approx(cfg.lr * _cosine(1, est_steps) * _cosine(n - 2, n - 1))
