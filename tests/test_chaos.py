"""Whole-system chaos: real `fanout produce` / `fanout train` processes under faults.

    .venv/bin/pytest tests/test_chaos.py -x -q                 # ~3-4 min on 2 shared cores
    .venv/bin/pytest tests/test_chaos.py -m slow -x -q         # + the 10-minute kill soak

Scenarios (issue 7; docs/reliability.md has the table of what they found):
1. kill -9 of the producer and of 3 consumers every 0.5-1.5 s, each restarted;
2. disk full on a tmpfs run dir (root only);
3. a bit flipped in a ready window's tensor data;
4. a consumer SIGSTOPped past its ttl, then resumed (detach and recapture policies);
5. bad input rows reaching the producer;
6. a restart with a changed contract (other target layers, other verifier weights).
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
import time
from pathlib import Path
from typing import Any

import pytest

from fanout.chaos import (
    ChaosAssets,
    ChaosConfig,
    ChaosReport,
    ChaosRun,
    build_assets,
    check_cover,
    read_log,
    run_cli,
    window_digest,
)


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


def _ready(run: ChaosRun) -> int:
    co = run.sampler._open()
    if co is None:
        return 0
    return int(co.conn.execute("SELECT COUNT(*) FROM windows WHERE state='ready'").fetchone()[0])


def _next_window(run: ChaosRun) -> int:
    co = run.sampler._open()
    return 0 if co is None else int(co.meta("next_window"))


def _tree(d: Path) -> dict[str, bytes]:
    """Every file under d (bytes), to prove a failed command touched nothing."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


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


def test_kill9_producer_and_consumers(chaos_root: Path, assets_root: Path) -> None:
    """≥ 30 SIGKILLs (0.5-1.5 s apart) of a 1P3C run, each role restarted at once."""
    cfg = _cfg(chaos_root / "kill9", chaos_root, conversations=700, kills=30)
    rep = ChaosRun(cfg, _assets(assets_root, cfg.conversations)).run()
    print(_summary(rep))
    _assert_ok(rep)
    assert rep.total_kills >= 30
    assert rep.kills["producer"] >= 3 and all(rep.kills[f"c{i}"] >= 3 for i in range(3))
    assert rep.unexpected_exits == {}
    assert rep.files_verified >= rep.total_windows // 2 and rep.samples >= 50
    assert rep.cli_samples >= 3
    assert rep.max_live <= cfg.max_live_windows + 1
    assert sum(c["restarts"] for c in rep.covers.values()) >= 1  # a crash did force a replay


@pytest.mark.slow
def test_kill9_soak_10_minutes(chaos_root: Path, assets_root: Path) -> None:
    cfg = _cfg(
        chaos_root / "soak",
        chaos_root,
        conversations=4000,
        epochs=3,
        minutes=10.0,
        kill_every_s=(1.0, 3.0),
        timeout_s=1800.0,
    )
    rep = ChaosRun(cfg, _assets(assets_root, cfg.conversations)).run()
    print(_summary(rep))
    _assert_ok(rep)
    assert rep.total_kills >= 200 and rep.unexpected_exits == {}


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
        if "full_at" not in state and _next_window(r) >= 8:
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
    assert "No space left" in log  # the producer reported the full disk
    _assert_ok(rep)
    assert rep.unexpected_exits == {}


# ---------------------------------------------------------------- 3. bit flip


def _flip_tensor_byte(path: Path) -> None:
    """Flip one bit in the middle of the tensor data (past the safetensors header)."""
    with path.open("r+b") as f:
        header = int.from_bytes(f.read(8), "little")
        size = path.stat().st_size
        at = 8 + header + (size - 8 - header) // 2
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 0x10]))


def test_bit_flip_is_quarantined_and_recaptured(chaos_root: Path, assets_root: Path) -> None:
    """K=4 windows wait for consumers; one gets a flipped bit before any consumer
    starts. Consumers must report it (checksum), it is quarantined and recaptured
    with the same bytes as the original, and nobody trains on the bad copy."""
    cfg = _cfg(chaos_root / "bitflip", chaos_root, conversations=60, consumers=2, max_live_windows=4)
    run = ChaosRun(cfg, _assets(assets_root, cfg.conversations))
    flipped: dict[str, Any] = {}

    def flip(r: ChaosRun) -> None:
        if flipped or _ready(r) < 4:
            return
        r.sampler.sample()  # the good bytes of every ready window, before the flip
        name = sorted(os.listdir(r.run_dir / "windows"))[1]
        flipped["name"], flipped["digest"] = name, window_digest(r.run_dir / "windows" / name)
        _flip_tensor_byte(r.run_dir / "windows" / name)
        r.start_trainers()

    rep = run.run(tick=flip, start_trainers=False)
    print(_summary(rep))
    assert flipped, "the producer never reached K ready windows"
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
