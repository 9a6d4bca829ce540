"""A data-parallel trainer's launcher ends in one line, and a silent rank is bounded (#55).

    .venv/bin/pytest tests/test_dp_launch.py -q

fanout.train.dplaunch is torchrun (its parser, its agent) with torch's ChildFailedError
traceback replaced by one line naming the rank that failed, its host, its exit and its
own error line; scripts/launch.sh's dp-trainer role starts it. The trainer's
--dp-timeout-s bounds how long a rank waits in a collective for a rank gone silent (a
host cut off or frozen: here, SIGSTOP): the rank left stops with RankLost's one line,
naming that bound. Every run here is `--standalone` on this host; no test waits on a
clock it asserts on (the bound is read from the message, not measured).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fanout.bench.assets import generate_corpus
from fanout.train.dplaunch import failure_line
from tiny_run import ENV, build_tiny_assets, config_flags, tiny_producer_config, wait_for

DEADLINE_S = 300  # a bound on a hang, never a timing
HOST = socket.gethostname()

# rank 1 fails at once with its own line (as fanout.cli says it, exit 3); rank 0 sleeps
# until the agent stops it
FAILS = """
import os, sys, time
if os.environ["RANK"] == "1":
    from fanout.train.dplaunch import tell_agent
    print("fanout train: error: rank one gave up", file=sys.stderr)
    tell_agent("fanout train: error: rank one gave up")
    sys.exit(3)
time.sleep(600)
"""


def _launch(*argv: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "fanout.train.dplaunch", "--standalone", "--nproc-per-node",
           "2", *argv]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=DEADLINE_S)


def test_a_rank_that_fails_is_one_line_naming_rank_host_exit_and_its_own_line(
    tmp_path: Path,
) -> None:
    """torchrun's `ChildFailedError` traceback and Root Cause box become one line; rank
    1's stderr still reaches the launcher's (the log); exit 1 as torchrun's."""
    script = tmp_path / "fails.py"
    script.write_text(FAILS)
    r = _launch(str(script))
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "Traceback" not in out and "ChildFailedError" not in out, out
    assert "Root Cause" not in out, out
    assert "fanout train: error: rank one gave up\n" in r.stderr  # the rank's own stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("fanout dp-launch:")]
    assert lines == [
        f"fanout dp-launch: error: rank 1 (local 1) on {HOST} exited with code 3: "
        "fanout train: error: rank one gave up; then rank 0 (SIGTERM)"
    ], r.stderr
    # the agent's own line for the same failure is not said twice
    assert "failed (exitcode" not in r.stderr, r.stderr


# every rank says when it is up and when SIGTERM reaches it, then exits 0
WAITS = """
import os, signal, sys, time
def stop(*_):
    print(f"rank {os.environ['RANK']} got SIGTERM", file=sys.stderr, flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print(f"rank {os.environ['RANK']} up", file=sys.stderr, flush=True)
time.sleep(600)
"""


def test_a_sigterm_to_the_launcher_reaches_every_rank_and_is_one_line(tmp_path: Path) -> None:
    """The scheduler's SIGTERM (launch.sh execs the launcher) goes to the agent, which
    passes it to its ranks, as torchrun's does; the launcher then says so in one line
    and exits 1 (torchrun's status for it), not with torch's SignalException traceback."""
    script, log = tmp_path / "waits.py", tmp_path / "launch.log"
    script.write_text(WAITS)
    cmd = [sys.executable, "-m", "fanout.train.dplaunch", "--standalone", "--nproc-per-node",
           "2", str(script)]  # fmt: skip
    with log.open("w") as f:
        launcher = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=ENV)
    try:
        text = lambda: log.read_text(errors="replace")  # noqa: E731
        wait_for(lambda: text().count(" up\n") == 2 or launcher.poll() is not None,
                 DEADLINE_S, "both ranks up", poll_s=0.1)  # fmt: skip
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(DEADLINE_S)
    finally:
        if launcher.poll() is None:
            for pid in _children(launcher):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            launcher.kill()
            launcher.wait(60)
    out = text()
    assert code == 1, out
    assert "rank 0 got SIGTERM" in out and "rank 1 got SIGTERM" in out, out
    assert "Traceback" not in out and "SignalException" not in out, out
    lines = [x for x in out.splitlines() if x.startswith("fanout dp-launch:")]
    assert lines == [f"fanout dp-launch: stopped by SIGTERM on {HOST}"], out


