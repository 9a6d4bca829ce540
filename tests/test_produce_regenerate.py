"""`fanout produce --regenerate`: the producer's one verifier answers first, then captures
its own text; a restart reuses the saved regeneration (same rows, same contract), and the
saved file is what `fanout regenerate` writes with the same settings.

.venv/bin/pytest tests/test_produce_regenerate.py -q -p no:randomly
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fanout.bench.assets import generate_corpus
from fanout.coord.coordinator import Coordinator
from fanout.errors import ConfigError
from fanout.produce.onpolicy import OPEN, OnPolicyStream
from fanout.produce.producer import Producer
from fanout.regen.hf import load_tokenizer
from fanout.regen.regenerate import RegenerateConfig, regenerate
from fanout.store.store import RunDir, Store
from tiny_run import (  # noqa: F401
    build_tiny_assets,
    config_flags,
    one_thread,
    tiny_producer_config,
    wait_for,
)
from window_files import window_names

REGEN = dict(regenerate=True, temperature=1.0, keep_truncated=True, max_new_tokens=6)


def test_producer_captures_its_own_answers_and_restarts_on_them(tmp_path: Path) -> None:
    root = tmp_path / "assets"
    build_tiny_assets(root, generate_corpus(12, 3))
    run = tmp_path / "run"
    cfg = tiny_producer_config(root, run, max_windows=1, **REGEN)
    p = Producer(cfg)
    assert p.run()["windows"] == 1
    regen = run / "regen" / "regenerated.jsonl"
    got = [json.loads(x) for x in regen.read_text().splitlines()]

    # the same file `fanout regenerate` writes with the same settings (reusable via --data)
    alone = RegenerateConfig(
        verifier_name_or_path=str(root / "verifier"),
        tokenizer=str(root / "tok"),
        data=[str(root / "chat.jsonl")],
        out=str(tmp_path / "alone"),
        temperature=1.0,
        keep_truncated=True,
        max_new_tokens=6,
        progress=False,
    )
    regenerate(alone)
    want = [
        json.loads(x) for x in (tmp_path / "alone" / "regenerated.jsonl").read_text().splitlines()
    ]
    assert got == want and len(got) >= 6

    # the windows hold the regenerated text, not the original answers
    tok = load_tokenizer(str(root / "tok"))
    store = Store(RunDir(run))
    texts = []
    for name in window_names(store):
        with store.open(name) as r:
            ids, docs = r.get("input_ids"), r.get("document_ids")
            texts += [tok.decode(ids[i][docs[i] >= 0].tolist()) for i in range(r.rows)]
    joined = "".join(texts)
    answers = [m["content"] for rec in got for m in rec["messages"][-1:]]
    corpus = generate_corpus(12, 3)
    originals = [corpus[rec["fanout_regen"]["index"]]["messages"][-1]["content"] for rec in got]
    kept_text = "".join(m["content"] for rec in got for m in rec["messages"])
    assert sum(a in joined for a in answers) >= 2
    # a replaced answer is in the windows only where the regenerated records have it too
    assert all(o in kept_text for o in originals if o in joined)
    assert any(o not in kept_text for o in originals)

    # a restart finds every shard done: same rows, same contract, nothing regenerated
    marks = {f: f.stat().st_mtime_ns for f in (run / "regen" / "shards").iterdir()}
    p2 = Producer(cfg.model_copy(update={"max_windows": None}))
    assert p2.contract.stream_id == p.contract.stream_id
    assert p2.run()["windows"] == p2.total_windows - 1 >= 1
    assert {f: f.stat().st_mtime_ns for f in (run / "regen" / "shards").iterdir()} == marks

    # other sampling settings on the same run dir: refused, naming what differs
    with pytest.raises(ConfigError, match="other settings"):
        Producer(cfg.model_copy(update={"temperature": 0.5}))


# ---- streaming: regenerate chunk by chunk while windows flow (fanout.produce.onpolicy)

STREAM = REGEN | dict(regen_chunk_records=2, max_live_windows=64, epochs=2, seq_len=48)


def _windows(run: Path) -> dict[int, dict[str, Any]]:
    """Every window file of `run` by window number: all its tensors."""
    store, out = Store(RunDir(run)), {}
    for name in window_names(store):
        with store.open(name) as r:
            out[int(name.split(".")[0])] = {k: r.get(k).clone() for k in r.names()}
    return out


def _done_chunks(run: Path) -> int:
    return len(list((run / "regen" / "shards").glob("*.json")))


@pytest.fixture(scope="module")
def stream_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("onpolicy") / "assets"
    build_tiny_assets(root, generate_corpus(12, 3))
    return root


@pytest.fixture(scope="module")
def reference(stream_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted streaming run to the end of its 2 epochs."""
    run = tmp_path_factory.mktemp("onpolicy") / "ref"
    p = Producer(tiny_producer_config(stream_assets, run, **STREAM))
    assert p.run()["windows"] == p.total_windows >= 3
    return run


