"""The producer: stream rows, capture against a direct forward, contract, crashes, backpressure.

    .venv/bin/pytest tests/test_producer.py -x -q

A random tiny Qwen3 (hidden 32, 4 layers, tied embeddings) over a 512-token BPE
built from the project's synthetic chat corpus keeps every forward cheap; it is
saved with `save_pretrained` and loaded through the same `from_pretrained` path
users take. Crash, signal and backpressure tests use real processes: the producer
CLI (`python -m fanout.cli produce`) and a small consumer script written below.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fanout import cli
from fanout.contract import CaptureContract
from fanout.coord.coordinator import Coordinator
from fanout.errors import ContractMismatch
from fanout.filesystem import FileSystem
from fanout.produce.config import ProducerConfig
from fanout.produce.producer import Producer
from fanout.produce.stream import stream_rows
from fanout.store.store import RunDir, Store, parse_window_name
from fanout.store.streaminfo import StreamInfo, window_count, window_span
from fanout.store.windowfile import hidden_name
from faults import Recording, after_rename, fail_each_call
from tiny_run import (  # noqa: F401 (one_thread: an autouse fixture)
    ENV,
    TinyAssets,
    config_flags,
    one_thread,
    tiny_assets,
    tiny_producer_config,
    wait_for,
)
from window_files import window_names

# A consumer process. Records every window it reads (window, generation, xxh3 of each
# tensor) as JSON lines; optionally sleeps per window (a slow reader), stops after
# `stop_after` without finishing, then re-registers at `restart_cursor` (a trainer
# restarted from an older checkpoint) and reads to the end.
CONSUMER = """
import json, sys, time
import torch, xxhash
torch.set_num_threads(1)
from fanout.train.consumer import ConsumerConfig, ConsumerStream
a = json.loads(sys.argv[1])
cfg = ConsumerConfig(run_dir=a["run_dir"], consumer_id=a["id"], heartbeat_s=0.3,
                     acquire_timeout_s=120)
out = open(a["out"], "a")
def read(stream, phase, stop_after=None):
    for ow in stream.windows():
        r = ow.reader
        raw = {n: r.get(n).contiguous().view(torch.uint8).numpy() for n in r.names()}
        digest = {n: xxhash.xxh3_64_hexdigest(v.tobytes()) for n, v in raw.items()}
        out.write(json.dumps({"phase": phase, "window": ow.window, "generation":
                              ow.lease.generation, "hash": digest}) + "\\n")
        out.flush()
        time.sleep(a.get("sleep", 0.0))
        stream.coord.ack(ow.lease)
        stream._held.pop(ow.window, None)
        if stop_after is not None and ow.window >= stop_after:
            return
with ConsumerStream(cfg) as s:
    read(s, 1, a.get("stop_after"))
if "restart_cursor" in a:
    s = ConsumerStream(cfg)
    s.load_state_dict({"cursor": a["restart_cursor"], "rows_done": 0})
    with s:
        read(s, 2)
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    tiny = tiny_assets(tmp_path_factory.mktemp("tiny"), 120)
    (tiny.root / "consumer.py").write_text(CONSUMER)
    return tiny


def _cfg(tiny: TinyAssets, run_dir: Path, **kw: Any) -> ProducerConfig:
    own = {"max_live_windows": 64, "cache_dir": str(tiny.root / "cache"), "heartbeat_s": 0.3}
    return tiny_producer_config(tiny.root, run_dir, **(own | kw))


def _argv_of(cfg: ProducerConfig) -> list[str]:
    """The `fanout produce` command line for `cfg` (every field as a flag)."""
    return [sys.executable, "-m", "fanout.cli", "produce", *config_flags(cfg)]


def _window_files(run_dir: Path) -> list[str]:
    return sorted(n for n in os.listdir(run_dir / "windows") if parse_window_name(n))


