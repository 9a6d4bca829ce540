"""One data-parallel rank's host lost mid-run, then the DP trainer resumed on two hosts (#55).

    .venv/bin/pytest tests/test_host_faults_dp.py -x -q -p no:randomly   # root; skips otherwise

The hosts are tests/test_hosts.py's (tests/netns_hosts.py): PostgreSQL on a host of its
own, the run dir exported by a file server and mounted over sshfs everywhere else, a
producer, a one-process trainer, and a data-parallel trainer of 2 gloo ranks on 2 more
hosts (`torchrun --nnodes 2`, c10d), every role started by scripts/launch.sh as
docs/deploy.md's recipes start them. A gate consumer this test plays itself
(tests/test_host_faults.py's `Gate`) holds the producer K windows ahead of it, so the
fault lands on a run in progress however fast the machine runs the roles.

Once the DP trainer has acked a window, rank 1's host dies (every process SIGKILLed at
once: `Host.lose`). What docs/operations.md ("Faults on a cluster") promises, checked
here: rank 0's next collective fails (the peer's sockets are gone) and the DP trainer
ends with one line naming the lost rank and the checkpoint it saved, exit non-zero,
no traceback (torchrun's agent runs as fanout.train.dplaunch, which reports the failed
rank in one line of its own, carrying that rank's line, not torch's ChildFailedError);
rank 0 recorded `stopped`, rank 1 is declared `lost` after ttl; at most K windows
live; the producer and the other trainer go on. Restarted with --resume on the
surviving host and a new one, the DP trainer continues from that checkpoint and
finishes: every window acked once, in order, by each rank. The slow variant loses
rank 0's host instead, which also held the c10d rendezvous store.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fanout.bench.assets import generate_corpus
from fanout.train.trainlog import read_train_log
from netns_hosts import Host, Hosts
from test_host_faults import Gate
from test_hosts import LAUNCH_VARS, _acked, _config, _q, launch_role
from tiny_run import build_tiny_assets, tiny_producer_config, wait_for

K = 3
TTL_S = 8.0
SCHEMA = "dp_lost"
DEADLINE_S = 600  # a bound on a hang, not a timing: the test ends well before
# a rank's line (the launcher's own line, `fanout dp-launch: error: ...`, carries it too)
ERROR_LINE = re.compile(r"^(?!fanout dp-launch:).*fanout train: error: .+$", re.M)
LAUNCHER_LINE = re.compile(r"^fanout dp-launch: .+$", re.M)
# a traceback through fanout's own code
FANOUT_FRAME = re.compile(r'File ".*/fanout/[^"]+\.py"')


@pytest.mark.parametrize(
    "lost", [1, pytest.param(0, marks=pytest.mark.slow)], ids=["rank1", "rank0-rendezvous"]
)
def test_a_dp_rank_host_lost_ends_the_dp_trainer_in_one_line_and_it_resumes_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lost: int
) -> None:
    """`lost`: the rank whose host dies. Rank 1's: rank 0 lives on and saves a checkpoint
    at its last step, so the resumed trainer starts where it stopped (no window captured
    again). Rank 0's (slow): that host also held the c10d rendezvous and did the saving,
    so the resumed trainer starts from the last periodic checkpoint (--checkpoint-every 1
    here) and may want a window again that was evicted meanwhile (captured again)."""
    pytest.importorskip("psycopg")
    assets = tmp_path / "assets"
    assets.mkdir()
    build_tiny_assets(assets, generate_corpus(24, seed=3))
    shared = tmp_path / "shared"  # the site's shared filesystem
    run, drafts, cfgs, logs = shared / "run", shared / "drafts", shared / "cfg", tmp_path / "logs"
    for d in (shared, drafts, cfgs, logs):
        d.mkdir()
    os.chmod(tmp_path, 0o755)
    producer = tiny_producer_config(
        assets, run, max_live_windows=K, expected_consumers=4, heartbeat_s=0.5, ttl_s=TTL_S,
        window_rows=2,
    ).model_dump(mode="json", exclude_unset=True)  # fmt: skip
    del producer["run_dir"]  # FANOUT_RUN_DIR gives it
    trainer = {
        "verifier_name_or_path": str(assets / "verifier"), "num_layers": 1, "block_size": 4,
        "max_anchors": 8, "heartbeat_s": 0.5, "acquire_timeout_s": 400,
        # rank 1 lost: the only checkpoint is the one rank 0 saves as it stops
        "checkpoint_every": 1_000_000_000 if lost else 1,
    }  # fmt: skip
    pcfg = _config(cfgs / "producer.json", producer)
    tcfg = _config(cfgs / "trainer.json", trainer)
    alive = 1 - lost

    with Hosts(7) as hs:
        files, db, p0, t0, d0, d1, spare = hs
        down, up = (d1, d0) if lost else (d0, d1)
        hs.share(shared, exporter=files)
        pg = hs.postgres(db)
        monkeypatch.setenv("PGPASSWORD", pg.password)  # the gate's and _q's connections
        base = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARS)}
        base |= {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PGPASSWORD": pg.password,
                 "FANOUT_PYTHON": sys.executable, "FANOUT_RUN_DIR": str(run)}  # fmt: skip
        procs: dict[str, subprocess.Popen[Any]] = {}

        def launch(name: str, host: Host, role: str, env: dict[str, str], *flags: str) -> None:
            procs[name] = launch_role(host, role, base | env, logs / f"{name}.log", *flags)

        def text(name: str) -> str:
            return (logs / f"{name}.log").read_text(errors="replace")

        def dp(name: str, host: Host, rdzv: Host, rdzv_id: str, *flags: str) -> None:
            launch(name, host, "dp-trainer", {
                "FANOUT_CONFIG": str(tcfg), "FANOUT_CONSUMER_ID": "dp",
                "FANOUT_SAVE_PATH": str(drafts / "dp"), "FANOUT_NNODES": "2",
                "FANOUT_NPROC_PER_NODE": "1", "FANOUT_RDZV_ENDPOINT": f"{rdzv.name}:29400",
                "FANOUT_RDZV_ID": rdzv_id}, "--rows-per-step", "1", *flags)  # fmt: skip

        def states() -> dict[str, tuple[int, str]]:
            rows = _q(pg, SCHEMA, "SELECT id, cursor, state FROM consumers")
            return {c: (int(cur), s) for c, cur, s in rows}

        def ended(name: str) -> int:
            try:
                return procs[name].wait(left())
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} still running:\n{text(name)[-3000:]}") from None

        deadline = time.monotonic() + DEADLINE_S

        def left() -> float:
            return max(1.0, deadline - time.monotonic())

        launch("p0", p0, "producer", {"FANOUT_DB_URL": pg.url(SCHEMA), "FANOUT_CONFIG": str(pcfg)})
        launch("t0", t0, "trainer", {"FANOUT_CONFIG": str(tcfg), "FANOUT_CONSUMER_ID": "t0",
               "FANOUT_SAVE_PATH": str(drafts / "t0")})  # fmt: skip
        # one torchrun per node, d0 hosting the rendezvous; c10d numbers the nodes in the
        # order of their names, so d0 (h4) runs rank 0 and d1 (h5) rank 1
        for h in (d0, d1):
            dp(f"dp-{h.name}", h, d0, "dp-1")
        gate = Gate(run, 0.5, timeout_s=left())
        try:
            wait_for(
                lambda: min(states().get(f"dp:dp{r}", (0, ""))[0] for r in (0, 1)) >= 1
                and (lost or list((drafts / "dp").glob("checkpoint-*"))),
                left(), "the DP trainer to ack a window", poll_s=0.5,
            )  # fmt: skip
            down.lose()  # its torchrun agent and worker, its sshfs, at once
            gate.drain()  # windows flow again: the rank left meets its lost peer
            survivor = f"dp-{up.name}"
            code = ended(survivor)
            out = text(survivor)
            assert code != 0, out[-3000:]
            errors = ERROR_LINE.findall(out)
            assert not FANOUT_FRAME.search(out), out[-3000:]  # no traceback through fanout
            launcher = LAUNCHER_LINE.findall(out)
            assert len(launcher) == 1 and "ChildFailedError" not in out, out[-3000:]
            if lost:
                # the rank left stops in one line; the launcher's names it, its host, its
                # exit and carries its line; no traceback at all (torch's or fanout's)
                assert len(errors) == 1, out[-3000:]
                assert "data-parallel rank 0 of 2: a collective failed" in errors[0], errors
                assert "Traceback" not in out, out[-3000:]
                assert launcher[0] == (
                    f"fanout dp-launch: error: rank 0 (local 0) on {up.name} exited with "
                    f"code 1: {errors[0]}"
                ), launcher
            else:
                # the lost host held the c10d store: the agent left fails on its own
                # (RendezvousConnectionError: the launcher's one line) and SIGTERMs its
                # worker, which stops either way: this line (RankLost) or a signal's
                # `stopped`
                assert len(errors) <= 1, out[-3000:]
                assert all("data-parallel rank 1 of 2: a collective" in e for e in errors), errors
                assert launcher[0].startswith("fanout dp-launch: error: "), launcher
                assert f" on {up.name} " in launcher[0], launcher
            # the rank left said how it ended; the lost one could not: lost by ttl
            wait_for(lambda: states().get(f"dp:dp{lost}", (0, ""))[1] == "lost", left(),
                     f"rank {lost} to be declared lost", poll_s=0.5)  # fmt: skip
            assert states()[f"dp:dp{alive}"][1] == "stopped", states()
            assert procs["p0"].poll() is None and procs["t0"].poll() is None
            assert states()["t0:dp0"][1] == "active", states()
            first = _acked(drafts / "dp", 0)  # what rank 0 trained on before the loss
            assert first == list(range(len(first))), first
            saved = re.search(r"saved a checkpoint at step \d+ \(cursor (\d+)\): (\S+);", errors[0])
            if lost:  # rank 0 lives on: it saved at its last step
                assert first and saved and int(saved[1]) == len(first), errors[0]
            before = {r: len(read_train_log(drafts / "dp", r)) for r in (0, 1)}
            # the DP trainer again, on the surviving host and a new one, from its checkpoint
            for h in (up, spare):
                dp(f"dp2-{h.name}", h, up, "dp-2", "--resume")
            for name in ("p0", "t0", f"dp2-{up.name}", f"dp2-{spare.name}"):
                assert ended(name) == 0 and "Traceback" not in text(name), text(name)[-3000:]
            wait_for(lambda: gate.finished or gate.error, left(), "the gate to finish", 0.2)
            assert gate.error is None, repr(gate.error)
        finally:
            gate.close()
        counters = dict(_q(pg, SCHEMA, "SELECT key, value FROM counters"))
        total = int(counters["next_window"])
        made = _q(pg, SCHEMA, "SELECT made FROM producers")
        # each window made once, or again where the resumed trainer wanted it after eviction
        assert sum(int(m) for (m,) in made) == total + int(counters["recaptures"]), made
        assert int(counters["hw_windows"]) <= K, counters
        want = {c: (total, "finished") for c in ("dp:dp0", "dp:dp1", "gate:dp0", "t0:dp0")}
        assert states() == want, states()
        assert _acked(drafts / "t0", 0) == list(range(total))
        # each rank resumed from rank 0's newest checkpoint, at its cursor
        said = [
            re.search(r"resumed from (\S+) at step \d+, stream at \{'cursor': (\d+)", text(n))
            for n in (f"dp2-{up.name}", f"dp2-{spare.name}")
        ]
        resumed = {(m[1], int(m[2])) for m in said if m}
        assert len(resumed) == 1 and None not in said, said
        ((path, cursor),) = resumed
        assert 1 <= cursor < total, (cursor, total)
        # every window from there acked once, in order, by each rank of the resumed trainer
        for r in (0, 1):
            again = [
                w
                for rec in read_train_log(drafts / "dp", r)[before[r] :]
                for w in rec.get("acked", [])
            ]
            assert again == list(range(cursor, total)), (r, again)
        if lost:  # rank 0 saved where it stopped: nothing acked twice, nothing made twice
            assert saved and (path, cursor) == (saved[2], int(saved[1])), (path, saved)
            assert _acked(drafts / "dp", 0) == list(range(total))
            assert int(counters["recaptures"]) == 0, counters


# ---- the guard on its own (no hosts) ---------------------------------------------------------


def test_a_collective_whose_peer_is_gone_is_one_rank_lost_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What gloo raises when a peer's sockets close (a plain RuntimeError with its source
    location) becomes RankLost: one line naming the rank that saw it and the peer's
    address, which the trainer handles like any failure (save, record, exit 1); any
    other RuntimeError of a collective is left alone (a bug, not a lost peer)."""
    import torch.distributed as dist

    from fanout.errors import RankLost
    from fanout.train.distributed import DataParallel

    gloo = (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
        "closed by peer [10.213.7.6]:56457. This is typically caused by a remote worker "
        "crashing. Check the logs of the remote worker"
    )

    def gone(*_a: Any, **_k: Any) -> None:
        raise RuntimeError(gloo)

    monkeypatch.setattr(dist, "all_reduce", gone)
    monkeypatch.setattr(dist, "broadcast", gone)
    monkeypatch.setattr(dist, "get_backend", lambda *_a: "gloo")  # no process group here
    dp = DataParallel(rank=0, world=2)
    for call in (lambda: dp.agree(False), lambda: dp.mean([1.0]), lambda: dp.from_main([1])):
        with pytest.raises(RankLost) as got:
            call()
        assert str(got.value) == (
            "data-parallel rank 0 of 2: a collective failed, so another rank is gone (its "
            "process died or its host was lost, or it was silent past the process group's "
            "timeout, --dp-timeout-s 1800): Connection closed by peer [10.213.7.6]:56457"
        )

    def bug(*_a: Any, **_k: Any) -> None:
        raise RuntimeError("expected a tensor of dtype Long")

    monkeypatch.setattr(dist, "all_reduce", bug)
    with pytest.raises(RuntimeError, match="dtype Long"):
        dp.agree(False)
