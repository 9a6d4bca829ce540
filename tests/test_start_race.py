"""Simultaneous starts: producers, producer replicas and trainers released together on
one run, as races.

    .venv/bin/pytest tests/test_start_race.py -x -q -p no:randomly            # a few rounds
    .venv/bin/pytest tests/test_start_race.py -m slow -x -q -p no:randomly    # many rounds

Every racer is a real process running the `fanout` command's entry point
(`fanout.cli.main`, or `fanout.train.trainer.main` under torchrun), forked from a
forkserver that imported torch once (as the chaos suite does), and held at a barrier
until all of them are ready: then all are released together, or each a random
fraction of a second after the barrier ("staggered"). What is asserted are the
invariants, never timings: exactly one holds the role; every other racer exits 1
with the holder line naming a racer that held it (never a traceback, never "this
same process registered the role again"); nothing of the run is removed or changed
(file listing and hashes, the coordinator's rows); and a trainer then trains on the
run to the end of its stream. Producer replicas (`--replicas M`) released together
on a fresh run dir all start: exactly one creates the run, the others join, none is
refused and nothing is removed; a rank asked for twice, or an M+1th replica, is
refused naming a replica that holds it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import xxhash

from fanout.bench.assets import generate_corpus
from fanout.chaos.procs import PRELOAD, child_to_log
from fanout.coord.coordinator import Coordinator
from fanout.errors import FanoutError
from tiny_run import build_tiny_assets, config_flags, tiny_producer_config, wait_for

HOST = socket.gethostname()
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(PRELOAD)
N = 4  # racers per race
HELD = re.compile(rf"is held by {re.escape(HOST)} pid (\d+)")


# ---- racers ------------------------------------------------------------------------


def _racer(argv: list[str], log_path: str, barrier: Any, delay_s: float) -> None:
    """A forked `fanout` command: stdout/stderr to its log; starts once released."""
    child_to_log(log_path)
    from fanout.cli import main

    if barrier is not None:
        barrier.wait(600)
    time.sleep(delay_s)
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


@dataclass
class Racer:
    proc: Any
    log: Path

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    @property
    def code(self) -> int | None:
        code: int | None = self.proc.exitcode
        return code

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def finish(self, timeout: float = 300) -> int:
        self.proc.join(timeout)
        assert self.code is not None, f"{self.log.name} still running after {timeout} s"
        return self.code


class Procs:
    """Every racer a test started; all are killed at the end, whatever happened."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.all: list[Racer] = []
        self.barriers: list[Any] = []
        logs.mkdir(exist_ok=True)

    def race(self, name: str, argvs: list[list[str]], stagger: random.Random | None) -> list[Racer]:
        """Start one racer per argv, released together by a barrier (or, with
        `stagger`, each 0-0.5 s after it)."""
        barrier = CTX.Barrier(len(argvs)) if len(argvs) > 1 else None
        self.barriers.append(barrier)  # kept: its semaphores go with the last reference
        out = []
        for i, argv in enumerate(argvs):
            delay = stagger.uniform(0, 0.5) if stagger else 0.0
            log = self.logs / f"{name}-{i}.log"
            p = CTX.Process(target=_racer, args=(argv, str(log), barrier, delay))
            p.start()
            out.append(Racer(p, log))
        self.all += out
        return out

    def kill_all(self) -> None:
        for r in self.all:
            if r.code is None:
                os.kill(r.pid, signal.SIGKILL)
                r.proc.join(60)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path / "logs")
    try:
        yield p
    finally:
        p.kill_all()


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("race-assets")
    build_tiny_assets(root, generate_corpus(24, seed=0))
    return root


def _refused(r: Racer, holders: set[int]) -> int:
    """Assert `r` exited 1 with the holder line naming one of `holders`; that pid."""
    code, text = r.finish(), r.text()
    assert code == 1, f"{r.log.name}: exit {code}\n{text[-3000:]}"
    found = HELD.findall(text)
    assert found, f"{r.log.name}: no holder line\n{text[-3000:]}"
    named = int(found[-1])
    assert named in holders and named != r.pid, (r.log.name, named, holders, text[-2000:])
    assert "Traceback" not in text and "registered the role again" not in text, text[-3000:]
    assert "removed what this start created" not in text, text[-3000:]
    return named


