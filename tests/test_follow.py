"""`fanout produce --follow`: a growing log of served conversations, captured exactly once.

    .venv/bin/pytest tests/test_follow.py -x -q

An appender process writes chats (data-stage records and OpenAI request/response log
pairs, one garbage line) into a directory, splitting records across writes and rotating
its file half-way; the producer follows it, is killed with -9 and restarted, and ends
the stream after --follow-idle-s without a record. A consumer process reads every
window. Checked against what the appender wrote: every conversation is in exactly one
chunk or in the held-out set, held-out ones never in a chunk, every row of every chunk
reaches the consumer exactly once, and the window files never exceed K.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fanout.bench.assets import generate_corpus
from fanout.coord.coordinator import Coordinator
from fanout.errors import ConfigError
from fanout.produce.config import ProducerConfig, check_inputs
from fanout.produce.follow import openai_pair
from tiny_run import (  # noqa: F401 (one_thread: an autouse fixture)
    RECORDER,
    build_tiny_assets,
    config_flags,
    one_thread,
    tiny_producer_config,
    wait_for,
)

ENV = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
K = 3
N = 48  # conversations the appender writes

# `python appender.py SRC_DIR RECORDS_JSON READY_DIR GO`: once READY_DIR exists, one
# record every ~200 ms (half of them, then GO.half is made and it waits for GO), each
# written in two
# parts (the first flushed without its newline), the file rotated a third of the way,
# one line that is not a chat.
APPENDER = """
import json, os, sys, time
src, recs, ready, go = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3], sys.argv[4]
while not os.path.isdir(ready):  # the producer follows: it made its chunk directory
    time.sleep(0.05)
