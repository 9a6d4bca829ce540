"""Exclusive roles: one live producer per run, one live process per consumer id.

    .venv/bin/pytest tests/test_roles.py -x -q

A second process asking for a role whose holder is live is refused (RoleHeld,
naming the holder); `--takeover` fences the holder off (RoleTaken on its next
write, naming the new holder); a holder that exited is replaced at once, one on
another host once its heartbeat counter stood still for ttl. The coordinator
cases run real child processes on both backends; the last test runs the real
`fanout produce` and `fanout train` commands.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import tiny_run
from fanout.bench.assets import generate_corpus
from fanout.coord.coordinator import Coordinator, RunConfig
from fanout.coord.heartbeat import Heartbeat
from fanout.coord.liveness import Holder, ProcessInfo, RoleWatch, this_process
from fanout.errors import FanoutError, RoleHeld, RoleTaken, StaleLease
from fanout.store.store import RunDir
from test_coordinator import FakeClock, make_contract
from tiny_run import build_tiny_assets, config_flags, tiny_producer_config

CTX = mp.get_context("spawn")
HOST = socket.gethostname()
ENV = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def new_run(tmp_path: Path, db: str | None, ttl_s: float = 600.0) -> Coordinator:
    """A run whose ttl is far longer than any test: nothing here waits for it to expire
    unless the test says so."""
    rd = RunDir(tmp_path / "run").create()
    return Coordinator.create(rd.root, make_contract(), RunConfig(ttl_s=ttl_s), db_path=db)


# ---- a child process that holds a role ---------------------------------------------


def _holder(root: str, db: str | None, role: str, ready: Any, go: Any, out: Any) -> None:
    """Take `role` ('producer' or a consumer name) and heartbeat; once `go` is set,
    report what a write says now (ok, or the fencing error)."""
    co = Coordinator.open(root, db_path=db)
    reg = _register(co, role)
    with Heartbeat(root, reg, interval_s=0.05, open_kwargs={"db_path": db}):
        ready.put(os.getpid())
        go.wait(120)
    try:
        co.heartbeat(reg)
        out.put("ok")
    except FanoutError as e:
        out.put(f"{type(e).__name__}: {e}")


def _start_holder(co: Coordinator, db: str | None, role: str) -> tuple[Any, Any, Any, int]:
    ready, go, out = CTX.Queue(), CTX.Event(), CTX.Queue()
    p = CTX.Process(target=_holder, args=(str(co.root), db, role, ready, go, out))
    p.start()
    return p, go, out, int(ready.get(timeout=120))


def _register(co: Coordinator, role: str, takeover: bool = False) -> Any:
    if role == "producer":
        return co.register_producer(make_contract(), takeover=takeover)
    return co.register_consumer(role, takeover=takeover)


@pytest.mark.parametrize("role", ["producer", "a"])
def test_a_live_holder_is_refused_then_taken_over(
    db: str | None, tmp_path: Path, role: str
) -> None:
    co = new_run(tmp_path, db)
    table = "producers" if role == "producer" else "consumers"
    p, go, out, child = _start_holder(co, db, role)
    try:
        before = co.conn.execute(f"SELECT token, host, pid FROM {table}").fetchone()
        assert before[1:] == (HOST, child)
        with pytest.raises(RoleHeld) as held:
            _register(co, role)
        msg = str(held.value)
        assert f"held by {HOST} pid {child}" in msg and "last heartbeat" in msg
        assert "--takeover" in msg and "ttl_s = 600 s" in msg
        # refused before anything changed
        assert co.conn.execute(f"SELECT token, host, pid FROM {table}").fetchone() == before
        _register(co, role, takeover=True)
        go.set()
        fenced = str(out.get(timeout=120))
    finally:
        go.set()
        p.join(60)
    assert fenced.startswith("RoleTaken: ")
    assert f"another process took this role: {HOST} pid {os.getpid()}" in fenced
    assert "register again" not in fenced


def _crash_holder(root: str, db: str | None, ready: Any) -> None:
    co = Coordinator.open(root, db_path=db)
    co.register_producer(make_contract())
    co.register_consumer("a")
    ready.put(os.getpid())
    time.sleep(600)  # SIGKILLed here


def test_a_crashed_holder_is_replaced_at_once_without_takeover(
    db: str | None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The holder died on this host (its pid is gone): a restart takes both roles
    without --takeover and without waiting out the 600 s ttl (no watching at all)."""
    co = new_run(tmp_path, db)
    ready = CTX.Queue()
    p = CTX.Process(target=_crash_holder, args=(str(co.root), db, ready))
    p.start()
    child = int(ready.get(timeout=120))
    os.kill(child, signal.SIGKILL)
    p.join(60)
    with caplog.at_level(logging.INFO, logger="fanout.coord.coordinator"):
        _register(co, "producer")
        reg = _register(co, "a")
    assert reg.cursor == 0
    assert "waiting up to" not in caplog.text  # decided without watching the heartbeat
    assert f"replacing {HOST} pid {child}: it has exited" in caplog.text
    rows = co.conn.execute("SELECT pid FROM consumers UNION ALL SELECT pid FROM producers")
    assert [r[0] for r in rows] == [os.getpid()] * 2


