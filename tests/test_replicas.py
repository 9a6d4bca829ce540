"""Producer replicas: several verifiers feed one run, each window made once (issue #34).

    .venv/bin/pytest tests/test_replicas.py -x -q -p no:randomly

Coordinator cases run in one process (a connection per replica) on both databases:
replicas claim distinct windows and K counts all of them, with the last slot kept
for the slowest consumer's window; a lost replica's claim goes to another (counted)
and the lost one's publish changes nothing, and it rejoins; the stream's end is
recorded once, by the replica that publishes its last window; a replica whose plan
or contract differs, whose rank is out of range, held by a live process, or that
would be the M+1th, is refused naming the field or the holder. Process cases run
the real `fanout produce`: replicas make byte-identical windows to one producer in
fp32 (producer metadata aside), a paused or killed replica loses its claim to the
others and rejoins, `--regenerate` splits its chunks and writes the one data set
`fanout regenerate` writes, and `torchrun --nproc-per-node 2 ... --replicas 2` is
the short form. Nothing waits on a timing: every wait is on a state in the database
or a process's exit.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from coord_children import hold, register_and_die
from fanout.bench.assets import generate_corpus
from fanout.coord.coordinator import Coordinator, RunConfig
from fanout.coord.grants import ProducerPlan, ProducerReg
from fanout.errors import (
    AcquireTimeout,
    ConfigError,
    ContractMismatch,
    FanoutError,
    PlanMismatch,
    RoleHeld,
    StaleLease,
)
from fanout.produce.config import ProducerConfig
from fanout.produce.producer import Producer
from fanout.produce.replicas import rank_of
from fanout.produce.run_start import take_start_lock
from fanout.status.snapshot import snapshot
from fanout.status.table import format_table
from fanout.store.rundir import RunDir
from fanout.store.store import Store, WindowReader
from fanout.store.streaminfo import StreamInfo
from forked_cli import ForkedPopen
from test_coordinator import FakeClock, make_contract, new_run, publish
from tiny_run import (  # noqa: F401 (one_thread: an autouse fixture)
    build_tiny_assets,
    config_flags,
    one_thread,
    tiny_producer_config,
    wait_for,
)
from window_files import window_names

# spawned children run the bodies in coord_children.py, which imports the coordinator
# only (this module's imports cost a child seconds)
CTX = mp.get_context("spawn")
HOST = socket.gethostname()
PLAN3 = ProducerPlan(replicas=3)


def _open(tmp_path: Path, db: str | None, clock: Any = None) -> Coordinator:
    kw = {} if clock is None else {"clock": clock}
    return Coordinator.open(tmp_path / "run", db_path=db, **kw)


def _replicas(tmp_path: Path, db: str | None, n: int, plan: ProducerPlan, clock: Any = None
              ) -> tuple[list[Coordinator], list[ProducerReg]]:  # fmt: skip
    conns = [_open(tmp_path, db, clock) for _ in range(n)]
    regs = [co.register_producer(make_contract(), rank=r, plan=plan) for r, co in enumerate(conns)]
    return conns, regs


# ---- the coordinator ---------------------------------------------------------------


def test_replicas_claim_distinct_windows_and_k_counts_them_all(
    db: str | None, tmp_path: Path
) -> None:
    """K = 4 across three replicas: three claims (K - 1), then none; published out of
    order, read in order; the fourth slot only for the window a late consumer waits on
    after it was evicted."""
    co, store, c = new_run(tmp_path, db, max_live_windows=4, total_windows=8)
    conns, regs = _replicas(tmp_path, db, 3, PLAN3)
    claims = [x.claim(p) for x, p in zip(conns, regs, strict=True)]
    assert [(cl.window, cl.rank) for cl in claims if cl] == [(0, 0), (1, 1), (2, 2)]
    assert all(x.claim(p) is None for x, p in zip(conns, regs, strict=True))
    assert not conns[0].wait_for_capacity(regs[0], 0.0)
    for i in (2, 0, 1):  # the last claimed is published first
        publish(conns[i], store, c, claims[i])  # type: ignore[arg-type]
    a = co.register_consumer("a")
    for w in range(3):
        lease = co.acquire(a, timeout_s=1)
        assert lease is not None and lease.window == w
        co.ack(lease)
    assert co.meta("evictions") == 3
    more = [x.claim(p) for x, p in zip(conns, regs, strict=True)]
    assert [cl.window for cl in more if cl] == [3, 4, 5]
    for x, cl in zip(conns, more, strict=True):
        publish(x, store, c, cl)  # type: ignore[arg-type]
    late = co.register_consumer("late")  # joins at cursor 0: window 0 was evicted
    with pytest.raises(AcquireTimeout):  # window 0 is queued again, on demand
        co.acquire(late, timeout_s=0.01)
    live = co.conn.execute(
        "SELECT COUNT(*) FROM windows WHERE state IN ('ready','capturing','evicting')"
    ).fetchone()[0]
    assert live == 3  # K - 1: no new window fits, the kept slot takes window 0
    cl = conns[1].claim(regs[1])
    assert cl is not None and cl.window == 0 and cl.rank == 1
    assert conns[2].claim(regs[2]) is None  # K live now
    publish(conns[1], store, c, cl)
    s = snapshot(co)
    assert [(r["rank"], r["windows"], r["state"]) for r in s["replicas"]] == [
        (0, 2, "active"), (1, 3, "active"), (2, 2, "active"),
    ]  # fmt: skip
    assert s["recaptures"] == 1 and s["high_water"]["windows"] <= 4
    table = format_table(s)
    assert "producer active  3 replicas (below)" in table
    assert f"      1 active    {HOST}:{os.getpid()}" in table
    for x in conns:
        x.close()


def test_a_lost_replicas_claim_goes_to_another_and_it_rejoins(
    db: str | None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Replica 1 stops heartbeating while it captures window 0: once its counter stood
    still for ttl, a watcher declares it lost, its claim is released (counted in
    claims_reclaimed) and replica 0 captures window 0 again, first, under a new
    generation; replica 1's publish then changes nothing (StaleLease). Registered again,
    it takes the next window."""
    clock = FakeClock()
    rd = RunDir(tmp_path / "run").create()
    cfg = RunConfig(max_live_windows=4, ttl_s=10)
    co = Coordinator.create(rd.root, make_contract(), cfg, db_path=db, clock=clock)
    store, c = Store(rd), make_contract()
    conns, regs = _replicas(tmp_path, db, 2, ProducerPlan(2), clock)
    lost = conns[1].claim(regs[1])
    assert lost is not None and lost.window == 0
    with caplog.at_level(logging.WARNING, logger="fanout.coord.coordinator"):
        for _ in range(3):  # watched every 4 s (a reclaimer away for ttl/2 starts over)
            assert co.reclaim_lost() == []
            clock.t += 4
            conns[0].heartbeat(regs[0])
        assert co.reclaim_lost() == ["producer:r1"]
    assert "released 1 claim(s) of producer:r1 for recapture" in caplog.text
    assert co.meta("claims_reclaimed") == 1 and co.meta("reclaims") == 1
    again = conns[0].claim(regs[0])
    assert again is not None and again.window == 0 and again.generation > lost.generation
    with pytest.raises(StaleLease):
        publish(conns[1], store, c, lost)
    co.sweep()  # its file (the publisher removes it too) is nobody's: swept
    assert window_names(store) == []
    publish(conns[0], store, c, again)
    s = snapshot(co)
    assert [(r["rank"], r["recorded_state"]) for r in s["replicas"]] == [(0, "active"), (1, "lost")]
    assert s["claims_reclaimed"] == 1 and "reclaimed claims 1" in format_table(s)
    regs[1] = conns[1].register_producer(c, rank=1, plan=ProducerPlan(2))  # it rejoins
    nxt = conns[1].claim(regs[1])
    assert nxt is not None and nxt.window == 1
    assert snapshot(co)["replicas"][1]["recorded_state"] == "active"
    for x in [co, *conns]:
        x.close()


