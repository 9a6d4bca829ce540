"""The coordinator under many hosts: N consumers and M producer replicas against one
PostgreSQL over a link with latency, each making the real coordinator calls.

    .venv/bin/python benchmarks/hosts.py --json /tmp/hosts.json                     # ≈ 2 min
    .venv/bin/python benchmarks/hosts.py --consumers 1,4,16,64,128,256 --rates 1,3 \
        --latency-ms 1,0 --seconds 25 --warmup-s 8 --json benchmarks/results/hosts.json  # kept
    .venv/bin/python benchmarks/hosts.py --consumers 4 --replicas 2 --seconds 4 --warmup-s 1
    git archive HEAD src | tar -x -C /tmp/base      # before / after, on one server in one run:
    .venv/bin/python benchmarks/hosts.py --consumers 1,16,64,256 --seconds 20 --warmup-s 6 \
        --baseline-src /tmp/base/src --json benchmarks/results/hosts.json
    .venv/bin/python benchmarks/hosts.py --consumers 256 --pg-set deadlock_timeout=60s   # a server setting

Run from the repository root; needs PostgreSQL's server binaries (initdb, pg_ctl; the
`pg_stat_statements` module of postgresql-contrib) and psycopg. Everything listens on
127.0.0.1 only.

- The database: a PostgreSQL server this script starts (initdb in a temp dir, its own
  max_connections, `pg_stat_statements` preloaded; fsync as `--pg-fsync`), one run per
  sweep point in a schema of its own, created by `Coordinator.create` as a producer does.
- The network: every client connection goes through a userspace TCP proxy on loopback
  (asyncio, `--proxies` processes) that holds each chunk `--latency-ms` in each
  direction, in order: a round trip costs 2 × latency (this kernel has no netem). The
  measured round trip of `SELECT 1` with and without the proxy is recorded.
- The clients: the fanout.coord Coordinator's public API, called as fanout.produce and
  fanout.train call it. A producer replica (producer.py's loop): `wait_for_capacity`,
  `meta("next_window")`, `claim`, a capture of `M / rate` seconds (the verifier's forward:
  the replicas together make `--rates` windows/s, a real cluster's rate, e.g. a Qwen3-8B
  verifier on 8 GPUs makes a few a second), then `renew` and `publish_ready`
  (publisher.py), with `Heartbeat(reclaim=True)`. A consumer (consumer.py): `acquire`
  of its next window, `--train-fraction` of a window period training on it, `ack`,
  with a `Heartbeat` thread. Windows are metadata only (no file is written): this
  measures the database path. Every one has its own connections (its heartbeat thread
  another), as a process on its own host has.
- The processes: 272 interpreters do not fit 2 cores, so `--workers` processes each
  run a share of the clients as threads, each with its own connections. What that
  costs is measured, not assumed: each call's client CPU time (time.thread_time), each
  worker's CPU use (of one core: the GIL's ceiling), and on the server side the time
  the statements took (pg_stat_statements) and how busy the run's single write lock
  was (pg_locks, sampled every 100 ms). If the workers stay well below one core each
  while the lock is busy nearly all the time, the queue is the database's, not Python's.

What is reported per point (consumers N, rate R), over `--seconds` after `--warmup-s`:
- acquire: from the later of the call and the window's publish (the producer's
  `publish_ready` returned) to the lease in hand, i.e. what the coordinator adds to a
  trainer's wait; p50 / p99 / n. The goal: p99 ≤ 100 ms at 256 consumers. Also split:
  `acquire_ready` (the window was ready when called: the call's own time).
- ack, heartbeat (the consumers'), claim and publish (the producers'): p50 / p99 / n.
- statements per window: every statement the server ran (pg_stat_statements, BEGIN,
  COMMIT, LISTEN, NOTIFY included), divided by the windows published; the top ones.
- the single serialised writer: write transactions per second (its advisory-lock
  statement's calls), the lock's mean wait (that statement's mean time), the fraction
  of samples with the lock held and the mean queue behind it.
- `uptime` at the start and the end (the machine is shared: its load is recorded).
- with `--baseline-src DIR`, every point run first on the fanout package under DIR (the
  code before a change), then on this one: the notes say each figure before → after.

`--json OUT` writes benchmarks/record.py's record (rows for docs/numbers.md, with the
notes generated from the measurement) and everything above under `raw`;
`--redo-from OUT` makes only the rows, plot and notes again from a kept record's `raw`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import pwd
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GOAL_MS = 100.0  # p99 acquire at 256 consumers (issue 55, item 5)
GOAL_N = 256
LOCK_SQL = "pg_advisory_xact_lock"  # fanout.coord.postgresdb's write lock


# ---------------------------------------------------------------------------- the proxy


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy reader → writer, each chunk held `delay` seconds; order kept (one queue per
    direction, drained by one task), so a steady stream sees a constant added latency."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def pump() -> None:
        while True:
            due, data = await q.get()
            if (left := due - loop.time()) > 0:
                await asyncio.sleep(left)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        writer.close()

    task = asyncio.create_task(pump())
    try:
        while data := await reader.read(1 << 16):
            q.put_nowait((loop.time() + delay, data))
    except ConnectionError:
        pass
    q.put_nowait((loop.time() + delay, b""))
    with contextlib.suppress(ConnectionError):
        await task


async def _proxy(listen_port: int, target_port: int, delay: float, ready: Path) -> None:
    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            cw.close()
            return
        for s in (cw, sw):
            sock = s.get_extra_info("socket")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(_pipe(cr, sw, delay), _pipe(sr, cw, delay))

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port, backlog=1024)
    ready.write_text("ok")
    async with server:
        await server.serve_forever()


def proxy_main(spec: str) -> int:
    """`--proxy LISTEN_PORT:TARGET_PORT:DELAY_S:READY_FILE` (internal: one proxy process)."""
    lp, tp, d, ready = spec.split(":", 3)
    asyncio.run(_proxy(int(lp), int(tp), float(d), Path(ready)))
    return 0


# ---------------------------------------------------------------------------- PostgreSQL


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Server:
    """A throwaway PostgreSQL cluster on 127.0.0.1 (as tests/conftest.py starts one; as
    root it runs as the `postgres` user), with room for every client's connections."""

    def __init__(
        self, base: Path, max_connections: int, fsync: bool, settings: Sequence[str] = ()
    ) -> None:
        sys.path.insert(0, str(REPO / "tests"))  # where the test suite finds the binaries
        from conftest import _postgres_bin

        initdb, pg_ctl = _postgres_bin("initdb"), _postgres_bin("pg_ctl")
        if initdb is None or pg_ctl is None:
            raise SystemExit("hosts.py: PostgreSQL server binaries (initdb, pg_ctl) not found")
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            try:
                pw = pwd.getpwnam("postgres")
            except KeyError:
                raise SystemExit("hosts.py: running as root without a postgres user") from None
            self.as_user = ["runuser", "-u", "postgres", "--"]
            os.chown(base, pw.pw_uid, pw.pw_gid)
        self.data, sock = base / "data", base / "sock"
        run = functools.partial(subprocess.run, check=True, capture_output=True, text=True)
        run([*self.as_user, initdb, "-D", str(self.data), "-U", "postgres", "--auth=trust",
             "--no-sync"])  # fmt: skip
        run([*self.as_user, "mkdir", "-p", str(sock)])
        self.port = _free_port()
        opts = (
            f"-k {sock} -c listen_addresses=127.0.0.1 -p {self.port} "
            f"-c max_connections={max_connections} -c fsync={'on' if fsync else 'off'} "
            "-c shared_preload_libraries=pg_stat_statements -c pg_stat_statements.max=1000 "
            "-c pg_stat_statements.track_utility=on" + "".join(f" -c {x}" for x in settings)
        )
        self.pg_ctl = pg_ctl
        log = base / "log"
        try:
            run([*self.as_user, pg_ctl, "-D", str(self.data), "-o", opts, "-w", "-l", str(log),
                 "start"])  # fmt: skip
        except subprocess.CalledProcessError:
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise SystemExit(f"hosts.py: PostgreSQL did not start:\n{tail}") from None
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres?connect_timeout=10"
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as c:
            c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            row = c.execute("SHOW server_version").fetchone()
            assert row is not None  # SHOW always returns its one row
            self.version = str(row[0])

    def stop(self) -> None:
        subprocess.run([*self.as_user, self.pg_ctl, "-D", str(self.data), "-m", "immediate",
                        "stop"], check=False, capture_output=True)  # fmt: skip


