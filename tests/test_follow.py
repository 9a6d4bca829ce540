"""`fanout produce --follow`: a growing log of served conversations, captured exactly once.

    .venv/bin/pytest tests/test_follow.py -x -q

An appender process writes chats (data-stage records and OpenAI request/response log
pairs, one garbage line) into a directory, splitting records across writes and rotating
its file half-way; the producer follows it, is killed with -9 and restarted (twice: the
second time once the coordinator deleted the rows of retired chunks), and ends the
stream after --follow-idle-s without a record. A consumer process reads every
window. Checked against what the appender wrote: every conversation is in exactly one
chunk or in the held-out set, held-out ones never in a chunk, every row of every chunk
reaches the consumer exactly once, and the window files never exceed K.
"""

from __future__ import annotations

import json
import logging
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
from fanout.coord.follow_log import FollowChunk
from fanout.errors import ConfigError, StaleLease
from fanout.produce.config import ProducerConfig, check_inputs
from fanout.produce.follow import FollowStream, chunk_name, openai_pair
from fanout.status.snapshot import snapshot
from fanout.status.table import format_table
from fanout.store.rundir import RunDir
from test_coordinator import make_contract, new_run
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


def committed(run: Path, db_path: str | None = None) -> list[FollowChunk]:
    """The chunks the run's coordinator committed (none before it exists)."""
    co = Coordinator.open_if_created(run, db_path=db_path)
    if co is None:
        return []
    with co:
        return co.follow_chunks()


def _pruned(run: Path) -> bool:
    """Has the run's coordinator deleted the rows of retired chunks (#52)?"""
    chunks = committed(run)
    return bool(chunks) and chunks[0].chunk > 0


def _chunk(run: Path, c: FollowChunk) -> Path:
    return run / "follow" / chunk_name(c.chunk, c.digest)


def _recorded(co: Coordinator) -> list[FollowChunk]:
    """Every chunk `co` commits from now on, as stored (the table deletes retired rows)."""
    made: list[FollowChunk] = []
    real = co.commit_follow_chunk

    def commit(preg: Any, chunk: FollowChunk) -> FollowChunk:
        made.append(real(preg, chunk))
        return made[-1]

    co.commit_follow_chunk = commit  # type: ignore[method-assign]
    return made


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("follow")
    build_tiny_assets(root, generate_corpus(60, seed=3))
    (root / "appender.py").write_text(APPENDER)
    (root / "recorder.py").write_text(RECORDER)
    return root


def _producer(
    assets: Path, src: Path, run: Path, log: Path, archive: Path | None = None
) -> subprocess.Popen[bytes]:
    cfg = tiny_producer_config(
        assets, run, follow=str(src), data=[], follow_idle_s=8.0, follow_flush_s=0.5,
        follow_chunk_records=6, holdout_fraction=0.25, max_live_windows=K, window_rows=2,
        cache_dir=str(assets / "cache"), heartbeat_s=0.3, ttl_s=3.0,
        follow_keep_windows=0,  # the reader checkpoints every step: it never rewinds
    )  # fmt: skip
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "fanout.cli", "produce", *config_flags(cfg)],
            env=ENV | ({"FANOUT_FOLLOW_ARCHIVE": str(archive)} if archive else {}),
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


