"""A run on PostgreSQL watched through `fanout status` from start to end (issue #45).

    .venv/bin/pytest tests/test_journey_postgres.py -x -q     # skips without PostgreSQL

Real processes over the real CLI, the coordinator on a private PostgreSQL server
(conftest's `postgres_server`): two producer replicas (`fanout produce --replicas 2
--replica-rank r`), one data-parallel DFlash trainer of two gloo ranks (`torchrun
--nproc-per-node 2 -m fanout.cli train`), a DFlash2 trainer, and a gate: a consumer
this test drives through the coordinator. The gate is the deterministic brake: nothing
is evicted past its cursor, so K live windows hold the replicas while it waits, and
the stream cannot end while a replica is down. The story: every role joins; the gate
lets windows flow to window GATE_AT and holds; replica 1 is stopped with SIGINT (exit
0); once the run stands still, `fanout status --serve`'s /status.json, / and /metrics
(prometheus_client's parser) agree with `--json`; replica 1 restarts with its rank and
rejoins; the gate lets go; everyone reaches the stream's end and exits 0.

Meanwhile a thread runs `fanout status --json` again and again. Every sample must
validate against StatusSnapshot; its totals must be the sum of its rows (windows made:
what the replicas published plus what is claimed or queued; the producer's rate: its
active replicas'); replica 1 must be `stopped` in every sample from its exit until it
re-registers (its new pid); a replica or consumer that made or read windows between two
samples (the same process in both) has a positive rate in the later one; each
trainer's ETA, once the gate lets go, falls from its first known value to its last
(during the hold it grows, rightly: time passes, no window moves); the DFlash2 trainer
is a row of its own family. No assertion is on a duration: every wait is on a state
seen in the database, a sample or a process's exit, under a generous deadline.

Those identities hold only if a snapshot is read at one instant: the last test commits
a publish between two of `fanout status`'s reads (both databases) and checks that the
snapshot does not see half of it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fanout.bench.assets import generate_corpus
from fanout.coord import reads
from fanout.coord.coordinator import Coordinator
from fanout.coord.heartbeat import Heartbeat
from fanout.errors import FanoutError
from fanout.status.schema import StatusSnapshot
from fanout.status.snapshot import build
from test_coordinator import new_run, produce, publish
from test_replicas import ENV
from test_status_serve import assert_cells_match, page_cells, strip
from tiny_run import build_tiny_assets, config_flags, tiny_producer_config, wait_for

K = 4  # live windows at most
GATE_AT = 6  # the gate's cursor while replica 1 is down
TRAINERS = ("ddp:dp0", "ddp:dp1", "d2:dp0")
GATE = "gate:dp0"
DEADLINE_S = 300.0  # any one wait; a healthy run needs a small part of it
# What moves while a run stands still: ages, rates over a time that grows, counters of
# heartbeats, and the words that quote an age.
MOVING = {
    "taken_wall", "heartbeat_age_s", "heartbeats", "age_s", "for_s", "windows_per_s",
    "rows_per_s", "producer_windows_per_s", "eta_s", "waiting",
}  # fmt: skip


# ---- the status sampler ---------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    t0: float  # monotonic, before `fanout status --json` started
    t1: float  # after it printed
    snap: StatusSnapshot


def status_json(run: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "fanout.cli", "status", "--run-dir", str(run), "--json"],
        capture_output=True, text=True, env=ENV, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout))


class Sampler:
    """`fanout status --json` in a loop on its own thread; every output validated."""

    def __init__(self, run: Path) -> None:
        self.run, self.born = run, time.monotonic()
        self.samples: list[Sample] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                snap = StatusSnapshot.model_validate(status_json(self.run))
            except Exception as e:  # every failure is reported by the test
                self.failures.append(f"{type(e).__name__}: {e}")
            else:
                self.samples.append(Sample(t0, time.monotonic(), snap))
            self._stop.wait(0.2)  # pacing only: the machine has 2 cores

    def next_where(self, pred: Any, what: str, alive: tuple[Proc, ...] = ()) -> Sample:
        """The first sample started from now on for which `pred` holds (while every
        process in `alive` runs: one that exited fails the test with its output)."""
        start, seen = time.monotonic(), len(self.samples)

        def found() -> Sample | None:
            assert not self.failures, self.failures
            _alive(*alive)
            for s in self.samples[seen:]:
                if s.t0 >= start and pred(s.snap):
                    return s
            return None

        got: Sample = wait_for(found, DEADLINE_S, what, poll_s=0.05)
        print(f"[+{got.t1 - self.born:.1f} s] {what} (sample {self.samples.index(got)})")
        return got

    def stop(self) -> list[Sample]:
        self._stop.set()
        self._thread.join(180)
        assert not self._thread.is_alive()
        return list(self.samples)


# ---- the run's processes -------------------------------------------------------------------


def _producer(assets: Path, run: Path, db: str, rank: int) -> list[str]:
    cfg = tiny_producer_config(
        assets, run, db_path=db, replicas=2, max_live_windows=K, expected_consumers=4,
        epochs=3, heartbeat_s=0.3, cache_dir=str(assets / "cache"),
    )  # fmt: skip
    return ["produce", *config_flags(cfg), "--replica-rank", str(rank)]


def _trainer(assets: Path, run: Path, db: str, name: str, saves: Path, *more: str) -> list[str]:
    return [
        "train", "--run-dir", str(run), "--db-path", db, "--consumer-id", name,
        "--verifier-name-or-path", str(assets / "verifier"), "--num-layers", "1",
        "--block-size", "4", "--max-anchors", "8", "--save-path", str(saves / name),
        "--heartbeat-s", "0.3", "--checkpoint-every", "1000000000", *more,
    ]  # fmt: skip


def _q(run: Path, db: str | None, sql: str) -> list[tuple[Any, ...]]:
    """Rows of `sql`; [] while the run's database is not there yet."""
    try:
        with Coordinator.open(run, db_path=db) as co:
            return [tuple(r) for r in co.conn.execute(sql).fetchall()]
    except FanoutError:
        return []


