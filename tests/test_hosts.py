"""Roles on several hosts, the run dir on a network filesystem (issue 55).

    .venv/bin/pytest tests/test_hosts.py -x -q -p no:randomly    # root; skips otherwise
    .venv/bin/pytest tests/test_hosts.py -m slow -q               # the >= 15 min soak

Hosts are namespaces on this machine (tests/netns_hosts.py): own network (a veth to a
bridge, a private test subnet), hostname, pid 1 and mounts. The run dir lives on one
host and is mounted over sshfs by the others, with sshfs's caches on; PostgreSQL runs
on a host of its own with password auth (SQLite is not for several hosts). The
scenario starts every role through scripts/launch.sh, as docs/deploy.md's Slurm and
Kubernetes recipes do: producer replicas, a trainer, a data-parallel trainer across two
hosts (torchrun, c10d, gloo), `fanout status --serve` scraped from another host, and a
follow-mode producer. Every wait is on a state (a file, a row, a process's exit) under
a generous deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fanout.bench.assets import generate_corpus
from fanout.train.trainlog import read_train_log
from netns_hosts import Host, Hosts, Postgres, _children
from tiny_run import build_tiny_assets, tiny_producer_config, wait_for

REPO = Path(__file__).resolve().parents[1]


def _tcp(host: Any, addr: str, port: int, timeout: float) -> str:
    """Connect from `host` to addr:port; what happened, in one word."""
    code = (
        "import socket,sys\n"
        f"s=socket.socket(); s.settimeout({timeout})\n"
        f"try: s.connect(('{addr}', {port})); print('connected')\n"
        "except socket.timeout: print('timeout')\n"
        "except OSError as e: print(type(e).__name__)\n"
    )
    return str(host.run([sys.executable, "-c", code]).stdout.strip())


def test_hosts_are_hosts_and_a_cut_link_is_silent(tmp_path: Path) -> None:
    """Each host its own hostname and pid 1; they reach each other over the test
    network; a cut link drops packets without a reset (a connect times out), and heals."""
    with Hosts(2) as hs:
        a, b = hs
        assert a.run(["hostname"]).stdout.strip() == "h0"
        assert b.run(["hostname"]).stdout.strip() == "h1"
        assert b.run(["sh", "-c", "echo $$"]).stdout.strip() != str(os.getpid())
        assert b.run(["cat", "/proc/1/comm"]).stdout.strip() == "sleep"
        server = b.popen(
            [sys.executable, "-c",
             "import socket,time\ns=socket.socket(); s.bind(('0.0.0.0', 7000)); s.listen()\n"
             "while True: c,_=s.accept(); c.close()"],
        )  # fmt: skip
        wait_for(lambda: _tcp(a, b.addr, 7000, 5) == "connected", 60, "the server on h1")
        b.cut()
        assert _tcp(a, b.addr, 7000, 1.5) == "timeout"  # no RST: packets just vanish
        b.heal()
        wait_for(lambda: _tcp(a, b.addr, 7000, 5) == "connected", 60, "the healed link")
        server.kill()


def test_a_run_dir_over_sshfs_is_one_directory_on_every_host(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    with Hosts(2) as hs:
        hs.share(run, exporter=hs[0])
        hs[1].run(["sh", "-c", f"echo from-h1 > {run}/x"])
        assert (run / "x").read_text() == "from-h1\n"  # written through sshfs, on h0's disk
        mounts = hs[1].run(["cat", "/proc/self/mountinfo"]).stdout
        assert f" {run} " in mounts and "fuse.sshfs" in mounts


# ---- a run half-made, as another host sees it --------------------------------------------


def test_a_pointer_written_while_a_monitor_opens_the_run_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scenario's `status --serve` looked for the run's database pointer just before
    the producer on another host wrote it, then found the pointer there and refused the
    default SQLite path on sshfs (exit 1) instead of waiting: the run is being created,
    and open() says so (NoCoordinator, which every wait for a run retries)."""
    from fanout.coord.coordinator import Coordinator
    from fanout.errors import NoCoordinator
    from fanout.store.rundir import RunDir

    run = tmp_path / "run"
    run.mkdir()
    real = Coordinator.resolve_db_path

    def looked_just_before(root: Path, db_path: Any) -> Any:
        where = real(root, db_path)  # no pointer yet: the default SQLite file
        RunDir(root).db_pointer.write_text("postgresql://fanout@db:5432/fanout?schema=r\n")
        return where

    monkeypatch.setattr(Coordinator, "resolve_db_path", staticmethod(looked_just_before))
    sshfs = (
        "27 1 254:0 / / rw - ext4 /dev/vda rw\n"
        f"40 27 0:50 / {tmp_path} rw - fuse.sshfs files:/x rw\n"
    )
    with pytest.raises(NoCoordinator, match="no producer has created this run"):
        Coordinator.open(run, mountinfo=sshfs)