def test_every_record_once_across_a_kill_with_held_out_ones_never_in_a_window(
    assets: Path, tmp_path: Path
) -> None:
    src, run = tmp_path / "src", tmp_path / "run"
    src.mkdir()
    recs = _records()
    (tmp_path / "recs.json").write_text(json.dumps(recs))
    extra = _source_records(300, start=1000)
    go = tmp_path / "go"
    appender = subprocess.Popen([sys.executable, str(assets / "appender.py"), str(src),
                                 str(tmp_path / "recs.json"), str(run / "follow"), str(go)])  # fmt: skip
    log, archive = tmp_path / "producer.log", tmp_path / "retired"
    prod = _producer(assets, src, run, log, archive)
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
        # kill -9 once half the records are written and a chunk is committed (records
        # after its position are read again by the restart), then the rest of the traffic
        wait_for(lambda: Path(f"{go}.half").exists(), 300, "half the records")
        wait_for(lambda: committed(run), 300, "a committed chunk", 0.1)
        prod.send_signal(signal.SIGKILL)
        prod.wait(30)
        prod = _producer(assets, src, run, log, archive)
        # a second kill once the coordinator deleted retired chunks' rows (#52): traffic
        # of the test's own (a second file of the source) until it has, then the restart
        # resumes from the rows left
        for rec in extra:
            if _pruned(run):
                break
            with open(src / "extra.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            recs.append(rec)
            time.sleep(0.2)
        assert _pruned(run), "no retired chunk's row was deleted"
        prod.send_signal(signal.SIGKILL)
        prod.wait(30)
        prod = _producer(assets, src, run, log, archive)
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
    skips = [x for x in text.splitlines() if "not a chat record" in x]
    assert not [x for x in skips if ":0: field" in x], skips  # a byte offset, not line 0
    # every conversation once: in exactly one committed chunk's rows, or held out. A
    # chunk's file starts with the records the one before it carried (its short rows);
    # chunks every consumer acknowledged were retired (moved to `archive` here), and the
    # coordinator's rows of the retired ones deleted (#52): the rows left are the newest
    chunks = committed(run)
    kept = sorted((run / "follow").glob("chunk-*.jsonl"))
    retired = sorted(archive.glob("chunk-*.jsonl")) if archive.is_dir() else []
    assert retired and kept, "chunks were retired, the newest kept"
    files = sorted(kept + retired, key=lambda p: p.name)  # chunk-<c>-…: in chunk order
    assert [int(p.name.split("-")[1]) for p in files] == list(range(len(files)))
    assert [p.name for p in files[-len(chunks) :]] == [_chunk(run, c).name for c in chunks]
    assert kept[-1] == _chunk(run, chunks[-1])  # the newest is never retired
    lines = [p.read_text().splitlines() for p in files]
    # a chunk's file starts with the records the one before carried (in both files)
    carried_in = [0] + [
        next((n for n, x in enumerate(ls) if x not in set(prev)), len(ls))
        for ls, prev in zip(lines[1:], lines, strict=False)
    ]  # fmt: skip
    for c in chunks:
        assert len(lines[c.chunk]) == c.records
        assert c.carried == [*carried_in, 0][c.chunk + 1]
    assert chunks[-1].carried == 0  # the stream's end keeps every row
    assert any(carried_in), "no chunk carried its short rows' records on"
    chunked = [json.loads(x) for ls, n in zip(lines, carried_in, strict=True) for x in ls[n:]]
    for ls, n, prev in zip(lines[1:], carried_in[1:], lines, strict=False):
        assert set(ls[:n]) <= set(prev), "a carried record is not the chunk before's"
    held = [json.loads(x) for x in (run / "follow" / "heldout.jsonl").read_text().splitlines()]
    want = sorted(_key((openai_pair(r) or r)["messages"]) for r in recs)
    got_chunks = [_key(d["messages"]) for d in chunked]
    got_held = {_key(d["messages"]) for d in held}
    assert len(got_chunks) == len(set(got_chunks)), "a record was captured twice"
    assert not set(got_chunks) & got_held, "a held-out conversation entered a chunk"
    assert sorted(got_chunks + sorted(got_held)) == want
    assert 0 < len(got_held) < len(recs)  # the fraction held some out, not all
    # every row of the stream reached the reader exactly once, in window order
    seen = [json.loads(x) for x in out.read_text().splitlines()]
    info = json.loads((run / "stream.json").read_text())
    rows = info["dataset_summary"]["rows_so_far"]
    # what `fanout promote --run-dir` decodes with (#52): the producer's verifier, tokenizer
    assert (info["verifier"], info["tokenizer"]) == (
        os.path.abspath(assets / "verifier"), os.path.abspath(assets / "tok"),
    )  # fmt: skip
    assert info["total_windows"] == -(-rows // 2)
    assert sorted((r["w"], r["i"]) for r in seen) == sorted({(r["w"], r["i"]) for r in seen}), (
        "a row was read twice"
    )
    assert len(seen) == rows
    assert most[0] <= K
    # `fanout status` shows the position the coordinator holds
    with Coordinator.open(run) as co:
        snap = snapshot(co)
    n = len(recs)
    assert snap["follow"] == {**snap["follow"], "chunks": len(files), "records": n,
                              "heldout": len(held), "skipped": 1}  # fmt: skip
    assert f"follow   {len(files)} chunks committed: {n} records read" in format_table(snap)


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


def test_the_coordinator_commits_each_chunk_once_in_order_fenced(
    db: str | None, tmp_path: Path
) -> None:
    """The commit point (fanout.coord.follow_log), on both databases: a chunk is committed
    once, only as the next one, only by the producer that holds the role; it is there
    for the next process that opens the run."""
    co, _, c = new_run(tmp_path, db)
    assert co.follow_chunks() == [] and co.follow_position() is None
    p = co.register_producer(c)

    def chunk(i: int, records: int = 3) -> FollowChunk:
        return FollowChunk(chunk=i, records=records, digest=f"d{i}",
                           positions={"1:2": 100 * (i + 1)},
                           counts={"records": 4 * (i + 1), "heldout": i + 1, "skipped": 0})  # fmt: skip

    co.commit_follow_chunk(p, chunk(0))
    for bad in (chunk(0), chunk(2)):  # again, or past the next one
        with pytest.raises(StaleLease, match="committed chunks"):
            co.commit_follow_chunk(p, bad)
    q = co.register_producer(c, takeover=True)  # p is fenced off from here on
    with pytest.raises(StaleLease):
        co.commit_follow_chunk(p, chunk(1))
    co.commit_follow_chunk(q, chunk(1, records=5))
    co.close()
    with Coordinator.open(tmp_path / "run", db_path=db) as again:
        got = again.follow_chunks()
        assert [(x.chunk, x.records, x.digest) for x in got] == [(0, 3, "d0"), (1, 5, "d1")]
        assert got[-1].positions == {"1:2": 200} and got[-1].stream == c.stream_id
        # only the newest keeps its positions (a row per chunk, each with every file ever
        # followed, grew quadratically over the half-hour soak)
        assert got[0].positions == {}
        pos = again.follow_position()
        assert pos is not None
        assert {k: pos[k] for k in ("chunks", "records", "heldout", "skipped")} == {
            "chunks": 2, "records": 8, "heldout": 2, "skipped": 0,
        }  # fmt: skip


def test_a_commit_deletes_the_rows_of_retired_chunks_and_the_order_still_holds(
    db: str | None, tmp_path: Path
) -> None:
    """#52: `follow_chunks` kept a row per chunk for the stream's life (~200 B a chunk).
    A commit now deletes the rows of the chunks below its `retired` (their files were
    removed), never the newest, on both databases: 50 chunks leave 3 rows. The order is
    the newest chunk's + 1, so a second committer is still refused; `fanout status`
    reads the newest row."""
    co, _, c = new_run(tmp_path, db)
    p = co.register_producer(c)

    def chunk(i: int, retired: int = 0) -> FollowChunk:
        return FollowChunk(chunk=i, records=2, digest=f"d{i}", positions={"1:2": i},
                           counts={"records": 2 * (i + 1), "heldout": 0, "skipped": 0},
                           rows=1, first_row=i, retired=retired)  # fmt: skip

    for i in range(50):
        co.commit_follow_chunk(p, chunk(i, retired=max(0, i - 2)))
        assert len(co.follow_chunks()) <= 3
    got = co.follow_chunks()
    assert [x.chunk for x in got] == [47, 48, 49]
    assert got[-1].positions == {"1:2": 49} and (got[0].first_row, got[-1].retired) == (47, 47)
    co.commit_follow_chunk(p, chunk(50, retired=99))  # never the newest
    assert [x.chunk for x in co.follow_chunks()] == [50]
    # a second committer (one that resumed fewer chunks, or cuts one twice) is refused by
    # the order, as by the fencing token (the test above): rows or none below
    for bad in (chunk(0), chunk(49), chunk(50), chunk(52)):
        with pytest.raises(StaleLease, match="the run has 51 committed chunks"):
            co.commit_follow_chunk(p, bad)
    co.commit_follow_chunk(p, chunk(51, retired=50))
    co.close()
    with Coordinator.open(tmp_path / "run", db_path=db) as again:
        assert [x.chunk for x in again.follow_chunks()] == [50, 51]
        pos = again.follow_position()
        assert pos is not None and (pos["chunks"], pos["records"]) == (52, 104), pos


def _source_records(n: int, start: int = 0) -> list[dict[str, Any]]:
    out = []
    for i, c in enumerate(generate_corpus(n, seed=5 + start)):
        msgs = [dict(m) for m in c["messages"]]
        msgs[0]["content"] += f" [s{start + i}]"
        out.append({"messages": msgs})
    return out


def test_a_chunk_written_but_not_committed_is_read_and_written_again(
    assets: Path, tmp_path: Path
) -> None:
    """In process, the two places a kill can fall: after the first chunk but before the
    run exists (nothing committed), and between a chunk's file and its commit. Each
    time the next start drops the uncommitted file and reads its records again from
    the last committed position; the committed chunks hold every record once, and a
    committed chunk that changed on disk is refused in one line."""
    src, run = tmp_path / "log.jsonl", tmp_path / "run"
    recs = _source_records(6)
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = tiny_producer_config(
        assets, run, follow=str(src), data=[], follow_flush_s=0.05, follow_chunk_records=100,
        cache_dir=str(assets / "cache"),
    )  # fmt: skip
    cache = str(assets / "cache")

    def make_prep(chunk: str) -> Any:
        return cfg.prepare_config(cache, data=[chunk])

    rd = RunDir(run).create()
    first = FollowStream.open(make_prep, cfg, rd)  # no run yet: chunk 0 is not committed
    assert first.files[0].is_file() and len(first.uncommitted) == 1
    more = _source_records(4, start=100)
    with open(src, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in more))
    # killed there; the next start creates the run, so chunk 0 is cut again, with all ten
    co = Coordinator.create(run, make_contract())
    p = co.register_producer(make_contract())
    second = FollowStream.open(make_prep, cfg, rd)
    second.attach(co, p)
    assert [x.records for x in co.follow_chunks()] == [10]
    assert not first.files[0].exists()  # the one never committed is gone
    assert sorted((run / "follow").glob("chunk-*.jsonl")) == second.files

    # a kill between chunk 1's file and its commit
    tail = _source_records(3, start=200)
    with open(src, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in tail))

    class Killed(Exception):
        pass

    def killed(*_: Any) -> FollowChunk:
        raise Killed("killed before the commit")

    def polled(s: FollowStream, chunks: int) -> bool:
        s.poll()
        return len(co.follow_chunks()) == chunks

    real = co.commit_follow_chunk
    co.commit_follow_chunk = killed  # type: ignore[method-assign,assignment]
    with pytest.raises(Killed):
        wait_for(lambda: polled(second, 2), 10, "a cut", 0.05)
    assert len(list((run / "follow").glob("chunk-*.jsonl"))) == 2
    assert len(co.follow_chunks()) == 1
    co.commit_follow_chunk = real  # type: ignore[method-assign]
    third = FollowStream.open(make_prep, cfg, rd)  # resumes chunk 0; chunk 1 is cut again
    assert len(third.rows.parts) == 1
    third.attach(co, p)
    wait_for(lambda: polled(third, 2), 10, "chunk 1 again", 0.05)
    assert [x.records for x in co.follow_chunks()] == [10, 3]
    assert sorted((run / "follow").glob("chunk-*.jsonl")) == [
        _chunk(run, c) for c in co.follow_chunks()
    ]
    st = src.stat()
    assert co.follow_chunks()[-1].positions == {f"{st.st_dev}:{st.st_ino}": st.st_size}
    got = [json.loads(x)["messages"][0]["content"] for c in co.follow_chunks()
           for x in _chunk(run, c).read_text().splitlines()]  # fmt: skip
    want = [r["messages"][0]["content"] for r in recs + more + tail]
    assert got == want  # every record once, in order
    assert len(third.rows.parts) == 2 and third.rows.num_rows > second.rows.num_rows
    # a start that resumed fewer chunks than are committed when it registers (it took a
    # live producer over, which committed meanwhile) stops before it commits anything
    fourth = FollowStream.open(make_prep, cfg, rd)
    zero = _chunk(run, co.follow_chunks()[0])
    co.commit_follow_chunk(p, FollowChunk(chunk=2, records=0, digest="x", positions={},
                                          counts={}))  # fmt: skip
    with pytest.raises(StaleLease, match="another producer committed while it started"):
        fourth.attach(co, p)
    co.close()
    zero.write_text(zero.read_text()[:-2] + "\n")
    with pytest.raises(ConfigError, match=r"\.jsonl: not the follow chunk 0"):
        FollowStream.open(make_prep, cfg, rd)


