"""The trainer as an operator sees it: what it says while waiting, per-step progress,
where its start-up goes, and that it imports nothing it does not use.

.venv/bin/pytest tests/test_startup.py -q

No test depends on timing: WaitNotice runs on a fake clock, and the CLI cases only
read what the trainer prints.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fanout.train.progress import WaitNotice
from tiny_run import produced_run


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_wait_notice_says_what_it_waits_for_every_few_seconds() -> None:
    clock, said = FakeClock(), list[str]()
    n = WaitNotice(600.0, every_s=5.0, clock=clock, write=said.append)
    assert n.tick() is None  # not waiting
    n.begin(lambda: "window 7 from the producer", after_s=5.0)
    clock.t += 4.9
    assert n.tick() is None  # a short wait says nothing
    clock.t += 0.2
    assert (
        n.tick() == "waiting for window 7 from the producer (5.1 s of 600 s; --acquire-timeout-s)"
    )
    clock.t += 1.0
    assert n.tick() is None
    clock.t += 4.0
    assert n.tick() == "waiting for window 7 from the producer (10 s of 600 s; --acquire-timeout-s)"
    n.end()
    clock.t += 60
    assert n.tick() is None and len(said) == 2
    n.begin(lambda: "a producer to create run/coordinator.sqlite3")  # after_s=0: at once
    assert n.tick() == (
        "waiting for a producer to create run/coordinator.sqlite3 (0.0 s of 600 s; "
        "--acquire-timeout-s)"
    )


def test_wait_notice_shows_the_counted_time_and_says_when_a_wait_does_not_count() -> None:
    """Only waits on the producer count toward --acquire-timeout-s (coord.leasing): the
    line shows those seconds against the timeout, and the whole wait beside them."""
    clock, said = FakeClock(), list[str]()
    counts = [True]
    n = WaitNotice(600.0, every_s=5.0, clock=clock, write=said.append)
    n.begin(lambda: "window 3 from the producer", after_s=5.0, counts=lambda: counts[0])

    def wait(seconds: int) -> None:
        for _ in range(seconds):
            clock.t += 1.0
            n.tick()

    wait(10)  # 10 s on the producer: all counted
    assert said[-1] == "waiting for window 3 from the producer (10 s of 600 s; --acquire-timeout-s)"
    counts[0] = False  # now another consumer holds the producer at K: a line every 30 s
    wait(815)
    assert said[-1] == (
        "waiting for window 3 from the producer (825 s, 10 s of 600 s counted; a wait for "
        "another consumer does not count toward --acquire-timeout-s)"
    )
    counts[0] = True  # the producer again: 30 more counted seconds, then the next line
    wait(30)
    assert said[-1] == (
        "waiting for window 3 from the producer (40 s of 600 s counted toward "
        "--acquire-timeout-s; 855 s in all: a wait for another consumer does not count)"
    )
    n.begin(lambda: "window 4 from the producer", counts=lambda: True)  # a new wait
    clock.t += 2.0
    assert n.tick() == (
        "waiting for window 4 from the producer (2.0 s of 600 s; --acquire-timeout-s)"
    )


def test_trainer_module_imports_nothing_heavy() -> None:
    """transformers, matplotlib, pandas, the data stage, torch._dynamo: none is needed to
    train (the optimizer's path past import: tests/test_optim.py)."""
    heavy = [
        "transformers",
        "matplotlib",
        "pandas",
        "fanout.data.prepare",
        "fanout.model.verifier",
        "psycopg",
        "torch._dynamo",
        "sympy",
    ]
    code = f"import sys, fanout.train.trainer; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip() == "[]"


def test_status_and_sweep_import_no_torch(tmp_path: Path) -> None:
    """`fanout status` / `sweep` (flags, --config, run) stay light: people run them in loops."""
    conf = tmp_path / "status.json"
    conf.write_text(json.dumps({"run_dir": str(tmp_path / "none"), "as_json": True}))
    code = (
        "import sys; from fanout import cli\n"
        "for c in ('status', 'sweep'):\n"
        f"    assert cli.main([c, '--config', {str(conf)!r}, '--json']) == 1\n"
        "print([m for m in ('torch', 'numpy', 'transformers') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip() == "[]", out.stderr
    assert out.stderr.count("no coordinator database") == 2, out.stderr


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("startup")
    return produced_run(root, max_live_windows=100, expected_consumers=100)


def _train(run: Path, name: str, *more: str) -> subprocess.CompletedProcess[str]:
    argv = [
        "train", "--run-dir", run / "run", "--consumer-id", name,
        "--verifier-name-or-path", run / "verifier", "--save-path", run / "drafts" / name,
        "--num-layers", "1", "--block-size", "4", "--max-anchors", "8", "--max-steps", "3", *more,
    ]  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "fanout.cli", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_progress_bar_and_startup_line(run: Path) -> None:
    r = _train(run, "p", "--progress")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])  # stdout: the summary, unchanged
    assert summary["steps"] == 3 and summary["consumer"] == "p:dp0"
    bar = r.stderr.replace("\r", "\n")
    assert "3/3" in bar
    for part in ("loss ", "EAL ", "rows/s", "waiting ", "window ", "cursor "):
        assert part in bar, part
    startup = [x for x in r.stderr.splitlines() if "first step" in x]
    assert len(startup) == 1
    for part in ("interpreter + imports", "waiting for the run", "draft + optimizer"):
        assert part in startup[0]


def test_no_progress_bar_when_asked_or_not_a_terminal(run: Path) -> None:
    for name, more in (("q", ["--no-progress"]), ("r", [])):  # stderr is a pipe here
        r = _train(run, name, *more)
        assert r.returncode == 0, r.stderr
        assert "rows/s" not in r.stderr and "step/s" not in r.stderr
        assert json.loads(r.stdout.strip().splitlines()[-1])["steps"] == 3
