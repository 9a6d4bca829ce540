"""Whole-system chaos: real `fanout produce` / `fanout train` processes under faults.

    .venv/bin/pytest tests/test_chaos.py -m "not slow" -x -q   # ~2-3 min on 2 shared cores
    .venv/bin/pytest tests/test_chaos.py -m slow -x -q         # + the 10-minute kill soak

Scenarios (issue 7; docs/reliability.md has the table of what they found):
1. kill -9 of the producer and of 3 consumers every 0.5-1.5 s, each restarted
   (also, shorter, with the coordinator on PostgreSQL);
2. disk full on a tmpfs run dir (root only);
3. a bit flipped in a ready window's tensor data;
4. a consumer SIGSTOPped past its ttl, then resumed (detach and recapture policies);
5. bad input rows reaching the producer;
6. a restart with a changed contract (other target layers, other verifier weights);
7. three producer replicas and three trainers, any role killed -9 at random (SQLite;
   PostgreSQL, shorter), and a replica SIGSTOPped past its ttl while it holds a claim.
The driver and the promise checks live in fanout.chaos.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from chaos_helpers import (
    bad_file,
    db_cursor,
    db_rows,
    flip_tensor_byte,
    max_gap_during,
    next_window,
    produce_argv,
    ready,
    tree,
)
from fanout.chaos import (
    ChaosAssets,
    ChaosConfig,
    ChaosReport,
    ChaosRun,
    build_assets,
    check_cover,
    run_cli,
    window_digest,
)
from fanout.chaos.soak import MAX_KILL_GAP_S, SoakReport, run_rounds
from fanout.train.trainlog import read_train_log
from tiny_run import wait_for


@pytest.fixture(scope="session")
def chaos_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chaos")


@pytest.fixture(scope="session")
def assets_root(chaos_root: Path) -> Path:
    return chaos_root / "assets"


def _assets(root: Path, conversations: int) -> ChaosAssets:
    return build_assets(root, conversations)


def _cfg(work: Path, chaos_root: Path, **kw: Any) -> ChaosConfig:
    kw.setdefault("timeout_s", 240.0)
    kw.setdefault("kills", 0)  # a test that kills says how often
    return ChaosConfig(work_dir=str(work), cache_dir=str(chaos_root / "cache"), **kw)


def _assert_ok(rep: ChaosReport, allow: tuple[str, ...] = ()) -> None:
    problems = [p for p in rep.problems() if not any(a in p for a in allow)]
    assert not problems, "\n".join(problems)


def _summary(rep: ChaosReport) -> str:
    return (
        f"kills={rep.kills} windows={rep.total_windows} rows={rep.rows_checked} "
        f"samples={rep.samples}+{rep.cli_samples} max_live={rep.max_live} "
        f"files_verified={rep.files_verified} final={rep.final.get('counters')} "
        f"elapsed={rep.elapsed_s}s"
    )


# ---------------------------------------------------------------- the checker itself


def _rec(step: int, *windows: int) -> dict[str, Any]:
    return {"step": step, "windows": list(windows)}


def test_check_cover_accepts_replay_after_restart() -> None:
    recs = [_rec(1, 0), _rec(2, 0), _rec(3, 1), _rec(3, 1), _rec(4, 1), _rec(5, 2)]
    c = check_cover(recs, 3)
    assert c.errors == [] and c.restarts == 1 and c.repeated_steps == 1 and c.windows == 3


@pytest.mark.parametrize(
    ("recs", "msg"),
    [
        ([_rec(1, 0), _rec(2, 2)], "skipped windows"),
        ([_rec(1, 0), _rec(2, 1), _rec(3, 0), _rec(4, 2)], "went back"),
        ([_rec(1, 0), _rec(2, 1), _rec(2, 2)], "replayed step had windows"),
        ([_rec(1, 0), _rec(2, 1)], "never trained on: [2]"),
        ([_rec(1, 1), _rec(2, 2)], "does not start at window 0"),
        ([_rec(1, 0), _rec(3, 1), _rec(4, 2)], "step jumped"),
        ([_rec(1, 0, 2), _rec(2, 2)], "not consecutive"),
    ],
)
def test_check_cover_rejects(recs: list[dict[str, Any]], msg: str) -> None:
    assert any(msg in e for e in check_cover(recs, 3).errors)


# ---------------------------------------------------------------- 1. kill -9


def _assert_soak_ok(rep: SoakReport) -> None:
    problems = rep.problems()
    assert not problems, "\n".join(problems)


def test_kill9_producer_and_consumers(chaos_root: Path, assets_root: Path) -> None:
    """≥ 12 SIGKILLs (kill_every_s apart) of a 1P3C run, each role restarted at once:
    three of every role (each kill takes the role with the fewest so far, and a round
    that ends with a role short owes it the rest: fanout.chaos.soak).

    The stream is looped (fanout.chaos.soak): if it ends before the 12th kill, another
    round on a fresh run takes the rest, so the count is met on any machine; every round
    is checked. 30 kills, recorded: benchmarks/chaos.py; the 10-minute soak: below.

    300 conversations (~110 windows): the 12 kills take ~13 s and a round runs until its
    stream ends, so a longer stream (700 conversations, ~265 windows, until #54) only
    added a kill-free tail; a stream that ends sooner is looped as above."""
    cfg = _cfg(
        chaos_root / "kill9", chaos_root, conversations=300, epochs=1, kills=12, timeout_s=540.0
    )
    rep = run_rounds(cfg, _assets(assets_root, cfg.conversations))
    print(rep.summary())
    _assert_soak_ok(rep)
    assert rep.total_kills >= 12
    assert rep.kills["producer"] >= 3 and all(rep.kills[f"c{i}"] >= 3 for i in range(3))
    assert rep.unexpected_exits == {}
    # The sampler checks the files live at each 0.2 s sample: how many windows that covers
    # depends on the machine's speed (fewer on a loaded one), so the floor is a count.
    assert rep.total("files_verified") >= 50 and rep.total("samples") >= 50
    assert rep.total("cli_samples") >= 3
    assert rep.max_live <= cfg.max_live_windows
    # Replays after a crash between a step's log line and its checkpoint are checked
    # when they happen (check_cover); they are forced in the test below.
    assert rep.every_consumer_read_every_window()


# slow (≈45 s): the default run keeps the SQLite kill -9 chaos run; real processes on
# PostgreSQL stay in test_endings (recapture) and test_coordinator_procs (8-process races)
@pytest.mark.slow
def test_kill9_with_the_coordinator_on_postgres(
    chaos_root: Path, assets_root: Path, pg_url: str
) -> None:
    """Scenario 1, shorter, with the coordinator on PostgreSQL: producer and trainers
    SIGKILLed (mid-transaction included) and restarted; every promise checked the same.
    Looped like the test above when the stream ends before the 12th kill (a round of its
    own, in a schema of its own)."""
    cfg = _cfg(
        chaos_root / "kill9pg", chaos_root, conversations=400, epochs=2, kills=12,
        timeout_s=400.0, db_path=pg_url,
    )  # fmt: skip
    rep = run_rounds(cfg, _assets(assets_root, cfg.conversations))
    print(rep.summary())
    _assert_soak_ok(rep)
    assert not list((chaos_root / "kill9pg").glob("**/coordinator.sqlite3"))
    assert rep.total_kills >= 12 and rep.kills["producer"] >= 1
    assert rep.unexpected_exits == {}
    assert rep.total("samples") >= 20 and rep.total("cli_samples") >= 3
    assert rep.max_live <= cfg.max_live_windows
    assert rep.every_consumer_read_every_window()


def _replicas_kill9(work: Path, chaos_root: Path, assets_root: Path, **kw: Any) -> SoakReport:
    """Three producer replicas (K = 5: each can hold a claim, the slowest consumer's
    slot apart) and three trainers; a role chosen from a shuffled bag SIGKILLed every
    0.5-1.5 s and restarted (a replica with its --replica-rank: it rejoins). The checks
    are ChaosReport.problems(): every consumer reads every window once, in order; live
    windows ≤ K at every sample; every published file verifies; no window captured
    twice beyond the counted recaptures and reclaimed claims."""
    cfg = _cfg(work, chaos_root, replicas=3, max_live_windows=5, **kw)
    rep = run_rounds(cfg, _assets(assets_root, cfg.conversations))
    print(rep.summary(), "claims reclaimed", sum(
        r.final.get("counters", {}).get("claims_reclaimed", 0) for r in rep.rounds))  # fmt: skip
    _assert_soak_ok(rep)
    assert rep.unexpected_exits == {}
    assert all(rep.kills[f"p{i}"] >= 1 for i in range(3)), rep.kills
    assert rep.max_live <= cfg.max_live_windows
    assert rep.every_consumer_read_every_window()
    return rep


# (kills, conversations, epochs): the default 12 kills over one pass of 300 conversations
# (~110 windows; the kills take ~13 s, the rest of a stream is a kill-free tail, and a
# stream that ends first is looped: fanout.chaos.soak); the slow 30 kills over the stream
# both used until #54 (700 conversations, 2 epochs: ~530 windows).
@pytest.mark.parametrize(
    ("kills", "conversations", "epochs"),
    [(12, 300, 1), pytest.param(30, 700, 2, marks=pytest.mark.slow)],
    ids=["12-kills", "30-kills"],
)
def test_kill9_replicas_and_consumers(
    chaos_root: Path, assets_root: Path, kills: int, conversations: int, epochs: int
) -> None:
    rep = _replicas_kill9(
        chaos_root / f"replicas-{kills}", chaos_root, assets_root, conversations=conversations,
        epochs=epochs, kills=kills, timeout_s=540.0,
    )  # fmt: skip
    assert rep.total_kills >= kills and rep.total("files_verified") >= 50


@pytest.mark.slow
def test_kill9_replicas_on_postgres(chaos_root: Path, assets_root: Path, pg_url: str) -> None:
    rep = _replicas_kill9(
        chaos_root / "replicaspg", chaos_root, assets_root, conversations=400, epochs=2,
        kills=12, timeout_s=400.0, db_path=pg_url,
    )  # fmt: skip
    assert rep.total_kills >= 12


def test_a_replica_paused_past_ttl_loses_its_claim(chaos_root: Path, assets_root: Path) -> None:
    """Two replicas, two trainers: a replica SIGSTOPped while it captures a window, for
    3×ttl. It is declared lost, its claim released (claims_reclaimed) and the window
    made by the other; resumed, it finds itself fenced off and exits 1 (its file, if
    it published one, is removed or swept); restarted, it rejoins. Every promise of
    ChaosReport.problems() holds."""
    ttl = 2.0
    cfg = _cfg(chaos_root / "replica-pause", chaos_root, conversations=300, consumers=2,
               replicas=2, max_live_windows=4, ttl_s=ttl)  # fmt: skip
    run = ChaosRun(cfg, _assets(assets_root, cfg.conversations))
    state: dict[str, Any] = {}
    claimed = "SELECT COUNT(*) FROM windows WHERE state='capturing' AND claim_rank=?"

    def pause(r: ChaosRun) -> None:
        co = r.sampler._open()
        if co is None or "cont" in state:
            return
        if "stop" not in state:
            rows = co.conn.execute(
                "SELECT p.rank, p.pid FROM windows w JOIN producers p ON p.rank = w.claim_rank "
                "WHERE w.state='capturing' AND p.state='active'"
            ).fetchall()
            for rank, pid in rows:
                victim = r.producers[int(rank)]
                if victim.proc is None or victim.proc.pid != pid:
                    continue
                if not r.pause(victim):  # stopped inside a write: later
                    continue
                if co.conn.execute(claimed, (int(rank),)).fetchone()[0]:  # still holds it
                    state["stop"], state["victim"] = time.monotonic(), victim
                    return
                victim.proc.signal(signal.SIGCONT)  # it had published meanwhile: later
        elif time.monotonic() - state["stop"] > 3 * ttl:
            state["victim"].proc.signal(signal.SIGCONT)
            state["cont"] = time.monotonic()

    rep = run.run(tick=pause)
    print(_summary(rep))
    assert "cont" in state, "no replica was ever paused holding a claim"
    _assert_ok(rep)
    victim = state["victim"]
    assert rep.final["counters"]["claims_reclaimed"] >= 1
    assert rep.unexpected_exits == {victim.name: [1]}, rep.unexpected_exits
    assert victim.starts == 2  # fenced once, rejoined once
    assert "lost" in victim.log.read_text() or "stale" in victim.log.read_text()


def test_kill_before_first_checkpoint_restarts_from_zero(
    chaos_root: Path, assets_root: Path
) -> None:
    """A trainer that dies before its first checkpoint committed (simulated: SIGKILL, then
    its checkpoint directory removed) must start the stream again at window 0 — its
    model saw nothing — not at the cursor its lost incarnation acked in the database."""
    cfg = _cfg(chaos_root / "nockpt", chaos_root, conversations=60, consumers=1)
    run = ChaosRun(cfg, _assets(assets_root, cfg.conversations))
    t = run.trainers[0]
    done: dict[str, int] = {}

    def crash(r: ChaosRun) -> None:
        if done or len(read_train_log(r.work / "drafts" / "c0")) < 6:
            return
        assert t.proc is not None
        t.proc.signal(signal.SIGKILL)
        t.proc.wait(10)
        for d in (r.work / "drafts" / "c0").glob("checkpoint-*"):
            shutil.rmtree(d)
        done["cursor"] = db_cursor(r)

    rep = run.run(tick=crash)
    print(_summary(rep))
    assert done and done["cursor"] >= 1
    _assert_ok(rep)
    assert rep.covers["c0"]["restarts"] == 1 and rep.covers["c0"]["repeated_steps"] >= 6


def test_producer_killed_inside_create_can_restart(chaos_root: Path, assets_root: Path) -> None:
    """The state a SIGKILL between Coordinator.create's first write (the WAL header)
    and its schema commit leaves: a database file with no tables. A restarted producer
    must start the run, not fail on it forever ("not a fanout coordinator database")."""
    a = _assets(assets_root, 60)
    work = chaos_root / "midcreate"
    (work / "run").mkdir(parents=True)
    conn = sqlite3.connect(work / "run" / "coordinator.sqlite3")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.close()
    argv = produce_argv(work / "run", a, a.data, chaos_root / "cache", "--max-windows", "1")
    log = work / "producer.log"
    assert run_cli(argv, log) == 0, log.read_text()[-2000:]
    assert "interrupted create" in log.read_text()
    assert len(os.listdir(work / "run" / "windows")) == 1


def _children(pid: int, needle: str) -> list[int]:
    """Pids whose parent is `pid` and whose command line contains `needle` (/proc)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and needle in cmd:
            out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:  # a zombie (state Z) has exited; only its parent's reaping is left
        return (Path(f"/proc/{pid}") / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_killed_producer_leaves_no_template_build_running(
    chaos_root: Path, assets_root: Path, tmp_path: Path
) -> None:
    """The tokenizer's chat metadata is built once in a child process; a producer
    SIGKILLed meanwhile used to leave that child running on (each importing
    transformers), and a soak on a loaded machine piled them up until no producer got
    through its start-up. The child now exits when its parent dies."""
    a = _assets(assets_root, 60)
    code = (
        "import sys; from fanout.data.template import load_chat_spec; "
        f"load_chat_spec({str(a.tokenizer)!r}, cache_root={str(tmp_path / 'cache')!r})"
    )
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        kids = wait_for(lambda: _children(parent.pid, "fanout.data.template build"), 120,
                        "the template build to start")  # fmt: skip
    finally:
        parent.kill()
        parent.wait(30)
    wait_for(lambda: not any(map(_alive, kids)), 60, "the orphaned template build to exit")
    # it stopped when its parent died, seconds before it could have finished (importing
    # transformers alone takes longer): its output was never written
    assert not list((tmp_path / "cache").glob("tokenizers/*.tmp*/chat.json"))


# FANOUT_SOAK_MINUTES=1.5 runs the same soak shortened (docs/reliability.md).
SOAK_MINUTES = float(os.environ.get("FANOUT_SOAK_MINUTES", "10"))


@pytest.mark.slow
def test_kill9_soak_10_minutes(chaos_root: Path, assets_root: Path) -> None:
    """Kill -9 for the whole SOAK_MINUTES, idle machine or loaded: the stream is looped
    (fanout.chaos.soak) rather than sized for one machine's speed (one 3-epoch stream of
    4000 conversations ended after 168 kills, in under 4 of 10 minutes, on an idle one)."""
    cfg = _cfg(  # a short stream per round: little tail once the time is up
        chaos_root / "soak",
        chaos_root,
        conversations=300,
        epochs=1,
        minutes=SOAK_MINUTES,
        timeout_s=900.0,  # per round
    )
    rep = run_rounds(cfg, _assets(assets_root, cfg.conversations))
    print(rep.summary())
    _assert_soak_ok(rep)
    assert rep.killing_s >= SOAK_MINUTES * 60  # it lasted its stated duration
    # the kill schedule's own bound (at least one kill per MAX_KILL_GAP_S while roles
    # run), whatever the machine's speed: a count of what was done, not a rate guess
    assert rep.total_kills >= rep.killing_s / MAX_KILL_GAP_S - 4 * len(rep.rounds)
    assert rep.unexpected_exits == {}
    assert rep.every_consumer_read_every_window()


# ---------------------------------------------------------------- 2. disk full


@pytest.fixture
def tmpfs(tmp_path: Path) -> Any:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    d = tmp_path / "tmpfs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(d)], check=False)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.mark.root
def test_disk_full_then_freed(chaos_root: Path, assets_root: Path, tmpfs: Path) -> None:
    """Run dir on a 512 KiB tmpfs (database on local disk: it must not share the
    artifacts' fate); the disk is kept full for 4 s mid-run, then freed."""
    work = chaos_root / "diskfull"
    cfg = _cfg(work, chaos_root, conversations=120, consumers=2, db_path=str(work / "db.sqlite3"))
    run = ChaosRun(cfg, _assets(assets_root, cfg.conversations))
    run.run_dir = tmpfs / "run"  # the artifacts live on the small disk
    run.sampler.run_dir = run.run_dir
    run.producer.argv = run.producer_argv()
    for i, t in enumerate(run.trainers):
        t.argv = run.trainer_argv(i)
    filler = tmpfs / "filler"
    state: dict[str, float] = {}

    def fill(r: ChaosRun) -> None:
        now = time.monotonic()
        if "full_at" not in state and next_window(r) >= 8:
            state["full_at"] = now
        if "full_at" in state and "freed_at" not in state:
            if now - state["full_at"] < 4.0:
                with contextlib.suppress(OSError), filler.open("ab") as f:
                    while True:  # take every byte an eviction frees
                        f.write(b"\0" * 4096)
                        f.flush()
            else:
                filler.unlink()
                state["freed_at"] = now

    rep = run.run(tick=fill)
    print(_summary(rep))
    assert "freed_at" in state
    log = run.producer.log.read_text()
    assert "No space left" in log and "disk full, retrying" in log  # reported, waited
    _assert_ok(rep)
    assert rep.unexpected_exits == {}


# ---------------------------------------------------------------- 3. bit flip


def test_bit_flip_is_quarantined_and_recaptured(chaos_root: Path, assets_root: Path) -> None:
    """K=4: three windows wait for consumers (the fourth slot is kept for the slowest
    consumer's window); one gets a flipped bit before any consumer starts. Consumers must report it (checksum), it is quarantined and recaptured
    with the same bytes as the original, and nobody trains on the bad copy."""
    cfg = _cfg(
        chaos_root / "bitflip", chaos_root, conversations=60, consumers=2, max_live_windows=4
    )
    run = ChaosRun(cfg, _assets(assets_root, cfg.conversations))
    flipped: dict[str, Any] = {}

    def flip(r: ChaosRun) -> None:
        if flipped:
            # The recapture may live only a few ms before every consumer passes it:
            # sample every tick until its file has been read and verified.
            w = flipped["digest"][0]
            if not any(v[0] == w and n != flipped["name"] for n, v in r.sampler.verified.items()):
                r.sampler.sample()
            return
        if ready(r) < 3:
            return
        r.sampler.sample()  # the good bytes of every ready window, before the flip
        name = sorted(os.listdir(r.run_dir / "windows"))[1]
        flipped["name"], flipped["digest"] = name, window_digest(r.run_dir / "windows" / name)
        flip_tensor_byte(r.run_dir / "windows" / name)
        r.start_trainers()

    rep = run.run(tick=flip, start_trainers=False)
    print(_summary(rep))
    assert flipped, "the producer never reached K - 1 ready windows"
    _assert_ok(rep)
    assert rep.final["counters"]["corrupt"] >= 1 and rep.final["counters"]["recaptures"] >= 1
    quarantined = os.listdir(run.run_dir / "quarantine")
    assert any(q.startswith(flipped["name"]) for q in quarantined), quarantined
    w = flipped["digest"][0]
    recaptured = [v for n, v in run.sampler.verified.items() if v[0] == w and n != flipped["name"]]
    assert recaptured and all(d == flipped["digest"][2] for _, _, d in recaptured)
    logs = "".join(t.log.read_text() for t in run.trainers)
    assert "checksum" in logs and "waiting for its recapture" in logs
    for c in rep.covers.values():  # window w trained once (no crash, so no repeat)
        assert c["repeated_steps"] == 0


# ---------------------------------------------------------------- 4. SIGSTOP past ttl


@pytest.mark.parametrize(("policy", "exit_code"), [("detach", 3), ("recapture", 1)])
def test_sigstop_past_ttl(chaos_root: Path, assets_root: Path, policy: str, exit_code: int) -> None:
    """c1 is SIGSTOPped for 3×ttl. The others keep training (stall < ttl + slack);
    once resumed c1 finds itself fenced (detached: exit 3; reclaimed as lost under
    recapture: StaleLease, exit 1), is restarted with --resume, rejoins at its
    checkpoint (its evicted windows recaptured) and completes its cover."""
    ttl = 2.0
    cfg = _cfg(
        chaos_root / f"sigstop-{policy}",
        chaos_root,
        conversations=150,
        lag_policy=policy,
        ttl_s=ttl,
    )
    run = ChaosRun(cfg, _assets(assets_root, cfg.conversations))
    victim = run.trainers[1]
    vlog = run.work / "drafts" / victim.name
    when: dict[str, float] = {}

    def pause(r: ChaosRun) -> None:
        if "stop" not in when and len(read_train_log(vlog)) >= 6:
            if r.pause(victim):  # not inside a write transaction (else: next tick)
                when["stop"], when["stop_wall"] = time.monotonic(), time.time()
        elif "stop" in when and "cont" not in when and time.monotonic() - when["stop"] > 3 * ttl:
            assert victim.proc is not None
            victim.proc.signal(signal.SIGCONT)
            when["cont"], when["cont_wall"] = time.monotonic(), time.time()

    rep = run.run(tick=pause)
    print(_summary(rep))
    assert "cont" in when, "the victim never got going"
    _assert_ok(rep)
    assert rep.unexpected_exits == {victim.name: [exit_code]}
    assert victim.starts == 2  # fenced once, rejoined once
    counters = rep.final["counters"]
    assert counters["detaches" if policy == "detach" else "reclaims"] >= 1
    assert counters["recaptures"] >= 1  # the rejoined consumer's windows came back
    for t in run.trainers:
        if t is not victim:
            recs = read_train_log(run.work / "drafts" / t.name)
            gap = max_gap_during(recs, when["stop_wall"], when["cont_wall"])
            print(f"{policy}: {t.name} longest stall while c1 was stopped: {gap:.2f} s")
            assert gap < ttl + 2.5, f"{t.name} stalled {gap:.2f} s (ttl {ttl} s)"
    assert "detached" in victim.log.read_text() or "stale" in victim.log.read_text()


# ---------------------------------------------------------------- 5. bad input


def test_bad_input_rows(chaos_root: Path, assets_root: Path) -> None:
    a = _assets(assets_root, 60)
    work = chaos_root / "badinput"
    work.mkdir()
    cache = chaos_root / "cache"
    bad = bad_file(work / "bad.jsonl")
    # A run with published windows that a bad restart must not touch.
    good_run = work / "good"
    assert (
        run_cli(produce_argv(good_run, a, a.data, cache, "--max-windows", "2"), work / "good.log")
        == 0
    )
    before = tree(good_run / "windows") | {"stream.json": (good_run / "stream.json").read_bytes()}
    assert len(before) == 3

    # error mode: the first bad row is named by file and line; nothing published is touched.
    log = work / "error.log"
    assert run_cli(produce_argv(good_run, a, bad, cache), log) == 1
    assert f"{bad}:4" in log.read_text() and "JSON" in log.read_text()
    assert (
        tree(good_run / "windows") | {"stream.json": (good_run / "stream.json").read_bytes()}
    ) == before

    # the over-long conversation with --over-length error: named by its line too
    log = work / "overlong.log"
    argv = produce_argv(
        work / "r-overlong", a, bad, cache, "--on-bad-row", "skip", "--over-length", "error"
    )
    assert run_cli(argv, log) == 1
    assert f"{bad}:7" in log.read_text() and "seq_len" in log.read_text()

    # skip mode: every bad row counted by reason; the long one dropped and counted.
    fresh = work / "skip"
    argv = produce_argv(
        fresh, a, bad, cache, "--on-bad-row", "skip", "--over-length", "drop", "--max-windows", "1"
    )
    assert run_cli(argv, work / "skip.log") == 0
    summary = json.loads((fresh / "stream.json").read_text())["dataset_summary"]
    assert summary["skipped_bad_rows"] == 3, summary
    assert summary["dropped_over_length"] == 1, summary

    # skip mode against the published run: another dataset = another contract → refused,
    # and still nothing touched (stream.json included).
    log = work / "skip-on-good.log"
    argv = produce_argv(good_run, a, bad, cache, "--on-bad-row", "skip", "--over-length", "drop")
    assert run_cli(argv, log) == 1
    assert "dataset_fingerprint" in log.read_text()
    assert (
        tree(good_run / "windows") | {"stream.json": (good_run / "stream.json").read_bytes()}
    ) == before


# ---------------------------------------------------------------- 6. changed contract


def test_changed_contract_is_refused(chaos_root: Path, assets_root: Path) -> None:
    from fanout.bench.assets import tiny_qwen3_verifier

    a = _assets(assets_root, 60)
    work = chaos_root / "contract"
    work.mkdir()
    cache = chaos_root / "cache"
    old = work / "old"
    assert run_cli(produce_argv(old, a, a.data, cache, "--max-windows", "3"), work / "old.log") == 0
    keep = {n: (old / n).read_bytes() for n in ("stream.json", "contract.json")} | tree(
        old / "windows"
    )
    rows = db_rows(old)
    vocab = json.loads((a.verifier / "config.json").read_text())["vocab_size"]
    other = tiny_qwen3_verifier(
        work / "other-verifier", vocab, hidden_size=32, num_layers=4, head_dim=8,
        intermediate_size=64, seed=1,
    )  # fmt: skip
    refusals = {
        "layers": (produce_argv(old, a, a.data, cache, "--capture-layer-ids", "1", "3"), "target_layer_ids"),
        "weights": ([*produce_argv(old, a, a.data, cache), "--verifier-name-or-path", str(other)], "verifier_weights_fingerprint"),
        "trainer": (["train", "--run-dir", str(old), "--consumer-id", "t", "--verifier-name-or-path", str(a.verifier),
                     "--target-layer-ids", "1", "3", "--save-path", str(work / "t"), "--acquire-timeout-s", "30"],
                    "--draft-layer-ids"),  # the trainer's own flag (the old name is an alias)
    }  # fmt: skip
    for what, (argv, field) in refusals.items():
        log = work / f"refused-{what}.log"
        assert run_cli(argv, log) == 1, what
        text = log.read_text()
        assert "capture contract mismatch" in text and field in text, (what, text[-800:])
    # Nothing of the old run changed: files, stream info, coordinator rows.
    assert (
        {n: (old / n).read_bytes() for n in ("stream.json", "contract.json")}
        | tree(old / "windows")
    ) == keep
    assert db_rows(old) == rows

    # A new run under the new contract: an old-contract file planted under one of its
    # window names is refused by the consumer (quarantined, recaptured), never trained on.
    cfg = _cfg(work / "new", chaos_root, conversations=60, consumers=1, max_live_windows=4,
               target_layer_ids=(1, 3))  # fmt: skip
    run = ChaosRun(cfg, a)
    planted: dict[str, Any] = {}

    def plant(r: ChaosRun) -> None:
        if planted or ready(r) < 3:
            return
        r.sampler.sample()
        name = sorted(os.listdir(r.run_dir / "windows"))[0]
        assert name.startswith("00000000.")
        shutil.copyfile(
            old / "windows" / sorted(os.listdir(old / "windows"))[0], r.run_dir / "windows" / name
        )
        planted["name"] = name
        r.start_trainers()

    rep = run.run(tick=plant, start_trainers=False)
    print(_summary(rep))
    assert planted
    _assert_ok(rep)
    assert rep.final["counters"]["corrupt"] == 1 and rep.final["counters"]["recaptures"] >= 1
    (_q,) = [q for q in os.listdir(run.run_dir / "quarantine") if q.startswith(planted["name"])]
    assert json.loads((old / "contract.json").read_text()) != json.loads(
        (run.run_dir / "contract.json").read_text()
    )
    assert "contract" in run.trainers[0].log.read_text()
    assert tree(old / "windows") == {
        k: v for k, v in keep.items() if k not in ("stream.json", "contract.json")
    }