# ---------------------------------------------------------------------------- the clients


def _contract() -> Any:
    from fanout.contract import CaptureContract

    return CaptureContract(
        verifier_config_hash="hosts", verifier_weights_fingerprint="hosts",
        verifier_num_layers=36, hidden_size=4096, vocab_size=151936,
        target_layer_ids=(1, 9, 17, 25, 33), dataset_fingerprint="hosts",
        tokenizer_fingerprint="hosts", seq_len=4096, window_rows=16, shuffle_seed=0,
    )  # fmt: skip


# name → [(wall start, seconds, client CPU seconds)], one list per worker process; a
# list's append is atomic under the GIL, so client threads share it.
CALLS: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
TIMED = ("ack", "heartbeat", "reclaim_lost", "claim", "publish_ready", "renew",
         "wait_for_capacity", "meta")  # fmt: skip


def _instrument() -> None:
    """Time the Coordinator's methods in this process (acquire is timed by its caller,
    which also knows the window)."""
    from fanout.coord.coordinator import Coordinator

    for name in TIMED:
        fn = getattr(Coordinator, name)

        def timed(*a: Any, _fn: Any = fn, _name: str = name, **k: Any) -> Any:
            w, c, t = time.time(), time.thread_time(), time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                CALLS[_name].append((w, time.perf_counter() - t, time.thread_time() - c))

        setattr(Coordinator, name, timed)