def test_a_follow_start_slower_than_its_idle_end_is_a_short_stream(tmp_path: Path) -> None:
    """The scenario's follow producer, loaded, prepared its first chunk for longer than
    --follow-idle-s; the idle end then flushed the carried records into rows, and the
    producer refused the run as having no usable record (exit 1). Here the idle end
    comes at the second look: the stream ends with those rows."""
    from fanout.produce.follow import FollowStream
    from fanout.store.rundir import RunDir

    assets, src, run = tmp_path / "assets", tmp_path / "gateway", tmp_path / "run"
    for d in (assets, src):
        d.mkdir()
    build_tiny_assets(assets, generate_corpus(24, seed=3))
    chats = generate_corpus(4, seed=5)  # a few short chats: rows too short to keep at once
    (src / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    cfg = tiny_producer_config(
        assets, run, data=[], follow=str(src), follow_idle_s=0.01, follow_flush_s=600,
        follow_chunk_records=4, window_rows=2,
    )  # fmt: skip
    cache = str(run / "cache")
    stream = FollowStream.open(
        lambda chunk: cfg.prepare_config(cache, data=[chunk]), cfg, RunDir(run)
    )
    assert stream.ended and stream.rows.num_rows > 0
    assert stream.counts["records"] == len(chats)


# ---- replicas on two hosts starting in one run dir over sshfs ------------------------------

_TWO_STARTS = """
import json, sys, time
from pathlib import Path
from fanout.coord.pathlock import PathLock
from fanout.errors import ConfigError, RoleHeld
from fanout.produce.run_start import CreatedPaths
from fanout.store.rundir import RunDir

root, go, rounds, rank = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
out = []
for i in range(rounds):  # released together on even rounds, staggered by 0-45 ms on odd
    at = go + i * 0.5 + (rank * 0.015 * (i % 4) if i % 2 else 0.0)
    time.sleep(max(0.0, at - time.time()))
    run = root / f"round{i}"
    lock = PathLock(RunDir(run).join_lock, f"round {i}")
    try:
        lock.acquire()
    except RoleHeld:
        out.append("held")
        continue
    except ConfigError as e:
        out.append(f"error: {e}")
        continue
    # a start that then failed before creating the run: it noted what was missing,
    # made the folders, and cleans up, while the other host's replica uses them
    created = CreatedPaths.note(run, None, lock, rank, 2)
    RunDir(run).create()
    lock.release()
    time.sleep(0.05)
    created.discard_if_unused(None, False, f"h{rank}:1")
    out.append("ok" if RunDir(run).tmp.is_dir() else "removed tmp/")
print(json.dumps(out))
"""


def test_replicas_on_two_hosts_start_together_in_one_sshfs_run_dir(tmp_path: Path) -> None:
    """CI: replica 1 of the scenario lost the exclusive create of producer.join.lock to
    replica 0 on another host, and sshfs said EPERM (SFTP's generic failure), not EEXIST:
    its start failed ("cannot create the lock file"), and its cleanup removed the tmp/
    it had found missing, which replica 0 had made and was publishing into: window 0
    failed three captures. Here two hosts race to take one lock file and make one run's
    folders, 12 rounds, together and staggered: a lost create is a lost race, and a
    failed start on a network filesystem removes nothing of the run dir."""
    root = tmp_path / "shared"
    root.mkdir()
    rounds = 12
    with Hosts(3) as hs:
        files, a, b = hs
        hs.share(root, exporter=files)
        go = time.time() + 5.0  # the hosts share this machine's clock
        argv = [sys.executable, "-c", _TWO_STARTS, str(root), str(go), str(rounds)]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        procs = [h.popen([*argv, str(r)], **pipes) for r, h in enumerate((a, b))]
        outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
        got = json.loads(out)
        assert len(got) == rounds, got
        assert [g for g in got if g not in ("ok", "held")] == [], got
    for i in range(rounds):
        assert (root / f"round{i}" / "tmp").is_dir(), i


# ---- the scenario: every role on a host of its own, each started by scripts/launch.sh ----

LAUNCH = REPO / "scripts" / "launch.sh"
K = 3  # --max-live-windows of both runs
# what the launcher reads: the test's own environment must not leak into a role's
LAUNCH_VARS = ("FANOUT_", "SLURM_", "JOB_COMPLETION_INDEX")


@dataclass(frozen=True)
class Size:
    chats: int  # conversations in the main run's data
    epochs: int  # the main run's passes over them
    follow: int  # records the gateway writes to the followed log (half before the start)
    gateway_s: float  # over how long it appends the second half, one record at a time
    deadline_s: float  # a bound on a hang, not a timing: every role ends well before


SCENARIO = Size(chats=24, epochs=1, follow=16, gateway_s=0, deadline_s=900)
# >= 15 min: the followed log grows for that long, one record every ~4 s, while the main
# run's producers make some hundreds of windows
SOAK = Size(chats=48, epochs=40, follow=480, gateway_s=900, deadline_s=3600)


def launch_role(host: Host, role: str, env: dict[str, str], log: Path, *flags: str) -> Any:
    """`scripts/launch.sh ROLE FLAGS` on `host` with `env` (its settings, as the recipes
    give them), stdout and stderr to `log`: the one way these tests start a role."""
    with log.open("w") as out:
        return host.popen(
            ["bash", str(LAUNCH), role, *flags], env=env, stdout=out, stderr=subprocess.STDOUT
        )


def _q(pg: Postgres, schema: str, sql: str) -> list[tuple[Any, ...]]:
    """Rows of `sql` in the run of `schema`; [] while that run is not made yet."""
    from fanout.coord.coordinator import Coordinator
    from fanout.errors import FanoutError

    os.environ["PGPASSWORD"] = pg.password
    try:
        with Coordinator.open(Path("/nonexistent"), db_path=pg.url(schema)) as co:
            return [tuple(r) for r in co.conn.execute(sql).fetchall()]
    except FanoutError:
        return []


def _append(log: Path, records: list[dict[str, Any]], over_s: float) -> None:
    """The gateway: append `records` to `log`, one at a time over `over_s` (0: at once)."""
    step = 1 if over_s else len(records)
    for i in range(0, len(records), step):
        with log.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records[i : i + step]))
        time.sleep(over_s / len(records))