def test_the_stream_end_is_recorded_once_by_the_last_publisher(
    db: str | None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Three windows: replica 0 publishes windows 0 and 2 and finishes by design while
    replica 1 still captures window 1; the end is recorded when window 1 is published,
    by replica 1, and not again when it finishes."""
    co, store, c = new_run(tmp_path, db, max_live_windows=5)
    conns, regs = _replicas(tmp_path, db, 2, ProducerPlan(2))
    c0 = conns[0].claim(regs[0], end=3)
    c1 = conns[1].claim(regs[1], end=3)
    assert c0 is not None and c1 is not None
    publish(conns[0], store, c, c0)
    c2 = conns[0].claim(regs[0], end=3)
    assert c2 is not None and c2.window == 2 and conns[0].claim(regs[0], end=3) is None
    with caplog.at_level(logging.INFO, logger="fanout.coord.coordinator"):
        publish(conns[0], store, c, c2)
        conns[0].finish_producer(regs[0], stream_end=3)
        assert snapshot(co)["stream_end"] is None  # window 1 is not published yet
        publish(conns[1], store, c, c1)
        assert snapshot(co)["stream_end"] == 3
        conns[1].finish_producer(regs[1], stream_end=3)
    lines = [r.getMessage() for r in caplog.records if "the stream ends" in r.getMessage()]
    assert lines == ["the stream ends at window 3 (recorded by producer:r1)"]
    reg = co.register_consumer("a")
    for w in range(3):
        lease = co.acquire(reg, timeout_s=1)
        assert lease is not None and lease.window == w
        co.ack(lease)
    assert co.acquire(reg, timeout_s=1) is None
    assert "(stream ended at window 3)" in format_table(snapshot(co))
    for x in conns:
        x.close()


def test_a_replica_with_another_plan_contract_or_rank_is_refused(
    db: str | None, tmp_path: Path
) -> None:
    co, _, c = new_run(tmp_path, db)
    plan = ProducerPlan(2, (("--epochs", "1"), ("--max-windows", "none")))
    co.register_producer(c, rank=0, plan=plan)
    other = _open(tmp_path, db)
    with pytest.raises(
        PlanMismatch, match=r"data plan mismatch.*--epochs: run has '1', you asked for '2'"
    ):
        other.register_producer(c, rank=1, plan=ProducerPlan(2, (("--epochs", "2"), ("--max-windows", "none"))))  # fmt: skip
    with pytest.raises(PlanMismatch, match=r"--replicas: run has '2', you asked for '3'"):
        other.check_plan(1, ProducerPlan(3, plan.fields))
    with pytest.raises(ConfigError, match=r"--replica-rank 2: must be below --replicas 2"):
        other.register_producer(c, rank=2, plan=plan)
    with pytest.raises(ContractMismatch, match=r"hidden_size: run has 8, you asked for 16"):
        other.register_producer(make_contract(hidden_size=16), rank=1, plan=plan)
    reg = other.register_producer(c, rank=1, plan=plan)  # the same plan joins
    assert reg.rank == 1
    for x in (co, other):
        x.close()


def test_a_replica_without_a_rank_takes_a_lost_ones_place_before_a_finished_one(
    db: str | None, tmp_path: Path
) -> None:
    """Replica 0 finished, replica 1 was lost: a replica started without --replica-rank
    (a restart of the lost one) takes rank 1, so no rank is left recorded as held by a
    process that is gone."""
    clock = FakeClock()
    rd = RunDir(tmp_path / "run").create()
    cfg = RunConfig(max_live_windows=4, ttl_s=10)
    co = Coordinator.create(rd.root, make_contract(), cfg, db_path=db, clock=clock)
    conns, regs = _replicas(tmp_path, db, 2, ProducerPlan(2), clock)
    conns[0].finish_producer(regs[0])
    for _ in range(3):
        assert co.reclaim_lost() == []
        clock.t += 4
    assert co.reclaim_lost() == ["producer:r1"]
    reg = co.register_producer(make_contract(), rank=None, plan=ProducerPlan(2))
    assert reg.rank == 1
    states = co.conn.execute("SELECT rank, state FROM producers ORDER BY rank").fetchall()
    assert [tuple(r) for r in states] == [(0, "finished"), (1, "active")]
    for x in [co, *conns]:
        x.close()


def test_a_start_without_a_rank_locks_a_crashed_ones_rank_before_a_finished_one(
    db: str | None, tmp_path: Path
) -> None:
    """The start lock comes first (take_start_lock settles the rank before the
    registration): replica 0 finished, replica 1's process died holding its rank, and
    a start without --replica-rank takes rank 1, not the finished 0 (CI met a restart
    that took rank 0 and left rank 1 'active' behind the dead process)."""
    co, _, c = new_run(tmp_path, db)
    co.finish_producer(co.register_producer(c, rank=0, plan=ProducerPlan(2)))
    dead = CTX.Process(target=register_and_die, args=(str(co.root), db, c, 1))
    dead.start()
    dead.join(120)
    states = co.conn.execute("SELECT rank, state FROM producers ORDER BY rank").fetchall()
    assert [tuple(r) for r in states] == [(0, "finished"), (1, "active")]
    assert co.free_rank_order(2) == [1, 0]
    lock, rank = take_start_lock(co.root, db, False, None, 2)
    try:
        assert rank == 1
    finally:
        lock.release()
    co.close()


def test_a_held_rank_and_an_extra_replica_are_refused_naming_the_holders(
    db: str | None, tmp_path: Path
) -> None:
    co, _, c = new_run(tmp_path, db)
    ready, go = CTX.Queue(), CTX.Event()
    procs = [CTX.Process(target=hold, args=(str(co.root), db, c, r, ready, go)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        pids = sorted(int(ready.get(timeout=120)) for _ in procs)
        held = dict(co.conn.execute("SELECT rank, pid FROM producers").fetchall())
        with pytest.raises(RoleHeld) as twice:
            co.register_producer(c, rank=1, plan=ProducerPlan(2))
        assert f"producer replica 1 of {co.root} is held by {HOST} pid {held[1]}" in str(
            twice.value
        )
        with pytest.raises(RoleHeld) as extra:  # an M+1th: every rank is held
            co.register_producer(c, rank=None, plan=ProducerPlan(2))
        msg = str(extra.value)
        assert all(f"is held by {HOST} pid {pid}" in msg for pid in pids), msg
        assert msg.count("refusing to start a second one") == 1
        assert sorted(held.values()) == pids  # refused before anything changed
    finally:
        go.set()
        for p in procs:
            p.join(60)
    co.close()


def test_a_replica_that_exited_is_replaced_and_a_fresh_session_reopens_the_stream(
    db: str | None, tmp_path: Path
) -> None:
    """A first replica of a new session (no other active) records its plan and reopens a
    stream whose end was recorded: a restart with a larger budget continues it."""
    co, store, c = new_run(tmp_path, db, max_live_windows=4)
    p = co.register_producer(c, rank=0, plan=ProducerPlan(1, (("--max-windows", "1"),)))
    publish(co, store, c, co.claim(p, end=1))  # type: ignore[arg-type]
    co.finish_producer(p, stream_end=1)
    assert snapshot(co)["stream_end"] == 1
    p = co.register_producer(c, rank=0, plan=ProducerPlan(1, (("--max-windows", "none"),)))
    assert snapshot(co)["stream_end"] is None
    cl = co.claim(p)
    assert cl is not None and cl.window == 1
    co.close()


def test_which_rank_a_process_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """--replica-rank if given; 0 alone; under torchrun (one process per replica) RANK;
    else any free rank (None). Bad ranks and torchrun worlds are one ConfigError line
    naming the flags."""
    for k in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(k, raising=False)
    assert (rank_of(1, None, 1), rank_of(3, None, 1), rank_of(3, 2, 1)) == (0, None, 2)
    with pytest.raises(ConfigError, match=r"--replica-rank 3 must be below --replicas 3"):
        rank_of(3, 3, 1)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    assert rank_of(3, None, 1) == 2
    with pytest.raises(ConfigError, match=r"torchrun started 3 processes .* --replicas is 2"):
        rank_of(2, None, 1)
    with pytest.raises(ConfigError, match=r"each replica is its own torchrun launch of 2"):
        rank_of(2, None, 2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert rank_of(2, None, 2) is None and rank_of(1, None, 2) == 0  # a TP group


# ---- processes --------------------------------------------------------------------------------

ENV = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class Cli:
    """A `fanout …` process, forked from the warm forkserver (forked_cli: without a
    process's own interpreter start-up and imports), or any `argv` (torchrun); stdout and
    stderr go to a file."""

    def __init__(self, log: Path, *args: str, argv: list[str] | None = None) -> None:
        self.log = log
        self.proc: subprocess.Popen[bytes] | ForkedPopen
        if argv is None:
            self.proc = ForkedPopen(list(args), log)
        else:
            with log.open("w") as f:
                self.proc = subprocess.Popen(argv, stdout=f, stderr=f, env=ENV)
        self.pid = self.proc.pid

    def finish(self, timeout: float = 600) -> str:
        """Wait for the exit; assert it is 0; its output."""
        code = self.proc.wait(timeout)
        text = self.log.read_text(errors="replace")
        assert code == 0, text[-3000:]
        return text


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("replica-assets")
    build_tiny_assets(root, generate_corpus(40, seed=1))
    return root


def _cfg(assets: Path, run: Path, **kw: Any) -> ProducerConfig:
    """fp32 compute and storage, 4 epochs (~24 windows), K = 3 unless given."""
    return tiny_producer_config(
        assets, run, dtype="float32", storage_dtype="float32", heartbeat_s=0.3,
        cache_dir=str(assets / "cache"), **({"epochs": 4, "max_live_windows": 3} | kw),
    )  # fmt: skip


def _argv(assets: Path, run: Path, **kw: Any) -> list[str]:
    """`fanout produce` with `_cfg`'s settings."""
    return ["produce", *config_flags(_cfg(assets, run, **kw))]


def _one_producer(assets: Path, run: Path, **kw: Any) -> None:
    """The reference run of one producer, made in this process: the Producer `fanout
    produce` runs, without a second interpreter's start-up (most of a tiny run's time;
    the replicas compared with it are `fanout produce` processes)."""
    Producer(_cfg(assets, run, **kw)).run()


def _q(run: Path, sql: str) -> list[tuple[Any, ...]]:
    """Rows of `sql` ([] while the run's database is not there yet)."""
    try:
        with Coordinator.open(run) as co:
            return [tuple(r) for r in co.conn.execute(sql).fetchall()]
    except FanoutError:
        return []


def _file(path: Path) -> tuple[dict[str, bytes], dict[str, str]]:
    """A window file's tensors (raw bytes by name) and its metadata without what only
    says who made it (generation, and the header checksum that covers it)."""
    with WindowReader(path) as r:
        tensors = {n: r.get(n).contiguous().view(torch.uint8).numpy().tobytes() for n in r.names()}
        meta = r.meta.to_metadata()
    for k in ("generation", "checksum"):
        meta.pop(k)
    return tensors, meta


def test_replicas_make_the_windows_one_producer_makes_byte_for_byte(
    assets: Path, tmp_path: Path
) -> None:
    """One producer makes the whole stream (K large, nothing evicted). Then two replicas
    of another run: both start and stop at K (no consumer yet); the one that made the
    first windows is killed (-9), so the other makes the next ones, and restarted, it
    rejoins; a consumer here reads every window in order and compares it with the
    one-producer run's: every tensor byte-identical, the metadata equal apart from the
    generation. Each window was made once, and both replicas made some."""
    one, two = tmp_path / "one", tmp_path / "two"
    logs = tmp_path / "logs"
    logs.mkdir()
    _one_producer(assets, one, max_live_windows=1000)
    total = StreamInfo.read(RunDir(one)).total_windows  # type: ignore[union-attr]
    assert total is not None and total >= 20
    argv = _argv(assets, two, replicas=2)
    reps = [Cli(logs / f"replica-{i}.log", *argv) for i in range(2)]
    q = "SELECT rank, pid, made FROM producers WHERE state='active' ORDER BY rank"
    ready = "SELECT COUNT(*) FROM windows WHERE state='ready'"
    try:
        wait_for(lambda: len(_q(two, q)) == 2 and _q(two, ready) == [(2,)], 300, "both, at K")
        first = max(_q(two, q), key=lambda r: r[2])  # made the first windows (held at K now)
        os.kill(first[1], signal.SIGKILL)
        victim = next(r for r in reps if r.pid == first[1])
        victim.proc.wait(60)
        co = Coordinator.open(two)
        reg = co.register_consumer("check")
        for w in range(total):
            lease = co.acquire(reg, timeout_s=300)
            assert lease is not None and lease.window == w
            (want,) = RunDir(one).windows.glob(f"{w:08d}.g*.safetensors")
            assert _file(Path(lease.path)) == _file(want), w
            co.ack(lease)
            if w == 4:  # the other replica made windows meanwhile: the killed one rejoins
                made = dict((r, m) for r, _, m in _q(two, q))
                assert made[1 - first[0]] >= 1, made
                reps.append(Cli(logs / "rejoined.log", *argv))
        assert co.acquire(reg, timeout_s=60) is None  # the stream's end
        co.finish(reg)
        co.close()
        for r in reps:
            if r is not victim:
                r.finish()
    finally:
        for r in reps:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait(60)
    rows = _q(two, "SELECT rank, made, state FROM producers ORDER BY rank")
    assert [r[2] for r in rows] == ["finished", "finished"]
    assert sum(r[1] for r in rows) == total  # each window once: no recapture, no reclaim
    assert _q(two, "SELECT value FROM counters WHERE key='recaptures'") == [(0,)]


def test_torchrun_starts_one_replica_per_process(assets: Path, tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 -m fanout.cli produce --replicas 2`: each process is
    the replica of its RANK; together they make the stream, each window once."""
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", "-m", "fanout.cli", *_argv(assets, run, replicas=2, max_live_windows=1000)]  # fmt: skip
    text = Cli(tmp_path / "torchrun.log", argv=argv).finish()
    rows = _q(run, "SELECT rank, pid, made, state FROM producers ORDER BY rank")
    assert [(r[0], r[3]) for r in rows] == [(0, "finished"), (1, "finished")], text[-3000:]
    assert rows[0][1] != rows[1][1]
    total = StreamInfo.read(RunDir(run)).total_windows  # type: ignore[union-attr]
    assert sum(r[2] for r in rows) == total
    assert len(list(RunDir(run).windows.iterdir())) == total
    # recorded at the stream's end; a replica that started only after the other had made
    # every window (a loaded machine) reopens the stream and records the same end again
    ends = re.findall(r"the stream ends at window (\d+)", text)
    assert ends and set(ends) == {str(total)}, ends


def test_regenerate_splits_its_chunks_among_replicas(tmp_path: Path) -> None:
    """`--regenerate` with two replicas: chunk c is regenerated by replica c mod 2 (each
    says so in its log), the joined regenerated.jsonl is the file one producer (and
    `fanout regenerate`) writes, and the windows are byte-identical to one producer's."""
    root = tmp_path / "assets"
    build_tiny_assets(root, generate_corpus(12, 3))
    regen = dict(regenerate=True, temperature=1.0, keep_truncated=True, max_new_tokens=6,
                 regen_chunk_records=2, max_live_windows=1000, epochs=1)  # fmt: skip
    logs = tmp_path / "logs"
    logs.mkdir()
    one, two = tmp_path / "one", tmp_path / "two"
    _one_producer(root, one, **regen)
    argv = _argv(root, two, replicas=2, **regen)
    reps = [Cli(logs / f"replica-{i}.log", *argv, "--replica-rank", str(i)) for i in range(2)]
    texts = [r.finish() for r in reps]
    for i, text in enumerate(texts):  # 6 chunks: replica i regenerated chunks i, i+2, i+4
        done = sorted(int(x.split("/")[0]) - 1 for x in text.split("regenerated chunk ")[1:])
        assert done == [i, i + 2, i + 4], (i, done)
    joined = (RunDir(one).regen / "regenerated.jsonl").read_text()
    assert (RunDir(two).regen / "regenerated.jsonl").read_text() == joined and joined
    names = sorted(p.name.split(".")[0] for p in RunDir(one).windows.iterdir())
    assert names == sorted(p.name.split(".")[0] for p in RunDir(two).windows.iterdir())
    for n in names:
        (a,) = RunDir(one).windows.glob(f"{n}.g*")
        (b,) = RunDir(two).windows.glob(f"{n}.g*")
        assert _file(a) == _file(b), n


def test_a_starting_replica_says_what_it_waits_for_every_few_seconds() -> None:
    """A restarted replica is not silent until it registers (issue #45): from the 5th
    second on, one line every 5 s naming its current step (fake clock)."""
    from fanout.produce.run_start import StartNotice

    now, said = [0.0], list[str]()
    notice = StartNotice(5.0, clock=lambda: now[0], say=said.append)
    notice.stage("loading the verifier tiny")
    now[0] = 4.0
    assert notice.tick() is None
    now[0] = 5.0
    assert notice.tick() == "starting (not registered yet, 5 s): loading the verifier tiny (5 s)"
    now[0] = 7.0
    notice.stage("waiting for the join lock")
    assert notice.tick() is None  # not due again before 10 s
    now[0] = 10.0
    assert notice.tick() == "starting (not registered yet, 10 s): waiting for the join lock (3 s)"
    assert len(said) == 2
    with StartNotice(0.01, say=said.append) as live:  # its thread ticks; exits cleanly
        live.stage("x")
        import time

        time.sleep(0.1)
    assert any(line.endswith(": x (0 s)") for line in said[2:]), said