class Clients:
    """One worker process's share of the clients, as threads."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.root, self.url = spec["root"], spec["url"]
        self.go = threading.Event()
        self.stop = threading.Event()
        self.t0 = 0.0
        self.registered = 0
        self.lock = threading.Lock()
        self.acquires: list[tuple[float, float, float, int]] = []  # (call wall, s, cpu, w)
        self.published: dict[int, float] = {}  # window → wall time publish_ready returned
        self.errors: list[str] = []
        self.wake_delays: list[
            tuple[float, float]
        ] = []  # a 10 ms sleep's overshoot: GIL + scheduler

    def probe(self) -> None:
        """How late a thread of this process wakes: what the GIL and the loaded machine
        add to every client call's wake-up, measured beside the clients."""
        self.go.wait()
        while not self.stop.is_set():
            t = time.perf_counter()
            time.sleep(0.01)
            self.wake_delays.append((time.time(), time.perf_counter() - t - 0.01))

    def _registered(self) -> None:
        with self.lock:
            self.registered += 1

    def _error(self, who: str, e: BaseException) -> None:
        self.errors.append(f"{who}: {type(e).__name__}: {e}")

    def producer(self, rank: int) -> None:
        from fanout.coord.coordinator import Coordinator
        from fanout.coord.grants import ProducerPlan
        from fanout.coord.heartbeat import Heartbeat
        from fanout.store.store import Published, window_name

        s = self.spec
        co = Coordinator.open(self.root, db_path=self.url)
        try:
            preg = co.register_producer(_contract(), owner=f"hosts-r{rank}", rank=rank,
                                        plan=ProducerPlan(s["replicas"]))  # fmt: skip
            self._registered()
            period = s["replicas"] / s["rate"]  # one replica's capture of one window
            self.go.wait()
            due = self.t0 + period * (rank + 1) / s["replicas"]  # replicas staggered
            with Heartbeat(self.root, preg, s["heartbeat_s"], reclaim=True,
                           open_kwargs={"db_path": self.url}) as hb:  # fmt: skip
                while not self.stop.is_set():
                    hb.check()
                    if not co.wait_for_capacity(preg, timeout_s=0.5):
                        continue
                    int(co.meta("next_window"))
                    claim = co.claim(preg)
                    if claim is None:
                        self.stop.wait(0.05)
                        continue
                    # the verifier's forward: the replicas together keep the rate
                    if self.stop.wait(max(0.0, due - time.time())):
                        co.fail(claim, "benchmark over")
                        break
                    due = max(due + period, time.time() - period)
                    name = window_name(claim.window, claim.generation)
                    co.renew(claim)
                    co.publish_ready(
                        claim, Published(name, Path(self.root) / "windows" / name, 1, "xxh3_128:0")
                    )
                    self.published[claim.window] = time.time()
        except Exception as e:  # counted and reported: a benchmark must not hide them
            self._error(f"producer r{rank}", e)
        finally:
            co.close()

    def consumer(self, i: int) -> None:
        from fanout.coord.coordinator import Coordinator
        from fanout.coord.heartbeat import Heartbeat
        from fanout.errors import AcquireCancelled

        s = self.spec
        co = Coordinator.open(self.root, db_path=self.url)
        try:
            reg = co.register_consumer(f"c{i:03d}", 0)
            self._registered()
            train_s = s["train_fraction"] / s["rate"]
            self.go.wait()
            with Heartbeat(self.root, reg, s["heartbeat_s"], open_kwargs={"db_path": self.url}):
                while not self.stop.is_set():
                    w, c, t = time.time(), time.thread_time(), time.perf_counter()
                    try:
                        lease = co.acquire(reg, timeout_s=120, cancel=self.stop)
                    except AcquireCancelled:
                        break
                    assert lease is not None  # an endless stream
                    dt, cpu = time.perf_counter() - t, time.thread_time() - c
                    self.acquires.append((w, dt, cpu, lease.window))
                    self.stop.wait(train_s)  # the optimizer steps on this window
                    co.ack(lease)
        except Exception as e:
            self._error(f"consumer c{i:03d}", e)
        finally:
            co.close()

    def run(self) -> dict[str, Any]:
        s = self.spec
        # A thread that dies outside the loops' own handlers (a Heartbeat thread whose
        # connection timed out) is an error of the run, not a line on stderr only.
        threading.excepthook = lambda e: self._error(
            f"thread {e.thread.name if e.thread else '?'}", e.exc_value or Exception("?")
        )
        threads = [threading.Thread(target=self.producer, args=(r,), daemon=True)
                   for r in s["ranks"]]  # fmt: skip
        threads += [threading.Thread(target=self.consumer, args=(i,), daemon=True)
                    for i in s["consumer_ids"]]  # fmt: skip
        prober = threading.Thread(target=self.probe, daemon=True)
        prober.start()
        for t in threads:  # spread out: 272 connections at once time out on 2 cores
            t.start()
            time.sleep(s["start_spread_s"] / len(threads))
        want = len(threads)
        while self.registered + len(self.errors) < want:
            time.sleep(0.01)
        Path(s["ready_file"]).write_text("ok")
        go = Path(s["go_file"])
        while not go.exists():
            time.sleep(0.005)
        while not go.read_text().strip():
            time.sleep(0.005)
        self.t0 = float(go.read_text())
        ru0 = os.times()
        time.sleep(max(0.0, self.t0 - time.time()))
        self.go.set()
        end = self.t0 + s["seconds"]
        time.sleep(max(0.0, end - time.time()))
        ru1 = os.times()
        self.stop.set()
        for t in threads:
            t.join(timeout=30)
        cpu = (ru1.user + ru1.system) - (ru0.user + ru0.system)
        return {
            "calls": {k: v for k, v in CALLS.items()},
            "acquires": self.acquires,
            "published": {str(k): v for k, v in self.published.items()},
            "errors": self.errors,
            "wake_delays": self.wake_delays,
            "cpu_s": cpu,
            "wall_s": ru1.elapsed - ru0.elapsed,
            "threads": want,
        }


def _say(p: dict[str, Any], label: str) -> None:
    """A point's line on stdout as it finishes."""
    print(
        f"L={p['latency_ms']:g} N={p['consumers']:4d} R={p['rate_target']:g}"
        f"{' (' + label + ')' if label else ''}: {p['windows_per_s']:.2f} win/s, "
        f"acquire p50/p99 {_fmt(p['acquire']['p50_ms'])}/"
        f"{_fmt(p['acquire']['p99_ms'])} ms (n {p['acquire']['n']}), ack "
        f"{_fmt(p['ack']['p50_ms'])}/{_fmt(p['ack']['p99_ms'])}, heartbeat "
        f"{_fmt(p['heartbeat']['p50_ms'])}/{_fmt(p['heartbeat']['p99_ms'])}; "
        f"{_fmt(p['statements_per_window'], 0)} statements/window, "
        f"{_fmt(p['write_tx_per_s'], 0)} writes/s, lock held "
        f"{100 * (p['write_lock_held_frac'] or 0):.0f}% "
        f"({_fmt(p['write_lock_hold_ms_mean'])} ms each), queue "
        f"{_fmt(p['write_lock_queue_mean'])}; workers' CPU "
        f"{p['worker_cpu_of_one_core']}; errors {p['error_count']}",
        flush=True,
    )


def worker_main(spec_path: str) -> int:
    """`--worker SPEC.json` (internal): run a share of the clients, write OUT.json."""
    spec = json.loads(Path(spec_path).read_text())
    # Imported before the clock starts: the first eviction imports the store (torch),
    # which would otherwise stall every thread of this process mid-measurement.
    import fanout.store.store  # noqa: F401

    _instrument()
    out = Clients(spec).run()
    Path(spec["out"]).write_text(json.dumps(out))
    return 0


# ---------------------------------------------------------------------------- one point


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _stats(secs: list[float]) -> dict[str, Any]:
    ms = [1e3 * x for x in secs]
    return {
        "n": len(ms),
        "p50_ms": _pct(ms, 0.5),
        "p99_ms": _pct(ms, 0.99),
        "max_ms": max(ms) if ms else None,
    }


class Sampler(threading.Thread):
    """Samples pg_locks every 100 ms on a direct connection: is the run's write lock held,
    and how many transactions queue behind it."""

    def __init__(self, url: str, proxied: str) -> None:
        super().__init__(daemon=True)
        import psycopg

        self.conn = psycopg.connect(url, autocommit=True)
        self.probe = psycopg.connect(proxied, autocommit=True)
        self.stop = threading.Event()
        self.active = threading.Event()
        self.samples: list[tuple[int, int]] = []
        self.rtts: list[float] = []  # SELECT 1 through the proxy, under the run's load

    def run(self) -> None:
        q = ("SELECT count(*) FILTER (WHERE granted), count(*) FILTER (WHERE NOT granted) "
             "FROM pg_locks WHERE locktype = 'advisory'")  # fmt: skip
        while not self.stop.wait(0.1):  # pg_locks takes the lock manager's locks: rarely
            if self.active.is_set():
                row = self.conn.execute(q).fetchone()
                assert row is not None  # an aggregate always returns one row
                held, queued = row
                self.samples.append((int(held), int(queued)))
                t = time.perf_counter()
                self.probe.execute("SELECT 1").fetchone()
                self.rtts.append(time.perf_counter() - t)
        self.conn.close()
        self.probe.close()