def test_torchruns_usage_errors_are_its_own() -> None:
    """The flags are torchrun's: its parser refuses an unknown one (exit 2, usage)."""
    cmd = [sys.executable, "-m", "fanout.train.dplaunch", "--no-such-flag", "x.py"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=DEADLINE_S)
    assert r.returncode == 2 and "unrecognized arguments: --no-such-flag" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def _failure(
    rank: int, code: int, ts: int, message: Any = "<NONE>", time_ns: int | None = None
) -> Any:
    """What torch's ProcessFailure carries that failure_line reads (`time_ns`: the stamp
    fanout's tell_agent adds to the error file)."""
    name = signal.Signals(-code).name if code < 0 else "<N/A>"
    data = {"message": message} | ({} if time_ns is None else {"time_ns": time_ns})
    return SimpleNamespace(
        local_rank=rank % 2, exitcode=code, timestamp=ts,
        error_file_data=data, signal_name=lambda: name,
    )  # fmt: skip


def test_the_line_names_the_first_rank_that_failed_on_its_own() -> None:
    """Whole-second timestamps tie: the rank that exited on its own is the root cause,
    not the one the agent then stopped; a rank without an error file says no more than
    its exit; torch's own @record report gives its last line (`Type: message`)."""
    tied = {0: _failure(0, -15, 100), 3: _failure(3, 1, 100, "fanout train: error: x")}
    assert failure_line(tied, "n1") == (
        "rank 3 (local 1) on n1 exited with code 1: fanout train: error: x; then rank 0 (SIGTERM)"
    )
    assert (
        failure_line({2: _failure(2, -9, 5)}, "n2")
        == "rank 2 (local 0) on n2 was killed by SIGKILL"
    )
    # within one second: the rank that wrote its line first, though the agent's SIGTERM
    # ended it while it exited (a peer thawed and failed on the closed socket meanwhile)
    raced = {
        0: _failure(0, -15, 100, "fanout train: error: timed out", time_ns=100_200_000_000),
        1: _failure(1, 1, 100, "fanout train: error: closed by peer", time_ns=100_700_000_000),
    }
    assert failure_line(raced, "n4") == (
        "rank 0 (local 0) on n4 failed, then was stopped by SIGTERM: fanout train: error: "
        "timed out; then rank 1 (code 1)"
    )
    recorded = {"message": "ValueError: bad", "extraInfo": {"py_callstack": "Traceback ..."}}
    assert failure_line({1: _failure(1, 1, 5, recorded)}, "n3") == (
        "rank 1 (local 1) on n3 exited with code 1: ValueError: bad"
    )


def test_the_agents_own_failure_is_one_line_with_its_cause() -> None:
    """torch chains the store's error under RendezvousConnectionError ("See inner
    exception"): both first lines, no C++ frames after them."""
    from fanout.train.dplaunch import _agent_line

    class RendezvousConnectionError(Exception):
        pass

    try:
        try:
            raise RuntimeError("Failed to recv, got 0 bytes.\nException raised from recvBytes")
        except RuntimeError as inner:
            raise RendezvousConnectionError("The store has failed. See inner exception") from inner
    except RendezvousConnectionError as e:
        assert _agent_line(e) == (
            "RendezvousConnectionError: The store has failed. See inner exception "
            "(RuntimeError: Failed to recv, got 0 bytes.)"
        )


def test_a_fanout_error_under_torchrun_is_left_for_the_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """fanout.cli's one-line error goes to stderr and to the agent's error file for this
    rank (TORCHELASTIC_ERROR_FILE), where the launcher reads it."""
    import json

    from fanout.cli import main

    err = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(err))
    assert main(["status", "--run-dir", str(tmp_path / "nope")]) == 1
    said = capsys.readouterr().err.strip()
    assert said.startswith("fanout status: error: ") and "\n" not in said
    assert json.loads(err.read_text())["message"] == said


# ---- --dp-timeout-s: a rank gone silent -------------------------------------------------------


def _children(launcher: subprocess.Popen[Any]) -> list[int]:
    """The launcher's workers (its agent runs in its own process: its children)."""
    path = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children")
    with contextlib.suppress(OSError):
        return [int(pid) for pid in path.read_text().split()]
    return []


