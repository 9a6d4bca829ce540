"""Chaos driver: a producer and N trainers as real processes, killed -9 at random, restarted.

    python -m fanout.chaos --work-dir runs/chaos --consumers 3 --kills 30   # ~2-4 min, 2 cores
    python -m fanout.chaos --work-dir runs/soak --minutes 10 --json soak.json   # the soak

Builds tiny assets once (BPE tokenizer, untrained 4-layer Qwen3 with H=32, synthetic
chat JSONL), starts `fanout produce` and `fanout train --resume` ×N on one run
directory, and every `kill_every_s` seconds SIGKILLs one running role that is at
least `min_age_s` old; a killed (or crashed) role is restarted at once from its
checkpoint / the coordinator's state. While it runs it samples the coordinator
(`fanout status --json`'s snapshot) and every final-named file in windows/ (fully
verified at first sight: a partial file under a final name fails the run). At the
end it checks what the system promises (`ChaosReport.problems()`): each consumer's
train_log.jsonl is an in-order cover of the stream with repeats only right after
its own crash (`check_cover`), every capture of a window holds the same bytes,
`PRAGMA integrity_check` is ok, no lease is left and windows/ + tmp/ end empty.

Roles run from a forkserver that has already imported torch and transformers
(`launcher="fork"`): a restart then costs ~1 s instead of ~8 s of imports on a
loaded 2-core box, which is what makes 30+ kills fit a test. They still are real
processes running the same entry point as the `fanout` command (fanout.cli.main),
killed with a real SIGKILL. `launcher="exec"` starts `python -m fanout.cli` instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

PRELOAD = [
    "torch",
    "transformers",
    "transformers.models.qwen3.modeling_qwen3",
    "fanout.cli",
    "fanout.producer",
    "fanout.prepare",
    "fanout.verifier",
    "fanout.train",
    "fanout.status",
]


# ---------------------------------------------------------------- assets


@dataclass(frozen=True)
class ChaosAssets:
    tokenizer: Path
    verifier: Path
    data: Path  # chat JSONL (OpenAI messages)


def build_assets(root: str | os.PathLike[str], conversations: int = 60) -> ChaosAssets:
    """Tokenizer (BPE, ~900 ids), tiny Qwen3 verifier (4 layers, H=32) and a chat file
    of `conversations` rows under `root`; reused when already there."""
    from filelock import FileLock

    from fanout.assets import build_tokenizer, generate_corpus, tiny_qwen3_verifier, write_jsonl

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    out = ChaosAssets(root / "tokenizer", root / "verifier", root / f"chat-{conversations}.jsonl")
    with FileLock(str(root / ".lock")):
        corpus = None
        if not (out.tokenizer / "tokenizer_config.json").is_file():
            # 4000 conversations so that role names and "\n" become single tokens.
            corpus = generate_corpus(4000, 0)
            build_tokenizer(out.tokenizer, corpus, 1024)
        if not (out.verifier / "config.json").is_file():
            from tokenizers import Tokenizer

            vocab = Tokenizer.from_file(str(out.tokenizer / "tokenizer.json")).get_vocab_size()
            tiny_qwen3_verifier(
                out.verifier, vocab, hidden_size=32, num_layers=4, head_dim=8, intermediate_size=64
            )
        if not out.data.is_file():
            corpus = corpus or generate_corpus(4000, 0)
            tmp = out.data.with_suffix(".tmp")
            write_jsonl(tmp, corpus[:conversations])
            tmp.replace(out.data)
    return out


# ---------------------------------------------------------------- processes


def _child(argv: list[str], log_path: str) -> None:
    """Body of a forked role: stdout/stderr to its log, one torch thread, the CLI."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    import torch

    torch.set_num_threads(1)  # 4+ roles on 2 cores: oversubscribed threads only spin
    from fanout.cli import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def _noop() -> None:
    pass