def _statements(url: str) -> list[dict[str, Any]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as c:
        rows = c.execute(
            "SELECT query, calls, total_exec_time FROM pg_stat_statements "
            "WHERE query NOT LIKE '%pg_stat_statements%' AND query NOT LIKE '%pg_locks%' "
            "ORDER BY calls DESC"
        ).fetchall()
    return [{"query": " ".join(q.split())[:160], "calls": int(n), "total_ms": float(t)}
            for q, n, t in rows]  # fmt: skip


def _reset_statements(url: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as c:
        c.execute("SELECT pg_stat_statements_reset()")


def create_main(spec: str) -> int:
    """`--create ROOT|URL|N|K` (internal): create a sweep point's run, as a producer does,
    with the fanout package this interpreter imports (the baseline's, under
    --baseline-src: its schema may be another version)."""
    from fanout.coord.coordinator import Coordinator, RunConfig

    root, url, n, k = spec.split("|")
    cfg = RunConfig(max_live_windows=int(k), expected_consumers=int(n))
    Coordinator.create(root, _contract(), cfg, db_path=url).close()
    return 0


def run_point(a: argparse.Namespace, server: Server, proxy_ports: list[int], work: Path,
              n: int, rate: float, src: str | None = None) -> dict[str, Any]:  # fmt: skip
    """One sweep point: a fresh run, N consumers and M replicas for --seconds; `src`:
    the fanout package's source dir every process of the point imports (the baseline)."""
    tag = f"hosts_{n}c_{str(rate).replace('.', 'p')}_{uuid.uuid4().hex[:6]}"
    root = work / tag
    direct = f"{server.url}&schema={tag}"
    env = None if src is None else os.environ | {"PYTHONPATH": src}
    subprocess.run([sys.executable, __file__, "--create",
                    f"{root}|{direct}|{n}|{a.max_live_windows}"], check=True, env=env)  # fmt: skip
    w = a.workers
    specs = []
    for k in range(w):
        port = proxy_ports[k % len(proxy_ports)]
        url = f"postgresql://postgres@127.0.0.1:{port}/postgres?connect_timeout=30&schema={tag}"
        spec = {
            "root": str(root), "url": url, "replicas": a.replicas, "rate": rate,
            "ranks": list(range(k, a.replicas, w)), "consumer_ids": list(range(k, n, w)),
            "heartbeat_s": a.heartbeat_s, "train_fraction": a.train_fraction,
            "seconds": a.seconds, "start_spread_s": a.start_spread_s, "ready_file": str(work / f"{tag}.ready{k}"),
            "go_file": str(work / f"{tag}.go"), "out": str(work / f"{tag}.out{k}.json"),
        }  # fmt: skip
        Path(work / f"{tag}.spec{k}.json").write_text(json.dumps(spec))
        specs.append(spec)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(work / f"{tag}.spec{k}.json")], env=env
        )
        for k in range(w)
    ]
    t_setup = time.time()
    while not all(Path(s["ready_file"]).exists() for s in specs):
        if any(p.poll() not in (None, 0) for p in procs):
            raise SystemExit(f"hosts.py: a client worker failed while registering ({tag})")
        time.sleep(0.05)
    setup_s = time.time() - t_setup
    sampler = Sampler(server.url, server.url.replace(f":{server.port}/", f":{proxy_ports[0]}/"))
    sampler.start()
    t0 = time.time() + 0.3
    go = Path(specs[0]["go_file"])
    go.with_suffix(".tmp").write_text(f"{t0!r}")
    go.with_suffix(".tmp").rename(go)
    t_meas, t_end = t0 + a.warmup_s, t0 + a.seconds
    time.sleep(max(0.0, t_meas - time.time()))
    _reset_statements(server.url)
    sampler.active.set()
    time.sleep(max(0.0, t_end - time.time()))
    sampler.active.clear()
    stmts = _statements(server.url)
    meas_s = time.time() - t_meas
    for p in procs:
        if p.wait(timeout=120) != 0:
            raise SystemExit(f"hosts.py: a client worker exited with {p.returncode} ({tag})")
    sampler.stop.set()
    sampler.join()
    outs = [json.loads(Path(s["out"]).read_text()) for s in specs]
    out = summarise(n, rate, a, outs, stmts, sampler.samples, t_meas, t_end, meas_s, setup_s)
    return out | {"rtt_under_load": _stats(sampler.rtts)}


def summarise(n: int, rate: float, a: argparse.Namespace, outs: list[dict[str, Any]],
              stmts: list[dict[str, Any]], samples: list[tuple[int, int]], t_meas: float,
              t_end: float, meas_s: float, setup_s: float) -> dict[str, Any]:  # fmt: skip
    published = {int(k): v for o in outs for k, v in o["published"].items()}
    in_window = lambda t: t_meas <= t < t_end  # noqa: E731
    made = sum(1 for t in published.values() if in_window(t))
    after_ready, ready_called, cpu = [], [], []
    for o in outs:
        for w, dt, c, win in o["acquires"]:
            if not in_window(w):
                continue
            ready = published.get(int(win), w)  # published before the run: ready
            after_ready.append(w + dt - max(w, ready))
            if ready <= w:
                ready_called.append(dt)
                cpu.append(c)
    calls: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for o in outs:
        for k, v in o["calls"].items():
            calls[k] += [x for x in v if in_window(x[0])]
    total = sum(s["calls"] for s in stmts)
    writes = sum(s["calls"] for s in stmts if LOCK_SQL in s["query"])
    lock_ms = sum(s["total_ms"] for s in stmts if LOCK_SQL in s["query"])
    held = (sum(1 for h, _ in samples if h) / len(samples)) if samples else 0.0
    per_worker = [o["cpu_s"] / o["wall_s"] for o in outs if o["wall_s"] > 0]
    out = {
        "consumers": n,
        "replicas": a.replicas,
        "rate_target": rate,
        "windows_per_s": made / meas_s,
        "windows_measured": made,
        "measured_s": meas_s,
        "setup_s": setup_s,
        "acquire": _stats(after_ready),
        "acquire_ready": _stats(ready_called),
        "acquire_client_cpu": _stats(cpu),
        "ack": _stats([x[1] for x in calls["ack"]]),
        "ack_client_cpu": _stats([x[2] for x in calls["ack"]]),
        "heartbeat": _stats([x[1] for x in calls["heartbeat"]]),
        "claim": _stats([x[1] for x in calls["claim"]]),
        "publish": _stats([x[1] for x in calls["publish_ready"]]),
        "reclaim_lost": _stats([x[1] for x in calls["reclaim_lost"]]),
        # what the clients asked of the writer, per second (acquire: leases obtained)
        "calls_per_s": {k: len(v) / meas_s for k, v in sorted(calls.items())}
        | {"acquire": len(after_ready) / meas_s},
        "statements": total,
        "statements_per_window": total / made if made else None,
        "statements_per_s": total / meas_s,
        "write_tx_per_s": writes / meas_s,
        "write_lock_wait_ms_mean": lock_ms / writes if writes else None,
        # the lock's hold per write transaction: busy fraction over transactions per second
        "write_lock_hold_ms_mean": 1e3 * held / (writes / meas_s) if writes and samples else None,
        "statements_per_write_tx": total / writes if writes else None,
        "write_lock_held_frac": held if samples else None,
        "write_lock_queue_mean": statistics.mean(q for _, q in samples) if samples else None,
        "lock_samples": len(samples),
        "worker_cpu_of_one_core": [round(x, 3) for x in per_worker],
        "client_wake_delay": _stats([d for o in outs for t, d in o["wake_delays"] if in_window(t)]),
        "top_statements": stmts[:15],
        "errors": [e for o in outs for e in o["errors"]][:20],
        "error_count": sum(len(o["errors"]) for o in outs),
    }  # fmt: skip
    return out


