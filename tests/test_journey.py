"""A user's first real run, as README's "Using it on a real verifier" tells it (#32).

    .venv/bin/pytest tests/test_journey.py -x -q

The documented commands, run as processes on SQLite over the tiny assets: `fanout
prepare --out prepared/` → `fanout produce --data prepared/` (no second preparation) →
two trainers of different block sizes with neither --max-steps nor --epochs (the
default schedule: warm-up, then cosine to the stream's end) → SIGINT one (exit 0, a
checkpoint, `stopped`) → `--resume` it (steps go on where they stopped) → SIGINT it
again and `fanout detach` it (the other reads on) → the stream's end (the other
finishes, the producer exits 0) → `fanout eval` of both drafts (lossless, one table).
Every wait is on a condition seen in a file, a log or the database, never a sleep.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from fanout.bench.assets import generate_corpus, write_jsonl
from fanout.checkpoints.layout import latest_checkpoint
from fanout.status.schema import StatusSnapshot
from fanout.train.trainlog import read_train_log
from test_endings import Procs, _alive, _summary
from test_roles import ENV, _row, _status, wait_for
from tiny_run import build_tiny_assets


def _fanout(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fanout.cli", *args],
        capture_output=True, text=True, env=ENV, timeout=600,
    )  # fmt: skip


def _log(save: Path) -> list[dict[str, Any]]:
    return read_train_log(save)


def _steps_logged(save: Path) -> int:
    return len(_log(save))


def test_the_documented_journey(tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    data, tok, ver = build_tiny_assets(assets, generate_corpus(60, seed=0))
    held = write_jsonl(tmp_path / "heldout.jsonl", generate_corpus(4, seed=99))
    run, drafts, prepared = tmp_path / "run1", tmp_path / "drafts", tmp_path / "prepared"

    # 1. prepare: packed, loss-masked rows in a fingerprinted cache
    r = _fanout(
        "prepare", "--data", str(data), "--tokenizer", str(tok), "--seq-len", "96",
        "--out", str(prepared), "--workers", "1", "--cache-dir", str(tmp_path / "cache"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]

    procs = Procs(tmp_path / "logs")
    try:
        # 2. one producer over what prepare wrote (K = 4, 3 epochs, two expected consumers)
        producer = procs.start(
            "producer", "produce", "--run-dir", str(run), "--verifier-name-or-path", str(ver),
            "--data", str(prepared), "--seq-len", "96", "--window-rows", "4",
            "--max-live-windows", "4", "--capture-layer-ids", "1", "2",
            "--expected-consumers", "2", "--epochs", "3", "--workers", "1",
            "--heartbeat-s", "0.5", "--exit-when-idle-s", "0",
        )  # fmt: skip

        # 3. two trainers, b4 and b8, as the README writes them: no --max-steps, no --epochs
        def trainer(name: str, block: int, *more: str) -> list[str]:
            return [
                "train", "--run-dir", str(run), "--consumer-id", name,
                "--verifier-name-or-path", str(ver), "--block-size", str(block),
                "--num-layers", "1", "--max-anchors", "8", "--rows-per-step", "1",
                "--save-path", str(drafts / name), "--heartbeat-s", "0.5",
                "--checkpoint-every", "1000000000", *more,
            ]  # fmt: skip

        b4 = procs.start("b4", *trainer("b4", 4))
        b8 = procs.start("b8", *trainer("b8", 8))

        # SIGINT b8 once it has trained a few steps: exit 0, checkpoint, `stopped`
        # (at once: a status command first let it run to the stream's end once, in CI)
        wait_for(lambda: _alive(b8) and _steps_logged(drafts / "b8") >= 3, 300, "b8 steps")
        b8.proc.send_signal(signal.SIGINT)
        code, out = b8.finish(300)
        assert code == 0, out[-3000:]
        s = _summary(out)
        assert s["interrupted"] is True and s["state"] == "stopped", s
        # a real run's `status --json` is a StatusSnapshot (docs/operations.md's schema)
        live = StatusSnapshot.model_validate(_status(run))
        c8 = {c.id: c for c in live.consumers}["b8:dp0"]
        assert (c8.name, c8.family, c8.dp_rank, c8.dp_world) == ("b8", "dflash", 0, 1), c8
        assert c8.step is not None and c8.step >= 3, c8  # from its train log
        rates = [r.windows_per_s or 0.0 for r in live.replicas if r.state == "active"]
        assert live.totals.producer_windows_per_s == round(sum(rates), 4) > 0, live.totals
        stopped_at = s["steps"]
        ckpt = latest_checkpoint(drafts / "b8")
        assert ckpt is not None
        assert json.loads((ckpt / "training_state.json").read_text())["step"] == stopped_at
        assert _row(run, "SELECT state FROM consumers WHERE id='b8:dp0'") == ("stopped",)

        # --resume: the same consumer goes on at the next step
        b8 = procs.start("b8-resumed", *trainer("b8", 8, "--resume"))
        wait_for(
            lambda: _alive(b8) and _steps_logged(drafts / "b8") >= stopped_at + 2, 300,
            "b8 resumed steps",
        )  # fmt: skip
        b8.proc.send_signal(signal.SIGINT)  # it may have reached the stream's end first
        code, out = b8.finish(300)
        assert code == 0, out[-3000:]
        s = _summary(out)
        assert s["state"] in ("stopped", "finished"), s
        b8_steps = s["steps"]
        assert [x["step"] for x in _log(drafts / "b8")] == list(range(1, b8_steps + 1))

        # b8 is stopped for good: release it, and b4 reads on to the stream's end
        r = _fanout("detach", "--run-dir", str(run), "--consumer-id", "b8")
        assert r.returncode == 0, r.stderr
        said = "detached (by `fanout detach`" if s["state"] == "stopped" else "already finished"
        assert r.stdout.startswith(f"b8:dp0: {said}"), r.stdout
        assert r.stderr.count("detached") == 0, r.stderr  # the result once, on stdout

        code, out = b4.finish(600)
        assert code == 0, out[-3000:]
        s4 = _summary(out)
        assert s4["finished_stream"] is True and s4["state"] == "finished", s4
        code, pout = producer.finish(600)
        assert code == 0, pout[-3000:]
    finally:
        procs.kill_all()

    # the producer used the prepared rows: nothing was prepared a second time
    assert f"using prepared rows from {prepared}" in pout, pout[-3000:]
    assert "preparing" not in pout, pout[-3000:]
    assert not (run / "cache").exists() or not any((run / "cache").iterdir())

    # the stream ended where the producer said; status says who finished, who detached
    info = json.loads((run / "stream.json").read_text())
    st = _status(run)
    end = StatusSnapshot.model_validate(st)
    assert end.producer.state == "finished" and end.stream.length_windows == info["total_windows"]
    assert st["stream_end"] == st["produced_windows"] == info["total_windows"]
    states = {c["id"]: c["recorded_state"] for c in st["consumers"]}
    assert states == {"b4:dp0": "finished", "b8:dp0": "detached"}, states
    assert s4["steps"] == info["num_rows"] * info["epochs"]  # every row, one per step

    # the default schedule held: warm-up to the peak, then a decay to ~0 at the end
    lrs = [x["lr"] for x in _log(drafts / "b4")]
    peak = max(lrs)
    top = lrs.index(peak)
    assert 0 < top < len(lrs) // 4, (top, len(lrs))
    assert lrs[0] < peak and lrs[-1] < 0.05 * peak, (lrs[0], peak, lrs[-1])

    # 4. eval: both drafts in one run, lossless, one table
    out_json = tmp_path / "eval.json"
    r = _fanout(
        "eval", "--verifier-name-or-path", str(ver), "--tokenizer", str(tok),
        "--draft", str(drafts / "b4"), "--draft", str(drafts / "b8"), "--data", str(held),
        "--num-prompts", "4", "--max-new-tokens", "16", "--json", str(out_json),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out_json.read_text())
    assert rep["lossless"] is True
    assert set(rep["drafts"]) == {"b4", "b8"}
    for d in rep["drafts"].values():
        assert d["acceptance_length"] >= 1.0
    assert "b4" in r.stdout and "b8" in r.stdout