def test_rotation_races_neither_repeat_nor_skip_a_record(
    assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two races of a rotation, made to happen: a directory listing taken while the file
    is renamed misses it (the soak saw its records read twice when its position was
    dropped then), and a listing that named the file before the rename while the open
    after it finds the new file (whose bytes are not the old file's)."""
    from fanout.produce import follow

    src = tmp_path / "src"
    src.mkdir()
    path = src / "log.jsonl"
    recs = _source_records(6)

    def append(target: Path, rs: list[dict[str, Any]]) -> None:
        with open(target, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rs))

    append(path, recs[:3])
    cfg = tiny_producer_config(assets, tmp_path / "run", follow=str(src), data=[])
    s = FollowStream(lambda chunk: cfg.prepare_config(str(tmp_path), data=[chunk]), cfg,
                     RunDir(tmp_path / "run").create())  # fmt: skip
    assert s._read() == 3
    real = follow._sources
    monkeypatch.setattr(follow, "_sources", lambda root: [])  # the file under neither name
    assert s._read() == 0
    monkeypatch.setattr(follow, "_sources", real)
    path.rename(src / "log.jsonl.1")
    append(path, recs[3:4])
    assert s._read() == 1  # the new file only: the old one's position was kept
    old = (src / "log.jsonl.1").stat()
    stale = [follow._File(path, f"{old.st_dev}:{old.st_ino}")]  # listed as the old file
    monkeypatch.setattr(follow, "_sources", lambda root: stale)
    append(path, recs[4:6])
    assert s._read() == 0  # opened the new file under the old one's key: left for later
    monkeypatch.setattr(follow, "_sources", real)
    assert s._read() == 2
    got = [d["messages"][0]["content"] for d in s.pending]
    assert got == [r["messages"][0]["content"] for r in recs]


def test_an_over_length_record_is_counted_and_named_by_its_place_in_the_source(
    assets: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """#52: a record longer than --seq-len was split across rows silently. Now each split
    is counted (the chunk's committed counts, so status and /metrics) and warned about
    with the source file and the record's byte offset."""
    src, run = tmp_path / "log.jsonl", tmp_path / "run"
    recs = _source_records(3)
    recs[1]["messages"][-1]["content"] = " ".join(["many words"] * 400)  # >> seq_len 96
    lines = [json.dumps(r) + "\n" for r in recs]
    src.write_text("".join(lines))
    cfg = tiny_producer_config(
        assets, run, follow=str(src), data=[], follow_flush_s=0.05, follow_chunk_records=100,
        cache_dir=str(assets / "cache"), holdout_fraction=0.0,
    )  # fmt: skip
    cache = str(assets / "cache")
    with caplog.at_level(logging.WARNING, logger="fanout"):
        s = FollowStream.open(lambda chunk: cfg.prepare_config(cache, data=[chunk]), cfg,
                              RunDir(run).create())  # fmt: skip
    assert s.counts["split"] == 1 and s.counts["records"] == 3, s.counts
    said = [r.getMessage() for r in caplog.records if "split across rows" in r.getMessage()]
    assert said == [
        f"--follow: {src}: byte {len(lines[0].encode())}: longer than --seq-len 96 tokens, "
        "split across rows (--over-length split)"
    ], said


def test_rows_carry_across_chunks_and_what_all_acknowledged_leaves_the_disk(
    assets: Path, tmp_path: Path
) -> None:
    """#52: each chunk was packed alone (70 % real tokens at ~1 record/s) and its file
    and prepared rows stayed for the stream's life. Now a chunk keeps only its rows at
    least FULL_FILL real tokens and carries the others' records into the next chunk, and
    once every consumer acknowledged a chunk's windows its file and its prepared rows
    (the run's cache entry) go: 40 chunks cut, the disk holds a few. A restart resumes
    the retired chunks by their row counts and the newest chunk's carried records; the
    stream's end keeps every row, and every record is in exactly one chunk's rows. The
    coordinator's rows go with them (a row per chunk grew the database with the stream):
    the table holds a few rows, not 40, and a restart after that resumes exactly."""
    from fanout.produce import follow

    src, run, cache = tmp_path / "log.jsonl", tmp_path / "run", tmp_path / "cache"
    src.write_text("")
    cfg = tiny_producer_config(
        assets, run, follow=str(src), data=[], seq_len=256, window_rows=2,
        follow_flush_s=1e6, follow_chunk_records=2, cache_dir=str(cache), holdout_fraction=0.0,
        follow_keep_windows=1,  # retire a chunk once every consumer is a window past it
    )  # fmt: skip

    def make_prep(chunk: str) -> Any:
        return cfg.prepare_config(str(cache), data=[chunk])

    def disk() -> tuple[int, int]:
        files = list((run / "follow").glob("chunk-*.jsonl"))
        return len(files), len(list((cache / "prepared").glob("*")))

    rd = RunDir(run).create()
    co = Coordinator.create(run, make_contract())
    p = co.register_producer(make_contract())
    s = FollowStream(make_prep, cfg, rd)
    s.fs.makedirs(s.dir)
    made = _recorded(co)  # every commit as stored: the table keeps the newest few
    s.attach(co, p)
    recs = _source_records(80)
    most, rows_most = (0, 0), 0
    for i in range(0, 80, 2):
        with open(src, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in recs[i : i + 2]))
        s.poll()  # two new records: a cut (--follow-chunk-records 2)
        co.register_consumer("t", cursor=s.ready_windows, takeover=True)  # acked all so far
        s.retire()
        most = max(most[0], disk()[0]), max(most[1], disk()[1])
        rows_most = max(rows_most, len(co.follow_chunks()))
    assert [c.chunk for c in made] == list(range(40)) and s.retired >= 30
    # files and cache entries: the chunks of the windows not yet acknowledged, not 40
    assert most[0] <= 14 and most[1] <= 14, most  # ~6 chunks a window, 1 kept back
    # and their coordinator rows: a retired chunk's row goes at the next commit
    left = co.follow_chunks()
    assert rows_most <= most[0] + 1 and left[0].chunk > 0, (rows_most, left[0].chunk)
    assert [c.chunk for c in left] == list(range(left[0].chunk, 40))
    assert left[-1] == made[-1] and left[0].first_row == s.rows.starts[left[0].chunk]
    assert co.follow_position() == {**(co.follow_position() or {}), "chunks": 40}
    assert any(c.carried for c in made) and s.carry
    tokens = s.summary()["row_fill"]
    assert tokens >= follow.FULL_FILL, tokens  # only full rows went out (no record was due)
    # a restart: the retired chunks by their row counts, the newest chunk's carried records
    co.close()
    # (the chunks whose rows were deleted: one count, on the last of them; the rows from
    # the first chunk with a row on as before)
    again = FollowStream.open(make_prep, cfg, rd)
    assert again.rows.num_rows == s.rows.num_rows and again.retired == s.retired
    assert again.carry == s.carry and len(again.files) == len(s.files) == 40
    base = left[0].chunk
    assert again.rows.starts[base:] == s.rows.starts[base:]
    with Coordinator.open(run) as co2:
        later = _recorded(co2)
        again.attach(co2, p)
        again._cut(end=True)  # the stream's end: every row kept, nothing carried on
        assert [c.chunk for c in co2.follow_chunks()][-1] == 40
    chunks = made + later
    assert [c.chunk for c in chunks] == list(range(41))
    assert chunks[-1].carried == 0 and not again.carry
    new = [c.records - prev.carried for c, prev in zip(chunks[1:], chunks, strict=False)]
    assert chunks[0].records + sum(new) == 80  # every record once in some chunk's rows
    assert [c.first_row for c in chunks] == [*s.rows.starts[:40], again.rows.starts[40]]


def _stream_on_a_fake_clock(
    assets: Path, src: Path, run: Path, **fields: Any
) -> tuple[Any, Coordinator, FollowStream, list[float]]:
    """A follow stream of `src` attached to a new run, on a clock the test moves
    (`now[0]`), --follow-idle-s 5: (its config, the coordinator, the stream, now)."""
    cfg = tiny_producer_config(
        assets, run, follow=str(src), data=[], follow_idle_s=5.0,
        cache_dir=str(assets / "cache"), **fields,
    )  # fmt: skip
    cache = str(assets / "cache")
    co = Coordinator.create(run, make_contract())
    p = co.register_producer(make_contract())
    s = FollowStream(
        lambda chunk: cfg.prepare_config(cache, data=[chunk]), cfg, RunDir(run).create()
    )
    s.fs.makedirs(s.dir)
    now = [0.0]
    s.clock = lambda: now[0]
    s.attach(co, p)
    return cfg, co, s, now


def test_a_held_out_record_read_after_the_last_chunk_is_kept_at_the_idle_end(
    assets: Path, tmp_path: Path
) -> None:
    """The live loop's soak (test_follow_soak.py) lost its last record: held out, read
    after the last chunk was cut, then --follow-idle-s ended the stream with nothing
    pending, so no chunk was cut again and neither R/follow/heldout.jsonl nor the
    committed counts ever had it. The idle end now cuts a last chunk (no rows) when
    records arrived after the last one. A fake clock: no timing."""
    src, run = tmp_path / "log.jsonl", tmp_path / "run"
    cfg, co, s, now = _stream_on_a_fake_clock(
        assets, src, run, follow_chunk_records=3, holdout_fraction=0.5
    )
    pool = _source_records(40, start=300)
    kept = [r for r in pool if not s._held_out(r)][:3]
    held = next(r for r in pool if s._held_out(r))
    src.write_text("".join(json.dumps(r) + "\n" for r in kept))
    s.poll()  # three records: a chunk
    assert [c.records for c in co.follow_chunks()] == [3] and not s.pending
    with open(src, "a") as f:
        f.write(json.dumps(held) + "\n")
    now[0] = 1.0
    s.poll()  # read: held out, nothing pending
    now[0] = 7.0
    s.poll()  # --follow-idle-s without a record: the end
    assert s.ended
    saved = [json.loads(x) for x in (run / "follow" / "heldout.jsonl").read_text().splitlines()]
    assert [d["messages"][0]["content"] for d in saved] == [held["messages"][0]["content"]]
    pos = co.follow_position()
    assert pos is not None and (pos["records"], pos["heldout"]) == (4, 1), pos
    assert [c.records for c in co.follow_chunks()] == [3, 0]  # the last one: no rows
    co.close()
    cache = str(assets / "cache")
    again = FollowStream.open(
        lambda chunk: cfg.prepare_config(cache, data=[chunk]), cfg, RunDir(run)
    )
    assert len(again.files) == 2 and again.rows.num_rows == s.rows.num_rows  # resumes it


def test_a_skipped_line_read_after_the_last_chunk_is_counted_at_the_idle_end(
    assets: Path, tmp_path: Path
) -> None:
    """A line that is not a chat, read after the last chunk was cut, then --follow-idle-s
    ended the stream: no record was pending or carried, so no chunk was cut again and the
    committed counts (`fanout status`, /metrics) never had the skip, nor the position its
    bytes (a restart read it again). The idle end now cuts a last chunk (no rows) when a
    line was skipped after the last one. A fake clock: no timing."""
    src, run = tmp_path / "log.jsonl", tmp_path / "run"
    cfg, co, s, now = _stream_on_a_fake_clock(
        assets, src, run, follow_chunk_records=100, follow_flush_s=1.0
    )
    src.write_text("".join(json.dumps(r) + "\n" for r in _source_records(3, start=500)))
    s.poll()  # three records read at t=0
    now[0] = 1.0
    s.poll()  # they waited --follow-flush-s: a chunk keeping all their rows, none carried
    assert [c.records for c in co.follow_chunks()] == [3] and not s.pending and not s.carry
    with open(src, "a") as f:
        f.write('{"messages": "not a list"}\nthis is not json\n')
    now[0] = 2.0
    s.poll()  # read: both skipped, nothing pending
    now[0] = 7.0
    s.poll()  # --follow-idle-s without a record: the end
    assert s.ended
    pos = co.follow_position()
    assert pos is not None and (pos["records"], pos["skipped"]) == (3, 2), pos
    chunks = co.follow_chunks()
    assert [c.records for c in chunks] == [3, 0]  # the last one: no rows
    assert list(chunks[-1].positions.values()) == [src.stat().st_size]  # read to the end
    co.close()
    cache = str(assets / "cache")
    again = FollowStream.open(
        lambda chunk: cfg.prepare_config(cache, data=[chunk]), cfg, RunDir(run)
    )
    assert again.counts["skipped"] == 2 and again.rows.num_rows == s.rows.num_rows