# ---------------------------------------------------------------------------- the report


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _rtt_ms(url: str, n: int = 200) -> float:
    """Median round trip of `SELECT 1` on `url` (ms)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as c:
        xs = []
        for _ in range(n):
            t = time.perf_counter()
            c.execute("SELECT 1").fetchone()
            xs.append(time.perf_counter() - t)
    return 1e3 * statistics.median(xs)


def _fmt(x: Any, nd: int = 1) -> str:
    return "—" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _floats(text: str, flag: str, kind: type = float, zero: bool = False) -> list[Any]:
    try:
        xs = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(
            f"hosts.py: {flag} {text!r}: expected numbers separated by commas"
        ) from None
    if not xs or any(x < 0 or (x == 0 and not zero) for x in xs):
        raise SystemExit(f"hosts.py: {flag} {text!r}: expected {'' if zero else 'positive '}"
                         f"numbers{', 0 or more' if zero else ''}")  # fmt: skip
    return xs


def _over(p: dict[str, Any]) -> bool:
    """p99 acquire past the goal, or no acquire finished at all (the writer collapsed)."""
    p99 = p["acquire"]["p99_ms"]
    return p99 is None or p99 > GOAL_MS


def notes(points: list[dict[str, Any]], a: argparse.Namespace,
          rtts: dict[float, dict[str, float]]) -> list[str]:  # fmt: skip
    """The prose docs/numbers.md carries under the table: generated from the
    measurement, so every figure in it is one this run has."""
    groups: dict[tuple[float, float], list[dict[str, Any]]] = defaultdict(list)
    for p in points:
        groups[(p["latency_ms"], p["rate_target"])].append(p)
    trips = "; ".join(
        f"{lat:g} ms each way: `SELECT 1` round trip {r['proxied_ms']:.2f} ms through the "
        f"proxy ({r['direct_ms']:.2f} ms direct)"
        for lat, r in sorted(rtts.items())
    )
    out = [
        f"{a.replicas} producer replicas and N consumers against one PostgreSQL through a "
        f"loopback TCP proxy ({trips}); {a.workers} client processes of threads, each "
        f"client with its own connections; {a.seconds:g} s per point, the first "
        f"{a.warmup_s:g} s not measured"
        + "".join(f"; the server run with {x}" for x in a.pg_set)
        + ". Acquire is timed from the later of the call and the window's publish to the "
        "lease in hand."
    ]
    for (lat, rate), ps in sorted(groups.items()):
        ps = sorted(ps, key=lambda p: p["consumers"])
        over = [p for p in ps if _over(p)]
        if over and over[0] is ps[0]:
            verdict = (f"p99 acquire is already past {GOAL_MS:g} ms at the smallest N "
                       f"measured, {ps[0]['consumers']}")  # fmt: skip
        elif over:
            verdict = f"p99 acquire passes {GOAL_MS:g} ms first at N = {over[0]['consumers']}"
        else:
            verdict = f"p99 acquire stays within {GOAL_MS:g} ms up to N = {ps[-1]['consumers']}"
        curve = "; ".join(
            f"N = {p['consumers']}: "
            + (f"{_fmt(p['acquire']['p99_ms'])} ms" if p["acquire"]["n"] else "no acquire done")
            + f", {p['windows_per_s']:.2f} windows/s made, heartbeat p99 "
            f"{_fmt(p['heartbeat']['p99_ms'])} ms, {_fmt(p['write_tx_per_s'], 0)} write "
            f"transactions/s, lock held in {100 * (p['write_lock_held_frac'] or 0):.0f}% of "
            f"samples, {_fmt(p['write_lock_queue_mean'])} waiting on average"
            for p in ps
        )
        out.append(f"{lat:g} ms each way, {rate:g} windows/s: {verdict}. By N — {curve}.")
    busy = [p for p in points if (p["write_lock_held_frac"] or 0) >= 0.9 and p["write_tx_per_s"]]
    if busy:
        server_ms = max(
            (st["total_ms"] / st["calls"] for p in busy for st in p["top_statements"]
             if LOCK_SQL not in st["query"] and st["calls"]),
            default=0.0,
        )  # fmt: skip
        line = "; ".join(
            f"{p['latency_ms']:g} ms, N = {p['consumers']}, {p['rate_target']:g} windows/s: "
            f"{_fmt(p['write_lock_hold_ms_mean'])} ms per write transaction, "
            f"{_fmt(p['statements_per_write_tx'])} statements per write transaction, "
            f"`SELECT 1` through the proxy meanwhile p50 {_fmt(p['rtt_under_load']['p50_ms'])} ms"
            for p in busy
        )
        out.append(
            "Where the write lock was busy (held in at least 90% of samples), how long each "
            "write transaction held it (busy fraction ÷ write transactions/s), against the "
            "statements it ran (all statements ÷ write transactions) and a round trip "
            f"measured beside it: {line}. The server's own mean time per statement (the "
            f"lock's wait aside) was at most {server_ms:.2f} ms (pg_stat_statements, "
            "`top_statements` in the JSON): the rest of the hold is round trips (a claim's "
            "read) and, on a loaded machine, the server's process waiting for a core while it "
            "holds the lock (the `SELECT 1` beside it says how loaded)."
        )
    for lat in sorted({p["latency_ms"] for p in points if p["latency_ms"] > 0}):
        sat = [p for p in busy if p["latency_ms"] == lat]
        if not sat:
            continue
        cap = max(p["write_tx_per_s"] for p in sat)
        n, rate = max(p["consumers"] for p in points), max(p["rate_target"] for p in points)
        # the fewest write transactions the calls need: an acquire and an ack per window
        # per consumer, a claim, a publish and an eviction per window (heartbeats and
        # renews take no run lock)
        need = 2 * n * rate + 3 * rate
        top = max(sat, key=lambda p: p["write_tx_per_s"])
        out.append(
            f"The arithmetic at {lat:g} ms each way: the saturated writer ran at most "
            f"{cap:.0f} write transactions/s (holding the run's lock "
            f"{_fmt(top['write_lock_hold_ms_mean'])} ms each on average), while N = {n} "
            f"consumers at {rate:g} windows/s need at least {need:.0f}/s (2 N R + 3 R: an "
            "acquire and an ack per window per consumer, a claim, a publish and an eviction "
            f"per window), {need / cap:.1f} times more. For that each may hold the lock for "
            f"at most {1e3 / need:.2f} ms, less than one round trip "
            f"({rtts[lat]['proxied_ms']:.2f} ms here): only a write sent with its lock and "
            "its COMMIT as one message can, and then the server's own time per transaction "
            "(its statements, its commit) sets the ceiling."
        )
    from fanout.coord.retention import RunOptions

    ttl = RunOptions().ttl_s
    late = [p for p in points if (p["heartbeat"]["p99_ms"] or 0) > 1e3 * ttl / 3]
    if late:
        out.append(
            f"Heartbeats were late: p99 past a third of ttl_s ({ttl:g} s, "
            "the margin `--heartbeat-s` asks for) at "
            + "; ".join(
                f"{p['latency_ms']:g} ms, N = {p['consumers']}, {p['rate_target']:g} windows/s"
                for p in late
            )
            + "; past ttl_s, live processes would be declared lost and fenced."
        )
    cpu = max((x for p in points for x in p["worker_cpu_of_one_core"]), default=0.0)
    wake = max((p["client_wake_delay"]["p99_ms"] or 0.0 for p in points), default=0.0)
    out.append(
        f"The client side {'was not' if cpu < 0.5 and wake < 5 else 'may have been part of'} "
        f"the limit: the busiest worker process used "
        f"{100 * cpu:.0f}% of one core (a process's threads share one GIL: near 100% "
        "would mean Python set the pace), and a probe thread beside the clients woke at "
        f"most {wake:.1f} ms late (p99 of a 10 ms sleep's overshoot, the worst point); "
        "each call's own client CPU time is in the JSON (`acquire_client_cpu`, "
        "`ack_client_cpu`)."
    )
    errs = sum(p["error_count"] for p in points)
    if errs:
        kinds = sorted({": ".join(e.split(": ")[:2]) for p in points for e in p["errors"]})
        where = "; ".join(
            f"{p['latency_ms']:g} ms, N = {p['consumers']}, {p['rate_target']:g} windows/s: "
            f"{p['error_count']}"
            for p in points
            if p["error_count"]
        )
        out.append(
            f"Clients that failed: {errs} ({where}); what failed: {'; '.join(kinds)} "
            "(each message in the JSON's `errors`)."
        )
    return out


WHY = (
    "How the calls use the run's single write lock (fanout.coord.postgresdb, leasing, "
    "claims, roles; issue #55): a heartbeat and a renew are one statement that takes no "
    "run lock (the row's own lock orders it against a registration or a reclaim); an "
    "acquire reads first, and while its window is not ready it writes nothing and waits, "
    "listening from before its read so that no commit is missed, and not woken by the "
    "acks of other trainers; a lease grant, an ack, a publish and an eviction's end are "
    "each one batch of statements that check their own preconditions in SQL, sent with "
    "the lock and the COMMIT as one message, so the lock is held for the server's time "
    "alone, not across round trips (a BEGIN before it, without the lock, finds a lost "
    "connection while nothing has run); a claim holds the lock for its reads (one, "
    "unless it takes the last slot) and one message. What stays serial: every grant and ack still passes through the one lock, "
    "each holding it for its statements and its commit (with fsync on, a WAL flush), so "
    "the writer's capacity is one over that time on the server, and on a loaded machine "
    "over however long the server's process waits for a core while it holds the lock. "
    "What would lift it further: locks per window row and per consumer instead of one "
    "per run for grants and acks (eviction then needs its own guard), tokens from a "
    "sequence instead of a counter row every grant updates, and a server with cores of "
    "its own. Where hundreds of connections wait for the lock, PostgreSQL's deadlock "
    "detector adds a collapse of its own: every waiter runs it once it has waited "
    "`deadlock_timeout` (1 s by default), holding the lock manager's partitions; "
    "`--pg-set deadlock_timeout=60s` (the record hosts-deadlock_timeout.json, measured "
    "before these changes) shows the writer back at its rate with fewer waiters. A "
    "server for a run this wide should raise `deadlock_timeout` (the run lock cannot "
    "deadlock: a write transaction takes no other lock first)."
)


def table(
    points: list[dict[str, Any]], a: argparse.Namespace, version: str
) -> tuple[list[Any], list[dict[str, Any]]]:
    """The record's rows and plot, from the measured points (a run, or --redo-from)."""
    from record import Row

    setting = (
        f"M = {a.replicas} replicas, heartbeat {a.heartbeat_s:g} s, K = {a.max_live_windows}, "
        f"{a.seconds:g} s ({a.warmup_s:g} s warm-up), {a.workers} client processes; "
        f"PostgreSQL {version}, fsync {a.pg_fsync}"
        + "".join(f", {x}" for x in a.pg_set)
        + "; a shared machine (load in the run line)"
    )
    rows = []
    for p in points:
        tag = f"{p['consumers']}c_{p['rate_target']:g}wps_{p['latency_ms']:g}ms"
        at = (f"N = {p['consumers']}, {p['rate_target']:g} windows/s, "
              f"{p['latency_ms']:g} ms each way")  # fmt: skip
        big = p["consumers"] == GOAL_N and p["latency_ms"] > 0
        p99 = p["acquire"]["p99_ms"]
        rows += [
            Row(stage="coordinator", name=f"hosts_acquire_p99_ms_{tag}",
                what=f"many hosts: acquire p99 (after the window is ready), {at}",
                result=p99 if p99 is not None else "no acquire done",
                unit="ms" if p99 is not None else "",
                n=max(1, p["acquire"]["n"]), n_of="acquires",
                goal=f"<= {GOAL_MS:g}" if big else None, met=not _over(p) if big else None,
                conditions=f"p50 {_fmt(p['acquire']['p50_ms'])} ms; ack p50/p99 "
                f"{_fmt(p['ack']['p50_ms'])}/{_fmt(p['ack']['p99_ms'])} ms, heartbeat "
                f"{_fmt(p['heartbeat']['p50_ms'])}/{_fmt(p['heartbeat']['p99_ms'])} ms; "
                f"{p['windows_per_s']:.2f} windows/s made; {p['error_count']} client errors; "
                f"{setting}"),
            Row(stage="coordinator", name=f"hosts_statements_per_window_{tag}",
                what=f"many hosts: SQL statements per window made (all clients), {at}",
                result=p["statements_per_window"] if p["statements_per_window"] is not None
                else "no window made", n=max(1, p["windows_measured"]), n_of="windows",
                conditions=f"{_fmt(p['statements_per_s'], 0)} statements/s, "
                f"{_fmt(p['write_tx_per_s'], 0)} write transactions/s; write lock held in "
                f"{100 * (p['write_lock_held_frac'] or 0):.0f}% of {p['lock_samples']} samples, "
                f"mean queue {_fmt(p['write_lock_queue_mean'])}, mean lock wait "
                f"{_fmt(p['write_lock_wait_ms_mean'])} ms"),
        ]  # fmt: skip
    series: dict[str, list[list[float]]] = defaultdict(list)
    for p in points:
        if p["acquire"]["p99_ms"] is not None:
            label = f"{p['rate_target']:g} windows/s, {p['latency_ms']:g} ms"
            series[label].append([p["consumers"], p["acquire"]["p99_ms"]])
    plot = {"name": "acquire-p99", "stage": "coordinator", "kind": "line",
            "title": f"acquire p99 by consumers ({a.replicas} replicas; rate, one-way latency)",
            "xlabel": "consumers", "ylabel": "acquire p99 (ms)", "series": dict(series)}  # fmt: skip
    return rows, [plot] if series else []