def _get(host: Host, url: str) -> str | None:
    """HTTP GET of `url` from `host` (its network namespace): the body, or None."""
    code = (
        "import sys, urllib.request\n"
        "try: sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())\n"
        "except OSError: sys.exit(3)\n"
    )
    r = host.run([sys.executable, "-c", code, url], check=False)
    return r.stdout if r.returncode == 0 else None


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.split(" ")[0].split("{")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return None


def _acked(save_path: Path, rank: int = 0) -> list[int]:
    """The windows a trainer rank acked, in the order it acked them (its train log)."""
    return [w for rec in read_train_log(save_path, rank) for w in rec.get("acked", [])]


def _config(path: Path, values: dict[str, Any]) -> Path:
    path.write_text(json.dumps(values, indent=1))
    return path


class LiveWindows:
    """The most window files each run dir held at once, sampled on the exporter's disk
    (the files themselves, not a cached view of them) until `stop()`."""

    def __init__(self, runs: list[Path]) -> None:
        self.runs, self.most = runs, dict.fromkeys(runs, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            for run in self.runs:
                with contextlib.suppress(OSError):  # not made yet; a file evicted meanwhile
                    n = sum(p.suffix == ".safetensors" for p in (run / "windows").iterdir())
                    self.most[run] = max(self.most[run], n)
            time.sleep(0.02)

    def stop(self) -> dict[Path, int]:
        self._stop.set()
        self._thread.join()
        return self.most


def _scenario(tmp_path: Path, size: Size) -> None:
    """PostgreSQL on its own host; a file server exporting the shared dir over sshfs;
    producer replicas on 2 hosts; a trainer on a third; a data-parallel trainer of 2 gloo
    ranks on 2 more (`torchrun --nnodes 2`, c10d rendezvous over the test network); a
    `fanout status --serve` on another host, scraped from a trainer host; a follow-mode
    producer of a second run on its own host, fed by a gateway's growing log, with its
    trainer on the trainer host. Every role is started by scripts/launch.sh with its
    settings in the environment, as the Slurm and Kubernetes recipes of docs/deploy.md
    start them, before any run exists. Checked: every exit 0 without a traceback, every
    window made once, every consumer acked every window once in order, at most K window
    files at any time, every followed record read once, and the status server's
    /metrics and /status.json, read from another host, agree with the database."""
    pytest.importorskip("psycopg")
    assets = tmp_path / "assets"
    assets.mkdir()
    build_tiny_assets(assets, generate_corpus(size.chats, seed=3))
    shared = tmp_path / "shared"  # the site's shared filesystem
    run, frun = shared / "run", shared / "follow-run"  # made by their producers
    drafts, gateway, cfgs = shared / "drafts", shared / "gateway", shared / "cfg"
    logs = tmp_path / "logs"
    for d in (shared, drafts, gateway, cfgs, logs):
        d.mkdir()
    os.chmod(tmp_path, 0o755)
    records = generate_corpus(size.follow, seed=5)
    half = size.follow // 2
    log_file = gateway / "requests.jsonl"
    log_file.write_text("".join(json.dumps(r) + "\n" for r in records[:half]))

    producer = tiny_producer_config(
        assets, run, replicas=2, max_live_windows=K, expected_consumers=3,
        epochs=size.epochs, heartbeat_s=0.5,
    ).model_dump(mode="json", exclude_unset=True)  # fmt: skip
    follow = tiny_producer_config(
        assets, frun, data=[], follow=str(gateway), follow_idle_s=30.0, follow_flush_s=0.5,
        follow_chunk_records=4, window_rows=2, max_live_windows=K, expected_consumers=1,
        heartbeat_s=0.5,
    ).model_dump(mode="json", exclude_unset=True)  # fmt: skip
    trainer = {
        "verifier_name_or_path": str(assets / "verifier"), "num_layers": 1, "block_size": 4,
        "max_anchors": 8, "heartbeat_s": 0.5, "checkpoint_every": 1_000_000_000,
        "acquire_timeout_s": 900,
    }  # fmt: skip
    for cfg in (producer, follow):
        del cfg["run_dir"]  # FANOUT_RUN_DIR gives it
    del follow["follow"]  # and FANOUT_FOLLOW this
    pcfg = _config(cfgs / "producer.json", producer)
    fcfg = _config(cfgs / "follow.json", follow)
    tcfg = _config(cfgs / "trainer.json", trainer)

    with Hosts(9) as hs:
        files, db, p0, p1, t0, d0, d1, st, fo = hs
        hs.share(shared, exporter=files)
        pg = hs.postgres(db)
        base = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARS)}
        base |= {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PGPASSWORD": pg.password,
                 "FANOUT_PYTHON": sys.executable}  # fmt: skip
        procs: dict[str, subprocess.Popen[Any]] = {}
        started: dict[str, tuple[str, Host]] = {}

        def launch(name: str, host: Host, role: str, env: dict[str, Any], *flags: str) -> None:
            procs[name] = launch_role(host, role, base | env, logs / f"{name}.log", *flags)
            started[name] = (role, host)

        main_db, follow_db = pg.url("hosts_run"), pg.url("hosts_follow")
        mine = {"FANOUT_RUN_DIR": str(run)}
        theirs = {"FANOUT_RUN_DIR": str(frun)}
        # every role at once, before either run exists: each waits for what it needs
        launch("status", st, "status", mine | {"FANOUT_STATUS_PORT": "9464"},
               "--interval-s", "0.5")  # fmt: skip
        launch("t0", t0, "trainer", mine | {"FANOUT_CONFIG": str(tcfg), "FANOUT_CONSUMER_ID": "t0",
               "FANOUT_SAVE_PATH": str(drafts / "t0")})  # fmt: skip
        for h in (d0, d1):  # one torchrun per node; d0 hosts the rendezvous
            launch(f"dp-{h.name}", h, "dp-trainer", mine | {
                "FANOUT_CONFIG": str(tcfg), "FANOUT_CONSUMER_ID": "dp",
                "FANOUT_SAVE_PATH": str(drafts / "dp"), "FANOUT_NNODES": "2",
                "FANOUT_NPROC_PER_NODE": "1", "FANOUT_RDZV_ENDPOINT": f"{d0.name}:29400",
                "FANOUT_RDZV_ID": "dp-hosts"}, "--rows-per-step", "1")  # fmt: skip
        launch("ft", t0, "trainer", theirs | {"FANOUT_CONFIG": str(tcfg),
               "FANOUT_CONSUMER_ID": "ft", "FANOUT_SAVE_PATH": str(drafts / "ft")})  # fmt: skip
        # the replica ranks as the recipes give them: an Indexed Job's index, srun's task id
        launch("p0", p0, "producer", mine | {"FANOUT_DB_URL": main_db,
               "FANOUT_CONFIG": str(pcfg), "JOB_COMPLETION_INDEX": "0"})  # fmt: skip
        launch("p1", p1, "producer", mine | {"FANOUT_DB_URL": main_db,
               "FANOUT_CONFIG": str(pcfg), "SLURM_PROCID": "1"})  # fmt: skip
        launch("follow", fo, "follow-producer", theirs | {"FANOUT_DB_URL": follow_db,
               "FANOUT_CONFIG": str(fcfg), "FANOUT_FOLLOW": str(gateway)})  # fmt: skip
        live = LiveWindows([run, frun])
        deadline = time.monotonic() + size.deadline_s

        def left() -> float:
            return max(1.0, deadline - time.monotonic())

        def running(*names: str) -> bool:
            gone = {n: procs[n].poll() for n in names if procs[n].poll() is not None}
            assert not gone, f"exited early: {gone}: " + "".join(
                (logs / f"{n}.log").read_text(errors="replace")[-2000:] for n in gone
            )
            return True

        # the gateway's second half, once the follow producer cut a chunk of the first (its
        # file is written before it is prepared; the producer reads on after that)
        wait_for(lambda: running("follow") and list((frun / "follow").glob("chunk-*")),
                 left(), "a chunk of the followed log", 0.2)  # fmt: skip
        gateway_thread = threading.Thread(
            target=_append, args=(log_file, records[half:], size.gateway_s), daemon=True
        )
        gateway_thread.start()
        # the dashboard, scraped over the network from a trainer host while the run goes
        url = f"http://{st.addr}:9464"
        metrics = wait_for(lambda: running("status") and _get(t0, f"{url}/metrics"), left(),
                           "/metrics of the status server", 0.2)  # fmt: skip
        assert _metric(metrics, "fanout_max_live_windows") == K, metrics[:2000]

        gateway_thread.join(left())
        for name, p in procs.items():
            if name == "status":
                continue
            code = p.wait(left())
            text = (logs / f"{name}.log").read_text(errors="replace")
            assert code == 0, f"{name} exited {code}:\n{text[-3000:]}"
            assert "Traceback" not in text, f"{name}:\n{text[-3000:]}"
        most = live.stop()

        for name, (role, host) in started.items():  # each started by the launcher, there
            first = (logs / f"{name}.log").read_text().splitlines()[0]
            assert first.startswith(f"launch.sh: {role} on {host.name}: "), (name, first)
        totals: dict[str, int] = {}
        for schema, r, want in (("hosts_run", run, ["dp:dp0", "dp:dp1", "t0:dp0"]),
                                ("hosts_follow", frun, ["ft:dp0"])):  # fmt: skip
            # the windows numbered (rows of evicted ones are compacted away on a long run)
            counters = dict(_q(pg, schema, "SELECT key, value FROM counters"))
            total = counters["next_window"]
            assert total >= 4, (schema, total)
            made = _q(pg, schema, "SELECT rank, made FROM producers ORDER BY rank")
            assert sum(m for _, m in made) == total, made  # each window made once
            assert counters["recaptures"] == 0, counters
            assert _q(pg, schema, "SELECT MAX(captures) FROM windows") in ([(1,)], [(None,)])
            cursors = _q(pg, schema, "SELECT id, cursor, state FROM consumers ORDER BY id")
            assert cursors == [(c, total, "finished") for c in want], cursors
            assert most[r] <= K, (schema, most[r])
            assert not list((r / "cache").rglob("*.tmp@*"))  # no temp left behind
            totals[schema] = total
        main_total = totals["hosts_run"]
        # every consumer acked every window once, in order (its train log says which)
        for save, rank, n in ((drafts / "t0", 0, main_total), (drafts / "dp", 0, main_total),
                              (drafts / "dp", 1, main_total),
                              (drafts / "ft", 0, totals["hosts_follow"])):  # fmt: skip
            assert _acked(save, rank) == list(range(n)), (save, rank)
        # every record the gateway wrote was read once, none held out or skipped (the last
        # commit's counts; a chunk's own `records` also counts those carried into it)
        last = "SELECT counts FROM follow_chunks ORDER BY chunk DESC LIMIT 1"
        ((counts,),) = _q(pg, "hosts_follow", last)
        assert json.loads(counts) == {**json.loads(counts), "records": size.follow,
                                      "heldout": 0, "skipped": 0}, counts  # fmt: skip

        # what the dashboard says, read from another host, is what the database says
        def done() -> dict[str, Any] | None:
            body = _get(t0, f"{url}/status.json")
            snap = json.loads(body) if body else None
            states = [(c["id"], c["state"]) for c in snap["consumers"]] if snap else []
            return snap if sorted(states) == [(c, "finished") for c in want_main] else None

        want_main = ["dp:dp0", "dp:dp1", "t0:dp0"]
        snap = wait_for(done, left(), "the status server showing the run finished", 0.2)
        assert snap["totals"]["windows_made"] == main_total, snap["totals"]
        metrics = _get(t0, f"{url}/metrics") or ""
        assert _metric(metrics, "fanout_windows_made_total") == main_total, metrics[:2000]
        server = procs["status"]
        assert running("status")
        (pid,) = _children(server.pid)  # nsenter's child: the launcher exec'd fanout there
        os.kill(pid, signal.SIGINT)  # Ctrl-C: the way to stop a dashboard, exit 0
        assert server.wait(left()) == 0, (logs / "status.log").read_text()[-3000:]


def test_every_role_on_its_own_host_started_by_the_launcher(tmp_path: Path) -> None:
    """The scenario of issue 55 in the default suite (a couple of minutes idle)."""
    _scenario(tmp_path, SCENARIO)


@pytest.mark.slow
def test_every_role_on_its_own_host_for_a_quarter_of_an_hour(tmp_path: Path) -> None:
    """The same roles and checks for >= 15 min: a main run of some hundreds of windows,
    a followed log growing one record every few seconds the whole time."""
    _scenario(tmp_path, SOAK)