def _rows_of(run_dir: Path, sql: str, *args: Any) -> list[Any]:
    with Coordinator.open(run_dir) as c:
        return c.conn.execute(sql, args).fetchall()


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _check_rows(store: Store, name: str, p: Producer) -> None:
    """The window file holds exactly stream rows [w·R, (w+1)·R) of the prepared dataset."""
    cfg = p.cfg
    with store.open(name, expect_contract=p.contract.stream_id) as r:
        w = r.meta.window
        idx, epoch = stream_rows(w, cfg.window_rows, p.dataset.num_rows, cfg.epochs, cfg.seed)
        want = p.dataset.rows(idx)
        assert r.meta.epoch == epoch and r.meta.row_start == w * cfg.window_rows
        assert r.rows == len(idx)
        for k in ("input_ids", "loss_mask", "document_ids", "position_ids"):
            np.testing.assert_array_equal(r.get(k).numpy(), want[k], err_msg=f"{name} {k}")


# ---- stream -------------------------------------------------------------------------


def test_stream_rows_each_epoch_is_a_seeded_permutation() -> None:
    n, r, epochs, seed = 10, 4, 3, 7
    total = window_count(n * epochs, r)
    assert total == 8
    parts = [stream_rows(w, r, n, epochs, seed) for w in range(total)]
    rows = np.concatenate([p[0] for p in parts])
    assert len(rows) == n * epochs and len(parts[-1][0]) == 2  # last window is partial
    per_epoch = rows.reshape(epochs, n)
    for e in range(epochs):
        assert sorted(per_epoch[e].tolist()) == list(range(n)), e
    assert len({tuple(x) for x in per_epoch.tolist()}) == epochs  # reshuffled each epoch
    assert [p[1] for p in parts] == [0, 0, 0, 1, 1, 2, 2, 2]  # epoch of each window's first row
    again = np.concatenate([stream_rows(w, r, n, epochs, seed)[0] for w in range(total)])
    np.testing.assert_array_equal(rows, again)  # window w always means the same rows
    other = np.concatenate([stream_rows(w, r, n, epochs, seed + 1)[0] for w in range(total)])
    assert not np.array_equal(rows, other)


# ---- stream.json ----------------------------------------------------------------------


def test_stream_json_is_written_whole_and_durably(tmp_path: Path) -> None:
    """stream.json goes through FileSystem.write_atomic: fsynced, renamed, run dir fsynced;
    a fault at any step (ENOSPC) leaves the old one readable and no temp file."""
    rd = RunDir(tmp_path)
    info = {1: StreamInfo.of("s", 4, 4, 1), 2: StreamInfo.of("s", 8, 4, 1)}
    info[1].write(rd, FileSystem())
    fs = Recording()
    info[1].write(rd, fs)
    assert fs.ops == ["open_new", "write", "fsync", "close", "rename", "fsync_dir"]

    def check(n: int, e: OSError) -> None:
        got = StreamInfo.read(rd)
        assert got == info[2 if after_rename(e) else 1], (n, e)
        assert os.listdir(tmp_path) == ["stream.json"], (n, e)

    fail_each_call(lambda fs: info[2].write(rd, fs), check, errno_=errno.ENOSPC)
    assert StreamInfo.read(rd) == info[2]
    assert json.loads(rd.stream_info.read_text())["total_windows"] == 2


def test_window_count_and_span_are_the_streams_one_rule() -> None:
    """Window w holds rows [w·R, (w+1)·R), the last of a finite stream fewer; the count
    is the ceiling. Checked against a slow reference (cutting a list of rows)."""
    for rows, r in [(1, 1), (7, 3), (9, 3), (10, 4), (0, 2)]:
        chunks = [list(range(rows))[i : i + r] for i in range(0, rows, r)]
        assert window_count(rows, r) == len(chunks)
        for w, chunk in enumerate(chunks):
            assert window_span(w, r, rows) == (chunk[0], chunk[-1] + 1)
        assert window_span(len(chunks), r) == (len(chunks) * r, (len(chunks) + 1) * r)


# ---- capture --------------------------------------------------------------------------