def outcome(points: list[dict[str, Any]], a: argparse.Namespace,
            rtts: dict[float, dict[str, float]],
            before: list[dict[str, Any]] | None = None) -> list[str]:  # fmt: skip
    """The notes: what the points say, against the baseline's when there is one, then
    why (the main sweep's, not a side run's)."""
    versus = [compare(before, points, a)] if before else []
    return [*notes(points, a, rtts), *versus, *([] if a.pg_set else [WHY])]


def compare(before: list[dict[str, Any]], after: list[dict[str, Any]],
            a: argparse.Namespace) -> str:  # fmt: skip
    """One note: each point on the baseline (--baseline-src, run just before it on the
    same server) against the current code."""

    def ms(p: dict[str, Any], call: str) -> str:
        x = p[call]["p99_ms"]
        return "none done" if x is None else f"{_fmt(x)} ms"

    parts = []
    for b, p in zip(before, after, strict=True):
        parts.append(
            f"N = {p['consumers']}, {p['rate_target']:g} windows/s, {p['latency_ms']:g} ms: "
            f"acquire p99 {ms(b, 'acquire')} → {ms(p, 'acquire')} (n {b['acquire']['n']} → "
            f"{p['acquire']['n']}), ack p99 {ms(b, 'ack')} → {ms(p, 'ack')}, heartbeat p99 "
            f"{ms(b, 'heartbeat')} → {ms(p, 'heartbeat')}, {_fmt(b['write_tx_per_s'], 0)} → "
            f"{_fmt(p['write_tx_per_s'], 0)} write transactions/s holding the lock "
            f"{_fmt(b['write_lock_hold_ms_mean'])} → {_fmt(p['write_lock_hold_ms_mean'])} ms "
            f"each, {_fmt(b['windows_per_s'], 2)} → {_fmt(p['windows_per_s'], 2)} windows/s made"
        )
    return (
        f"Before → after, each point run first on the baseline code (--baseline-src "
        f"{a.baseline_src}: the coordinator before issue #55's one-message writes) and then "
        "on this code, on the same server in the same run: " + "; ".join(parts) + "."
    )