def _one_winner(racers: list[Racer], timeout: float = 300) -> Racer:
    """Wait until all racers but one have exited; assert that one is still running."""
    wait_for(lambda: sum(r.code is not None for r in racers) >= len(racers) - 1, timeout,
             "all racers but one to exit")  # fmt: skip
    alive = [r for r in racers if r.code is None]
    assert len(alive) == 1, [(r.log.name, r.code, r.text()[-1500:]) for r in racers]
    return alive[0]


# ---- the run, as the coordinator and the file system hold it ------------------------------


def _query(run: Path, db: str | None, sql: str) -> list[tuple[Any, ...]] | None:
    """Rows of `sql`; None while the run's database is not there (yet)."""
    try:
        with Coordinator.open(run, db_path=db) as co:
            return [tuple(r) for r in co.conn.execute(sql).fetchall()]
    except FanoutError:
        return None


def _producer(run: Path, db: str | None) -> tuple[Any, ...] | None:
    rows = _query(run, db, "SELECT pid, state, token FROM producers ORDER BY rank")
    return rows[0] if rows else None


def _ready(run: Path, db: str | None) -> int:
    rows = _query(run, db, "SELECT COUNT(*) FROM windows WHERE state='ready'")
    return int(rows[0][0]) if rows else -1


def _snapshot(run: Path, db: str | None) -> tuple[dict[str, str], list[tuple[Any, ...]] | None]:
    """Every file under the run dir (xxh3 of its bytes) but the database itself (its
    rows instead: every window, the producer's registration) and the start lock's
    record; tmp/ holds only a publish's temp files."""
    files = {}
    for p in sorted(run.rglob("*")):
        rel = p.relative_to(run).as_posix()
        if p.is_file() and not rel.startswith(("coordinator.sqlite3", "producer.lock", "tmp/")):
            files[rel] = xxhash.xxh3_64_hexdigest(p.read_bytes())
    rows = _query(run, db, "SELECT window, state, generation, name, checksum FROM windows")
    producers = _query(run, db, "SELECT rank, pid, state, token FROM producers ORDER BY rank")
    return files, [*sorted(rows or []), *(("producer", *p) for p in producers or [])]


def _produce_argv(
    assets: Path, run: Path, db: str | None, consumers: int = 1, **kw: Any
) -> list[str]:
    """K = 3: two windows ahead (and the slowest consumer's slot); nothing is evicted
    before `consumers` consumers registered."""
    cfg = tiny_producer_config(
        assets, run, heartbeat_s=0.3, ttl_s=600.0, db_path=db,
        cache_dir=str(assets / "cache"), expected_consumers=consumers,
        **({"max_live_windows": 3} | kw),
    )  # fmt: skip
    return ["produce", *config_flags(cfg)]


def _train_argv(assets: Path, run: Path, save: Path, consumer: str = "c0") -> list[str]:
    return [
        "train", "--run-dir", str(run), "--consumer-id", consumer, "--verifier-name-or-path",
        str(assets / "verifier"), "--num-layers", "1", "--block-size", "4", "--max-anchors", "8",
        "--rows-per-step", "2", "--save-path", str(save), "--heartbeat-s", "0.3",
        "--acquire-timeout-s", "600",
    ]  # fmt: skip


def _trains_to_the_end(r: Racer) -> dict[str, Any]:
    code, text = r.finish(600), r.text()
    assert code == 0, text[-3000:]
    summary = json.loads([x for x in text.splitlines() if x.startswith("{")][-1])
    assert summary["finished_stream"] and summary["steps"] > 0, summary
    return dict(summary)


# ---- producers ---------------------------------------------------------------------------