def _rank_pid(launcher: subprocess.Popen[Any], rank: int) -> int:
    """The pid of the launcher's worker with RANK=`rank` (by its environment)."""
    kids = _children(launcher)
    for pid in kids:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no worker of rank {rank} among {kids}")


def test_a_silent_rank_ends_the_other_in_one_line_bounded_by_dp_timeout_s(
    tmp_path: Path,
) -> None:
    """Both ranks start their process group and wait for a run that is not there yet;
    rank 1 is then frozen (SIGSTOP: a host cut off, its sockets open, no RST). The run
    is created: rank 0 goes on to its next collective with rank 1, which never answers,
    and after --dp-timeout-s ends with RankLost's line naming that bound (not 30 min);
    the launcher's line names rank 0 and carries it."""
    assets, run = tmp_path / "assets", tmp_path / "run"
    assets.mkdir()
    build_tiny_assets(assets, generate_corpus(24, seed=0))
    log = tmp_path / "dp.log"
    train = [
        "-m", "fanout.cli", "train", "--run-dir", str(run), "--consumer-id", "c0",
        "--verifier-name-or-path", str(assets / "verifier"), "--num-layers", "1",
        "--block-size", "4", "--max-anchors", "8", "--save-path", str(tmp_path / "draft"),
        "--heartbeat-s", "0.3", "--acquire-timeout-s", str(DEADLINE_S), "--dp-timeout-s", "4",
    ]  # fmt: skip
    argv = [sys.executable, "-m", "fanout.train.dplaunch", "--standalone", "--nproc-per-node",
            "2", *train]  # fmt: skip
    producer = None
    with log.open("w") as f:
        launcher = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=ENV)
    text = lambda: log.read_text(errors="replace")  # noqa: E731
    try:
        # both ranks are in their process group (logged once it is up), then wait for the run
        up = ("data parallel: rank 0 of 2", "data parallel: rank 1 of 2")
        wait_for(lambda: all(x in text() for x in up)
                 or launcher.poll() is not None, DEADLINE_S, "both ranks' process group",
                 poll_s=0.1)  # fmt: skip
        assert launcher.poll() is None, text()[-3000:]
        frozen = _rank_pid(launcher, 1)
        os.kill(frozen, signal.SIGSTOP)
        cfg = tiny_producer_config(assets, run, max_live_windows=3, expected_consumers=2)
        with (tmp_path / "producer.log").open("w") as f:
            producer = subprocess.Popen(
                [sys.executable, "-m", "fanout.cli", "produce", *config_flags(cfg)],
                stdout=f, stderr=subprocess.STDOUT, env=ENV,
            )  # fmt: skip
        wait_for(lambda: "error: data-parallel rank 0" in text() or launcher.poll() is not None,
                 DEADLINE_S, "rank 0's line", poll_s=0.1)  # fmt: skip
        os.kill(frozen, signal.SIGCONT)  # the agent's SIGTERM reaches it now
        code = launcher.wait(DEADLINE_S)
    finally:
        if launcher.poll() is None:  # a failed test: its ranks first (one may be stopped)
            for pid in _children(launcher):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for p in (launcher, producer):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(60)
    out = text()
    assert code == 1, out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    # rank 0's line (rank 1, thawed into the agent's SIGTERM, may say its own)
    (lost,) = [
        x for x in out.splitlines() if x.startswith("fanout train: error: data-parallel rank 0")
    ]
    assert lost.startswith(
        "fanout train: error: data-parallel rank 0 of 2: a collective failed, so another rank "
        "is gone (its process died or its host was lost, or it was silent past the process "
        "group's timeout, --dp-timeout-s 4): "
    ), lost
    assert "timed out" in lost.lower(), lost  # gloo's own words: a wait, not a closed socket
    (line,) = [x for x in out.splitlines() if x.startswith("fanout dp-launch:")]
    # rank 0 exits on its own, or, on a loaded host, is still exiting when the thawed rank 1
    # fails on the closed socket and the agent stops the group: rank 0 is named either way
    how = ("exited with code 1", "failed, then was stopped by SIGTERM")
    assert any(
        line.startswith(f"fanout dp-launch: error: rank 0 (local 0) on {HOST} {h}: {lost}")
        for h in how
    ), line