def redo(path: Path) -> int:
    """`--redo-from JSON`: a kept record's rows, plot and notes made again from its own
    raw measurement (when this script's tables or prose change; nothing is measured
    again, no figure is typed)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        rec = json.loads(path.read_text())
        raw = rec["raw"]
        a = argparse.Namespace(**({"pg_set": []} | raw["settings"]))
        rtts = {float(k): v for k, v in raw["rtt"].items()}
        rows, plots = table(raw["points"], a, raw["postgresql"])
        rec["rows"] = [dataclasses.asdict(r) for r in rows]
        rec["plots"] = plots
        rec["notes"] = outcome(raw["points"], a, rtts, raw.get("before"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"hosts.py: --redo-from {path}: not a hosts.py record ({e})") from None
    path.write_text(json.dumps(rec, indent=2, default=str) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--consumers", default="4,16,256", help="consumer counts to sweep (N,N,...)")
    ap.add_argument("--replicas", type=int, default=16, help="producer replicas (M)")
    ap.add_argument("--rates", default="3", help="stream rates to sweep, windows/s (R,R,...)")
    ap.add_argument("--seconds", type=float, default=15.0, help="each point's length (s)")
    ap.add_argument("--warmup-s", type=float, default=5.0, help="not measured, of --seconds")
    ap.add_argument("--latency-ms", default="1",
                    help="proxy delay each way to sweep (ms, L,L,...; 0: the proxy alone)")  # fmt: skip
    ap.add_argument("--workers", type=int, default=4, help="client processes (threads in each)")
    ap.add_argument("--proxies", type=int, default=2, help="proxy processes per latency")
    ap.add_argument("--heartbeat-s", type=float, default=2.0, help="every client's heartbeat")
    ap.add_argument("--max-live-windows", type=int, default=16, help="the run's K")
    ap.add_argument("--train-fraction", type=float, default=0.8,
                    help="a consumer's time on a window, of the window period (< 1: it keeps up)")  # fmt: skip
    ap.add_argument("--start-spread-s", type=float, default=3.0,
                    help="each worker starts its clients over this long (connections)")  # fmt: skip
    ap.add_argument("--pg-fsync", choices=("on", "off"), default="on", help="the server's fsync")
    ap.add_argument("--pg-set", action="append", default=[], metavar="NAME=VALUE",
                    help="a setting of the server the benchmark starts (repeatable)")  # fmt: skip
    ap.add_argument("--dir", type=Path, default=None, help="where to work (default: temp dir)")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT", help="write results as JSON")
    ap.add_argument("--redo-from", type=Path, default=None, metavar="JSON",
                    help="only make that record's rows and notes again from its measurement")  # fmt: skip
    ap.add_argument("--baseline-src", default=None, metavar="DIR",
                    help="also run each point, just before, on the fanout package under DIR "
                    "(e.g. `git archive HEAD src | tar -x -C /tmp/base`, DIR /tmp/base/src): "
                    "before and after in one run, on one server; the notes compare them")  # fmt: skip
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--create", help=argparse.SUPPRESS)
    ap.add_argument("--proxy", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker_main(a.worker)
    if a.proxy:
        return proxy_main(a.proxy)
    if a.create:
        return create_main(a.create)
    if a.baseline_src is not None and not (Path(a.baseline_src) / "fanout").is_dir():
        raise SystemExit(f"hosts.py: --baseline-src {a.baseline_src}: no fanout package there")
    if a.redo_from:
        return redo(a.redo_from)
    consumers = _floats(a.consumers, "--consumers", int)
    rates = _floats(a.rates, "--rates")
    latencies = _floats(a.latency_ms, "--latency-ms", zero=True)
    for flag, v in (("--replicas", a.replicas), ("--workers", a.workers),
                    ("--proxies", a.proxies), ("--max-live-windows", a.max_live_windows)):  # fmt: skip
        if v < 1:
            raise SystemExit(f"hosts.py: {flag} {v}: must be at least 1")
    if a.seconds <= a.warmup_s or a.warmup_s < 0:
        raise SystemExit(f"hosts.py: --seconds {a.seconds:g} must exceed --warmup-s {a.warmup_s:g}")
    if not 0 < a.train_fraction < 1:
        raise SystemExit(f"hosts.py: --train-fraction {a.train_fraction:g}: must be in (0, 1)")
    for x in a.pg_set:
        if not re.fullmatch(r"[a-z_.]+=[\w.]+", x):
            raise SystemExit(
                f"hosts.py: --pg-set {x!r}: expected NAME=VALUE (e.g. deadlock_timeout=60s)"
            )
    if a.start_spread_s < 0:
        raise SystemExit(f"hosts.py: --start-spread-s {a.start_spread_s:g}: must be 0 or more")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        raise SystemExit("hosts.py: needs psycopg 3 (pip install 'fanout[postgres]')") from None
    sys.path.insert(0, str(REPO / "benchmarks"))
    from record import Recorder

    rec = Recorder("hosts", argv)
    uptime_start = _uptime()
    print(f"hosts.py: start {uptime_start}", flush=True)
    # each client: its own connection and its heartbeat's; the sampler's; spare
    max_conn = 2 * (max(consumers) + a.replicas) + 40
    points: list[dict[str, Any]] = []
    before: list[dict[str, Any]] = []  # --baseline-src's points
    rtts: dict[float, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="fanout-hosts-") as d:
        work = Path(d)
        base = Path(tempfile.mkdtemp(prefix="fanout-hosts-pg-"))  # the server may be another user
        server = Server(base, max_conn, a.pg_fsync == "on", a.pg_set)
        proxies: list[subprocess.Popen[bytes]] = []
        try:
            for lat in latencies:
                ports = []
                for k in range(a.proxies):
                    port, ready = _free_port(), work / f"proxy{lat:g}-{k}.ready"
                    spec = f"{port}:{server.port}:{lat / 1e3}:{ready}"
                    proxies.append(subprocess.Popen([sys.executable, __file__, "--proxy", spec]))
                    ports.append(port)
                    while not ready.exists():
                        if proxies[-1].poll() is not None:
                            raise SystemExit("hosts.py: the latency proxy did not start")
                        time.sleep(0.02)
                rtts[lat] = {
                    "direct_ms": _rtt_ms(server.url),
                    "proxied_ms": _rtt_ms(server.url.replace(f":{server.port}/", f":{ports[0]}/")),
                }
                print(f"{lat:g} ms each way: SELECT 1 round trip {rtts[lat]['proxied_ms']:.2f} ms "
                      f"(direct {rtts[lat]['direct_ms']:.2f} ms)", flush=True)  # fmt: skip
                for rate in rates:
                    for n in consumers:
                        runs = [("before", a.baseline_src)] if a.baseline_src else []
                        for label, src in [*runs, ("", None)]:
                            p = {"latency_ms": lat} | run_point(a, server, ports, work, n, rate,
                                                                src)  # fmt: skip
                            (before if label else points).append(p)
                            _say(p, label)
        finally:
            for pr in proxies:
                pr.terminate()
                pr.wait(timeout=10)
            server.stop()
            shutil.rmtree(base, ignore_errors=True)
    uptime_end = _uptime()
    print(f"hosts.py: end {uptime_end}", flush=True)
    rows, plots = table(points, a, server.version)
    raw = {
        "uptime_start": uptime_start,
        "uptime_end": uptime_end,
        "machine_shared": "other jobs ran on this 2-core machine meanwhile: see load, uptime",
        "postgresql": server.version,
        "rtt": {f"{k:g}": v for k, v in rtts.items()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                     if k not in ("worker", "proxy")},
        "points": points,
        "before": before,
    }  # fmt: skip
    rec.write(a.json, rows, raw=raw, plots=plots, notes=outcome(points, a, rtts, before))
    return 0


if __name__ == "__main__":
    sys.exit(main())