def warm_forkserver() -> None:
    """Start the forkserver (it imports PRELOAD once, ~5-10 s) before timing anything."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    p = ctx.Process(target=_noop)
    p.start()
    p.join()


class Proc:
    """One started role process (forked from the forkserver, or exec'd)."""

    def __init__(self, argv: list[str], log_path: Path, launcher: str) -> None:
        self.started = time.monotonic()
        self._mp: Any = None
        self._po: subprocess.Popen[bytes] | None = None
        if launcher == "fork":
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            self._mp = ctx.Process(target=_child, args=(argv, str(log_path)), daemon=False)
            self._mp.start()
            self.pid = int(self._mp.pid)
        else:
            env = dict(os.environ, OMP_NUM_THREADS="1")
            with open(log_path, "ab") as f:
                self._po = subprocess.Popen(
                    [sys.executable, "-m", "fanout.cli", *argv], stdout=f, stderr=f, env=env
                )
            self.pid = self._po.pid

    def poll(self) -> int | None:
        if self._mp is not None:
            code: int | None = self._mp.exitcode
            return code
        assert self._po is not None
        return self._po.poll()

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int | None:
        end = time.monotonic() + timeout
        while (code := self.poll()) is None and time.monotonic() < end:
            time.sleep(0.02)
        return code


@dataclass
class Role:
    """A producer or trainer the driver keeps alive: its command line and history."""

    name: str
    argv: list[str]
    log: Path
    proc: Proc | None = None
    done: bool = False
    starts: int = 0
    kills: int = 0
    exits: list[int] = field(default_factory=list)  # exit codes not caused by our kills

    def start(self, launcher: str) -> None:
        last = "" if self.proc is None else f" (last exit code {self.proc.poll()})"
        with self.log.open("a") as f:
            f.write(f"\n==== chaos: start #{self.starts + 1} of {self.name}{last}\n")
        self.proc = Proc(self.argv, self.log, launcher)
        self.starts += 1

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.is_file() else ""


def run_cli(argv: list[str], log_path: Path, launcher: str = "fork", timeout: float = 120) -> int:
    """Run one `fanout …` command as a process to completion; its exit code."""
    p = Proc(argv, log_path, launcher)
    code = p.wait(timeout)
    if code is None:
        p.signal(signal.SIGKILL)
        raise TimeoutError(f"fanout {' '.join(argv)} still running after {timeout} s")
    return code


# ---------------------------------------------------------------- checks


def read_log(path: Path) -> list[dict[str, Any]]:
    """Records of a train_log.jsonl (appended to by every incarnation of a trainer)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Cover:
    """What check_cover found in one consumer's log."""

    windows: int = 0  # distinct windows trained on
    records: int = 0
    restarts: int = 0  # incarnation boundaries visible in the log (step went back)
    repeated_steps: int = 0  # steps logged again after a restart
    errors: list[str] = field(default_factory=list)


def check_cover(records: list[dict[str, Any]], total_windows: int) -> Cover:
    """In-order cover: the windows of successive steps never go back or skip one,
    except that after a restart (step number ≤ the previous one) the trainer replays
    from its checkpoint — the same windows at the same step numbers as before — and
    the union is exactly windows 0 .. total_windows-1."""
    c = Cover(records=len(records))
    by_step: dict[int, list[int]] = {}
    seen: set[int] = set()
    prev_step, prev_hi = 0, -1
    for i, r in enumerate(records):
        step, ws = int(r["step"]), [int(w) for w in r["windows"]]
        where = f"record {i + 1} (step {step}, windows {ws})"
        if ws != sorted(ws) or not ws or ws[-1] - ws[0] != len(ws) - 1:
            c.errors.append(f"{where}: windows of one step are not consecutive")
        if step != prev_step + 1:
            if step > prev_step + 1 or step < 1:
                c.errors.append(f"{where}: step jumped from {prev_step}")
            c.restarts += 1
        elif ws[0] < prev_hi:
            c.errors.append(f"{where}: went back from window {prev_hi} without a restart")
        if ws[0] > prev_hi + 1 and step != 1:
            c.errors.append(f"{where}: skipped windows after {prev_hi}")
        if step == 1 and ws[0] != 0:
            c.errors.append(f"{where}: the first step does not start at window 0")
        if step in by_step:
            c.repeated_steps += 1
            if by_step[step] != ws:
                c.errors.append(f"{where}: replayed step had windows {by_step[step]} before")
        by_step[step] = ws
        seen.update(ws)
        prev_step, prev_hi = step, ws[-1]
    missing = sorted(set(range(total_windows)) - seen)
    extra = sorted(seen - set(range(total_windows)))
    if missing:
        c.errors.append(
            f"windows never trained on: {missing[:20]}{' …' if len(missing) > 20 else ''}"
        )
    if extra:
        c.errors.append(f"windows beyond the stream: {extra[:20]}")
    c.windows = len(seen)
    return c


def window_digest(path: Path) -> tuple[int, int, str]:
    """(window, generation, xxh3 of every tensor's bytes) of a fully verified window file.
    Raises CorruptWindow for a partial or damaged file."""
    import torch
    import xxhash

    from fanout.store import WindowReader

    with WindowReader(path, verify=True) as r:
        h = xxhash.xxh3_64()
        for n in sorted(r.names()):
            h.update(n.encode())
            h.update(r.get(n).contiguous().view(torch.uint8).numpy().tobytes())
        return r.meta.window, r.meta.generation, h.hexdigest()


class Sampler:
    """Samples the coordinator and windows/ of one run while chaos happens."""

    def __init__(self, run_dir: Path, k: int, db_path: Path | None = None) -> None:
        self.run_dir, self.k, self.db_path = run_dir, k, db_path
        self.co: Any = None
        self.samples = 0
        self.max_live = 0  # ready + capturing + evicting rows (the capacity rule's count)
        self.max_ready = 0
        self.max_files = 0
        self.over_k = 0  # samples that used the K+1st slot (slowest consumer's recapture)
        self.verified: dict[str, tuple[int, int, str]] = {}  # file name -> (w, g, digest)
        self.bad_files: list[str] = []
        self.digest_by_window: dict[int, str] = {}
        self.digest_mismatch: list[str] = []

    def _open(self) -> Any:
        if self.co is None:
            from fanout.coordinator import Coordinator
            from fanout.errors import ConfigError, SchemaVersionError

            try:
                self.co = Coordinator.open(self.run_dir, db_path=self.db_path)
            except (ConfigError, SchemaVersionError, sqlite3.Error):
                return None
        return self.co

    def sample(self) -> None:
        from fanout.errors import CorruptWindow
        from fanout.status import snapshot

        co = self._open()
        if co is not None:
            s = snapshot(co)
            w = s["windows"]
            live = w["ready"] + w["capturing"] + w["evicting"]
            self.samples += 1
            self.max_live, self.max_ready = (
                max(self.max_live, live),
                max(self.max_ready, w["ready"]),
            )
            self.over_k += live > self.k
        wdir = self.run_dir / "windows"
        names = [n for n in os.listdir(wdir) if n.endswith(".safetensors")] if wdir.is_dir() else []
        self.max_files = max(self.max_files, len(names))
        for n in names:
            if n in self.verified:
                continue
            try:
                wgd = window_digest(wdir / n)
            except FileNotFoundError:
                continue  # evicted between listdir and open
            except CorruptWindow as e:
                if (wdir / n).exists():  # still there under its final name: a real failure
                    self.bad_files.append(f"{n}: {e.reason}")
                continue
            self.verified[n] = wgd
            first = self.digest_by_window.setdefault(wgd[0], wgd[2])
            if first != wgd[2]:
                self.digest_mismatch.append(
                    f"window {wgd[0]} g{wgd[1]} differs from its first capture"
                )

    def close(self) -> None:
        if self.co is not None:
            self.co.close()
            self.co = None


def final_state(run_dir: Path, db_path: Path | None = None) -> dict[str, Any]:
    """integrity_check, leases left, consumer states and debris after a run."""
    from fanout.coordinator import Coordinator

    db = Coordinator.resolve_db_path(run_dir, db_path)
    if not db.is_file():
        return {"integrity_check": f"no database at {db}"}
    conn = sqlite3.connect(db)
    try:
        q = conn.execute
        return {
            "integrity_check": q("PRAGMA integrity_check").fetchone()[0],
            "leases_left": q("SELECT COUNT(*) FROM leases").fetchone()[0],
            "consumers": dict(q("SELECT id, state FROM consumers").fetchall()),
            "failed_windows": q("SELECT COUNT(*) FROM windows WHERE state='failed'").fetchone()[0],
            "counters": dict(
                q(
                    "SELECT key, value FROM meta WHERE key IN ('recaptures','evictions',"
                    "'corrupt','detaches','reclaims','next_window','hw_windows')"
                ).fetchall()
            ),
            "files_left": sorted(os.listdir(run_dir / "windows")),
            "tmp_left": sorted(os.listdir(run_dir / "tmp")),
        }
    finally:
        conn.close()


# ---------------------------------------------------------------- the run


class ChaosConfig(BaseModel):
    """One chaos run: sizes, fault schedule and limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    work_dir: str = Field(description="assets/, run/, drafts/, logs/ go here")
    consumers: int = Field(3, ge=1, description="trainers (consumers c0 … cN-1)")
    conversations: int = Field(60, ge=1, description="chat rows in the data file (stream length)")
    epochs: int = Field(1, ge=1, description="passes over the data (longer stream)")
    seq_len: int = Field(64, ge=8, description="tokens per packed row")
    window_rows: int = Field(2, ge=1, description="rows per window R")
    rows_per_step: int = Field(
        1, ge=1, description="rows per optimizer step (<R: mid-window resume)"
    )
    max_live_windows: int = Field(3, ge=2, description="K")
    lag_policy: Literal["hold", "recapture", "detach"] = Field("hold", description="lag policy")
    ttl_s: float = Field(5.0, gt=0, description="heartbeat ttl (s)")
    heartbeat_s: float = Field(0.3, gt=0, description="heartbeat interval (s)")
    kills: int = Field(0, ge=0, description="stop killing after this many kills")
    minutes: float | None = Field(None, gt=0, description="or keep killing this long (soak)")
    kill_every_s: tuple[float, float] = Field((0.5, 1.5), description="kill interval range (s)")
    min_age_s: float = Field(1.0, ge=0, description="only kill roles at least this old (s)")
    sample_every_s: float = Field(0.2, gt=0, description="status + windows/ sampling period (s)")
    timeout_s: float = Field(600.0, gt=0, description="give up (and fail) after this long (s)")
    launcher: Literal["fork", "exec"] = Field("fork", description="how roles are started")
    seed: int = Field(0, description="seeds the kill schedule")
    target_layer_ids: tuple[int, ...] = Field((1, 2), description="verifier layers captured")
    db_path: str | None = Field(None, description="coordinator database outside the run dir")
    cache_dir: str | None = Field(None, description="data-prep cache (default work_dir/cache)")


@dataclass
class ChaosReport:
    config: dict[str, Any]
    elapsed_s: float = 0.0
    kills: dict[str, int] = field(default_factory=dict)
    starts: dict[str, int] = field(default_factory=dict)
    unexpected_exits: dict[str, list[int]] = field(default_factory=dict)
    total_windows: int = 0
    rows_checked: int = 0
    covers: dict[str, dict[str, Any]] = field(default_factory=dict)
    samples: int = 0
    cli_samples: int = 0
    max_live: int = 0
    max_ready: int = 0
    max_files: int = 0
    over_k_samples: int = 0
    files_verified: int = 0
    bad_files: list[str] = field(default_factory=list)
    digest_mismatch: list[str] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)
    timed_out: bool = False

    @property
    def total_kills(self) -> int:
        return sum(self.kills.values())

    def problems(self) -> list[str]:
        """Every broken promise; empty when the run kept them all."""
        k = self.config["max_live_windows"]
        out = [f"{c}: {e}" for c, cov in self.covers.items() for e in cov["errors"]]
        out += [f"partial/corrupt file under a final name: {b}" for b in self.bad_files]
        out += self.digest_mismatch
        if not self.total_windows:
            out.append("no stream.json: the producer never started the run")
        if self.timed_out:
            out.append(f"timed out after {self.elapsed_s:.0f} s")
        if self.max_live > k + 1 or self.max_files > k + 1:
            out.append(f"live windows {self.max_live} / files {self.max_files} exceed K+1={k + 1}")
        f = self.final
        if f.get("integrity_check") != "ok":
            out.append(f"integrity_check: {f.get('integrity_check')}")
        if f.get("leases_left"):
            out.append(f"{f['leases_left']} leases left at the end")
        if any(s != "finished" for s in f.get("consumers", {}).values()):
            out.append(f"consumers not finished: {f.get('consumers')}")
        if f.get("failed_windows"):
            out.append(f"{f['failed_windows']} windows failed")
        if f.get("files_left") or f.get("tmp_left"):
            out.append(f"debris after sweep: {f.get('files_left')} {f.get('tmp_left')}")
        return out


class ChaosRun:
    """Set up, run with faults, and check one 1-producer / N-consumer run."""

    def __init__(self, cfg: ChaosConfig, assets: ChaosAssets | None = None) -> None:
        self.cfg = cfg
        self.work = Path(cfg.work_dir).absolute()
        self.run_dir = self.work / "run"
        self.assets = assets or build_assets(self.work / "assets", cfg.conversations)
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(cfg.seed)
        db = Path(cfg.db_path) if cfg.db_path else None
        self.sampler = Sampler(self.run_dir, cfg.max_live_windows, db)
        self.producer = Role("producer", self.producer_argv(), self.work / "logs" / "producer.log")
        self.trainers = [
            Role(f"c{i}", self.trainer_argv(i), self.work / "logs" / f"c{i}.log")
            for i in range(cfg.consumers)
        ]
        self.report = ChaosReport(config=cfg.model_dump(mode="json"))
        self._status_proc: subprocess.Popen[str] | None = None

    @property
    def roles(self) -> list[Role]:
        return [self.producer, *self.trainers]

    def producer_argv(self, **over: Any) -> list[str]:
        c, a = self.cfg, self.assets
        opts: dict[str, Any] = {
            "run-dir": self.run_dir,
            "verifier-name-or-path": a.verifier,
            "tokenizer": a.tokenizer,
            "data": a.data,
            "seq-len": c.seq_len,
            "window-rows": c.window_rows,
            "max-live-windows": c.max_live_windows,
            "expected-consumers": c.consumers,
            "epochs": c.epochs,
            "lag-policy": c.lag_policy,
            "target-layer-ids": " ".join(map(str, c.target_layer_ids)),
            "ttl-s": c.ttl_s,
            "heartbeat-s": c.heartbeat_s,
            "workers": 1,
            "cache-dir": c.cache_dir or self.work / "cache",
            "device": "cpu",
            "capture-batch-rows": c.window_rows,
            "db-path": c.db_path,
        }
        opts.update(over)
        return ["produce", "--no-progress", *_flags(opts)]

    def trainer_argv(self, i: int, **over: Any) -> list[str]:
        c = self.cfg
        opts: dict[str, Any] = {
            "run-dir": self.run_dir,
            "consumer-id": f"c{i}",
            "verifier-name-or-path": self.assets.verifier,
            "block-size": 4,
            "max-anchors": 8,
            "rows-per-step": c.rows_per_step,
            "save-path": self.work / "drafts" / f"c{i}",
            "checkpoint-every": 1,
            "heartbeat-s": c.heartbeat_s,
            "acquire-timeout-s": c.timeout_s,
            "seed": i,
            "db-path": c.db_path,
        }
        opts.update(over)
        return ["train", "--resume", *_flags(opts)]

    # ---- the loop ---------------------------------------------------------------

    def _killing(self, t0: float) -> bool:
        c = self.cfg
        if c.minutes is not None:
            return time.monotonic() - t0 < c.minutes * 60
        return sum(r.kills for r in self.roles) < c.kills

    def _supervise(self, role: Role, killed: set[int]) -> None:
        """Restart a role that died; a trainer that exited 0 is done; so is the
        producer once every trainer is (before that it is restarted to serve demand)."""
        if role.done or role.proc is None or (code := role.proc.poll()) is None:
            return
        pid = role.proc.pid
        if pid not in killed and code != 0:
            role.exits.append(code)
            log.warning("%s exited %d on its own:\n%s", role.name, code, role.tail(600))
        if code == 0 and (role is not self.producer or all(t.done for t in self.trainers)):
            role.done = True
            return
        if role is self.producer and code == 0 and not self._demand():
            return  # finished its stream; restarted only to serve recapture demand
        role.start(self.cfg.launcher)

    def _demand(self) -> bool:
        co = self.sampler._open()
        q = "SELECT COUNT(*) FROM windows WHERE state IN ('queued', 'capturing')"
        return co is not None and bool(co.conn.execute(q).fetchone()[0])

    def start_trainers(self) -> None:
        for t in self.trainers:
            if t.proc is None:
                t.start(self.cfg.launcher)

    def run(
        self, tick: Callable[[ChaosRun], None] | None = None, start_trainers: bool = True
    ) -> ChaosReport:
        """Start the roles (trainers later, by `tick`, if not `start_trainers`), kill
        and restart them until every trainer finished, then check. `tick(self)` runs
        every loop turn (~20 ms): scenarios inject their faults there."""
        c, rep = self.cfg, self.report
        if c.launcher == "fork":
            warm_forkserver()
        t0 = time.monotonic()
        killed: set[int] = set()
        self.producer.start(c.launcher)
        if start_trainers:
            self.start_trainers()
        next_kill = t0 + self.rng.uniform(*c.kill_every_s)
        next_sample = next_cli = t0
        try:
            while not all(r.done for r in self.roles):
                now = time.monotonic()
                if now - t0 > c.timeout_s:
                    rep.timed_out = True
                    break
                for r in self.roles:
                    self._supervise(r, killed)
                if now >= next_kill and self._killing(t0):
                    # Uniform over roles (the producer gets its share); one too young or
                    # not running now is retried shortly.
                    v = self.rng.choice(self.roles)
                    if v.running and v.proc is not None and now - v.proc.started >= c.min_age_s:
                        v.proc.signal(signal.SIGKILL)
                        killed.add(v.proc.pid)
                        v.kills += 1
                        v.proc.wait(5)
                        next_kill = now + self.rng.uniform(*c.kill_every_s)
                    else:
                        next_kill = now + 0.1
                if tick is not None:
                    tick(self)
                if now >= next_sample:
                    self.sampler.sample()
                    next_sample = now + c.sample_every_s
                if now >= next_cli:  # the real command, now and then
                    self._cli_status()
                    next_cli = now + 3.0
                time.sleep(0.02)
        finally:
            for r in self.roles:
                if r.running and r.proc is not None:
                    r.proc.signal(signal.SIGKILL)
                    r.proc.wait(5)
            self.sampler.sample()
            self.sampler.close()
            if self._status_proc is not None:
                self._status_proc.wait(60)
                self._cli_status(launch=False)
        rep.elapsed_s = round(time.monotonic() - t0, 1)
        self.check()
        return rep

    def _cli_status(self, launch: bool = True) -> None:
        """Run the real `fanout status --json` in the background; read the last one's answer."""
        p = self._status_proc
        if p is not None:
            if p.poll() is None:
                return
            out, _ = p.communicate()
            if p.returncode == 0:
                w = json.loads(out)["windows"]
                live = w["ready"] + w["capturing"] + w["evicting"]
                self.report.max_live = max(self.report.max_live, live)
                self.report.cli_samples += 1
            self._status_proc = None
        if not launch or not (self.run_dir / "contract.json").is_file():
            return
        args = [sys.executable, "-m", "fanout.cli", "status", "--run-dir", str(self.run_dir)]
        args += ["--json", *(["--db-path", self.cfg.db_path] if self.cfg.db_path else [])]
        self._status_proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)

    def check(self) -> ChaosReport:
        rep, s = self.report, self.sampler
        args = ["sweep", "--run-dir", str(self.run_dir)]
        if self.cfg.db_path:
            args += ["--db-path", self.cfg.db_path]
        run_cli(args, self.work / "logs" / "sweep.log", self.cfg.launcher)
        stream = self.run_dir / "stream.json"
        if stream.is_file():
            rep.total_windows = int(json.loads(stream.read_text())["total_windows"])
        for t in self.trainers:
            cov = check_cover(
                read_log(self.work / "drafts" / t.name / "train_log.jsonl"), rep.total_windows
            )
            rep.covers[t.name] = asdict(cov)
            rep.rows_checked += cov.windows * self.cfg.window_rows
        rep.kills = {r.name: r.kills for r in self.roles}
        rep.starts = {r.name: r.starts for r in self.roles}
        rep.unexpected_exits = {r.name: r.exits for r in self.roles if r.exits}
        rep.samples = s.samples
        rep.max_live = max(rep.max_live, s.max_live)
        rep.max_ready, rep.max_files, rep.over_k_samples = s.max_ready, s.max_files, s.over_k
        rep.files_verified, rep.bad_files = len(s.verified), s.bad_files
        rep.digest_mismatch = s.digest_mismatch
        rep.final = final_state(self.run_dir, Path(self.cfg.db_path) if self.cfg.db_path else None)
        return rep


