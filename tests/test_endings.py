"""How trainers and producers end, wait and keep what they trained (issue #27, #20 part 4).

    .venv/bin/pytest tests/test_endings.py -x -q                # default: SQLite + one PG run
    .venv/bin/pytest tests/test_endings.py -x -q -m slow        # the rest of the matrix

The coordinator cases run in one process on both backends: a stream a producer ends
by design ends for its trainers (a signal leaves it open), a wait for another
consumer never counts toward the acquire timeout, `detach_consumer` releases a
stopped consumer and refuses a live one. The process cases run the real `fanout
produce` / `fanout train` commands (forked from a warm forkserver: forked_cli): one
producer and three trainers with --max-steps 20 / 200 / none under each lag policy
all reach their own ends (exit 0, final checkpoint, state finished), the short one's
checkpoint resumed later rejoins with its evicted windows recaptured; --max-windows
ends the stream; a producer killed with SIGKILL leaves a trainer that times out with
a checkpoint at its last step.
Nothing here depends on timing: waits are bounded by conditions seen in the
database or in a process's output, never by a sleep.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fanout.bench.assets import generate_corpus
from fanout.checkpoints.layout import latest_checkpoint
from fanout.cli import main as cli_main
from fanout.coord.coordinator import Coordinator
from fanout.coord.waits import WaitState
from fanout.errors import AcquireCancelled, AcquireTimeout, ConfigError, Detached
from fanout.produce.backpressure import BlockedNotice
from fanout.status.snapshot import snapshot
from fanout.status.table import format_table
from fanout.train.trainlog import read_train_log
from forked_cli import ForkedPopen
from test_coordinator import new_run, produce
from test_roles import ENV, Cli, _row, _status, wait_for
from tiny_run import build_tiny_assets, config_flags, tiny_producer_config


def _acquire_until(
    co: Coordinator, reg: Any, timeout_s: float, stop_after_s: float
) -> tuple[list[WaitState], BaseException]:
    """acquire() with `timeout_s`, cancelled once it has waited `stop_after_s` (longer):
    what it heard while waiting, and how it ended."""
    heard: list[WaitState] = []
    cancel = threading.Event()
    t0 = time.monotonic()

    def on_wait(why: WaitState) -> None:
        heard.append(why)
        if time.monotonic() - t0 > stop_after_s:
            cancel.set()

    try:
        co.acquire(reg, timeout_s=timeout_s, cancel=cancel, on_wait=on_wait)
    except (AcquireCancelled, AcquireTimeout) as e:
        return heard, e
    raise AssertionError("acquire returned a lease")


def test_a_stream_ended_by_design_ends_a_signal_leaves_it_open(
    db: str | None, tmp_path: Path
) -> None:
    co, store, c = new_run(tmp_path, db, max_live_windows=4)
    p = co.register_producer(c)
    reg = co.register_consumer("a")
    for _ in range(2):
        produce(co, p, store, c)
    assert "windows  produced 2/∞  " in format_table(snapshot(co))  # open-ended, still open
    co.finish_producer(p, stream_end=2)  # --max-windows 2
    for w in range(2):
        lease = co.acquire(reg, timeout_s=1)
        assert lease is not None and lease.window == w
        co.ack(lease)
    assert co.acquire(reg, timeout_s=1) is None  # the end, at once: no timeout
    assert snapshot(co)["stream_end"] == 2
    table = format_table(snapshot(co))
    assert "stream ended at window 2" in table
    assert "windows  produced 2/2  " in table  # its end recorded: the total is known

    p2 = co.register_producer(c)  # a restarted producer reopens the stream
    assert snapshot(co)["stream_end"] is None
    co.finish_producer(p2, stream_end=None)  # stopped by a signal: open
    heard, err = _acquire_until(co, reg, timeout_s=0.2, stop_after_s=5)
    assert isinstance(err, AcquireTimeout), err
    assert "stopped (a signal" in str(err) and "restart `fanout produce`" in str(err)
    assert heard and all(w.counts for w in heard)
    table = format_table(snapshot(co))
    assert "stopped by a signal: the stream is open" in table
    assert "windows  produced 2/∞  " in table  # open again


def test_a_wait_for_another_consumer_never_counts_toward_the_timeout(
    db: str | None, tmp_path: Path
) -> None:
    """Hold, K = 3 (two windows and the slowest's slot, its next needed window 2), two
    consumers: `slow` stopped at cursor 0 holds the producer at K;
    `fast` waits for window 3 far longer than its timeout and hears who holds it; once
    `slow` is detached the producer has room and `fast` reads on."""
    co, store, c = new_run(tmp_path, db, max_live_windows=3, expected_consumers=2)
    p = co.register_producer(c)
    fast = Coordinator.open(tmp_path / "run")
    rf = fast.register_consumer("fast")
    rs = co.register_consumer("slow")
    for _ in range(3):
        produce(co, p, store, c)
        lease = fast.acquire(rf, timeout_s=1)
        assert lease is not None
        fast.ack(lease)
    co.stop(rs)
    assert co.wait_for_capacity(p, timeout_s=0.1) is False
    blocked = snapshot(co)["blocked"]
    assert blocked is not None and blocked["by"] == ["slow:dp0"], blocked
    line = format_table(snapshot(co))
    assert "producer blocked at K=3 by slow:dp0 (stopped, cursor 0" in line, line
    assert "fanout detach --run-dir" in line
    assert "slow:dp0 (stopped" in co.blocked_by() and "--lag-policy" in co.blocked_by()

    heard, err = _acquire_until(fast, rf, timeout_s=0.2, stop_after_s=1.0)
    assert isinstance(err, AcquireCancelled), err  # never AcquireTimeout: not counted
    assert heard and not any(w.counts for w in heard)
    assert "blocked at K=3 live windows by slow:dp0 (stopped" in heard[-1].text

    with pytest.raises(ConfigError, match=r"no consumer 'nobody'.*fast:dp0, slow:dp0"):
        co.detach_consumer("nobody")
    with pytest.raises(ConfigError, match=r"fast:dp0 of .* is active.*--force"):
        co.detach_consumer("fast")  # this live process holds it
    (line,) = co.detach_consumer("slow")  # a name: every rank of it
    assert line.startswith("slow:dp0: detached (by `fanout detach`") and "was stopped" in line
    s = snapshot(co)
    assert s["detaches"] == 1 and s["blocked"] is None
    assert [x["state"] for x in s["consumers"]] == ["active", "detached"]
    assert "slow:dp0: detached by `fanout detach`" in format_table(s)
    assert co.wait_for_capacity(p, timeout_s=0.1) is True  # windows 0, 1, 2 evicted
    produce(co, p, store, c)
    lease = fast.acquire(rf, timeout_s=1)
    assert lease is not None and lease.window == 3

    again = co.register_consumer("slow")  # may register again: active, at its cursor
    assert again.cursor == 0 and snapshot(co)["consumers"][1]["state"] == "active"
    fast.close()


def test_detach_force_fences_a_live_consumer_and_a_finished_one_holds_nothing(
    db: str | None, tmp_path: Path
) -> None:
    co, store, c = new_run(tmp_path, db, max_live_windows=3, expected_consumers=2)
    p = co.register_producer(c)
    a, b = co.register_consumer("a"), co.register_consumer("b")
    for _ in range(2):
        produce(co, p, store, c)
    lease = co.acquire(a, timeout_s=1)
    assert lease is not None
    co.ack(lease)
    co.finish(b)  # its own end at cursor 0: windows it never read no longer wait for it
    assert co.meta("evictions") == 1  # window 0: `a` passed it, `b` finished
    assert co.detach_consumer("b:dp0") == ["b:dp0: already finished; it holds nothing back"]
    (line,) = co.detach_consumer("a", force=True)
    assert "was active at cursor 1" in line
    with pytest.raises(Detached, match="detached \\(by `fanout detach`"):
        co.acquire(a, timeout_s=1)


def test_waiting_for_an_expected_consumer_is_named_and_not_counted(
    db: str | None, tmp_path: Path
) -> None:
    co, store, c = new_run(tmp_path, db, max_live_windows=3, expected_consumers=2)
    p = co.register_producer(c)
    reg = co.register_consumer("only")
    for _ in range(3):  # K: the last in the slot kept for its next needed window
        produce(co, p, store, c)
        lease = co.acquire(reg, timeout_s=1)
        assert lease is not None
        co.ack(lease)
    assert co.wait_for_capacity(p, timeout_s=0.1) is False
    heard, err = _acquire_until(co, reg, timeout_s=0.2, stop_after_s=1.0)
    assert isinstance(err, AcquireCancelled), err
    assert "waiting for 1 of 2 expected consumers" in heard[-1].text
    assert "waiting for 1 of 2 expected consumers" in format_table(snapshot(co))
    json.dumps(snapshot(co))  # --json stays serialisable


def test_a_blocked_producer_says_who_holds_it_at_most_every_30_s(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """BlockedNotice on a fake clock: the bar gets the words at once, the log a line
    once the block is 5 s old, then at most one per 30 s; a new block starts over."""

    class Coord:
        text = "blocked at K=4 live windows by short:dp0 (stopped, ...); ways out: ..."

        def blocked_by(self) -> str:
            return self.text

    class Bar:
        words = ""

        def set_postfix_str(self, s: str) -> None:
            self.words = s

    now = [100.0]
    notice, bar = BlockedNotice(Coord(), clock=lambda: now[0]), Bar()
    said: list[bool] = []
    for t in (0, 1, 4.9, 5, 6, 20, 34.9, 35, 36):
        now[0] = 100.0 + t
        said.append(notice.waiting(bar) is not None)
    assert said == [False, False, False, True, False, False, False, True, False]
    assert bar.words.startswith("blocked at K=4 live windows by short:dp0 (stopped")
    assert any(r.levelname == "WARNING" and "ways out" in r.message for r in caplog.records)
    notice.clear()
    now[0] += 1
    assert notice.waiting(bar) is None  # a new block: quiet for its first 5 s again


def test_fanout_detach_command(
    db: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fanout detach`: one line per consumer released, exit 0; a live consumer is
    refused with one line naming it (exit 1); `--config FILE` works like the flags."""
    co, _store, _c = new_run(tmp_path, db)
    live = co.register_consumer("live")
    co.stop(co.register_consumer("idle"))
    run = str(tmp_path / "run")
    assert cli_main(["detach", "--run-dir", run, "--consumer-id", "live:dp0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fanout detach: error: consumer live:dp0 of {run} is active (")
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    cfg = tmp_path / "detach.json"
    cfg.write_text(json.dumps({"run_dir": run, "consumer_id": "idle"}))
    assert cli_main(["detach", "--config", str(cfg)]) == 0
    assert capsys.readouterr().out.startswith("idle:dp0: detached (by `fanout detach`")
    states = {c["id"]: c["recorded_state"] for c in snapshot(co)["consumers"]}
    assert states == {"idle:dp0": "detached", "live:dp0": "active"}
    co.heartbeat(live)  # untouched
    # the real command, --force on the live one: its result once, on stdout; no stderr
    r = subprocess.run(
        [sys.executable, "-m", "fanout.cli", "detach", "--run-dir", run, "--consumer-id",
         "live", "--force"], capture_output=True, text=True, env=ENV, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("live:dp0: detached (by `fanout detach`"), r.stdout
    assert len(r.stdout.splitlines()) == 1 and "was active at cursor 0" in r.stdout
    assert r.stderr == ""
    with pytest.raises(Detached):
        co.heartbeat(live)


# ---- the real commands ----------------------------------------------------------------

ENDS = {"t20": 20, "t200": 200, "tall": None}  # --max-steps of each trainer


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("endings")
    build_tiny_assets(root, generate_corpus(60, seed=0))
    return root


def _producer(assets: Path, run: Path, db: str | None, **kw: Any) -> list[str]:
    """`fanout produce` flags: K = 4, 8 epochs (62 windows of 4 rows: 248 rows, so the
    200-step trainer ends at its own --max-steps, not at the stream's end)."""
    cfg = tiny_producer_config(
        assets, run, heartbeat_s=0.5, cache_dir=str(assets / "cache"),
        **({"epochs": 8, "db_path": db, "max_live_windows": 4} | kw),
    )  # fmt: skip
    return ["produce", *config_flags(cfg)]


def _trainer(assets: Path, run: Path, name: str, saves: Path, *more: str) -> list[str]:
    return [
        "train", "--run-dir", str(run), "--consumer-id", name, "--verifier-name-or-path",
        str(assets / "verifier"), "--num-layers", "1", "--block-size", "4", "--max-anchors", "8",
        "--rows-per-step", "1", "--save-path", str(saves / name), "--heartbeat-s", "0.5",
        "--checkpoint-every", "1000000000", *more,
    ]  # fmt: skip


def _summary(out: str) -> dict[str, Any]:
    """The trainer's summary line (its stdout shares the log file with stderr)."""
    lines = [x for x in out.splitlines() if x.startswith('{"consumer"')]
    assert lines, out[-3000:]
    return dict(json.loads(lines[-1]))


def _checkpoint_step(save: Path) -> int:
    ckpt = latest_checkpoint(save)
    assert ckpt is not None, f"no checkpoint in {save}"
    return int(json.loads((ckpt / "training_state.json").read_text())["step"])


def _logged_steps(save: Path) -> list[int]:
    return [int(r["step"]) for r in read_train_log(save)]


def _alive(p: Cli) -> bool:
    """True while `p` runs; its output, in the failure, once it has exited."""
    assert p.proc.poll() is None, p.log.read_text()[-3000:]
    return True


class ForkedCli(Cli):
    """`Cli`, forked from the warm forkserver (forked_cli): a real `fanout` process
    without the interpreter start-up and imports each of a test's processes paid."""

    def __init__(self, log: Path, *args: str) -> None:
        self.log = log
        self.proc = ForkedPopen(list(args), log)  # type: ignore[assignment]
        self.pid = self.proc.pid


class Procs:
    """The `fanout` processes of one test, each logging to its own file; all killed at
    the end, whatever happened."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.all: list[Cli] = []
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, *args: str) -> Cli:
        self.all.append(ForkedCli(self.logs / f"{name}.log", *args))
        return self.all[-1]

    def kill_all(self) -> None:
        for p in self.all:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait(60)


def _three_trainers(assets: Path, tmp_path: Path, db: str | None, policy: str) -> None:
    run, saves = tmp_path / "run", tmp_path / "drafts"
    procs = Procs(tmp_path / "logs")
    # detach_after_s 600: `detach` must not fire on a trainer that is merely slower
    # than the others on a loaded machine (this test is about each one's own end).
    produce = _producer(
        assets, run, db, lag_policy=policy, expected_consumers=3, detach_after_s=600.0
    )
    try:
        producer = procs.start("producer", *produce)
        trainers = {
            name: procs.start(name, *_trainer(assets, run, name, saves, *(
                ["--max-steps", str(n)] if n else [])))
            for name, n in ENDS.items()
        }  # fmt: skip
        results = {name: t.finish(600) for name, t in trainers.items()}
        code, out = producer.finish(600)
        assert code == 0, out[-3000:]
        info = json.loads((run / "stream.json").read_text())
        rows = info["num_rows"] * info["epochs"]
        assert rows > 200
        for name, (code, out) in results.items():
            assert code == 0, f"{name}: {out[-3000:]}"
            s = _summary(out)
            want = ENDS[name] or rows
            assert (s["steps"], s["state"]) == (want, "finished"), (name, s)
            assert s["finished_stream"] is (ENDS[name] is None), (name, s)
            assert _checkpoint_step(saves / name) == want
        st = _status(run)
        assert st["produced_windows"] == info["total_windows"] == st["stream_end"]
        assert {c["id"]: c["recorded_state"] for c in st["consumers"]} == {
            f"{n}:dp0": "finished" for n in ENDS
        }
        if policy == "hold":
            _resume_the_finished_one(assets, run, db, saves, procs, produce)
    finally:
        procs.kill_all()


def _resume_the_finished_one(
    assets: Path, run: Path, db: str | None, saves: Path, procs: Procs, produce: list[str]
) -> None:
    """#20 part 4, under hold: t20 finished at cursor 5 and its windows were evicted once
    the others passed them. `--resume` from its checkpoint rejoins as a late joiner: the
    windows it needs are queued for recapture, a producer started again (same flags)
    captures them, the trainer trains 8 more steps (windows 5 and 6) and finishes."""
    resumed = procs.start(
        "t20-resumed", *_trainer(assets, run, "t20", saves, "--max-steps", "28", "--resume")
    )
    q = "SELECT state, demand FROM windows WHERE window=5"
    wait_for(lambda: _alive(resumed) and _row(run, q) == ("queued", 1), 300, "window 5 queued")
    producer = procs.start("producer-again", *produce, "--exit-when-idle-s", "60")
    code, out = resumed.finish(600)
    assert code == 0, out[-3000:]
    s = _summary(out)
    assert (s["steps"], s["cursor"], s["state"]) == (28, 7, "finished"), s
    assert "queued for recapture" in out  # said, not silent
    assert _checkpoint_step(saves / "t20") == 28
    assert _logged_steps(saves / "t20") == list(range(1, 29))
    code, out = producer.finish(600)  # nobody active before the end: it exits by itself
    assert code == 0, out[-3000:]
    assert _status(run)["recaptures"] >= 2


def _policies(fast: str) -> list[Any]:
    """Every --lag-policy, `fast` in the default suite and the others marked slow."""
    return [p if p == fast else pytest.param(p, marks=pytest.mark.slow)
            for p in ("hold", "recapture", "detach")]  # fmt: skip


@pytest.mark.parametrize("policy", _policies(fast="hold"))
def test_three_trainers_reach_their_own_ends_sqlite(
    assets: Path, tmp_path: Path, policy: str
) -> None:
    _three_trainers(assets, tmp_path, None, policy)


@pytest.mark.parametrize("policy", _policies(fast="recapture"))
def test_three_trainers_reach_their_own_ends_postgres(
    assets: Path, tmp_path: Path, pg_url: str, policy: str
) -> None:
    _three_trainers(assets, tmp_path, pg_url, policy)


def test_a_trainer_detached_with_force_says_so_once(assets: Path, tmp_path: Path) -> None:
    """Issue 32: `fanout detach --force` on a training trainer. The command prints its
    result once, on stdout; the trainer saves a checkpoint and exits 3 with one line
    that names it and says once how to rejoin (--resume)."""
    run, saves = tmp_path / "run", tmp_path / "drafts"
    procs = Procs(tmp_path / "logs")
    # 2 expected consumers, one joins: nothing is evicted, so `t` reads windows 0-4
    # (K = 5: four windows and the slowest's slot, which takes its next needed window)
    # and waits at window 5 until it is detached.
    produce = _producer(assets, run, None, expected_consumers=2, max_live_windows=5)
    try:
        producer = procs.start("producer", *produce)
        t = procs.start("t", *_trainer(assets, run, "t", saves))
        cq = "SELECT cursor FROM consumers WHERE id='t:dp0'"
        wait_for(lambda: _alive(t) and (_row(run, cq) or [0])[0] == 5, 300, "cursor 5")
        r = subprocess.run(
            [sys.executable, "-m", "fanout.cli", "detach", "--run-dir", str(run),
             "--consumer-id", "t", "--force"], capture_output=True, text=True, env=ENV,
            timeout=120,
        )  # fmt: skip
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert (
            r.stdout.startswith("t:dp0: detached (by `fanout detach`")
            and len(r.stdout.splitlines()) == 1
        ), r.stdout
        code, out = t.finish(300)
        assert code == 3, out[-3000:]
        last = out.strip().splitlines()[-1]
        assert last.startswith("t: consumer t:dp0 was detached (by `fanout detach`"), last
        assert "saved a checkpoint at step 20 (cursor 5)" in last, last
        assert last.count("--resume") == 1, last
        assert _checkpoint_step(saves / "t") == 20
        producer.proc.send_signal(signal.SIGINT)
        assert producer.finish(300)[0] == 0
    finally:
        procs.kill_all()


def _max_windows_then_kill9(assets: Path, tmp_path: Path, db: str | None) -> None:
    """--max-windows 3 ends the stream: both trainers finish at window 3 (12 rows),
    exit 0 with a checkpoint. A producer started again reopens it; killed with SIGKILL,
    it leaves the stream open: the resumed trainer waits (first for the stopped
    `holder`, not counted), hears the producer is lost (ttl 10 s), times out
    (--acquire-timeout-s 5) with a checkpoint at its last step, records itself
    stopped and exits 1 with one line saying all of that."""
    run, saves = tmp_path / "run", tmp_path / "drafts"
    procs = Procs(tmp_path / "logs")
    produce = _producer(assets, run, db, expected_consumers=2, ttl_s=10.0)
    try:
        producer = procs.start("producer", *produce, "--max-windows", "3")
        trainers = [procs.start(n, *_trainer(assets, run, n, saves)) for n in ("a", "b")]
        for t in trainers:
            code, out = t.finish(600)
            assert code == 0, out[-3000:]
            s = _summary(out)
            assert (s["steps"], s["cursor"], s["finished_stream"]) == (12, 3, True), s
            assert _checkpoint_step(saves / s["consumer"].split(":")[0]) == 12
        assert producer.finish(600)[0] == 0
        assert _status(run)["stream_end"] == 3
        # A stopped consumer at cursor 3 holds the restarted producer at windows 3-5
        # (K = 4, hold), so it cannot run the stream to its end before `a` resumes.
        with Coordinator.open(run) as co:
            co.stop(co.register_consumer("holder", cursor=3))

        again = procs.start("producer-again", *produce)
        pq = "SELECT pid, state FROM producers"
        wait_for(lambda: _alive(again) and _row(run, pq) == (again.proc.pid, "active"), 300,
                 "the producer started again")  # fmt: skip
        resumed = procs.start(
            "a-resumed", *_trainer(assets, run, "a", saves, "--resume", "--acquire-timeout-s", "5")
        )
        cq = "SELECT cursor FROM consumers WHERE id='a:dp0'"
        wait_for(lambda: _alive(resumed) and (_row(run, cq) or [0])[0] >= 5, 300, "cursor 5")
        again.proc.kill()  # SIGKILL: no clean exit, the stream stays open
        code, out = resumed.finish(600)
        assert code == 1, out[-3000:]
        last = out.strip().splitlines()[-1]
        assert "a stopped: a:dp0: window" in last and "the producer is lost" in last, last
        step = _logged_steps(saves / "a")[-1]
        assert step > 12 and f"saved a checkpoint at step {step} " in last, last
        assert _checkpoint_step(saves / "a") == step
        assert "Traceback" not in out
        a = next(c for c in _status(run)["consumers"] if c["id"] == "a:dp0")
        assert a["recorded_state"] == "stopped"
    finally:
        procs.kill_all()


# slow (real processes, ≈ 25 s): the rule — an end by design closes the stream, a
# producer that dies or is stopped leaves it open and a waiting trainer is told so — is
# checked in the default run by test_a_stream_ended_by_design_ends_a_signal_leaves_it_open
# (both databases), and trainers reaching their own ends by test_three_trainers_*.
@pytest.mark.slow
def test_max_windows_ends_the_stream_and_a_killed_producer_leaves_it_open_sqlite(
    assets: Path, tmp_path: Path
) -> None:
    _max_windows_then_kill9(assets, tmp_path, None)


@pytest.mark.slow
def test_max_windows_ends_the_stream_and_a_killed_producer_leaves_it_open_postgres(
    assets: Path, tmp_path: Path, pg_url: str
) -> None:
    _max_windows_then_kill9(assets, tmp_path, pg_url)


def test_a_stop_the_coordinator_refused_to_record_is_not_called_recorded() -> None:
    """A trainer whose window failed and whose 'stopped' write was then fenced off must
    not tell the operator it recorded 'stopped' (it holds nothing now)."""
    from fanout.errors import StaleLease, TrainerStopped, WindowGone
    from fanout.train.ending import Ending

    class Stream:
        finished = False

        def __init__(self, refuse: bool) -> None:
            self.refuse = refuse

        def close(self, clean: bool, done: bool) -> None:
            if self.refuse:
                raise StaleLease("consumer c1 was taken over")

    lines = []
    for refuse in (False, True):
        end = Ending("c1")
        end.failed(WindowGone("window 7 failed for good"))
        end.close(Stream(refuse))
        with pytest.raises(TrainerStopped) as e:
            end.raise_failure(3, Stream(refuse))
        lines.append(str(e.value))
    assert "recorded 'stopped'" in lines[0] and "not recorded" not in lines[0]
    assert "recorded 'stopped'" not in lines[1] and "'stopped' not recorded" in lines[1]


def test_a_signal_raises_only_while_waiting_for_a_window() -> None:
    """SIGINT while waiting stops at once; anywhere else (a step, the final save, the
    summary of a trainer that already finished) it only asks: raising there cut a save
    short and ended a finished trainer with exit -2 (CI saw it in test_journey)."""
    from types import SimpleNamespace

    from fanout.train.trainer import Trainer

    t = SimpleNamespace(_waiting=True, _stop_requested=False)
    with pytest.raises(KeyboardInterrupt):
        Trainer.request_stop(t, signal.SIGINT, None)  # type: ignore[arg-type]
    t = SimpleNamespace(_waiting=False, _stop_requested=False)
    Trainer.request_stop(t, signal.SIGINT, None)  # type: ignore[arg-type]
    assert t._stop_requested is True