def test_a_holder_on_another_host_is_watched(db: str | None, tmp_path: Path) -> None:
    """A holder this host cannot check (another host's process) is refused once its
    heartbeat counter moves; once it stands still for ttl, it is replaced."""
    co = new_run(tmp_path, db, ttl_s=3.0)
    reg = co.register_consumer("a")
    elsewhere = "UPDATE consumers SET host='elsewhere', pid=4242, proc='other-boot/pid:[1]/7'"
    with Heartbeat(co.root, reg, interval_s=0.05, open_kwargs={"db_path": db}):
        with co.conn.write() as cur:
            cur.execute(elsewhere)
        with pytest.raises(RoleHeld, match=r"held by elsewhere pid 4242 .*heartbeat moved"):
            co.register_consumer("a")
    with co.conn.write() as cur:  # it beats no more (the Heartbeat thread stopped)
        cur.execute(elsewhere)
    again = co.register_consumer("a")  # after ttl_s without a beat: taken, no flag
    assert again.token > reg.token
    assert co.conn.execute("SELECT pid FROM consumers").fetchone()[0] == os.getpid()
    with pytest.raises(StaleLease, match="registered the role again"):
        co.heartbeat(reg)  # the old registration (this process's own) is fenced off


def test_role_watch_verdicts() -> None:
    """RoleWatch's rules on an injected clock (no processes, no waiting)."""
    clock = FakeClock()
    me = this_process()
    now = time.time()

    def holder(state: str = "active", seq: int = 0, **kw: Any) -> Holder:
        base: dict[str, Any] = dict(
            state=state, token=5, hb_seq=seq, hb_wall=now, host="h", pid=1, proc="x/y/1"
        )
        return Holder(**(base | kw))

    watch = RoleWatch(10.0, clock)
    assert watch.verdict(None, me) == "free"
    for state in ("lost", "finished", "stopped", "detached"):
        assert watch.verdict(holder(state), me) == "free"
    assert watch.verdict(holder(host=me.host, pid=me.pid, proc=me.proc), me) == "free"
    # on this host: a live process with a fresh heartbeat is held at once; a gone one is free
    assert watch.verdict(holder(pid=me.pid, proc=me.proc), ProcessInfo("h", 0, "other")) == "held"
    gone = me.proc.rpartition("/")[0] + "/1"  # our pid, another start time: pid reused
    assert watch.verdict(holder(pid=me.pid, proc=gone), ProcessInfo("h", 0, "o")) == "free"
    # elsewhere: watched; its counter moving means held, standing still for ttl means free
    assert watch.verdict(holder(seq=3), me) == "watch"
    clock.t += 9.9
    assert watch.verdict(holder(seq=3), me) == "watch"
    assert watch.verdict(holder(seq=4), me) == "held"
    watch = RoleWatch(10.0, clock)
    assert watch.verdict(holder(seq=4), me) == "watch"
    clock.t += 10.0
    assert watch.verdict(holder(seq=4), me) == "free"


def test_a_process_declared_lost_is_told_so_not_that_its_role_was_taken(
    db: str | None, tmp_path: Path
) -> None:
    """A process fenced because it was declared lost (nobody took its role) hears that."""
    co = new_run(tmp_path, db)
    reg = co.register_consumer("a")
    with co.conn.write() as cur:
        cur.execute("UPDATE consumers SET state='lost', token=token+100")
    with pytest.raises(StaleLease, match="declared lost") as err:
        co.heartbeat(reg)
    assert not isinstance(err.value, RoleTaken) and "register again" not in str(err.value)


# ---- the real commands ----------------------------------------------------------------


class Cli:
    """A `fanout …` process; stdout and stderr go to a file (no pipe to fill up)."""

    def __init__(self, log: Path, *args: str) -> None:
        self.log = log
        with log.open("w") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fanout.cli", *args], stdout=f, stderr=f, env=ENV
            )
        self.pid = self.proc.pid

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        """Wait for the exit: (exit code, its output)."""
        code = self.proc.wait(timeout)
        return code, self.log.read_text()