def test_windows_hold_stream_rows_and_equal_a_direct_forward(
    tiny: TinyAssets, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    cfg = _cfg(tiny, tmp_path / "run", max_windows=3)
    p = Producer(cfg)
    summary = p.run()
    assert summary["windows"] == 3 and summary["tokens"] > 0 and summary["bytes"] > 0
    store = Store(RunDir(tmp_path / "run"))
    names = window_names(store)
    assert [parse_window_name(n)[0] for n in names] == [0, 1, 2]  # type: ignore[index]

    # contract.json and stream.json describe the run
    assert CaptureContract.load(tmp_path / "run" / "contract.json") == p.contract
    info = json.loads((tmp_path / "run" / "stream.json").read_text())
    assert info["stream_id"] == p.contract.stream_id
    assert info["num_rows"] == p.dataset.num_rows and info["window_rows"] == 4
    assert info["total_windows"] == window_count(p.dataset.num_rows, 4)

    # Reference: HF's own forward with output_hidden_states=True, one document at a time
    # (positions from 0, no packing), fp32. Layer i is hidden_states[i + 1].
    model = AutoModelForCausalLM.from_pretrained(tiny.verifier, dtype=torch.float32).eval()
    layers = p.verifier.capture_layer_ids
    checked = 0
    for name in names:
        _check_rows(store, name, p)
        with store.open(name) as r, torch.inference_mode():
            hidden = torch.cat([r.get(hidden_name(j)) for j in layers], -1)  # [R, T, n·H]
            target = r.get("target_ids")  # [R, T]
            assert hidden.dtype == torch.bfloat16 and hidden.shape[-1] == 2 * 32
            ids, docs = r.get("input_ids"), r.get("document_ids")
            for i in range(r.rows):
                for d in docs[i][docs[i] >= 0].unique():
                    sel = docs[i] == d  # [T] bool: one document
                    out = model(input_ids=ids[i][sel][None].long(), output_hidden_states=True)
                    ref = torch.cat([out.hidden_states[j + 1][0] for j in layers], -1)  # [t, n·H]
                    # bf16 storage: within one bf16 ulp (2^-8 relative) of the fp32 reference
                    torch.testing.assert_close(hidden[i][sel].float(), ref, rtol=2**-7, atol=1e-4)
                    logits = out.logits[0]  # [t, vocab]
                    top = logits.topk(2, dim=-1).values  # [t, 2]
                    clear = (top[:, 0] - top[:, 1]) > 1e-4  # skip exact near-ties
                    got = target[i][sel].long()
                    assert torch.equal(got[clear], logits.argmax(-1)[clear])
                    assert clear.float().mean() > 0.9
                    checked += 1
    assert checked >= 6


def test_overlapped_publish_writes_the_same_windows(tiny: TinyAssets, tmp_path: Path) -> None:
    """Publishing on a background thread (two buffer slots) changes no byte of any window
    and still publishes every window exactly once."""
    files: dict[str, Any] = {}
    for mode in ("off", "on"):
        run = tmp_path / mode
        p = Producer(_cfg(tiny, run, max_windows=5, overlap_publish=mode))
        summary = p.run()
        assert summary["windows"] == 5 and summary["failures"] == 0
        mib = summary["bytes"] / 2**20
        assert p._progress_line().startswith(f"ready 5 ({mib:.0f} MiB) | "), p._progress_line()
        store = Store(RunDir(run))
        names = window_names(store)
        assert [parse_window_name(n)[0] for n in names] == [0, 1, 2, 3, 4]  # type: ignore[index]
        captures = _rows_of(run, "SELECT window, captures, state FROM windows ORDER BY window")
        assert captures == [(w, 1, "ready") for w in range(5)]
        files[mode] = {}
        for n in names:
            with store.open(n) as r:
                files[mode][r.meta.window] = {k: r.get(k).clone() for k in r.names()}
    for w, tensors in files["off"].items():
        for k, t in tensors.items():
            assert torch.equal(t, files["on"][w][k]), f"window {w} {k} differs with overlap"


def test_changed_contract_is_refused_naming_the_fields(
    tiny: TinyAssets, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    Producer(_cfg(tiny, run, max_windows=1)).run()
    stream_json = (run / "stream.json").read_text()
    counts = (run / "token_counts.safetensors").read_bytes()
    with pytest.raises(ContractMismatch, match="target_layer_ids") as e:
        Producer(_cfg(tiny, run, max_windows=1, capture_layer_ids=[1, 3]))
    assert set(e.value.fields) == {"target_layer_ids"}
    with pytest.raises(ContractMismatch, match="seq_len"):
        Producer(_cfg(tiny, run, max_windows=1, seq_len=64))
    assert (run / "stream.json").read_text() == stream_json  # a refused producer changes nothing
    assert (run / "token_counts.safetensors").read_bytes() == counts
    # the CLI says the same and exits 1
    argv = _argv_of(_cfg(tiny, run, max_windows=1, capture_layer_ids=[0, 2]))
    assert cli.main(argv[3:]) == 1
    err = capsys.readouterr().err
    assert "contract mismatch" in err and "target_layer_ids" in err


# ---- crashes and signals (real processes) ---------------------------------------------


def test_kill9_restart_sigterm_every_window_exactly_once(tiny: TinyAssets, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = _cfg(tiny, run, epochs=2, capture_batch_rows=1)
    argv = _argv_of(cfg)
    log = open(tmp_path / "producer.log", "w")  # noqa: SIM115 - closed below

    def ready() -> int:
        return len(_window_files(run)) if (run / "windows").is_dir() else 0

    p1 = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=ENV)
    try:
        wait_for(lambda: ready() >= 1 or p1.poll() is not None, 180, "a first window")
        p1.send_signal(signal.SIGKILL)
        assert p1.wait(30) == -signal.SIGKILL
        total = json.loads((run / "stream.json").read_text())["total_windows"]
        after_kill = ready()
        assert 1 <= after_kill < total, "the kill landed after the run ended; test is vacuous"

        p2 = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=ENV)
        wait_for(lambda: ready() > after_kill or p2.poll() is not None, 180, "a new window")
        assert p2.poll() is None, "restarted producer ended before SIGTERM"
        p2.send_signal(signal.SIGTERM)
        assert p2.wait(60) == 0  # graceful: finish or discard the window in flight, exit 0
        assert ready() < total
    finally:
        for p in (p1, locals().get("p2")):
            if p is not None and p.poll() is None:
                p.kill()
        log.close()
    text = (tmp_path / "producer.log").read_text()
    assert "signal 15: stopping once the window in flight is published" in text
    assert _rows_of(run, "SELECT window FROM windows WHERE state='capturing'") == []

    # A third producer (in this process) finishes the stream.
    p3 = Producer(cfg)
    p3.run()
    rows = _rows_of(run, "SELECT window, state, captures, generation, name FROM windows")
    assert [r[0] for r in rows] == list(range(total))
    assert all(r[1] == "ready" and r[2] == 1 for r in rows), rows  # captured exactly once
    files = _window_files(run)
    assert files == sorted(r[4] for r in rows)  # one file per window, the recorded generation
    store = Store(RunDir(run))
    for name in files:
        _check_rows(store, name, p3)  # opens with checksum verification
    assert os.listdir(run / "tmp") == []  # the kill's temp debris was swept


# ---- backpressure and lag policies (real consumer processes) ---------------------------


def _consumer(tiny: TinyAssets, run: Path, out: Path, **kw: Any) -> subprocess.Popen[bytes]:
    args = {"run_dir": str(run), "id": "reader", "out": str(out)} | kw
    return subprocess.Popen(
        [sys.executable, str(tiny.root / "consumer.py"), json.dumps(args)], env=ENV
    )


def _run_with(p: Producer, reader: subprocess.Popen[bytes]) -> dict[str, Any]:
    """p.run() in this (main) thread; stop it if the reader process dies early."""

    def watch() -> None:
        while reader.poll() is None and not done.is_set():
            time.sleep(0.05)
        if reader.returncode:
            p.stop.request()  # the reader failed: the producer would hold forever

    done = threading.Event()
    threading.Thread(target=watch, daemon=True).start()
    try:
        return p.run()
    finally:
        done.set()
        assert not reader.returncode, f"reader exited with {reader.returncode}"


class Sampler(threading.Thread):
    """Counts final-named files in windows/ every few ms while the producer runs."""

    def __init__(self, run: Path) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.max, self.samples = run, 0, 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.max = max(self.max, len(_window_files(self.run_dir)))
            self.samples += 1
            time.sleep(0.003)


def test_backpressure_never_more_than_k_files(
    db: str | None, tiny: TinyAssets, tmp_path: Path
) -> None:
    """Also with the coordinator on PostgreSQL: the consumer process finds it through the
    run dir (coordinator.dbpath), as a trainer on another host would."""
    run = tmp_path / "run"
    p = Producer(_cfg(tiny, run, max_live_windows=2, lag_policy="hold", db_path=db))
    out = tmp_path / "reads.jsonl"
    reader = _consumer(tiny, run, out, sleep=0.15)
    sampler = Sampler(run)
    sampler.start()
    try:
        summary = _run_with(p, reader)
        assert reader.wait(120) == 0
    finally:
        sampler.stop.set()
        sampler.join()
        if reader.poll() is None:
            reader.kill()
    assert sampler.samples > 100
    assert sampler.max <= 2  # K
    assert summary["backpressure_wait_s"] > 1.0  # the producer really waited on the reader
    recs = _records(out)
    assert [r["window"] for r in recs] == list(range(p.total_windows))  # in order, once each
    hw = _rows_of(run, "SELECT value FROM counters WHERE key='hw_windows'")[0][0]
    assert int(hw) <= 2
    assert (run / "coordinator.sqlite3").exists() == (db is None)


def test_recapture_serves_a_consumer_restarted_from_an_old_cursor(
    db: str | None, tiny: TinyAssets, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cfg = _cfg(
        tiny, run, max_live_windows=2, lag_policy="recapture", exit_when_idle_s=5, db_path=db
    )
    p = Producer(cfg)
    assert p.total_windows >= 8
    out = tmp_path / "reads.jsonl"
    # reads 0..5, stops (not finished: still counted at cursor 6), re-registers at cursor 1
    reader = _consumer(tiny, run, out, stop_after=5, restart_cursor=1)
    try:
        summary = _run_with(p, reader)
        assert reader.wait(120) == 0
    finally:
        if reader.poll() is None:
            reader.kill()
    recs = _records(out)
    first = {r["window"]: r for r in recs if r["phase"] == 1}
    second = {r["window"]: r for r in recs if r["phase"] == 2}
    assert sorted(first) == list(range(6))
    assert [r["window"] for r in recs if r["phase"] == 2] == list(range(1, p.total_windows))
    recaptured = [w for w in range(1, 6) if second[w]["generation"] != first[w]["generation"]]
    assert len(recaptured) >= 3  # K=2: at most 2 of windows 1..5 could still be live
    for w in recaptured:
        assert second[w]["hash"] == first[w]["hash"], w  # byte-identical tensors
    count = int(_rows_of(run, "SELECT value FROM counters WHERE key='recaptures'")[0][0])
    caps = dict(_rows_of(run, "SELECT window, captures FROM windows"))
    # windows past 5 the first phase left live may have given the last slot back to
    # window 1 (retention.yield_reserved): captured again too, and counted
    gave_back = [w for w, c in caps.items() if w >= 6 and c and c > 1]
    assert count == len(recaptured) + len(gave_back)
    assert summary["windows"] == p.total_windows + count
    # the stream's full windows were each captured, some twice (counted)
    assert sum(c - 1 for c in caps.values() if c) <= count


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
def test_window_bytes_and_a_start_warning_when_k_windows_do_not_fit(
    tiny: TinyAssets, tmp_path: Path, caplog: pytest.LogCaptureFixture, storage: str
) -> None:
    from fanout.filesystem import FileSystem

    class SmallDisk(FileSystem):
        def free_bytes(self, path: Any) -> int:
            return 1 << 20  # 1 MiB

    cfg = _cfg(tiny, tmp_path / "run", max_windows=2, storage_dtype=storage,
               store_last_hidden_states=True)  # fmt: skip
    with caplog.at_level("WARNING", logger="fanout.produce.run_start"):
        p = Producer(cfg, fs=SmallDisk())
    warned = [r.getMessage() for r in caplog.records if "will wait on a full disk" in r.message]
    assert len(warned) == 1 and "only 0.0 GiB are free" in warned[0], caplog.text
    p.run()
    store = Store(RunDir(tmp_path / "run"))
    for name in window_names(store):
        with store.open(name) as r:  # the arithmetic equals the bytes a window holds
            data = sum(r.get(k).numel() * r.get(k).element_size() for k in r.names())
            assert data == p.window_bytes(), (storage, data, p.window_bytes())
    caplog.clear()
    with caplog.at_level("WARNING", logger="fanout.produce.run_start"):
        Producer(cfg)  # the real disk has room: no warning
    assert "full disk" not in caplog.text