path = os.path.join(src, "log.jsonl")
f = open(path, "ab")
for i, r in enumerate(recs):
    if i == len(recs) // 3:
        f.close(); os.rename(path, path + ".1"); f = open(path, "ab")
    if i == len(recs) // 2:  # half written: wait until the test has killed the producer
        open(go + ".half", "w").close()
        while not os.path.exists(go):
            time.sleep(0.05)
    if i == 5:
        f.write(b"this is not json\\n")
    line = (json.dumps(r) + "\\n").encode()
    f.write(line[: len(line) // 2]); f.flush(); time.sleep(0.1)
    f.write(line[len(line) // 2 :]); f.flush(); time.sleep(0.1)
f.close()
"""


def _records() -> list[dict[str, Any]]:
    """Chats in the data stage's shape, every third as an OpenAI log pair."""
    out = []
    for i, c in enumerate(generate_corpus(N, seed=11)):
        msgs = [dict(m) for m in c["messages"]]
        msgs[0]["content"] += f" [{i}]"  # every conversation distinct: counted by content
        c = c | {"messages": msgs}
        if i % 3 == 0:
            out.append({"request": {"model": "v", "messages": msgs[:-1]},
                        "response": {"choices": [{"index": 0, "message": msgs[-1]}]}})  # fmt: skip
        else:
            out.append(c)
    return out


def _key(messages: list[dict[str, Any]]) -> str:
    return json.dumps([(m["role"], m["content"]) for m in messages])


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("follow")
    build_tiny_assets(root, generate_corpus(60, seed=3))
    (root / "appender.py").write_text(APPENDER)
    (root / "recorder.py").write_text(RECORDER)
    return root


def _producer(assets: Path, src: Path, run: Path, log: Path) -> subprocess.Popen[bytes]:
    cfg = tiny_producer_config(
        assets, run, follow=str(src), data=[], follow_idle_s=8.0, follow_flush_s=0.5,
        follow_chunk_records=6, holdout_fraction=0.25, max_live_windows=K, window_rows=2,
        cache_dir=str(assets / "cache"), heartbeat_s=0.3, ttl_s=3.0,
    )  # fmt: skip
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "fanout.cli", "produce", *config_flags(cfg)],
            env=ENV, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


def test_every_record_once_across_a_kill_with_held_out_ones_never_in_a_window(
    assets: Path, tmp_path: Path
) -> None:
    src, run = tmp_path / "src", tmp_path / "run"
    src.mkdir()
    recs = _records()
    (tmp_path / "recs.json").write_text(json.dumps(recs))
    go = tmp_path / "go"
    appender = subprocess.Popen([sys.executable, str(assets / "appender.py"), str(src),
                                 str(tmp_path / "recs.json"), str(run / "follow"), str(go)])  # fmt: skip
    log = tmp_path / "producer.log"
    prod = _producer(assets, src, run, log)
    wait_for(lambda: Coordinator.open_if_created(run) is not None, 120, "the run", 0.05)
    out, ckpt = tmp_path / "seen.jsonl", tmp_path / "ckpt.json"
    args = {"run_dir": str(run), "out": str(out), "ckpt": str(ckpt), "sleep": 0.05,
            "every": 1, "cfg": {"consumer_id": "reader"}}  # fmt: skip
    reader = subprocess.Popen([sys.executable, str(assets / "recorder.py"), json.dumps(args)],
                              env=ENV)  # fmt: skip
    most = [0]
    stop = threading.Event()

    def sample() -> None:  # window files on disk, every 20 ms
        while not stop.is_set():
            d = run / "windows"
            n = len([p for p in d.iterdir() if p.suffix == ".safetensors"]) if d.is_dir() else 0
            most[0] = max(most[0], n)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        # kill -9 once half the records are written and a chunk is in (records after its
        # manifest are read again by the restart), then the rest of the traffic
        wait_for(lambda: Path(f"{go}.half").exists(), 300, "half the records")
        wait_for(lambda: len(list((run / "follow").glob("chunk-*.json"))) >= 1, 300, "a chunk")
        prod.send_signal(signal.SIGKILL)
        prod.wait(30)
        prod = _producer(assets, src, run, log)
        go.touch()
        assert appender.wait(120) == 0
        assert prod.wait(180) == 0, log.read_text()[-3000:]
        assert reader.wait(180) == 0
    finally:
        stop.set()
        for p in (appender, prod, reader):
            if p.poll() is None:
                p.kill()
                p.wait(30)
    text = log.read_text()
    assert "not a chat record, skipped" in text and "byte " in text
    # every conversation once: in exactly one chunk, or held out
    chunked = [json.loads(x) for c in sorted((run / "follow").glob("chunk-*.jsonl"))
               for x in c.read_text().splitlines()]  # fmt: skip
    held = [json.loads(x) for x in (run / "follow" / "heldout.jsonl").read_text().splitlines()]
    want = sorted(_key((openai_pair(r) or r)["messages"]) for r in recs)
    got_chunks = [_key(d["messages"]) for d in chunked]
    got_held = {_key(d["messages"]) for d in held}
    assert len(got_chunks) == len(set(got_chunks)), "a record was captured twice"
    assert not set(got_chunks) & got_held, "a held-out conversation entered a chunk"
    assert sorted(got_chunks + sorted(got_held)) == want
    assert 0 < len(got_held) < N  # the fraction held some out, not all
    # every row of the stream reached the reader exactly once, in window order
    seen = [json.loads(x) for x in out.read_text().splitlines()]
    info = json.loads((run / "stream.json").read_text())
    rows = info["dataset_summary"]["rows_so_far"]
    assert info["total_windows"] == -(-rows // 2)
    assert sorted((r["w"], r["i"]) for r in seen) == sorted({(r["w"], r["i"]) for r in seen}), (
        "a row was read twice"
    )
    assert len(seen) == rows
    assert most[0] <= K


def test_follow_refuses_bad_input_in_one_line(assets: Path, tmp_path: Path) -> None:
    base = tiny_producer_config(assets, tmp_path / "run")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"follow": str(tmp_path / "nope")}, "no such file or directory"),
        ({"follow": str(assets), "replicas": 2}, "--follow with --replicas"),
        ({"follow": str(assets), "epochs": 2}, "one epoch"),
    ]
    for update, needle in cases:
        cfg = ProducerConfig(**(base.model_dump() | {"data": []} | update))
        with pytest.raises(ConfigError, match=needle):
            check_inputs(cfg)
    assert not (tmp_path / "run").exists()  # refused before the run dir is touched