def producer_round(assets: Path, base: Path, db: str | None, procs: Procs, rng: random.Random,
                   stagger: bool) -> None:  # fmt: skip
    """One round on a new run dir: N producers race to create it; N more race against
    the live winner; the winner is killed and N more race to replace it; a trainer
    then trains on the run to the end."""
    run = base / f"run-{uuid.uuid4().hex[:8]}"
    argv = _produce_argv(assets, run, db)
    jitter = rng if stagger else None

    new = procs.race(f"{run.name}-new", [argv] * N, jitter)
    first = _one_winner(new)
    for r in new:
        if r is not first:
            _refused(r, {first.pid})
    wait_for(lambda: (_producer(run, db) or (0,))[0] == first.pid and _ready(run, db) == 2,
             300, "the winner's K - 1 windows")  # fmt: skip
    before = _snapshot(run, db)
    assert {"contract.json", "stream.json", "token_counts.safetensors"} <= set(before[0])

    held = procs.race(f"{run.name}-held", [argv] * N, jitter)
    for r in held:
        _refused(r, {first.pid})
    assert _snapshot(run, db) == before  # the refused changed nothing
    assert first.code is None

    os.kill(first.pid, signal.SIGKILL)
    assert first.finish() == -signal.SIGKILL
    again = procs.race(f"{run.name}-again", [argv] * N, jitter)
    second = _one_winner(again)
    for r in again:
        if r is not second:
            _refused(r, {second.pid})
    wait_for(lambda: (_producer(run, db) or (0,))[0] == second.pid, 300, "the new producer")
    kept = {k: v for k, v in before[0].items() if k.startswith("windows/") or k == "contract.json"}
    now = _snapshot(run, db)[0]
    assert {k: now.get(k) for k in kept} == kept  # the dead one's windows are all there

    (trainer,) = procs.race(f"{run.name}-train", [_train_argv(assets, run, run / "draft")], None)
    _trains_to_the_end(trainer)
    assert second.finish() == 0, second.text()[-3000:]  # the stream ended: a clean exit


def _pg(server: str) -> str:
    return f"{server}&schema=race_{uuid.uuid4().hex[:10]}"


@pytest.mark.parametrize("stagger", [False, True], ids=["together", "staggered"])
def test_producers_started_together_one_holds_the_run(
    assets: Path, tmp_path: Path, procs: Procs, stagger: bool
) -> None:
    producer_round(assets, tmp_path, None, procs, random.Random(1), stagger)


def test_producers_started_together_on_postgres(
    assets: Path, tmp_path: Path, procs: Procs, postgres_server: str
) -> None:
    producer_round(assets, tmp_path, _pg(postgres_server), procs, random.Random(2), True)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_producer_races_many_rounds(
    assets: Path, tmp_path: Path, procs: Procs, backend: str, request: pytest.FixtureRequest
) -> None:
    rng = random.Random(3)
    for i in range(8):
        db = None if backend == "sqlite" else _pg(request.getfixturevalue("postgres_server"))
        producer_round(assets, tmp_path, db, procs, rng, stagger=bool(i % 2))


# ---- producer replicas ----------------------------------------------------------------------

M = 3  # replicas


def _replicas(run: Path, db: str | None) -> list[tuple[Any, ...]]:
    return _query(run, db, "SELECT rank, pid, state FROM producers ORDER BY rank") or []


def replica_round(assets: Path, base: Path, db: str | None, procs: Procs, rng: random.Random,
                  stagger: bool) -> None:  # fmt: skip
    """One round on a new run dir: M replicas (no rank given: each takes a free one)
    race to start it: all start, one creates the run, the others join, none is refused
    and nothing is removed. Then a replica asking for rank 1 and two more (an M+1th)
    race against them: each is refused naming a live replica, and nothing changes. A
    trainer then trains to the end of the stream, which the replicas make together,
    each window once."""
    run = base / f"run-{uuid.uuid4().hex[:8]}"
    argv = _produce_argv(assets, run, db, replicas=M)
    jitter = rng if stagger else None

    racers = procs.race(f"{run.name}-replicas", [argv] * M, jitter)
    pids = {r.pid for r in racers}
    wait_for(lambda: {p for _, p, s in _replicas(run, db) if s == "active"} == pids
             or any(r.code is not None for r in racers), 300, "M replicas")  # fmt: skip
    assert all(r.code is None for r in racers), [
        (r.log.name, r.code, r.text()[-2000:]) for r in racers
    ]
    assert [rank for rank, _, _ in _replicas(run, db)] == list(range(M))
    created = [r for r in racers if "created coordinator" in r.text()]
    assert len(created) == 1, [r.text()[-2000:] for r in racers]
    for r in racers:
        assert "removed what this start created" not in r.text() and "Traceback" not in r.text()
    wait_for(lambda: _ready(run, db) == 2, 300, "K - 1 windows")  # no consumer yet: held at K
    before = _snapshot(run, db)

    extra = [_produce_argv(assets, run, db, replicas=M, replica_rank=1), argv, argv]
    for r in procs.race(f"{run.name}-extra", extra, jitter):
        _refused(r, pids)
    assert _snapshot(run, db) == before  # the refused changed nothing
    assert all(r.code is None for r in racers)

    (trainer,) = procs.race(f"{run.name}-train", [_train_argv(assets, run, run / "draft")], None)
    _trains_to_the_end(trainer)
    for r in racers:
        assert r.finish() == 0, r.text()[-3000:]
    total = json.loads((run / "stream.json").read_text())["total_windows"]
    made = _query(run, db, "SELECT SUM(made) FROM producers") or [(0,)]
    assert made[0][0] == total  # each window made once, by one of the replicas
    assert sum("the stream ends at window" in r.text() for r in racers) == 1