class Proc:
    """A process of the run (`fanout …`, or torchrun and its workers) in a process group
    of its own, its output in a file: `kill()` ends it and what it started."""

    def __init__(self, log: Path, argv: list[str]) -> None:
        self.log = log
        with log.open("w") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=f, env=ENV, start_new_session=True)
        self.pid = self.proc.pid

    def finish(self, timeout: float) -> str:
        """Wait for the exit; assert it is 0; its output."""
        code = self.proc.wait(timeout)
        text = self.log.read_text(errors="replace")
        assert code == 0, text[-3000:]
        return text

    def kill(self) -> None:
        if self.proc.poll() is None:
            # SIGTERM first: torchrun then ends its workers (each in a session of its own,
            # out of reach of the group kill below); a fanout process stops cleanly
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(60)
        # the group outlives its leader while a member runs (so its id is not reused)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait(60)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fanout.cli", *args]


def _kill_all(procs: list[Proc]) -> None:
    for p in procs:
        p.kill()


@contextlib.contextmanager
def _served(run: Path) -> Iterator[str]:
    """`fanout status --serve 0` running: its URL; Ctrl-C ends it with exit 0."""
    server = subprocess.Popen(
        [sys.executable, "-m", "fanout.cli", "status", "--run-dir", str(run), "--serve", "0",
         "--interval-s", "5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=ENV,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        m = re.search(r"serving (http://\S+/) ", line)
        assert m, line + server.stdout.read()
        yield m.group(1)
        server.send_signal(signal.SIGINT)
        assert server.wait(60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(60)
        if server.stdout is not None:
            server.stdout.close()


def _alive(*procs: Proc) -> bool:
    for p in procs:
        assert p.proc.poll() is None, p.log.read_text(errors="replace")[-3000:]
    return True


# ---- what every sample must say -------------------------------------------------------------


def _check_sample(s: StatusSnapshot) -> None:
    t, w = s.totals, s.windows
    active = [r for r in s.replicas if r.state == "active"]
    assert t.producer_windows_per_s == round(sum(r.windows_per_s or 0.0 for r in active), 4), s
    assert (t.replicas, t.replicas_active) == (len(s.replicas), len(active)), s
    assert t.consumers == len(s.consumers), s
    assert t.consumers_active == sum(c.state == "active" for c in s.consumers), s
    # nothing is lost, reclaimed or recaptured here: every window the frontier handed
    # out is published by exactly one replica, or claimed, or queued (a released claim)
    assert (s.recaptures, s.reclaims, s.claims_reclaimed, s.corrupt) == (0, 0, 0, 0), s
    published = sum(r.windows for r in s.replicas)
    pending = w["queued"] + w["capturing"]
    assert published == t.windows_made - pending, (published, t, w)
    assert s.produced_windows == t.windows_made and t.windows_ready == w["ready"], s
    assert t.windows_live <= t.max_live_windows == K, s
    for c in s.consumers:
        if c.windows_per_s is not None:
            assert c.rows_per_s == round(c.windows_per_s * s.capture.window_rows, 3), c
        assert c.eta_s is None or c.eta_s >= 0, c
    fam = {c.id: (c.family, c.dp_rank, c.dp_world) for c in s.consumers}
    want = {"ddp:dp0": ("dflash", 0, 2), "ddp:dp1": ("dflash", 1, 2), "d2:dp0": ("dflash2", 0, 1)}
    assert all(fam[k] == v for k, v in want.items() if k in fam), fam


def _check_rates(a: StatusSnapshot, b: StatusSnapshot) -> tuple[int, int]:
    """Rates are positive where windows flowed from sample `a` to `b`, for a process in
    both (same pid: one incarnation's rate). How many replica and consumer rows moved."""
    moved_r = moved_c = 0
    before = {r.rank: r for r in a.replicas}
    for r in b.replicas:
        was = before.get(r.rank)
        if (
            was
            and was.pid == r.pid
            and r.state == was.state == "active"
            and r.windows > was.windows
        ):
            assert r.windows_per_s is not None and r.windows_per_s > 0, (was, r)
            assert b.totals.producer_windows_per_s > 0, b.totals
            moved_r += 1
    cbefore = {c.id: c for c in a.consumers}
    for c in b.consumers:
        old = cbefore.get(c.id)
        if old and old.pid == c.pid and c.state == old.state == "active" and c.cursor > old.cursor:
            assert c.windows_per_s is not None and c.windows_per_s > 0, (old, c)
            assert c.rows_per_s is not None and c.rows_per_s > 0, c
            moved_c += 1
    return moved_r, moved_c


# ---- one instant, three views ---------------------------------------------------------------


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as r:
        return str(r.read().decode())


def _three_views_agree(run: Path, url: str) -> dict[str, Any]:
    """At a moment the run stands still: /status.json, the page and /metrics say what
    `fanout status --json` says (ages and rates aside, which move with the clock)."""
    want = status_json(run)
    served = json.loads(_get(url + "status.json"))
    assert strip(served, MOVING) == strip(want, MOVING)
    StatusSnapshot.model_validate(served)

    cells = page_cells(_get(url))
    assert len(cells) > 20, cells
    assert_cells_match(cells, want, tuple(MOVING))
    assert cells["replicas.1.state"] == "stopped" and cells["consumers.d2:dp0.family"] == "dflash2"

    fams = {f.name: f for f in text_string_to_metric_families(_get(url + "metrics"))}

    def value(name: str, **labels: Any) -> float:
        fam = fams[name.removesuffix("_total")]
        (v,) = [x.value for x in fam.samples if x.name == name
                and all(x.labels.get(k) == str(y) for k, y in labels.items())]  # fmt: skip
        return float(v)

    t = want["totals"]
    assert value("fanout_windows_made_total") == t["windows_made"]
    assert value("fanout_windows_live") == t["windows_live"]
    assert value("fanout_windows_ready") == t["windows_ready"]
    assert value("fanout_max_live_windows") == t["max_live_windows"] == K
    for r in want["replicas"]:
        assert value("fanout_replica_state", rank=r["rank"], state=r["state"]) == 1
        assert value("fanout_replica_windows_total", rank=r["rank"]) == r["windows"]
    for c in want["consumers"]:
        who = {"consumer": c["id"], "family": c["family"] or "", "dp_rank": c["dp_rank"]}
        assert value("fanout_consumer_state", **who, state=c["state"]) == 1
        assert value("fanout_consumer_cursor", **who) == c["cursor"]
        assert value("fanout_consumer_lag_windows", **who) == c["lag_windows"]
        if c["step"] is not None:
            assert value("fanout_consumer_step", **who) == c["step"]
    return want


# ---- the journey --------------------------------------------------------------------------


def test_a_postgres_run_as_status_shows_it(pg_url: str, tmp_path: Path) -> None:
    assets, run, saves = tmp_path / "assets", tmp_path / "run", tmp_path / "drafts"
    # 24 rows × 3 epochs = 18 whole windows: the last one splits over the two DP ranks too
    build_tiny_assets(assets, generate_corpus(40, seed=1))
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[Proc] = []

    def start(name: str, argv: list[str]) -> Proc:
        procs.append(Proc(logs / f"{name}.log", argv))
        return procs[-1]

    with contextlib.ExitStack() as stack:
        # on the way out, last in first out: the server stops (Ctrl-C, exit 0), the gate's
        # heartbeat and connection close, what still runs is killed, the sampler stops
        sampler_box: list[Sampler] = []
        stack.callback(lambda: sampler_box and sampler_box[0].stop())
        stack.callback(_kill_all, procs)

        reps = [start(f"replica-{r}", _cli(*_producer(assets, run, pg_url, r))) for r in (0, 1)]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", "-m", "fanout.cli",
                    *_trainer(assets, run, pg_url, "ddp", saves, "--rows-per-step", "1")]  # fmt: skip
        ddp = start("ddp", torchrun)
        d2 = start("d2", _cli(*_trainer(assets, run, pg_url, "d2", saves, "--draft-family",
                                        "dflash2", "--rows-per-step", "2")))  # fmt: skip

        # once the run exists (and the run dir names its database): the gate joins, the
        # sampler and the dashboard server start
        wait_for(lambda: _alive(*reps) and _q(run, None, "SELECT 1"), DEADLINE_S, "the run")
        gate_co = stack.enter_context(Coordinator.open(run, db_path=pg_url))
        gate = gate_co.register_consumer("gate")
        beat = stack.enter_context(
            Heartbeat(run, gate, interval_s=0.3, open_kwargs={"db_path": pg_url})
        )
        sampler = Sampler(run)
        sampler_box.append(sampler)
        url = stack.enter_context(_served(run))

        # every role joined: two active replicas, the four consumers
        active_reps = "SELECT rank, pid FROM producers WHERE state='active' ORDER BY rank"
        wait_for(lambda: _alive(*reps, ddp, d2) and len(_q(run, pg_url, active_reps)) == 2
                 and len(_q(run, pg_url, "SELECT id FROM consumers")) == 4, DEADLINE_S,
                 "both replicas and every consumer")  # fmt: skip
        old_pid = dict(_q(run, pg_url, active_reps))[1]
        sampler.next_where(
            lambda s: [(r.state, r.pid) for r in s.replicas][1:] == [("active", old_pid)],
            "a sample of replica 1 active", (*reps, ddp, d2),
        )  # fmt: skip

        # windows flow to the gate's hold; replica 1 is stopped while they flow
        for w in range(GATE_AT):
            lease = gate_co.acquire(gate, timeout_s=DEADLINE_S)
            assert lease is not None and lease.window == w
            gate_co.ack(lease)
        sent = time.monotonic()
        reps[1].proc.send_signal(signal.SIGINT)
        reps[1].finish(DEADLINE_S)  # exit 0
        exited = time.monotonic()

        # the run stands still: replica 0 blocked at K, every trainer waits at the frontier
        def still(s: StatusSnapshot) -> bool:
            cons = {c.id: c for c in s.consumers}
            return (
                s.blocked is not None and s.replicas[1].state == "stopped"
                and s.windows["capturing"] == s.windows["queued"] == 0
                and all(cons[t].cursor == s.totals.windows_made for t in TRAINERS)
            )  # fmt: skip

        running = (reps[0], ddp, d2)
        sampler.next_where(still, "the run standing still with replica 1 stopped", running)
        at = _three_views_agree(run, url)
        assert [(r["rank"], r["state"]) for r in at["replicas"]] == [(0, "active"), (1, "stopped")]
        assert at["producer"]["state"] == "active" and at["blocked"]["by"] == [GATE]
        assert all(c["waiting"] for c in at["consumers"] if c["id"] in TRAINERS), at["consumers"]
        assert "restart it" in at["replicas"][1]["waiting"], at["replicas"][1]
        table = subprocess.run(
            [sys.executable, "-m", "fanout.cli", "status", "--run-dir", str(run)],
            capture_output=True, text=True, env=ENV, timeout=120, check=True,
        ).stdout  # fmt: skip
        assert re.search(r"^\s+1 stopped ", table, re.M), table

        # two more samples while it is down, then it restarts with its rank and rejoins
        sampler.next_where(lambda s: True, "a sample", running)
        sampler.next_where(lambda s: True, "another sample", running)
        back = start("replica-1-again", _cli(*_producer(assets, run, pg_url, 1)))
        sampler.next_where(
            lambda s: s.replicas[1].pid == back.pid and s.replicas[1].state == "active",
            "replica 1 active again",
            (*running, back),
        )

        # the gate lets go, a window at a time with a sample after every other one (the
        # trainers, K windows ahead of it at most, are watched while windows flow):
        # everyone reads to the end and exits 0
        released = time.monotonic()
        while (lease := gate_co.acquire(gate, timeout_s=DEADLINE_S)) is not None:
            gate_co.ack(lease)
            if lease.window % 2:
                sampler.next_where(lambda s: True, f"a sample after window {lease.window}")
        gate_co.finish(gate)
        beat.stop()
        beat.check()  # the gate was never fenced off
        for p in (ddp, d2, reps[0], back):
            p.finish(DEADLINE_S)
        final = sampler.next_where(lambda s: True, "a sample after the end")
        samples = sampler.stop()
        assert not sampler.failures, sampler.failures

    # ---- what the samples said, from start to end
    snaps = [s.snap for s in samples]
    for s in snaps:
        _check_sample(s)
    moved = [_check_rates(a, b) for a, b in itertools.pairwise(snaps)]
    assert sum(r for r, _ in moved) >= 1 and sum(c for _, c in moved) >= 1, moved

    # replica 1: active before the signal; stopped (not finished, not lost) from its exit
    # until it registered again, in every sample; then active, and finished at the end
    rank1 = [(s, s.snap.replicas[1]) for s in samples if len(s.snap.replicas) > 1]
    before = [r for s, r in rank1 if s.t1 < sent and r.pid == old_pid]
    down = [r for s, r in rank1 if s.t0 > exited and r.pid != back.pid]
    again = [r for s, r in rank1 if s.t0 > exited and r.pid == back.pid]
    assert before and all(r.state == "active" for r in before), before
    assert len(down) >= 3, len(down)
    assert all(
        r.state == "stopped" and r.recorded_state == "finished" and r.pid == old_pid for r in down
    ), down
    assert again and all(r.state in ("active", "finished") for r in again), again
    assert again[-1].state == "finished"

    # each trainer's ETA, where known while it trains after the hold, falls from the
    # first to the last (during the hold it grows: no window moves while time does)
    for cid in TRAINERS:
        etas = [c.eta_s for s in samples if s.t0 > released for c in s.snap.consumers
                if c.id == cid and c.state == "active" and c.eta_s is not None]  # fmt: skip
        assert len(etas) >= 2 and etas[-1] < etas[0], (cid, etas)

    # the end: every role finished, the stream ended where every trainer read to
    end = final.snap
    total = end.stream.length_windows
    assert end.stream.ended and total is not None and total > GATE_AT + K, end.stream
    assert end.producer.state == "finished"
    assert [r.state for r in end.replicas] == ["finished", "finished"]
    assert sum(r.windows for r in end.replicas) == end.totals.windows_made == total
    cons = {c.id: c for c in end.consumers}
    assert set(cons) == {GATE, *TRAINERS}
    for c in cons.values():
        assert (c.state, c.cursor, c.eta_s) == ("finished", total, 0.0), c
    assert cons["d2:dp0"].family == "dflash2" and cons["ddp:dp1"].family == "dflash"
    assert cons["d2:dp0"].step is not None and cons["ddp:dp0"].step is not None


# ---- one instant ----------------------------------------------------------------------------


def test_a_snapshot_reads_one_instant(
    db: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window published while `fanout status` is halfway through its reads (after the
    window counts, before the replicas' rows) is not half seen: the snapshot is read in
    one transaction, so the replicas' windows stay what the counts beside them say."""
    co, store, c = new_run(tmp_path, db, max_live_windows=K)
    p = co.register_producer(c)
    for _ in range(2):
        produce(co, p, store, c)
    claim = co.claim(p)
    assert claim is not None
    exits, published = reads.producer_exits, list[Any]()

    def publish_between(cur: Any) -> dict[int, int | None]:
        if not published:  # another connection commits, once, mid-snapshot
            published.append(publish(co, store, c, claim))
        return exits(cur)

    monkeypatch.setattr(reads, "producer_exits", publish_between)  # what status calls
    with Coordinator.open(co.root, db_path=db) as reader:
        s = build(reader)
    assert published  # the write happened inside the snapshot's reads
    assert (s.totals.windows_made, s.windows["capturing"], s.replicas[0].windows) == (3, 1, 2)
    _check_sample(s)  # every identity the journey checks holds
    monkeypatch.undo()
    with Coordinator.open(co.root, db_path=db) as reader:  # and the next one sees it
        after = build(reader)
    assert (after.windows["capturing"], after.replicas[0].windows) == (0, 3)
    co.close()
