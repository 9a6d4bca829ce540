"""The faults a cluster has, on namespaced hosts with PostgreSQL on a host of its own (issue 55).

    .venv/bin/pytest tests/test_host_faults.py -x -q -p no:randomly   # root; skips otherwise

Each test runs one small run (two producer replicas, two trainers, each on a host of
its own, PostgreSQL on another: tests/netns_hosts.py), puts one fault on it and
checks the same invariants at the end (`_check_run`): every window made once (or
captured again by the rules: the `recaptures` counter), every consumer's cursor at the
stream's end (acks are in order: the cursor is the next window it needs), at most K
windows live at once (the `hw_windows` high-water mark), and every process exited 0,
or was refused in one line (`fanout CMD: error: ...`, no traceback). The run dir is
on the machine's own filesystem (each host's mount namespace is a copy of this one):
the network filesystem is tests/test_hosts.py's; these faults are the database's.

Every wait is on a state (a log line, a row, an exit) under a generous deadline; the
bounds asserted are the ones docs/operations.md ("Faults on a cluster") promises.
Where a fault must land on a run in progress (a tiny run is a second or two of work),
a consumer the test plays itself (`Gate`) holds the stream until the fault is over.
The partition (it waits out TCP's half-minute bound) and the latency run are
`slow`; a host's clock is moved for its Python processes by a sitecustomize
(netns_hosts.clock_offset_env: libfaketime hangs Python's threading here).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fanout.bench.assets import generate_corpus
from fanout.coord.postgresdb import TCP_DEFAULTS
from netns_hosts import Host, Hosts, Postgres, clock_offset_env, restart_postgres, signal_postgres
from tiny_run import build_tiny_assets, config_flags, tiny_producer_config, wait_for

PY = [sys.executable, "-m", "fanout.cli"]
K = 3
TTL_S = 8.0
ERROR_LINE = re.compile(r"^fanout (train|produce): error: .+$", re.M)
# A cut-off process's first word that it is cut off comes from a call that times out
# (tcp_user_timeout: a request nobody acknowledges) or an idle connection whose
# keepalive probes go unanswered (idle + count * interval), whichever ends first.
CUT_NOTICE_S = max(
    int(TCP_DEFAULTS["tcp_user_timeout"]) / 1000,
    int(TCP_DEFAULTS["keepalives_idle"])
    + int(TCP_DEFAULTS["keepalives_count"]) * int(TCP_DEFAULTS["keepalives_interval"]),
)
CUT_SAID = re.compile(r"connection lost|cannot reach the coordinator|unreachable")


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("psycopg")
    root = tmp_path_factory.mktemp("fault-assets")
    build_tiny_assets(root, generate_corpus(48, seed=3))
    os.chmod(root.parent, 0o755)
    return root


@dataclass
class Proc:
    name: str
    host: Host
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes]
    env: dict[str, str]
    exits: list[int] = field(default_factory=list)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


class Run:
    """One small run on hosts: start roles, query the database, check the invariants."""

    def __init__(
        self, tmp: Path, assets: Path, hs: Hosts, pg: Postgres, url: str | None = None,
        ttl_s: float = TTL_S, heartbeat_s: float = 0.5, consumers: int = 2,
    ) -> None:  # fmt: skip
        self.tmp, self.assets, self.hs, self.pg = tmp, assets, hs, pg
        self.consumers = consumers  # the stream's expected consumers (trainers, a gate)
        self.ttl_s, self.heartbeat_s = ttl_s, heartbeat_s
        self.schema = "faults"
        self.url = url or pg.url(self.schema)
        self.run, self.saves, self.logs = tmp / "run", tmp / "saves", tmp / "logs"
        for d in (self.run, self.saves, self.logs):
            d.mkdir(exist_ok=True)
        os.chmod(tmp, 0o755)
        self.procs: dict[str, Proc] = {}
        self.refused: dict[str, str] = {}  # name -> its one error line, for faults that refuse
        self.lost: set[str] = set()  # killed with their host: no exit to check
        self.env = pg.env({**os.environ, "OMP_NUM_THREADS": "1"})

    def producer_argv(self, rank: int, **kw: Any) -> list[str]:
        cfg = tiny_producer_config(
            self.assets, self.run, db_path=self.url, replicas=2, max_live_windows=K,
            expected_consumers=self.consumers, epochs=1, heartbeat_s=self.heartbeat_s,
            ttl_s=self.ttl_s, window_rows=2, **kw,
        )  # fmt: skip
        return [*PY, "produce", *config_flags(cfg), "--replica-rank", str(rank)]

    def trainer_argv(self, name: str) -> list[str]:
        """A tiny DFlash trainer that finds the database through the run dir's pointer;
        --resume: a restart continues where its consumer left off."""
        return [
            *PY, "train", "--run-dir", str(self.run), "--consumer-id", name,
            "--verifier-name-or-path", str(self.assets / "verifier"), "--num-layers", "1",
            "--block-size", "4", "--max-anchors", "8", "--save-path", str(self.saves / name),
            "--heartbeat-s", str(self.heartbeat_s), "--checkpoint-every", "1000000000",
            "--acquire-timeout-s", "400", "--resume",
        ]  # fmt: skip

    def start(self, name: str, host: Host, argv: list[str], env: dict[str, str] | None = None):
        env = env or self.env
        n = sum(1 for k in self.procs if k == name or k.startswith(name + "#"))
        log = self.logs / (f"{name}.log" if not n else f"{name}.{n}.log")
        with log.open("w") as f:
            p = host.popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
        self.procs[name if not n else f"{name}#{n}"] = Proc(name, host, argv, log, p, env)
        return self.procs[name if not n else f"{name}#{n}"]

    def start_all(self, hosts: dict[str, Host], env: dict[str, dict[str, str]] | None = None):
        env = env or {}
        for name in ("t0", "t1"):
            self.start(name, hosts[name], self.trainer_argv(name), env.get(name))
        for rank in (0, 1):
            self.start(f"p{rank}", hosts[f"p{rank}"], self.producer_argv(rank), env.get(f"p{rank}"))

    # ---- the database, from this test's own network namespace -------------------------

    def q(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(
            host=self.pg.host.addr, port=self.pg.port, user="postgres", dbname="postgres",
            password=self.pg.password, connect_timeout=5, autocommit=True,
        ) as c:  # fmt: skip
            c.execute(f"SET search_path TO {self.schema}")
            return [tuple(r) for r in c.execute(sql, params).fetchall()]

    def try_q(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        try:
            return self.q(sql, params)
        except Exception:  # not created yet, restarting, paused: the caller polls again
            return []

    def cursor(self, consumer: str) -> int:
        got = self.try_q("SELECT cursor FROM consumers WHERE id=%s", (consumer,))
        return int(got[0][0]) if got else -1

    # ---- ends ------------------------------------------------------------------------

    def wait(self, proc: Proc, timeout: float) -> int:
        try:
            return proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{proc.name} still running after {timeout:.0f} s:\n{proc.text()[-3000:]}"
            ) from None

    def wait_all(self, timeout: float) -> None:
        """Every process started ends; each exits 0 unless the test recorded its refusal."""
        deadline = time.monotonic() + timeout
        for name, p in self.procs.items():
            if name in self.lost:
                continue
            code = self.wait(p, max(1.0, deadline - time.monotonic()))
            text = p.text()
            assert "Traceback" not in text, f"{name}:\n{text[-3000:]}"
            if name in self.refused:
                assert code != 0, f"{name} exited 0 but should have been refused:\n{text[-2000:]}"
                continue
            assert code == 0, f"{name} exited {code}:\n{text[-3000:]}"

    def refusal(self, proc: Proc, timeout: float, words: str) -> str:
        """`proc` exits nonzero with one error line (no traceback) that says `words`."""
        code = self.wait(proc, timeout)
        text = proc.text()
        lines = ERROR_LINE.findall(text)
        errors = [m.group(0) for m in ERROR_LINE.finditer(text)]
        assert code != 0 and len(lines) == 1, f"{proc.name} exited {code}:\n{text[-3000:]}"
        assert "Traceback" not in text, text[-3000:]
        assert re.search(words, errors[0]), errors[0]
        self.refused[next(k for k, v in self.procs.items() if v is proc)] = errors[0]
        return errors[0]

    def restart_crashed(self) -> bool:
        """Restart (same host, same flags) each process that exited nonzero in one line
        because its connection went at one of its writes' COMMIT (the outcome was the
        server's to know), or inside one whose reads had changed by the time it was
        begun again (docs/operations.md, "Outages"). Always False: a poll step for
        wait_for."""
        for key, p in list(self.procs.items()):
            if key in self.refused or p.popen.poll() in (None, 0):
                continue
            self.refusal(p, 10, r"coordinator database .*(connection|closed|terminat|unreachable)")
            self.start(p.name, p.host, p.argv)
        return False

    def check(self, *, reclaims: int | None = None) -> dict[str, Any]:
        """The invariants every fault test shares; returns the counters for the test."""
        total = int(self.q("SELECT COUNT(*) FROM windows")[0][0])
        end = int(self.q("SELECT value FROM counters WHERE key='next_window'")[0][0])
        assert total == end and total >= 4, (total, end)
        counters = dict(self.q("SELECT key, value FROM counters"))
        made = sum(int(m) for (m,) in self.q("SELECT made FROM producers"))
        captures = [int(c) for (c,) in self.q('SELECT captures FROM windows ORDER BY "window"')]
        # every window made once, or again only by the rules (an eviction recaptured)
        assert min(captures) >= 1, captures
        assert sum(captures) - total == int(counters["recaptures"]), (captures, counters)
        assert made == sum(captures), (made, captures)
        cursors = self.q("SELECT id, cursor, state FROM consumers ORDER BY id")
        assert [(c, s) for _, c, s in cursors] == [(total, "finished")] * self.consumers, cursors
        assert int(counters["hw_windows"]) <= K, counters
        assert self.q("SELECT COUNT(*) FROM leases") == [(0,)]
        if reclaims is not None:
            assert int(counters["reclaims"]) == reclaims, counters
        return counters


@contextlib.contextmanager
def hosts_with_postgres(n: int) -> Iterator[tuple[Hosts, Postgres]]:
    """`n` hosts, PostgreSQL on the first."""
    with Hosts(n) as hs:
        yield hs, hs.postgres(hs[0])


def _said_after(proc: Proc, since: int, pattern: re.Pattern[str]) -> str | None:
    """A line of `proc`'s log past byte `since` that matches `pattern`."""
    with proc.log.open("rb") as f:
        f.seek(since)
        tail = f.read().decode(errors="replace")
    return next((ln for ln in tail.splitlines() if pattern.search(ln)), None)