@pytest.mark.parametrize("stagger", [False, True], ids=["together", "staggered"])
def test_replicas_started_together_all_join_one_run(
    assets: Path, tmp_path: Path, procs: Procs, stagger: bool
) -> None:
    replica_round(assets, tmp_path, None, procs, random.Random(6), stagger)


def test_replicas_started_together_on_postgres(
    assets: Path, tmp_path: Path, procs: Procs, postgres_server: str
) -> None:
    replica_round(assets, tmp_path, _pg(postgres_server), procs, random.Random(7), True)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_replica_races_many_rounds(
    assets: Path, tmp_path: Path, procs: Procs, backend: str, request: pytest.FixtureRequest
) -> None:
    rng = random.Random(8)
    for i in range(6):
        db = None if backend == "sqlite" else _pg(request.getfixturevalue("postgres_server"))
        replica_round(assets, tmp_path, db, procs, rng, stagger=bool(i % 2))


# ---- trainers ----------------------------------------------------------------------------


def trainer_round(assets: Path, base: Path, db: str | None, procs: Procs,
                  rng: random.Random | None) -> None:  # fmt: skip
    """N trainers with one consumer id race on a run with a live producer: N-1 on one
    --save-path, one on its own. Exactly one trains; each other exits 1 naming the
    live trainer that held its consumer id or its save path. The run waits for a
    second consumer before it evicts anything, so the winner, done with the K windows
    on disk, is still waiting for the next while the others decide (it cannot finish
    first and leave the role free); then consumer c1 joins and both train to the end."""
    run = base / f"run-{uuid.uuid4().hex[:8]}"
    argv = _produce_argv(assets, run, db, consumers=2)
    (producer,) = procs.race(f"{run.name}-produce", [argv], None)
    wait_for(lambda: _ready(run, db) == 2, 300, "the producer's K windows")
    assert json.loads((run / "stream.json").read_text())["total_windows"] > 2
    shared, own = run / "draft", run / "draft-own"
    argvs = [_train_argv(assets, run, shared)] * (N - 1) + [_train_argv(assets, run, own)]
    racers = procs.race(f"{run.name}-train", argvs, rng)
    wait_for(lambda: sum(r.code is not None for r in racers) >= N - 1, 600, "N-1 refusals")
    alive = [r for r in racers if r.code is None]
    assert len(alive) == 1, [(r.log.name, r.code, r.text()[-1500:]) for r in racers]
    winner = alive[0]
    pids = {r.pid for r in racers}
    for r in racers:
        if r is not winner:
            _refused(r, pids)
    (other,) = procs.race(f"{run.name}-c1", [_train_argv(assets, run, run / "c1", "c1")], None)
    _trains_to_the_end(winner)
    _trains_to_the_end(other)
    assert producer.finish() == 0, producer.text()[-3000:]
    rows = _query(run, db, "SELECT id, state, pid FROM consumers ORDER BY id")
    assert rows == [("c0:dp0", "finished", winner.pid), ("c1:dp0", "finished", other.pid)]
    # the winner's save path has its checkpoints and no temp directory; the other none
    mine, theirs = (shared, own) if racers.index(winner) < N - 1 else (own, shared)
    assert any(p.name.startswith("checkpoint-") for p in mine.iterdir())
    assert not [p.name for p in mine.iterdir() if p.name.startswith(".tmp-")]
    assert not theirs.exists() or not any(
        p.name.startswith("checkpoint-") for p in theirs.iterdir()
    )


@pytest.mark.parametrize("stagger", [False, True], ids=["together", "staggered"])
def test_trainers_with_one_consumer_id_and_save_path(
    assets: Path, tmp_path: Path, procs: Procs, stagger: bool
) -> None:
    trainer_round(assets, tmp_path, None, procs, random.Random(4) if stagger else None)


