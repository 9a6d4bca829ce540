"""The consumer stream: order, row shuffling, acks, exact resume, kill -9, detach.

    .venv/bin/pytest tests/test_consumer.py -x -q

Windows come from the real producer over a random tiny Qwen3 (512-token BPE).
The shared run never evicts (it expects more consumers than ever register), so
every test reads the same windows without a producer running.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fanout.bench.assets import generate_corpus
from fanout.coord.coordinator import Coordinator
from fanout.produce.config import ProducerConfig
from fanout.produce.producer import Producer
from fanout.store.store import RunDir, Store
from fanout.store.windowfile import hidden_name
from fanout.train.consumer import ConsumerConfig, ConsumerStream, row_order
from fanout.train.trainlog import read_train_log
from tiny_run import (  # noqa: F401 (one_thread: an autouse fixture)
    ENV,
    RECORDER,
    build_tiny_assets,
    one_thread,
    run_recorder,
    tiny_producer_config,
    wait_for,
)
from window_files import window_names

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Env:
    root: Path
    run_dir: Path
    verifier: Path
    data: Path
    tokenizer: Path
    total: int
    rows: list[int]  # rows per window


def _producer_cfg(root: Path, run_dir: Path, **kw: Any) -> ProducerConfig:
    never_evict = {"max_live_windows": 1000, "expected_consumers": 1000}
    return tiny_producer_config(
        root, run_dir, **(never_evict | {"cache_dir": str(root / "cache"), "heartbeat_s": 0.3} | kw)
    )


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    root = tmp_path_factory.mktemp("consumer")
    data, tok, ver = build_tiny_assets(root, generate_corpus(120, seed=0))
    p = Producer(_producer_cfg(root, root / "run"))
    p.run()
    store = Store(RunDir(root / "run"))
    rows = []
    for name in window_names(store):
        with store.open(name) as r:
            rows.append(r.rows)
    (root / "recorder.py").write_text(RECORDER)
    return Env(root, root / "run", ver, data, tok, p.total_windows, rows)


def _ccfg(env: Env, name: str, seed: int = 0) -> ConsumerConfig:
    return ConsumerConfig(
        run_dir=str(env.run_dir), consumer_id=name, row_shuffle_seed=seed, heartbeat_s=0.3
    )


def _expected(env: Env, seed: int) -> list[tuple[int, int]]:
    return [(w, int(i)) for w in range(env.total) for i in row_order(w, env.rows[w], seed)]


def _db(env: Env, sql: str, *args: Any) -> list[Any]:
    with Coordinator.open(env.run_dir) as c:
        return c.conn.execute(sql, args).fetchall()


def test_row_order_is_a_seeded_permutation() -> None:
    a = row_order(5, 16, seed=3)
    assert sorted(a.tolist()) == list(range(16))
    np.testing.assert_array_equal(a, row_order(5, 16, seed=3))
    assert not np.array_equal(a, row_order(5, 16, seed=4))  # consumers differ by seed
    assert not np.array_equal(a, row_order(6, 16, seed=3))  # and windows differ
    assert not np.array_equal(a, np.arange(16))


def test_windows_in_order_rows_shuffled_acks_after_the_step(env: Env) -> None:
    assert env.total >= 6
    store = Store(RunDir(env.run_dir))
    seen: list[tuple[int, int]] = []
    cid = "order:dp0"
    with ConsumerStream(_ccfg(env, "order", seed=3)) as s:
        for b in s.batches(3):  # 3 rows per step over 4-row windows: batches span windows
            ends = {w: int(row_order(w, env.rows[w], 3)[-1]) for w, _ in b.rows}
            assert [ow.window for ow in b.completes] == [w for w, i in b.rows if i == ends[w]]
            for j, (w, i) in enumerate(b.rows):  # tensors are those rows of the window files
                name = _db(env, "SELECT name FROM windows WHERE window=?", w)[0][0]
                with store.open(name) as r:
                    assert torch.equal(b.tensors["input_ids"][j], r.get("input_ids")[i])
                    hidden = torch.cat([r.get(hidden_name(k))[i] for k in (1, 2)], -1)
                    assert torch.equal(b.tensors["hidden_states"][j], hidden)  # [T, n·H]
            before = _db(env, "SELECT cursor FROM consumers WHERE id=?", cid)[0][0]
            leased = {w for (w,) in _db(env, "SELECT window FROM leases WHERE consumer=?", cid)}
            done = [ow.window for ow in b.completes]
            assert set(done) <= leased  # still leased until the step is acked
            s.ack(b)
            after = _db(env, "SELECT cursor FROM consumers WHERE id=?", cid)[0][0]
            assert after == (max(done) + 1 if done else before)
            leased = {w for (w,) in _db(env, "SELECT window FROM leases WHERE consumer=?", cid)}
            assert not set(done) & leased
            w_last, i_last = b.rows[-1]
            consumed = [i for w, i in [*seen, *b.rows] if w == w_last]
            want = (w_last + 1, 0) if i_last == ends[w_last] else (w_last, len(consumed))
            assert b.next_position == want
            seen += b.rows
    assert seen == _expected(env, 3)
    assert seen != _expected(env, 4)
    assert _db(env, "SELECT state FROM consumers WHERE id=?", cid)[0][0] == "finished"
    assert _db(env, "SELECT COUNT(*) FROM leases WHERE consumer=?", cid)[0][0] == 0


def test_data_parallel_ranks_read_disjoint_equal_shards_of_every_window(env: Env) -> None:
    """Two ranks of one consumer: every window, half its rows each, no row twice, the
    same number of steps (a window with an odd row count loses one row, said in the log)."""
    seen: dict[int, list[tuple[int, int]]] = {}
    steps: dict[int, int] = {}
    for rank in (0, 1):
        cfg = _ccfg(env, "dp", seed=5).model_copy(update={"dp_rank": rank, "dp_world_size": 2})
        with ConsumerStream(cfg) as s:
            seen[rank], steps[rank] = [], 0
            for b in s.batches(1):
                seen[rank] += b.rows
                steps[rank] += 1
                s.ack(b)
    assert steps[0] == steps[1] and not set(seen[0]) & set(seen[1])
    want = {
        (w, int(i))
        for w in range(env.total)
        for i in row_order(w, env.rows[w], 5)[: env.rows[w] // 2 * 2]
    }
    assert set(seen[0]) | set(seen[1]) == want
    assert _db(env, "SELECT state FROM consumers WHERE id LIKE 'dp:%'") == [("finished",)] * 2
    with pytest.raises(ValueError, match="dp_rank 2 >= dp_world_size 2"):
        ConsumerConfig(run_dir="x", consumer_id="c", dp_rank=2, dp_world_size=2)


def test_windows_with_no_rows_for_a_rank_are_acked_to_the_stream_end(env: Env) -> None:
    """More data-parallel ranks than a window has rows: each rank's shard is empty. Such
    windows are acked with the next batch, and when the stream ends on them (no next
    batch) they are acked at once, so every rank's cursor reaches the end (it stopped
    one window short, holding the last window and showing lag 1, before)."""
    world = max(env.rows) + 1  # no rank gets a row of any window
    for rank in range(2):  # two of the ranks are enough: each acks on its own
        cfg = _ccfg(env, "wide").model_copy(update={"dp_rank": rank, "dp_world_size": world})
        with ConsumerStream(cfg) as s:
            assert list(s.batches(1)) == []
            assert s.state_dict()["cursor"] == env.total
    got = _db(env, "SELECT cursor, state FROM consumers WHERE id IN ('wide:dp0', 'wide:dp1')")
    assert got == [(env.total, "finished")] * 2


def test_resume_at_cursor_and_rows_done_continues_at_the_next_row(env: Env) -> None:
    want = _expected(env, 1)
    for stop in (2, 5, 7):  # a window boundary and mid-window positions (4-row windows)
        name = f"resume{stop}"
        got: list[tuple[int, int]] = []
        with ConsumerStream(_ccfg(env, name, seed=1)) as s:
            for n, b in enumerate(s.batches(3), 1):
                got += b.rows
                s.ack(b)
                if n == stop:
                    pos = b.next_position
                    break
        assert got == want[: 3 * stop]
        s = ConsumerStream(_ccfg(env, name, seed=1))
        s.load_state_dict({"cursor": pos[0], "rows_done": pos[1]})
        with s:
            for b in s.batches(3):
                got += b.rows
                s.ack(b)
        assert got == want, stop


def test_killed_consumer_resumes_from_its_checkpoint(env: Env, tmp_path: Path) -> None:
    out, ckpt = tmp_path / "rows.jsonl", tmp_path / "ckpt.json"
    args = {"run_dir": str(env.run_dir), "out": str(out), "ckpt": str(ckpt),
            "cfg": {"consumer_id": "rec", "row_shuffle_seed": 5}}  # fmt: skip

    def recorded() -> list[dict[str, Any]]:
        return [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []

    run_recorder(env.root / "recorder.py", args, until=lambda: len(recorded()) >= 10)
    state = json.loads(ckpt.read_text())
    first = recorded()
    want = _expected(env, 5)
    assert len(first) < len(want), "the kill came after the end; test is vacuous"
    assert [(r["w"], r["i"]) for r in first] == want[: len(first)]
    assert state["seen"] <= len(first)
    run_recorder(env.root / "recorder.py", args)  # to the end
    second = [(r["w"], r["i"]) for r in recorded()[len(first) :]]
    # every row after the checkpoint, in order; rows between checkpoint and kill come again
    assert second == want[state["seen"] :]
    assert state["rows_done"] > 0 or state["seen"] % 4 == 0


def test_detached_trainer_exits_3_with_a_clear_message(env: Env, tmp_path: Path) -> None:
    run = tmp_path / "run"
    p = Producer(
        _producer_cfg(
            env.root,
            run,
            epochs=3,
            max_live_windows=2,
            lag_policy="detach",
            expected_consumers=2,
            ttl_s=1.5,
        )
    )
    with Coordinator.open(run) as c:  # a leader far ahead (it read everything)
        c.register_consumer("leader", cursor=p.total_windows)
    save = tmp_path / "draft"
    cmd = [sys.executable, str(REPO / "scripts" / "train.py"), "--run-dir", str(run),
           "--consumer-id", "slow", "--verifier-name-or-path", str(env.verifier),
           "--block-size", "4", "--max-anchors", "8", "--rows-per-step", "1",
           "--save-path", str(save), "--heartbeat-s", "0.3"]  # fmt: skip
    errf = open(tmp_path / "trainer.err", "w")  # noqa: SIM115 - closed below
    trainer = subprocess.Popen(cmd, env=ENV, stdout=errf, stderr=subprocess.STDOUT)

    def pause_then_resume() -> None:
        # Once it trains, freeze it: it holds the producer at K until the lag policy
        # detaches it (after ttl_s blocked); then let it run into the news.
        try:
            wait_for(lambda: read_train_log(save) != [], 120, "a first step")
            trainer.send_signal(signal.SIGSTOP)
            wait_for(lambda: _db_state(run, "slow:dp0") == "detached", 60, "the trainer's detach")
        finally:
            trainer.send_signal(signal.SIGCONT)

    t = threading.Thread(target=pause_then_resume, daemon=True)
    t.start()
    try:
        summary = p.run()
        t.join(60)
        rc = trainer.wait(60)
    finally:
        if trainer.poll() is None:
            trainer.kill()
        errf.close()
    err = (tmp_path / "trainer.err").read_text()
    assert rc == 3, err[-2000:]
    assert "slow: consumer slow:dp0 was detached (by the detach lag policy" in err
    assert "saved a checkpoint at step" in err and "--resume" in err  # nothing trained lost
    assert summary["windows"] == p.total_windows  # the producer went on without it
    with Coordinator.open(run) as c:
        assert int(c.meta("detaches")) == 1


def _db_state(run: Path, cid: str) -> str | None:
    with Coordinator.open(run) as c:
        row = c.conn.execute("SELECT state FROM consumers WHERE id=?", (cid,)).fetchone()
    return None if row is None else str(row[0])


def test_close_cancels_a_prefetch_waiting_for_an_unproduced_window(
    env: Env, tmp_path: Path
) -> None:
    """The producer stopped after 2 windows of a longer stream: reading window 1 starts
    a prefetch of window 2 that would wait acquire_timeout_s (600 s). Closing the
    stream (a trainer at --max-steps, or stopping on SIGTERM) must not wait for it."""
    run = tmp_path / "run"
    Producer(_producer_cfg(env.root, run, max_windows=2)).run()
    cfg = ConsumerConfig(run_dir=str(run), consumer_id="early", heartbeat_s=0.3)
    assert cfg.acquire_timeout_s >= 600
    s = ConsumerStream(cfg)
    got = [ow.window for _, ow in zip(range(2), s.windows(), strict=False)]
    assert got == [0, 1]
    time.sleep(0.3)  # the prefetch of window 2 is now waiting inside acquire
    t0 = time.monotonic()
    s.close()
    assert time.monotonic() - t0 < 2.0
    # nothing is left leased, and the consumer did not claim to have finished the stream
    with Coordinator.open(run) as c:
        assert c.conn.execute("SELECT COUNT(*) FROM leases").fetchone()[0] == 0
        state = c.conn.execute("SELECT state FROM consumers WHERE id='early:dp0'").fetchone()[0]
        assert state != "finished"
