"""Roles on several hosts, the run dir on a network filesystem (issue 55).

    .venv/bin/pytest tests/test_hosts.py -x -q -p no:randomly    # root; skips otherwise

Hosts are namespaces on this machine (tests/netns_hosts.py): own network (a veth to a
bridge, a private test subnet), hostname, pid 1 and mounts. The run dir lives on one
host and is mounted over sshfs by the others, with sshfs's caches on; PostgreSQL runs
on a host of its own with password auth (SQLite is not for several hosts). Every wait
is on a state (a file, a row, a process's exit) under a generous deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fanout.bench.assets import generate_corpus
from netns_hosts import Hosts
from tiny_run import build_tiny_assets, config_flags, tiny_producer_config, wait_for

REPO = Path(__file__).resolve().parents[1]
PY = [sys.executable, "-m", "fanout.cli"]


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


# ---- the scenario: two producer hosts, two trainer hosts, one file server, PostgreSQL ----


def _trainer(assets: Path, run: Path, name: str, saves: Path) -> list[str]:
    """A tiny DFlash trainer that finds the database through the run dir's pointer (no
    --db-path: the run is not made yet when it starts)."""
    return [
        *PY, "train", "--run-dir", str(run), "--consumer-id", name,
        "--verifier-name-or-path", str(assets / "verifier"), "--num-layers", "1",
        "--block-size", "4", "--max-anchors", "8", "--save-path", str(saves / name),
        "--heartbeat-s", "0.5", "--checkpoint-every", "1000000000",
        "--acquire-timeout-s", "300",
    ]  # fmt: skip


def _q(pg: Any, schema: str, sql: str) -> list[tuple[Any, ...]]:
    from fanout.coord.coordinator import Coordinator
    from fanout.errors import FanoutError

    os.environ["PGPASSWORD"] = pg.password
    try:
        with Coordinator.open(Path("/nonexistent"), db_path=pg.url(schema)) as co:
            return [tuple(r) for r in co.conn.execute(sql).fetchall()]
    except FanoutError:
        return []


def test_two_producer_hosts_and_two_trainer_hosts_share_a_run_dir_over_sshfs(
    tmp_path: Path,
) -> None:
    """The run issue 55 could not start: producer replicas on two hosts, trainers on two
    others started at the same moment (before the run exists), the run dir (with the
    data cache in it) on sshfs, PostgreSQL on its own host. Every window is made once,
    both trainers ack every window in order (cursor = the stream's length) and every
    process exits 0."""
    pytest.importorskip("psycopg")
    assets = tmp_path / "assets"
    assets.mkdir()
    build_tiny_assets(assets, generate_corpus(24, seed=3))
    run, saves, logs = tmp_path / "run", tmp_path / "saves", tmp_path / "logs"
    for d in (run, saves, logs):
        d.mkdir()
    os.chmod(tmp_path, 0o755)
    with Hosts(6) as hs:
        files, db, p0, p1, t0, t1 = hs
        hs.share([run, saves], exporter=files)
        pg = hs.postgres(db)
        schema = "hosts_run"
        env = pg.env({**os.environ, "OMP_NUM_THREADS": "1"})
        cfg = tiny_producer_config(
            assets, run, db_path=pg.url(schema), replicas=2, max_live_windows=3,
            expected_consumers=2, epochs=1, heartbeat_s=0.5,
        )  # fmt: skip
        procs = {}
        for name, host, argv in (
            ("t0", t0, _trainer(assets, run, "t0", saves)),
            ("t1", t1, _trainer(assets, run, "t1", saves)),
            ("p0", p0, [*PY, "produce", *config_flags(cfg), "--replica-rank", "0"]),
            ("p1", p1, [*PY, "produce", *config_flags(cfg), "--replica-rank", "1"]),
        ):
            with (logs / f"{name}.log").open("w") as log:
                procs[name] = host.popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 170
        for name, p in procs.items():
            code = p.wait(max(1.0, deadline - time.monotonic()))
            text = (logs / f"{name}.log").read_text(errors="replace")
            assert code == 0, f"{name} exited {code}:\n{text[-3000:]}"
            assert "Traceback" not in text, f"{name}:\n{text[-3000:]}"
        total = _q(pg, schema, "SELECT COUNT(*) FROM windows")[0][0]
        assert total >= 4
        made = _q(pg, schema, "SELECT rank, made FROM producers ORDER BY rank")
        assert sum(m for _, m in made) == total, made  # each window made once
        assert _q(pg, schema, "SELECT MAX(captures) FROM windows") == [(1,)]
        cursors = _q(pg, schema, "SELECT id, cursor, state FROM consumers ORDER BY id")
        assert [(c, s) for _, c, s in cursors] == [(total, "finished")] * 2, cursors
        assert not list((run / "cache").rglob("*.tmp@*"))  # no temp left behind