def test_trainers_started_together_on_postgres(
    assets: Path, tmp_path: Path, procs: Procs, postgres_server: str
) -> None:
    trainer_round(assets, tmp_path, _pg(postgres_server), procs, None)


@pytest.mark.slow
def test_trainer_races_many_rounds(assets: Path, tmp_path: Path, procs: Procs) -> None:
    rng = random.Random(5)
    for i in range(8):
        trainer_round(assets, tmp_path, None, procs, rng if i % 2 else None)


# ---- torchrun ------------------------------------------------------------------------------

# torchrun's worker: wait at a file barrier (every worker of both launches ready), then
# scripts/train.py's main.
WORKER = """
import os, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from fanout.train.trainer import main
barrier = Path(sys.argv[1])
(barrier / f"ready-{os.getpid()}").touch()
while not (barrier / "go").exists():
    time.sleep(0.002)
sys.exit(main(sys.argv[2:]))
"""


def test_two_torchrun_launches_with_one_consumer_id_and_save_path(
    assets: Path, tmp_path: Path, procs: Procs
) -> None:
    """Two `torchrun --nproc-per-node 2` trainers (gloo ranks) released together: one
    launch trains both ranks to the end; the other fails, its rank 0 refused naming a
    rank of the winner, and nothing of the winner's is touched. Nothing is evicted
    before a third consumer (c1, started once the loser exited) registers, so the
    winner cannot finish the stream before the loser has decided."""
    run = tmp_path / "run"
    (producer,) = procs.race("produce", [_produce_argv(assets, run, None, consumers=3)], None)
    wait_for(lambda: _ready(run, None) == 2, 300, "the producer's K windows")
    worker, barrier = tmp_path / "worker.py", tmp_path / "barrier"
    worker.write_text(WORKER)
    barrier.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launches = []
    for i in range(2):
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", str(worker), str(barrier),
                *_train_argv(assets, run, tmp_path / "draft")[1:]]  # fmt: skip
        with (tmp_path / f"torchrun-{i}.log").open("w") as f:
            launches.append(subprocess.Popen(argv, stdout=f, stderr=f, env=env))
    try:
        ready = lambda: len(list(barrier.glob("ready-*")))  # noqa: E731
        wait_for(lambda: ready() == 4 or any(p.poll() is not None for p in launches), 300,
                 "4 workers at the barrier")  # fmt: skip
        assert ready() == 4, [p.poll() for p in launches]
        (barrier / "go").touch()
        wait_for(lambda: any(p.poll() is not None for p in launches), 600, "the refused launch")
        (c1,) = procs.race("c1", [_train_argv(assets, run, tmp_path / "c1", "c1")], None)
        codes = [p.wait(600) for p in launches]
        _trains_to_the_end(c1)
    finally:
        for p in launches:
            if p.poll() is None:
                p.kill()
                p.wait(60)
    logs = [(tmp_path / f"torchrun-{i}.log").read_text(errors="replace") for i in range(2)]
    assert sorted(c == 0 for c in codes) == [False, True], (codes, [t[-3000:] for t in logs])
    win = codes.index(0)
    rows = dict(
        (r[0], r[1:]) for r in _query(run, None, "SELECT id, state, pid FROM consumers") or []
    )
    assert set(rows) == {"c0:dp0", "c0:dp1", "c1:dp0"}
    assert all(s == "finished" for s, _ in rows.values()), rows
    summaries = [json.loads(x) for x in logs[win].splitlines() if x.startswith("{")]
    assert len(summaries) == 2 and all(s["finished_stream"] for s in summaries), logs[win][-3000:]
    named = {int(p) for p in HELD.findall(logs[1 - win])}
    assert named and named <= {rows["c0:dp0"][1], rows["c0:dp1"][1]}, logs[1 - win][-3000:]
    assert "this same process registered" not in logs[1 - win]
    # every rank of the refused launch stops with its line, none in a broken collective
    assert "Connection closed by peer" not in logs[1 - win], logs[1 - win][-3000:]
    lines = [x for x in logs[1 - win].splitlines() if x.startswith("fanout train: error: ")]
    assert len(lines) == 2, lines
    assert "AtomicWriteError" not in logs[1 - win] + logs[win]
    assert producer.finish() == 0, producer.text()[-3000:]