def _flags(opts: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for k, v in opts.items():
        if v is None:
            continue
        out.append(f"--{k}")
        out += str(v).split(" ") if k == "target-layer-ids" else [str(v)]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fanout.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", required=True, help="directory for assets, run, drafts, logs")
    p.add_argument("--consumers", type=int, default=3, help="trainers (default: 3)")
    p.add_argument("--kills", type=int, default=30, help="kills before letting the run finish")
    p.add_argument("--minutes", type=float, default=None, help="kill for this long instead (soak)")
    p.add_argument("--conversations", type=int, default=60, help="chat rows (stream length)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the data")
    p.add_argument("--launcher", choices=["fork", "exec"], default="fork", help="role start-up")
    p.add_argument("--seed", type=int, default=0, help="kill schedule seed")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="fail after this long (s)")
    p.add_argument("--json", default=None, help="write the report here")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = ChaosConfig(
        work_dir=a.work_dir,
        consumers=a.consumers,
        kills=a.kills,
        minutes=a.minutes,
        conversations=a.conversations,
        epochs=a.epochs,
        launcher=a.launcher,
        seed=a.seed,
        timeout_s=a.timeout_s,
    )
    rep = ChaosRun(cfg).run()
    text = json.dumps(asdict(rep), indent=2, default=str)
    if a.json:
        Path(a.json).write_text(text + "\n")
    problems = rep.problems()
    print(
        f"kills {rep.total_kills} {rep.kills}  windows {rep.total_windows}  rows checked "
        f"{rep.rows_checked}  samples {rep.samples}+{rep.cli_samples} cli  max live "
        f"{rep.max_live} (K={cfg.max_live_windows})  files verified {rep.files_verified}  "
        f"elapsed {rep.elapsed_s} s"
    )
    for line in problems:
        print("PROBLEM:", line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