# ---- a. a host partitioned from the database past ttl, then healed ------------------------


@pytest.mark.slow
def test_a_host_cut_off_from_the_database_says_so_and_is_fenced_on_heal(
    tmp_path: Path, assets: Path
) -> None:
    """A trainer host and a producer host lose their link (no RST: packets vanish) for
    longer than ttl. Each process SAYS SO while cut off, within the TCP bound
    (CUT_NOTICE_S: tcp_user_timeout / keepalives, plus scheduling); the others declare
    them lost after ttl and go on (the server ends a cut-off session that held the
    run's lock: its own keepalives); on heal each is fenced with one line. Restarted,
    they finish the run, which keeps every invariant."""
    with hosts_with_postgres(5) as (hs, pg):
        _, p0, p1, t0, t1 = hs
        r = Run(tmp_path, assets, hs, pg)
        r.start_all({"p0": p0, "p1": p1, "t0": t0, "t1": t1})
        wait_for(lambda: r.cursor("t1:dp0") >= 1, 240, "t1 to ack a window", poll_s=0.5)
        wait_for(
            lambda: r.try_q("SELECT hb_seq > 0 FROM producers WHERE rank=1 AND state='active'"),
            240, "replica 1 to register and beat", poll_s=0.5,
        )  # fmt: skip
        marks = {n: r.procs[n].log.stat().st_size for n in ("t1", "p1")}
        cut = time.monotonic()
        t1.cut()
        p1.cut()
        said: dict[str, float] = {}
        deadline = cut + CUT_NOTICE_S + 40  # the bound, and room for a loaded machine
        while len(said) < 2 and time.monotonic() < deadline:
            for n in ("t1", "p1"):
                if n not in said and _said_after(r.procs[n], marks[n], CUT_SAID):
                    said[n] = time.monotonic() - cut
            time.sleep(0.5)
        # still cut off here: the line came while the host is unreachable, not on heal
        assert set(said) == {"t1", "p1"}, (
            f"a cut-off process said nothing for {time.monotonic() - cut:.0f} s: "
            + "; ".join(f"{n}:\n{r.procs[n].text()[-1500:]}" for n in ("t1", "p1"))
        )
        wait_for(
            lambda: r.try_q("SELECT value FROM counters WHERE key='reclaims'") >= [(2,)],
            120, "the others to declare the cut-off pair lost", poll_s=0.5,
        )  # fmt: skip
        assert r.procs["t0"].popen.poll() is None and r.procs["p0"].popen.poll() is None
        t1.heal()
        p1.heal()
        for n in ("t1", "p1"):
            # fenced at its first write after heal; or, where its call timed out at a
            # write's COMMIT (the outcome unknown to it), that error; or a write begun
            # again on heal that finds what it had read changed: one line each way
            r.refusal(
                r.procs[n], 180,
                r"declared lost|fenced|coordinator database .*(timed out|unreachable|changed)",
            )  # fmt: skip
        r.start("t1", t1, r.trainer_argv("t1"))
        r.start("p1", p1, r.producer_argv(1))
        r.wait_all(400)
        counters = r.check(reclaims=2)
        print(f"cut-off said so after {said} s (bound {CUT_NOTICE_S} s); {counters}")


