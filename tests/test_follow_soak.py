"""The live loop under kill -9: a gateway's log followed, trained on and promoted from, with the producer, trainer and promoter killed at random.

    .venv/bin/pytest tests/test_follow_soak.py -q -x              # short: SQLite, PostgreSQL
    .venv/bin/pytest tests/test_follow_soak.py -q -x -m slow      # minutes of traffic

An appender process writes chats into a directory at a fixed rate (each record split
across two writes, the file rotated every few records, one line that is not a chat,
every third record an OpenAI request/response pair; each carries a marker `<<rN>>`
in its first message). `fanout produce --follow DIR` captures them, `fanout train`
trains a draft on the open stream, `fanout promote --run-dir` serves its checkpoints
from SERVED (margin 0: nearly every checkpoint is promoted, so `current` flips
often), and a recorder (a second consumer, never killed) writes down the token ids
of every row it is handed. The verifier changes under the loop (#52, RL co-training):
a `Policy` thread, the RL trainer, commits a new version of the tiny verifier every few
seconds (every minute in the slow soaks) in fanout.checkpoints.versions' layout, each
named by `current` a while before its COMMITTED marker lands; the producer follows it
(--follow-verifier), the trainer's draft follows its rows' versions (--max-verifier-lag
2) and the promoter measures against the live one. SERVED is rolled back (`fanout
promote --rollback`) at seeded random moments. The three roles are killed with -9 at
seeded random moments (every 0.8-2.5 s in the short run, 4-12 s in the long ones) and
restarted until each was killed `kills_each` times (and, for the long variants, for
`minutes`); then, without more kills, the loop runs on until SERVED was rolled back
`rollbacks` times and a window was captured with a later version than the first; then
the appender stops and the stream ends after --follow-idle-s without a record.

Checked, none of it depending on timing: against what the appender wrote (the source
files, read back), every record's marker is in exactly one row of the stream or the
record is held out, and held out ones are in no row (the rows decoded from their
token ids, deduplicated by (window, row)); the coordinator's committed chunks hold
exactly the captured records, each once, and are the only chunk files; window files
on disk never exceed K at any 20 ms sample; every time SERVED/current was sampled
it was a complete checkpoint that speculators 0.9.0's DFlashDraftModel loads (that
part is skipped when speculators is not installed), and never a version a rollback took
off serving. Of the verifier: every row's window records a committed version, never one
past the policy's live version when the row was handed over (a half-written version is
never captured), and the coordinator records that version or a later one (a window
asked for again after a trainer's resume is captured again with the version live then);
at least two versions were captured; every promote look names a committed version. Of rollbacks, replayed from
SERVED's decision log: no promotion after a rollback is of its checkpoint or an earlier
step of its save path, and no rollback goes back to a version rolled back before.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from fanout.bench.assets import generate_corpus
from fanout.chaos.procs import Proc, warm_forkserver
from fanout.checkpoints.layout import MARKER
from fanout.checkpoints.versions import (
    CURRENT,
    VERSIONS,
    committed_versions,
    version_name,
)
from fanout.coord.coordinator import Coordinator
from fanout.decode.config import PromoteConfig
from fanout.filesystem import FileSystem
from fanout.flags import to_flags
from fanout.produce.config import ProducerConfig
from fanout.produce.follow import chunk_name
from fanout.train.config import TrainConfig
from tiny_run import build_tiny_assets, one_thread, wait_for  # noqa: F401 (one_thread: autouse)

ENV = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
K = 3
MARK = re.compile(r"<<r(\d+)>>")

# `python appender.py SRC_DIR EVERY_S ROTATE STOP`: record after record, each written
# in two halves (the first flushed without its newline), one every EVERY_S seconds,
# log.jsonl renamed to log.jsonl.<n> every ROTATE records, line 7 not a chat; it stops
# after the record it is writing once the file STOP exists.
APPENDER = """
import json, os, sys, time
from fanout.bench.assets import generate_corpus
src, every, rotate, stop = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
path = os.path.join(src, "log.jsonl")
f = open(path, "ab")
i = 0
while not os.path.exists(stop):
    if i and i % rotate == 0:
        f.close(); os.rename(path, f"{path}.{i // rotate:04d}"); f = open(path, "ab")
    if i == 7:
        f.write(b"[1, 2, 3]\\n")
    msgs = [dict(m) for m in generate_corpus(1, seed=1000 + i)[0]["messages"]]
    msgs[0]["content"] = f"<<r{i}>> " + msgs[0]["content"]
    rec = {"messages": msgs}
    if i % 3 == 0:
        rec = {"request": {"model": "v", "messages": msgs[:-1]},
               "response": {"choices": [{"index": 0, "message": msgs[-1]}]}}
    line = (json.dumps(rec) + "\\n").encode()
    f.write(line[: len(line) // 2]); f.flush(); time.sleep(every / 2)
    f.write(line[len(line) // 2 :]); f.flush(); time.sleep(every / 2)
    i += 1
f.close()
"""

# `python recorder.py JSON`: a consumer that writes {"w", "i", "ids", "v", "live"} for
# every row it is handed (its token ids; with a policy, the verifier version the batch
# records and the policy's live version read after the batch was handed over), acks,
# and keeps its position in a checkpoint.
RECORDER = """
import json, os, sys
import torch
torch.set_num_threads(1)
from fanout.checkpoints.versions import current_version
from fanout.rows import INPUT_IDS
from fanout.train.consumer import ConsumerConfig, ConsumerStream
a = json.loads(sys.argv[1])
ckpt = a["ckpt"]
state = json.load(open(ckpt)) if os.path.exists(ckpt) else {"cursor": None, "rows_done": 0}
cfg = ConsumerConfig(run_dir=a["run_dir"], db_path=a["db_path"], consumer_id="recorder",
                     heartbeat_s=0.3, acquire_timeout_s=900)
out = open(a["out"], "a")
s = ConsumerStream(cfg)
s.load_state_dict(state)
with s:
    for b in s.batches(1):
        live = current_version(a["policy"]) if a["policy"] else None
        for k, (w, i) in enumerate(b.rows):
            ids = b.tensors[INPUT_IDS][k].tolist()
            out.write(json.dumps({"w": w, "i": i, "ids": ids, "v": b.verifier_version,
                                  "live": live and live.number}) + "\\n")
        out.flush()
        s.ack(b)
        with open(ckpt + ".tmp", "w") as f:
            json.dump(s.state_dict(), f)
        os.replace(ckpt + ".tmp", ckpt)
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("soak")
    build_tiny_assets(root, generate_corpus(60, seed=3))
    (root / "appender.py").write_text(APPENDER)
    (root / "recorder.py").write_text(RECORDER)
    warm_forkserver()  # roles fork from it: a restart costs ~1 s, not the imports
    return root


class Role:
    """A role the loop keeps alive: restarted after each kill, done after exit 0."""

    def __init__(self, name: str, argv: list[str], log: Path) -> None:
        self.name, self.argv, self.log = name, argv, log
        self.proc: Proc | None = None
        self.kills, self.starts, self.done = 0, 0, False
        self.crashes: list[int] = []

    def start(self) -> None:
        with self.log.open("a") as f:
            f.write(f"\n==== soak: start #{self.starts + 1} of {self.name}\n")
        self.proc = Proc(self.argv, self.log, "fork")
        self.starts += 1

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.signal(signal.SIGKILL)
        self.proc.wait(10)
        self.kills += 1

    def supervise(self, finishes: bool) -> None:
        """Restart after a kill or a crash; a role that `finishes` is done after exit 0."""
        if self.done or self.proc is None or (code := self.proc.poll()) is None:
            return
        if code == 0 and finishes:
            self.done = True
            return
        if code not in (0, -signal.SIGKILL):
            self.crashes.append(code)
        if len(self.crashes) > 3:
            raise AssertionError(f"{self.name} crashed {self.crashes}:\n{self.tail()}")
        self.start()

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.is_file() else ""

    def stop(self) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.signal(signal.SIGKILL)
            self.proc.wait(10)


class Policy(threading.Thread):
    """The RL trainer beside the loop (#52): the tiny verifier as a versioned directory
    (fanout.checkpoints.versions: versions/vNNNN, `current`, COMMITTED), a new version
    every `every_s` seconds until stopped. Each is the last one's weights moved by noise
    drawn from its number, written file by file with `current` flipped to it a while
    *before* its COMMITTED marker lands (a writer may: a half-written version is never
    loaded; the recorder's check sees one that was), the marker last."""

    HALF_WRITTEN_S = 1.0  # current -> vN, no marker yet: longer than a window's capture

    def __init__(self, root: Path, source: Path, every_s: float) -> None:
        super().__init__(daemon=True)
        self.root, self.every_s = root, every_s
        self.halt = threading.Event()
        self.made = 0
        self.error: BaseException | None = None
        self.write(source)  # v0001: the loop starts from it

    def write(self, source: Path) -> None:
        from safetensors.torch import load_file, save_file

        n = self.made + 1
        d = self.root / VERSIONS / version_name(n)
        d.mkdir(parents=True)
        for f in source.iterdir():
            if f.is_file() and f.name != MARKER:
                shutil.copy(f, d / f.name)
        if n > 1:
            g = torch.Generator().manual_seed(n)
            w = load_file(d / "model.safetensors")
            moved = {k: (v + 0.05 * torch.randn(v.shape, generator=g)).to(v.dtype)
                     for k, v in w.items()}  # fmt: skip
            save_file(moved, d / "model.safetensors", metadata={"format": "pt"})
        FileSystem().point(self.root / CURRENT, f"{VERSIONS}/{d.name}")
        if n > 1:
            self.halt.wait(self.HALF_WRITTEN_S)
        (d / MARKER).write_text("")
        self.made = n

    def run(self) -> None:
        try:
            while not self.halt.wait(self.every_s):
                self.write(self.root / VERSIONS / version_name(self.made))
        except BaseException as e:  # surfaced by the soak's checks
            self.error = e


class Watch(threading.Thread):
    """Samples, until stopped: window files on disk (every 20 ms) and SERVED/current
    loaded by speculators (each time a new version is served, and every few seconds),
    never one a rollback took off serving (`rolled_back`, the soak adds each)."""

    def __init__(self, run: Path, served: Path) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.served = run, served
        self.halt = threading.Event()
        self.most, self.disk_samples, self.loads = 0, 0, 0
        self.most_chunks = 0
        self.bad: list[str] = []
        self.rolled_back: set[str] = set()  # served versions a rollback took off serving
        self.last_load = 0.0
        self.spec: Any = None
        try:
            with warnings.catch_warnings():  # its imports warn of torch.jit deprecations
                warnings.simplefilter("ignore", DeprecationWarning)
                import speculators.models.dflash as spec
            self.spec = spec
        except ImportError:
            pass

    def disk(self) -> None:
        d = self.run_dir / "windows"
        n = len([p for p in d.iterdir() if p.suffix == ".safetensors"]) if d.is_dir() else 0
        self.most, self.disk_samples = max(self.most, n), self.disk_samples + 1
        # what K does not bound (#52): the follow chunks, retired once all acknowledged
        chunks = len(list((self.run_dir / "follow").glob("chunk-*.jsonl")))
        self.most_chunks = max(self.most_chunks, chunks)

    def load_served(self) -> None:
        """Open SERVED/current as an engine would: resolve it once, load what is there."""
        link = self.served / CURRENT
        gone = set(self.rolled_back)  # before resolving: each rolled back before this look
        if not link.is_symlink():
            return
        target = link.resolve()
        if target.name in gone:
            self.bad.append(f"{target}: served again after a rollback took it off serving")
        if self.spec is None:
            return
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                model = self._load(target)
            missing = set(model["missing_keys"]) | set(model["unexpected_keys"])
            if missing:
                self.bad.append(f"{target}: keys {sorted(missing)}")
            self.loads += 1
        except Exception as e:  # any failure to load is what this sample looks for
            self.bad.append(f"{target}: {type(e).__name__}: {e}")

    def _load(self, target: Path) -> dict[str, Any]:
        """speculators' own loading path (as tests/test_speculators.py): its loading info."""
        cfg = self.spec.DFlashSpeculatorConfig.from_pretrained(str(target))
        cfg.transformer_layer_config._attn_implementation = "eager"  # CPU, no flex attention
        _, info = self.spec.DFlashDraftModel.from_pretrained(
            str(target), config=cfg, output_loading_info=True
        )
        return dict(info)

    def run(self) -> None:
        while not self.halt.is_set():
            self.disk()
            if time.monotonic() - self.last_load > 2.0:
                self.load_served()
                self.last_load = time.monotonic()
            time.sleep(0.02)


def _argv(config: type[Any], command: str, opts: dict[str, Any]) -> list[str]:
    return [command, *to_flags(config, {k: v for k, v in opts.items() if v is not None})]


def live_loop(
    assets: Path,
    work: Path,
    db: str | None,
    *,
    kills_each: int,
    minutes: float,
    seed: int,
    verifier_every_s: float | None = None,
    rollbacks: int = 0,
) -> dict[str, Any]:
    """Run the loop (module docstring); return what the checks need. With
    `verifier_every_s`, every role reads the verifier from a `Policy` that commits a new
    version that often (the producer with --follow-verifier); `rollbacks`: that many
    `fanout promote --rollback`s of SERVED at random moments, at least."""
    src, run, served = work / "src", work / "run", work / "served"
    logs, drafts = work / "logs", work / "drafts"
    for d in (src, logs):
        d.mkdir(parents=True)
    policy = None
    if verifier_every_s is not None:
        policy = Policy(work / "policy", assets / "verifier", verifier_every_s)
    ver, tok = str(assets / "verifier" if policy is None else policy.root), str(assets / "tok")
    follows = {} if policy is None else {"follow_verifier": True}
    produce = _argv(ProducerConfig, "produce", {**follows,
        "run_dir": run, "follow": src, "verifier_name_or_path": ver, "tokenizer": tok,
        "seq_len": 96, "window_rows": 2, "capture_layer_ids": [1, 2], "workers": 1,
        "progress": False, "max_live_windows": K, "expected_consumers": 2,
        "follow_idle_s": 4.0, "follow_flush_s": 0.5, "follow_chunk_records": 5,
        "holdout_fraction": 0.25, "holdout_keep": 100_000, "cache_dir": work / "cache",
        "heartbeat_s": 0.3, "ttl_s": 3.0, "db_path": db, "device": "cpu",
        "capture_batch_rows": 2,
    })  # fmt: skip
    train = _argv(TrainConfig, "train", {
        "run_dir": run, "consumer_id": "c0", "verifier_name_or_path": ver, "num_layers": 1,
        "block_size": 4, "max_anchors": 8, "rows_per_step": 2, "save_path": drafts / "c0",
        "checkpoint_every": 2, "heartbeat_s": 0.3, "acquire_timeout_s": 900, "db_path": db,
        "resume": True, "max_verifier_lag": None if policy is None else 2,
    })  # fmt: skip
    promote = _argv(PromoteConfig, "promote", {
        "run_dir": run, "draft": [drafts / "c0"], "served": served,
        "verifier_name_or_path": ver, "tokenizer": tok, "num_prompts": 2,
        "max_new_tokens": 8, "margin": 0.0, "keep_versions": 1000, "poll_s": 0.5,
        "floor_epsilon": -1.0,  # a few steps' draft is served (the loop, not its τ)
    })  # fmt: skip
    producer = Role("producer", produce, logs / "producer.log")
    trainer = Role("trainer", train, logs / "trainer.log")
    promoter = Role("promoter", promote, logs / "promoter.log")
    roles = [producer, trainer, promoter]
    stop = work / "stop-appending"
    appender = subprocess.Popen(
        [sys.executable, str(assets / "appender.py"), str(src), "0.15", "7", str(stop)],
        env=ENV,
    )  # fmt: skip
    rec = {"run_dir": str(run), "db_path": db, "out": str(work / "rows.jsonl"),
           "ckpt": str(work / "recorder.json"), "policy": policy and str(policy.root)}  # fmt: skip
    recorder: subprocess.Popen[bytes] | None = None
    watch = Watch(run, served)
    watch.start()
    if policy is not None:
        policy.start()
    rng = random.Random(seed)
    t0 = time.monotonic()
    next_kill: float | None = None
    next_rollback = next_look = 0.0
    # seconds between two kills, two rollbacks: a short run's burst, a long one's spread
    kill_gap = (0.8, 2.5) if minutes == 0 else (4.0, 12.0)
    rollback_gap = (2.0, 6.0) if minutes == 0 else (10.0, 30.0)
    took = [0.0, 0.0]  # seconds until the traffic stopped, until the stream ended
    rolled: list[str] = []  # what each rollback's stdout said
    captured_new = policy is None  # a window captured with a version after the first
    heldout = run / "follow" / "heldout.jsonl"
    try:
        producer.start()
        while True:
            now = time.monotonic()
            if now - t0 > 600 + 60 * minutes:
                raise AssertionError("the soak did not end:\n" + producer.tail())
            producer.supervise(finishes=True)
            trainer.supervise(finishes=True)
            promoter.supervise(finishes=False)
            if recorder is None and Coordinator.open_if_created(run, db_path=db) is not None:
                with open(logs / "recorder.log", "ab") as out:
                    recorder = subprocess.Popen(
                        [sys.executable, str(assets / "recorder.py"), json.dumps(rec)],
                        env=ENV, stdout=out, stderr=subprocess.STDOUT,
                    )  # fmt: skip
                trainer.start()
                next_kill = now + rng.uniform(1.0, 3.0)  # killing starts with the run
            if promoter.proc is None and heldout.is_file():
                promoter.start()
            # killed enough: no more kills (what is left to wait for needs the roles to
            # make progress, which kills every second or two starve on a loaded machine)
            killed = now - t0 >= 60 * minutes and min(r.kills for r in roles) >= kills_each
            goal = killed and len(rolled) >= rollbacks
            if goal and not captured_new and recorder is not None and now >= next_look:
                next_look = now + 1.0
                with Coordinator.open(run, db_path=db) as co:  # the verifier changed under it
                    captured_new = (co.newest_verifier_version() or 0) >= 2
            goal = goal and captured_new
            if not stop.exists() and goal:
                stop.touch()  # enough: the traffic stops, the stream ends when idle
                took[0] = now - t0
            if next_kill is not None and not stop.exists() and not killed and now >= next_kill:
                ready = [r for r in roles if r.running() and r.proc is not None
                         and now - r.proc.started >= 1.0]  # fmt: skip
                if ready:
                    order = rng.sample(ready, len(ready))
                    min(order, key=lambda r: r.kills).kill()
                next_kill = now + rng.uniform(*kill_gap)
            if rollbacks and not stop.exists() and now >= next_rollback:
                # back one version, as an operator would (once there is one to go back to)
                said = None
                left = [v for v in committed_versions(served) if v.name not in watch.rolled_back]
                if len(left) >= 2:
                    said = _rollback(served, logs / "rollback.log")
                if said is not None:
                    rolled.append(said)
                    watch.rolled_back.add(said.split()[-3])  # "…: v0004 -> v0002"
                next_rollback = now + rng.uniform(*rollback_gap)
            done = producer.done and trainer.done
            if done and recorder is not None and recorder.poll() is not None:
                took[1] = time.monotonic() - t0
                break
            time.sleep(0.05)
        assert recorder is not None and recorder.wait(60) == 0
        assert appender.wait(60) == 0
        # the promoter loops forever: stop it, then decide once on the last checkpoint
        # (the first promotion if none came yet) and look at what is served
        promoter.stop()
        once = Proc([*promote, "--once"], logs / "promoter.log", "fork")
        assert once.wait(300) == 0, promoter.tail()
        watch.load_served()
    finally:
        watch.halt.set()
        watch.join(30)
        if policy is not None:
            policy.halt.set()
            policy.join(30)
        stop.touch()
        for r in roles:
            r.stop()
        for p in (appender, recorder):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(30)
    return {"src": src, "run": run, "served": served, "work": work, "watch": watch,
            "roles": {r.name: r for r in roles}, "db": db, "policy": policy,
            "rolled": rolled, "took": took}  # fmt: skip


def _rollback(served: Path, log: Path) -> str | None:
    """`fanout promote --served SERVED --rollback`, as an operator runs it: what it said
    ("…/current: v0004 -> v0002"), None when there was nothing to roll back to (exit 1,
    one line: every earlier version was rolled back already)."""
    out = log.with_suffix(".out")
    p = Proc(["promote", "--served", str(served), "--rollback"], out, "fork")
    code = p.wait(120)
    text = out.read_text(errors="replace")
    out.unlink()
    with log.open("a") as f:
        f.write(text)
    if code == 1 and "no earlier version to roll back to" in text:
        return None
    assert code == 0, text
    return next(x for x in text.splitlines() if "/current: " in x)


def _written(src: Path) -> dict[int, dict[str, Any]]:
    """What the appender wrote, read back from the source files: marker -> record."""
    out: dict[int, dict[str, Any]] = {}
    for f in sorted(src.iterdir()):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            if not isinstance(rec, dict):
                continue  # the line that is not a chat
            msgs = rec["messages"] if "messages" in rec else rec["request"]["messages"]
            m = MARK.match(msgs[0]["content"])
            assert m is not None, line
            assert int(m.group(1)) not in out, f"the appender wrote record {m.group(1)} twice"
            out[int(m.group(1))] = rec
    return out


def _markers(messages: list[dict[str, Any]]) -> int:
    m = MARK.match(messages[0]["content"])
    assert m is not None
    return int(m.group(1))


def check(got: dict[str, Any], assets: Path, kills_each: int) -> None:
    """Every promise of the module docstring, against what the appender wrote."""
    from tokenizers import Tokenizer

    run, watch = got["run"], got["watch"]
    written = _written(got["src"])
    assert len(written) >= 20
    held = [json.loads(x) for x in (run / "follow" / "heldout.jsonl").read_text().splitlines()]
    held_ids = [_markers(d["messages"]) for d in held]
    assert len(held_ids) == len(set(held_ids)), "a held-out record was kept twice"
    # the rows of the stream, each (window, row) once, decoded back to text
    tok = Tokenizer.from_file(str(assets / "tok" / "tokenizer.json"))
    rows: dict[tuple[int, int], list[int]] = {}
    for line in (got["work"] / "rows.jsonl").read_text().splitlines():
        r = json.loads(line)
        assert rows.setdefault((r["w"], r["i"]), r["ids"]) == r["ids"], "a row changed"
    captured = Counter(
        int(m)
        for ids in rows.values()
        for m in MARK.findall(tok.decode(ids, skip_special_tokens=False))
    )
    twice = {m: n for m, n in captured.items() if n > 1}
    assert not twice, f"records captured more than once: {twice}"
    assert not set(captured) & set(held_ids), "a held-out record reached a window"
    assert sorted([*captured, *held_ids]) == sorted(written), (
        f"missing: {sorted(set(written) - set(captured) - set(held_ids))[:20]}, "
        f"unknown: {sorted((set(captured) | set(held_ids)) - set(written))[:20]}"
    )
    assert 0 < len(held_ids) < len(written)
    info = json.loads((run / "stream.json").read_text())
    assert len(rows) == info["dataset_summary"]["rows_so_far"]
    # the coordinator's committed chunks are the chunk files, and hold the captured
    co = Coordinator.open(run, db_path=got["db"])
    with co:
        chunks = co.follow_chunks()
        pos = co.follow_position()
    # files: the chunks not retired yet (#52: every consumer acknowledged the others), the
    # newest always; a chunk's file starts with the records the one before it carried.
    # Rows: the retired chunks' went at a later commit, so the first row's chunk may be
    # past 0 (the records it carried in are then counted here: the file before is gone)
    names = [chunk_name(c.chunk, c.digest) for c in chunks]
    files = {f.name: f for f in (run / "follow").glob("chunk-*.jsonl")}
    assert set(files) <= set(names) and names[-1] in files
    assert [c.chunk for c in chunks] == list(range(chunks[0].chunk, chunks[-1].chunk + 1))
    carried_in = [0] + [c.carried for c in chunks[:-1]]
    chunked = [
        _markers(json.loads(x)["messages"])
        for name, n in zip(names, carried_in, strict=True) if name in files
        for x in files[name].read_text().splitlines()[n:]
    ]  # fmt: skip
    if len(files) == len(names) and chunks[0].chunk == 0:
        assert sorted(chunked) == sorted(captured)
    else:
        assert set(chunked) <= set(captured) and len(chunked) == len(set(chunked))
    assert pos is not None and pos["records"] == len(written) and pos["skipped"] == 1
    # K at every sample; SERVED/current always a checkpoint speculators loads
    assert watch.disk_samples > 0 and watch.most <= K
    assert not watch.bad, watch.bad
    if watch.spec is not None:
        assert watch.loads >= 1
    roles = got["roles"]
    kills = {n: r.kills for n, r in roles.items()}
    assert all(n >= kills_each for n in kills.values()), kills
    decisions = [
        json.loads(x) for x in (got["served"] / "promotions.jsonl").read_text().splitlines()
    ]
    promoted = sum(1 for d in decisions if d.get("promoted"))
    _check_rollbacks(decisions, got["rolled"])
    versions = _check_versions(got, rows, decisions)
    print(f"soak: {len(written)} records ({len(held_ids)} held out) in {len(rows)} rows, "
          f"{pos['chunks']} chunks ({len(chunks)} coordinator rows left); kills {kills}; "
          f"{promoted} promotions, "
          f"{len(got['rolled'])} rollbacks; {len(versions)} verifier versions captured "
          f"{versions[:1]}…{versions[-1:]}; served loaded "
          f"{watch.loads} times; at most {watch.most} window files; traffic stopped after "
          f"{got['took'][0]:.0f} s, the stream ended after {got['took'][1]:.0f} s")  # fmt: skip


def _check_rollbacks(decisions: list[dict[str, Any]], rolled: list[str]) -> None:
    """No rolled-back draft is served again: replayed in the order SERVED's decision log
    holds them, no promotion after a rollback is of its checkpoint or an earlier step of
    its save path, and no rollback goes to a version an earlier one took off serving."""
    assert len([d for d in decisions if d.get("rollback")]) == len(rolled)
    gone: set[str] = set()  # versions rolled back
    barred: list[tuple[Path, int | None]] = []  # (checkpoint, step) rolled back
    for d in decisions:
        if d.get("rollback"):
            assert d["to"] not in gone, f"rollback to {d['to']}, rolled back before: {d}"
            gone.add(d["from"])
            barred.append((Path(d["from_candidate"]), d["from_step"]))
        elif d.get("promoted") and d["version"] not in gone:
            # (a promoter appends its line after its version went live: a rollback of
            # that version can come first in the log; the line is that version's own)
            c, step = Path(d["candidate"]), d["candidate_step"]
            for was, was_step in barred:
                assert c != was, f"{c} promoted again after its rollback: {d}"
                assert c.parent != was.parent or step > was_step, (c, step, was, was_step)


def _check_versions(
    got: dict[str, Any], rows: dict[tuple[int, int], list[int]], decisions: list[dict[str, Any]]
) -> list[int]:
    """With a policy: every row's window records a committed version, never one after the
    policy's live version when the row was handed over (a half-written one never
    captured), the coordinator records that version or a later one's recapture, the
    verifier changed under the loop, and each promote look measured against a committed
    version. The versions captured, in window order."""
    policy: Policy | None = got["policy"]
    if policy is None:
        return []
    assert policy.error is None, policy.error
    committed = {v.number for v in committed_versions(policy.root)}
    seen: dict[int, int] = {}  # window -> version
    for line in (got["work"] / "rows.jsonl").read_text().splitlines():
        r = json.loads(line)
        v, live = r["v"], r["live"]
        assert v in committed, f"window {r['w']}: version {v} (committed: {sorted(committed)})"
        assert v <= live, f"window {r['w']}: version {v} after the live {live} when read"
        assert seen.setdefault(r["w"], v) == v, f"window {r['w']}: two versions"
    windows = sorted({w for w, _ in rows})
    assert sorted(seen) == windows
    from fanout.coord import reads

    with Coordinator.open(got["run"], db_path=got["db"]) as co:
        recorded = {w: reads.window_verifier_version(co.conn, w) for w in windows}
    # an evicted window's row is compacted away (fanout.coord.states): None. The rest name
    # the version of the window's newest publication: the one the recorder read, or a
    # later one (a trainer resumed from its checkpoint asked for the window again, and
    # it was captured again with the version live then)
    kept = {w: v for w, v in recorded.items() if v is not None}
    assert kept and all(v >= seen[w] for w, v in kept.items()), (kept, seen)
    order = [seen[w] for w in windows]
    assert len(set(order)) >= 2, f"the verifier never changed under the loop: {order}"
    looked = [d["verifier_version"] for d in decisions if "candidate_tau" in d]
    assert looked and all(v in {version_name(n) for n in committed} for v in looked), looked
    return sorted(set(order))


# SQLite's short run is slow-marked: its minutes-long soak below and test_follow.py's
# kill test cover SQLite in the default run's place (suite time)
@pytest.mark.parametrize("backend", [pytest.param("sqlite", marks=pytest.mark.slow), "postgres"])
def test_the_live_loop_keeps_every_promise_through_kills(
    assets: Path, tmp_path: Path, backend: str, request: pytest.FixtureRequest
) -> None:
    """The verifier changes every 3 s here (every minute in the slow soaks below)."""
    db = None if backend == "sqlite" else str(request.getfixturevalue("pg_url"))
    got = live_loop(assets, tmp_path, db, kills_each=2, minutes=0, seed=46,
                    verifier_every_s=3.0, rollbacks=2)  # fmt: skip
    check(got, assets, kills_each=2)


@pytest.mark.slow
def test_the_live_loop_for_minutes(assets: Path, tmp_path: Path) -> None:
    """#52's soak: 4 minutes, a new verifier version every minute, every role killed -9
    at random, SERVED rolled back at random."""
    got = live_loop(assets, tmp_path, None, kills_each=5, minutes=4, seed=4646,
                    verifier_every_s=60.0, rollbacks=4)  # fmt: skip
    check(got, assets, kills_each=5)


@pytest.mark.slow
def test_the_live_loop_for_half_an_hour_keeps_the_disk_flat(assets: Path, tmp_path: Path) -> None:
    """#52: follow chunks and their prepared rows grew for the stream's life. Over 30
    minutes (thousands of chunks) the chunk files on disk stay at what
    --follow-keep-windows (32) and K hold, as a run's cache entries do with them."""
    got = live_loop(assets, tmp_path, None, kills_each=10, minutes=30, seed=52,
                    verifier_every_s=60.0, rollbacks=10)  # fmt: skip
    check(got, assets, kills_each=10)
    with Coordinator.open(got["run"]) as co:
        rows = co.follow_chunks()
    made = rows[-1].chunk + 1
    assert made > 1000 and got["watch"].most_chunks <= 150, (made, got["watch"].most_chunks)
    # the coordinator's rows of them too: a retired chunk's goes at the next commit
    assert len(rows) <= 150, (len(rows), made)
    prepared = list((tmp_path / "cache" / "prepared").glob("*"))
    assert len(prepared) <= 150, len(prepared)
    # the coordinator's own file too: each chunk's row kept every followed file's
    # position (116 MB after this soak, growing quadratically), now only the newest's,
    # and a row per chunk no more (~200 B a chunk, forever) but the unretired ones
    db = Path(got["run"]) / "coordinator.sqlite3"
    assert db.stat().st_size < 16 * 2**20, f"{db}: {db.stat().st_size / 2**20:.1f} MiB"