def wait_for(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    return tiny_run.wait_for(pred, timeout, what, poll_s=0.05)  # each poll is a query


def _row(run: Path, sql: str) -> Any:
    """One row of `sql`; None while the producer has not created the database yet."""
    try:
        with Coordinator.open(run) as co:
            return co.conn.execute(sql).fetchone()
    except FanoutError:
        return None


def _status(run: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "fanout.cli", "status", "--run-dir", str(run), "--json"],
        capture_output=True, text=True, env=ENV, check=True, timeout=120,
    )  # fmt: skip
    return dict(json.loads(out.stdout))


# slow (real `fanout` processes, ≈ 25 s): the rule — a live holder is refused naming it,
# --takeover fences it — is checked in the default run by
# test_a_live_holder_is_refused_then_taken_over (both roles, both databases) and, with
# real processes started together, by tests/test_start_race.py.
@pytest.mark.slow
def test_second_producer_and_trainer_are_refused_and_takeover_fences_the_first(
    tmp_path: Path,
) -> None:
    """Real `fanout produce` and `fanout train` processes on one run (K = 3, hold, no
    evictions before a trainer joins, ttl 600 s so nothing expires):

    - a second producer exits 1 naming the first; `--takeover` replaces it, and the
      first exits 1 saying another process took its role (naming the new one);
    - the new producer stopped with SIGTERM exits 0 and `fanout status` shows it
      finished, not active;
    - the same for a trainer's consumer id; the trainer that took over, killed with
      SIGKILL, shows as lost.
    """
    root = tmp_path / "assets"
    build_tiny_assets(root, generate_corpus(60, seed=0))
    run = tmp_path / "run"
    cfg = tiny_producer_config(
        root, run, max_live_windows=3, heartbeat_s=0.3, ttl_s=600.0,
        cache_dir=str(root / "cache"),
    )  # fmt: skip
    produce = ["produce", *config_flags(cfg)]

    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[Cli] = []

    def cli(name: str, *args: str) -> Cli:
        procs.append(Cli(logs / f"{name}.log", *args))
        return procs[-1]

    first = cli("producer-1", *produce)
    try:
        q = "SELECT pid, (SELECT COUNT(*) FROM windows WHERE state='ready') FROM producers"
        wait_for(lambda: _row(run, q) == (first.pid, 2), 300, "the first producer's K windows")
        code, err = cli("producer-2", *produce).finish()
        assert code == 1, err[-3000:]
        assert f"is held by {HOST} pid {first.pid}" in err and "--takeover" in err

        taker = cli("producer-3", *produce, "--takeover")
        code, err = first.finish()
        assert code == 1, err[-3000:]
        assert f"another process took this role: {HOST} pid {taker.pid}" in err
        assert "register again" not in err
        wait_for(lambda: _row(run, "SELECT pid, state FROM producers") == (taker.pid, "active"),
                 120, "the new producer")  # fmt: skip
        taker.proc.send_signal(signal.SIGTERM)
        code, err = taker.finish()
        assert code == 0, err[-3000:]
        assert _status(run)["producer"]["state"] == "stopped"  # by a signal (issue 45.1)

        train = [
            "train", "--run-dir", str(run), "--consumer-id", "c0", "--verifier-name-or-path",
            str(root / "verifier"), "--num-layers", "1", "--block-size", "4", "--max-anchors", "8",
            "--rows-per-step", "2", "--save-path", str(tmp_path / "draft"),
            "--heartbeat-s", "0.3", "--acquire-timeout-s", "600",
        ]  # fmt: skip
        t1 = cli("trainer-1", *train)
        # It reads windows 0 and 1, then waits for window 2 (no producer runs now).
        cq = "SELECT pid, cursor FROM consumers WHERE id='c0:dp0'"
        wait_for(lambda: _row(run, cq) == (t1.pid, 2), 300, "the first trainer's 2 windows")
        code, err = cli("trainer-2", *train).finish()
        assert code == 1, err[-3000:]
        assert f"consumer c0:dp0 is held by {HOST} pid {t1.pid}" in err and "--takeover" in err

        t3 = cli("trainer-3", *train, "--takeover")
        code, err = t1.finish()
        assert code == 1, err[-3000:]
        assert f"another process took this role: {HOST} pid {t3.pid}" in err
        wait_for(lambda: (_row(run, cq) or [0])[0] == t3.pid, 120, "the new trainer")
        c0 = _status(run)["consumers"][0]
        assert (c0["state"], c0["pid"]) == ("active", t3.pid)
        t3.proc.kill()
        t3.proc.wait(60)
        c0 = _status(run)["consumers"][0]  # gone without a word: lost, no ttl to wait out
        assert (c0["state"], c0["recorded_state"]) == ("lost", "active")
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait(60)