# ---- b. the database restarted, then paused past ttl ---------------------------------------


class Gate:
    """A consumer this test plays itself, one more of the stream's expected consumers:
    until it acks, the producers stop K windows ahead of it, so the run cannot end
    before a fault is put on it, however fast the machine runs the roles (a tiny run
    takes a second or two). It beats from a thread of its own, as a trainer does, so
    the same liveness rules judge it, and its connection rides out the same faults."""

    def __init__(self, run: Path, heartbeat_s: float, timeout_s: float) -> None:
        from fanout.coord.coordinator import Coordinator
        from fanout.coord.heartbeat import Heartbeat

        self.co = Coordinator.open_when_created(run, timeout_s)
        self.reg = self.co.register_consumer("gate")
        self.hb = Heartbeat(run, self.reg, interval_s=heartbeat_s).start()
        self.cancel = threading.Event()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.finished = False

    def ack_one(self, timeout_s: float) -> None:
        lease = self.co.acquire(self.reg, timeout_s=timeout_s, cancel=self.cancel)
        assert lease is not None, "the stream ended under the gate"
        self.co.ack(lease)

    def drain(self) -> None:
        """Ack every window to the stream's end, in a thread (the test meanwhile
        restarts crashed processes, which the gate's next window may wait for)."""

        def loop() -> None:
            try:
                while (lease := self.co.acquire(self.reg, cancel=self.cancel)) is not None:
                    self.co.ack(lease)
                self.hb.stop()  # as a trainer does: a beat after `finish` is fenced
                self.hb.check()  # and never fenced before it either
                self.co.finish(self.reg)
                self.finished = True
            except BaseException as e:  # kept for the test's thread (AcquireCancelled too)
                self.error = e

        self.thread = threading.Thread(target=loop, name="gate", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop acquiring (within ~50 ms: AcquireCancelled) and beating."""
        self.cancel.set()
        if self.thread is not None:
            self.thread.join(60)
        self.hb.stop()
        self.co.close()


def test_a_database_restarted_then_paused_past_ttl_loses_nobody(
    tmp_path: Path, assets: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL restarted under the run (every connection dropped), then paused
    (SIGSTOP of the postmaster and its backends) for 2.5 x ttl: every process rides
    both out (reconnects; waits poll as well as LISTEN, and LISTEN again on the new
    connection), nobody is declared lost because the database was slow (liveness is
    judged on heartbeat counters seen moving, and a reclaimer that could not watch
    starts over), and the run ends with every invariant. A gate consumer (`Gate`)
    holds the stream, so both faults land on a run in progress; each phase waits on
    a state, never on how fast the roles happen to run.

    Without the gate it was flaky (failed once, hung once, in 6 runs): the run is a
    second or two of work, so by the time this process read the cursors after the
    restart (a loaded machine deschedules it) the trainers could be at the stream's
    end, and its wait for both to ack past the furthest one could never end (shown
    by delaying that read 15 s); the pause could land after the run had ended, too."""
    with hosts_with_postgres(5) as (hs, pg):
        _, p0, p1, t0, t1 = hs
        r = Run(tmp_path, assets, hs, pg, consumers=3)
        monkeypatch.setenv("PGPASSWORD", pg.password)  # the gate's connections
        r.start_all({"p0": p0, "p1": p1, "t0": t0, "t1": t1})
        gate = Gate(r.run, r.heartbeat_s, timeout_s=240)
        try:
            # the trainers stop at K (the gate acked nothing): both ack a window first
            wait_for(
                lambda: min(r.cursor("t0:dp0"), r.cursor("t1:dp0")) >= 1, 240,
                "both trainers to ack a window", poll_s=0.5,
            )  # fmt: skip
            restart_postgres(pg)
            # The gate's ack lets one more window be made: both trainers can reach K + 1
            # only through a window claimed, captured and published after the restart.
            gate.ack_one(timeout_s=120)
            wait_for(
                lambda: r.restart_crashed()
                or min(r.cursor("t0:dp0"), r.cursor("t1:dp0")) >= K + 1,
                300, "both trainers to ack a window made after the restart", poll_s=0.5,
            )  # fmt: skip
            stopped = signal_postgres(pg, "STOP")
            try:
                time.sleep(2.5 * TTL_S)  # the fault itself: a database that answers nobody
            finally:
                signal_postgres(pg, "CONT")
            assert len(stopped) >= 5, stopped  # the postmaster and its backends
            gate.drain()
            wait_for(
                lambda: r.restart_crashed()
                or (gate.finished and all(p.popen.poll() is not None for p in r.procs.values()))
                or gate.error is not None,
                400, "the gate and every process to end", poll_s=0.5,
            )  # fmt: skip
            assert gate.error is None, repr(gate.error)
        finally:
            gate.close()
        r.wait_all(60)
        # Nobody lost because the database was slow: every process that did not crash
        # exited 0 (a fenced one exits 1); a crashed one may be declared lost before its
        # restart registers (it cannot say goodbye to a database that is gone).
        crashed = len(r.refused)
        counters = r.check()
        assert int(counters["reclaims"]) <= crashed, (counters, r.refused)
        said = [n for n, p in r.procs.items() if "reconnected" in p.text()]
        assert said, "no process reconnected after the restart"
        print(f"reconnected: {said}; crashed in a write and restarted: {r.refused}; {counters}")


# ---- c. latency and loss between every host and PostgreSQL ---------------------------------


@pytest.mark.slow
def test_a_run_through_200ms_and_2pct_loss_to_the_database_completes(
    tmp_path: Path, assets: Path
) -> None:
    """Every host reaches PostgreSQL through a proxy that adds 100 ms each way (200 ms a
    round trip) and holds 2 % of chunks for a retransmission timeout, as lost segments
    do, for the whole run: it is slower, nothing breaks (nobody lost, every exit 0)."""
    from tcp_proxy import Proxy

    with hosts_with_postgres(5) as (hs, pg):
        _, p0, p1, t0, t1 = hs
        with Proxy((f"{hs.subnet}.254", 0), (pg.host.addr, pg.port), delay_s=0.1,
                   loss=0.02) as px:  # fmt: skip
            url = (
                f"postgresql://postgres@{px.addr[0]}:{px.addr[1]}/postgres"
                "?connect_timeout=10&schema=faults"
            )
            r = Run(tmp_path, assets, hs, pg, url=url, ttl_s=30.0, heartbeat_s=2.0)
            start = time.monotonic()
            r.start_all({"p0": p0, "p1": p1, "t0": t0, "t1": t1})
            r.wait_all(560)
            took = time.monotonic() - start
            counters = r.check(reclaims=0)
            print(f"through the proxy: {took:.0f} s, {px.stats()}; {counters}")
            assert px.stats()["held_as_lost"] > 0  # the loss was there


# ---- d. a host whose wall clock is 5 minutes off -------------------------------------------


def test_hosts_whose_clocks_are_5_minutes_off_neither_steal_nor_keep_a_role(
    tmp_path: Path, assets: Path
) -> None:
    """A producer replica's host runs 5 minutes ahead (it reclaims in its heartbeat:
    everyone else's stamps look 5 minutes old to it) and a trainer's host 5 minutes
    behind (its stamps look 5 minutes old to everyone): nobody is declared lost and the
    run ends with every invariant, because liveness is judged on heartbeat counters
    seen moving on the judge's own monotonic clock, never on wall-clock stamps."""
    with hosts_with_postgres(5) as (hs, pg):
        _, p0, p1, t0, t1 = hs
        r = Run(tmp_path, assets, hs, pg)
        ahead = clock_offset_env(r.env, +300, tmp_path / "clocks")
        behind = clock_offset_env(r.env, -300, tmp_path / "clocks")
        probe = [sys.executable, "-c", "import time; print(time.time())"]
        for env, sign in ((ahead, 1), (behind, -1)):
            off = float(p1.run(probe, env=env).stdout) - time.time()
            assert abs(off - sign * 300) < 30, off  # the host's clock is off indeed
        r.start_all({"p0": p0, "p1": p1, "t0": t0, "t1": t1}, env={"p1": ahead, "t1": behind})
        r.wait_all(400)
        r.check(reclaims=0)
        walls = dict(r.q("SELECT rank, hb_wall FROM producers"))
        assert walls[1] - walls[0] > 200, walls  # p1 stamped with its own (wrong) clock


# ---- e. a whole host lost ------------------------------------------------------------------


def test_a_producer_host_and_a_trainer_host_lost_are_replaced_from_another_host(
    tmp_path: Path, assets: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host of producer replica 1 and the host of trainer t1 die at once (every
    process SIGKILLed: nothing says goodbye). Restarted on a spare host, each takes its
    role back once the dead holder's counter stood still for ttl (no --takeover: a
    holder on another host that does not beat is gone), the dead replica's claim is
    captured again by the rules, and the run ends with every invariant. A gate
    consumer holds the stream until both have taken their roles back, so the hosts
    die in a run in progress and the replacements join it, however fast it runs."""
    with hosts_with_postgres(6) as (hs, pg):
        _, p0, p1, t0, t1, spare = hs
        r = Run(tmp_path, assets, hs, pg, consumers=3)
        monkeypatch.setenv("PGPASSWORD", pg.password)  # the gate's connections
        r.start_all({"p0": p0, "p1": p1, "t0": t0, "t1": t1})
        gate = Gate(r.run, r.heartbeat_s, timeout_s=240)
        try:
            wait_for(lambda: r.cursor("t1:dp0") >= 1, 240, "t1 to ack a window", poll_s=0.5)
            p1.lose()
            t1.lose()
            r.lost |= {"p1", "t1"}
            r.start("p1", spare, r.producer_argv(1))
            r.start("t1", spare, r.trainer_argv("t1"))
            back = "SELECT host FROM {} WHERE {} AND state='active'"
            wait_for(
                lambda: r.try_q(back.format("producers", "rank=1")) == [(spare.name,)]
                and r.try_q(back.format("consumers", "id='t1:dp0'")) == [(spare.name,)],
                300, "both roles taken back on the spare host", poll_s=0.5,
            )  # fmt: skip
            gate.drain()
            wait_for(lambda: gate.finished or gate.error is not None, 400, "the stream's end")
            assert gate.error is None, repr(gate.error)
        finally:
            gate.close()
        r.wait_all(400)
        counters = r.check()
        holders = dict(r.q("SELECT rank, host FROM producers"))
        assert holders[1] == spare.name, holders
        print(counters)


# ---- the guards on their own (no hosts: the suite's local PostgreSQL) ----------------------


def test_a_new_connection_during_a_restart_waits_for_the_server(
    pg_url: str, postgres_control: Any
) -> None:
    """A connection opened while the server this process already reached is down (a
    trainer's prefetch thread, mid-run, during a restart) waits for it as a lost one
    does, instead of stopping the process; the error it would give is one line."""
    from fanout.coord.postgresdb import PostgresDatabase

    first = PostgresDatabase(pg_url)  # this process has reached the server
    try:
        postgres_control.stop()
        back = threading.Timer(2.0, postgres_control.start)
        back.start()
        try:
            second = PostgresDatabase(pg_url, reconnect_s=120)
        finally:
            back.join()
        assert second.execute("SELECT 1").fetchone() == (1,)
        assert second.reconnects == 1
        second.close()
    finally:
        first.close()


def test_a_beat_whose_connection_went_is_retried_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A heartbeat whose call failed with CoordinatorUnavailable (its connection went
    inside the beat, at a database restart, or a cut link outlasted the reconnect
    window) says so and beats again; it used to stop the thread and so the process,
    which a restart did to every process caught mid-beat."""
    import logging

    from fanout.coord import heartbeat
    from fanout.coord.heartbeat import Heartbeat
    from fanout.errors import CoordinatorUnavailable
    from test_coordinator import new_run

    co, _, _ = new_run(tmp_path)
    reg = co.register_consumer("a")
    real = heartbeat.Coordinator.heartbeat
    fails = [2]

    def flaky(self: Any, r: Any) -> None:
        if fails[0] > 0:
            fails[0] -= 1
            raise CoordinatorUnavailable("server closed the connection (injected)")
        real(self, r)

    monkeypatch.setattr(heartbeat.Coordinator, "heartbeat", flaky)
    with (
        caplog.at_level(logging.WARNING, logger="fanout"),
        Heartbeat(tmp_path / "run", reg, interval_s=0.01) as hb,
    ):
        wait_for(lambda: hb.beats >= 2 or not hb._thread.is_alive(), 60, "two beats")
        hb.check()  # no error kept: the failures were an outage's
        assert hb.beats >= 2 and fails == [0]
    assert any("cannot reach the coordinator" in r.getMessage() for r in caplog.records)
    co.close()