def test_first_window_is_served_before_regeneration_finishes(
    stream_assets: Path, reference: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cfg = tiny_producer_config(stream_assets, run, **STREAM)
    p = Producer(cfg.model_copy(update={"max_windows": 1}))
    chunks = p.growing.num_chunks if isinstance(p.growing, OnPolicyStream) else 0
    assert chunks == 6 and p.total_windows == OPEN  # length unknown: the run is open-ended
    assert json.loads((run / "stream.json").read_text())["total_windows"] is None
    assert p.run()["windows"] == 1
    # window 0 is published with most chunks not yet regenerated, and a trainer gets it
    assert 0 < _done_chunks(run) < chunks
    assert not (run / "regen" / "regenerated.jsonl").exists()
    coord = Coordinator.open(run)
    lease = coord.acquire(coord.register_consumer("t0"), timeout_s=30)
    assert lease is not None and lease.window == 0
    # resumed to the end: the same windows and text as the uninterrupted run
    assert Producer(cfg).run()["windows"] >= 2
    assert _done_chunks(run) == chunks
    _same_run(run, reference)
    info = json.loads((run / "stream.json").read_text())
    assert info["total_windows"] == len(_windows(reference)) and info["num_rows"] > 0
    # a recapture now, every chunk done, gathers the rows each window was published with
    p3 = Producer(cfg)
    assert p3.growing is not None and p3.growing.reach(1 << 20) == info["total_windows"]
    for w, want in _windows(run).items():
        idx, _ = p3.growing.window_rows_of(w)
        got = torch.from_numpy(p3.dataset.rows(idx)["input_ids"]).to(torch.int32)
        assert torch.equal(got, want["input_ids"]), f"window {w}"


def _same_run(run: Path, ref: Path) -> None:
    got, want = _windows(run), _windows(ref)
    assert sorted(got) == sorted(want) == list(range(len(want)))
    for w in want:
        assert got[w].keys() == want[w].keys()
        for k in want[w]:
            assert torch.equal(got[w][k], want[w][k]), f"window {w} {k}"
    for name in ("regenerated.jsonl", *(f"shards/{i:05d}.jsonl" for i in range(6))):
        assert (run / "regen" / name).read_bytes() == (ref / "regen" / name).read_bytes(), name


def test_kill9_mid_regeneration_then_restart_gives_the_same_windows(
    stream_assets: Path, reference: Path, tmp_path: Path
) -> None:
    """A real `fanout produce --regenerate` killed (-9) once its second chunk is saved,
    then restarted: every window equals the uninterrupted run's, and so does the text."""
    run = tmp_path / "run"
    cfg = tiny_producer_config(stream_assets, run, **STREAM)
    argv = [sys.executable, "-m", "fanout.cli", "produce", *config_flags(cfg)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: proc.poll() is not None or _done_chunks(run) >= 2, 300, "chunk 1")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert _done_chunks(run) < 6  # killed mid-regeneration
    assert Producer(cfg.model_copy(update={"takeover": True})).run()["windows"] >= 1
    _same_run(run, reference)


def test_a_signal_while_the_stream_is_open_prints_its_length_as_null(
    stream_assets: Path, tmp_path: Path
) -> None:
    """Issue 32 #5: a real `fanout produce --regenerate` stopped by SIGINT while its
    stream is still open (held at K = 3, nobody reading, regeneration not done). Its
    summary says `"total_windows": null`, never the OPEN sentinel, nor does its log;
    `fanout status` says `produced 2/∞` and that a signal stopped it."""
    from fanout.status.snapshot import snapshot
    from fanout.status.table import format_table

    run = tmp_path / "run"
    cfg = tiny_producer_config(stream_assets, run, **(STREAM | {"max_live_windows": 3}))
    argv = [sys.executable, "-m", "fanout.cli", "produce", *config_flags(cfg)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(argv, env=env, stdout=o, stderr=e)
    try:

        def held_at_k() -> bool:
            if proc.poll() is not None:
                return True  # exited early: the asserts below say how
            co = Coordinator.open_if_created(run)  # None until its tables are committed
            if co is None:
                return False
            with co:
                return bool(snapshot(co)["windows"]["ready"] == 2)

        wait_for(held_at_k, 300, "two windows published", poll_s=0.2)
        assert proc.poll() is None, err.read_text()[-3000:]
        assert _done_chunks(run) < 6  # still regenerating: the stream's length is unknown
        assert json.loads((run / "stream.json").read_text())["total_windows"] is None
        proc.send_signal(signal.SIGINT)
        assert proc.wait(300) == 0, err.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    summary = json.loads(out.read_text())
    assert summary["windows"] == 2 and summary["total_windows"] is None, summary
    assert str(OPEN) not in out.read_text() + err.read_text()
    with Coordinator.open(run) as co:
        table = format_table(snapshot(co))
    assert "windows  produced 2/∞  " in table and "stopped by a signal" in table, table
