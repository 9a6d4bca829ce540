"""A trainer and the producer at a small K, as real processes (issue #47).

    .venv/bin/pytest tests/test_small_k.py -x -q

At K = 2 the last slot goes to the window after the one the trainer holds, so
capture overlaps training: each of the trainer's steps is held (a hook, not a sleep)
until the producer has published the next window, which it can only do while the
trainer still holds its current one. Before issue #47 the producer waited for the
trainer's ack and the trainer for the producer: the hook never returned. At K = 1
the two take turns. A step that spans more windows than K is refused at start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fanout.bench.assets import generate_corpus
from fanout.coord.coordinator import Coordinator
from tiny_run import build_tiny_assets, config_flags, one_thread, tiny_producer_config, wait_for  # noqa: F401 (one_thread: an autouse fixture)

REPO = Path(__file__).resolve().parents[1]
ENV = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
WINDOWS = 6
HOOK_S = 90.0  # how long a held step waits for the next window before the test fails

# A trainer-like consumer process: `python step.py JSON`. Each step holds its window(s)
# until the producer has published the window after them ("hook": true) or at once,
# then acks. Prints {"windows": [...], "overlapped": n} on success; exit 2 when a held
# step's next window never came (the producer waited for this trainer's ack).
STEP = """
import json, sys, time
import torch
torch.set_num_threads(1)
from fanout.coord.coordinator import Coordinator
from fanout.train.consumer import ConsumerConfig, ConsumerStream
a = json.loads(sys.argv[1])
cfg = ConsumerConfig(run_dir=a["run_dir"], consumer_id="t", heartbeat_s=0.3,
                     acquire_timeout_s=a["timeout_s"], db_path=a["db"])
seen, overlapped = [], 0
with ConsumerStream(cfg) as s, Coordinator.open(a["run_dir"], db_path=a["db"]) as co:
    for b in s.batches(a["rows_per_step"]):
        w = b.rows[-1][0]
        seen += sorted({x for x, _ in b.rows} - set(seen))
        if a["hook"] and w + 1 < a["windows"]:
            end = time.monotonic() + a["hook_s"]
            while True:
                row = co.conn.execute(
                    "SELECT captures FROM windows WHERE window=?", (w + 1,)).fetchone()
                if row is not None and int(row[0]) > 0:
                    overlapped += 1
                    break
                if time.monotonic() > end:
                    print(f"window {w + 1} was not published while window {w} was held",
                          file=sys.stderr)
                    sys.exit(2)
                time.sleep(0.02)
        s.ack(b)
print(json.dumps({"windows": seen, "overlapped": overlapped}))
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("small_k")
    build_tiny_assets(root, generate_corpus(60, seed=3))
    (root / "step.py").write_text(STEP)
    return root


def _producer(assets: Path, run: Path, db: str | None, k: int) -> subprocess.Popen[bytes]:
    cfg = tiny_producer_config(
        assets, run, max_live_windows=k, max_windows=WINDOWS, window_rows=2,
        cache_dir=str(assets / "cache"), heartbeat_s=0.3, db_path=db,
    )  # fmt: skip
    with open(run.parent / "producer.log", "wb") as log:  # the child keeps its own fd
        proc = subprocess.Popen(
            [sys.executable, "-m", "fanout.cli", "produce", *config_flags(cfg)],
            env=ENV, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def created() -> bool:
        assert proc.poll() is None, (run.parent / "producer.log").read_text()[-3000:]
        co = Coordinator.open_if_created(run, db_path=db)
        if co is not None:
            co.close()
        return co is not None

    wait_for(created, 120, "the producer's run", poll_s=0.05)  # the trainer joins it
    return proc


def _trainer(
    assets: Path, run: Path, db: str | None, **kw: object
) -> subprocess.CompletedProcess[str]:
    args = {"run_dir": str(run), "db": db, "timeout_s": 60, "rows_per_step": 2,
            "windows": WINDOWS, "hook_s": HOOK_S} | kw  # fmt: skip
    return subprocess.run(
        [sys.executable, str(assets / "step.py"), json.dumps(args)],
        env=ENV, capture_output=True, text=True, timeout=HOOK_S * WINDOWS,
    )  # fmt: skip


@pytest.mark.parametrize(("k", "hook"), [(2, True), (1, False)], ids=["k2-overlap", "k1-turns"])
def test_a_trainer_at_small_k_finishes_the_stream(
    assets: Path, tmp_path: Path, db: str | None, k: int, hook: bool
) -> None:
    """K = 2: every step but the last sees its next window published while it holds its
    own (capture overlaps training; the producer is held by at most the step it waits
    for). K = 1: capture and training take turns. Either way: the whole stream, in
    order, both processes exit 0."""
    run = tmp_path / "run"
    producer = _producer(assets, run, db, k)
    try:
        done = _trainer(assets, run, db, hook=hook)
        assert done.returncode == 0, done.stderr[-3000:]
        assert producer.wait(120) == 0, (tmp_path / "producer.log").read_text()[-3000:]
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.wait(30)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["windows"] == list(range(WINDOWS))
    assert got["overlapped"] == (WINDOWS - 1 if hook else 0)


def test_a_step_spanning_more_windows_than_k_is_refused_in_one_line(
    assets: Path, tmp_path: Path
) -> None:
    """A step of 3 rows over windows of 2 holds 2 windows at once: at K = 1 its second
    window could only get room from its own ack. The trainer says so and exits 1."""
    run = tmp_path / "run"
    producer = _producer(assets, run, None, 1)
    try:
        cmd = [sys.executable, str(REPO / "scripts" / "train.py"), "--run-dir", str(run),
               "--consumer-id", "wide", "--verifier-name-or-path", str(assets / "verifier"),
               "--block-size", "4", "--max-anchors", "8", "--rows-per-step", "3",
               "--save-path", str(tmp_path / "draft"), "--heartbeat-s", "0.3"]  # fmt: skip
        done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    finally:
        producer.kill()
        producer.wait(30)
    assert done.returncode == 1, done.stderr[-3000:]
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "--rows-per-step" in lines[-1] and "--max-live-windows K=1" in lines[-1], lines[-3:]
    assert "holds up to 2 windows" in lines[-1], lines[-1]
