"""The chaos run: start a producer (or M replicas) and N trainers, kill -9 / pause / break
things, check.

    from fanout.chaos import ChaosConfig, ChaosRun
    rep = ChaosRun(ChaosConfig(work_dir="runs/chaos", kills=30)).run()
    assert not rep.problems()

A loop (~20 ms a turn) restarts every role that died (a trainer that exited 0 is
done; a producer replica is restarted only while trainers still need windows
captured; `replicas` > 1 runs p0 … pM-1, each `--replica-rank i` of `--replicas M`),
SIGKILLs a random role every `kill_every_s` while killing is on (from the moment the
first producer has created the run until the kill goal is met), calls the
scenario's `tick(run)` (fault injection) and samples the run. Then `check()`. One run
ends with its stream, however few kills fitted: fanout.chaos.soak loops runs until a
kill count or a duration is reached, on any machine.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fanout.chaos.checks import ChaosReport, Sampler, check_cover, final_state
from fanout.chaos.procs import ChaosAssets, Role, build_assets, run_cli, warm_forkserver
from fanout.coord.states import LIVE
from fanout.flags import to_flags
from fanout.produce.config import ProducerConfig
from fanout.store.rundir import RunDir
from fanout.store.streaminfo import StreamInfo
from fanout.train.config import TrainConfig
from fanout.train.trainlog import read_train_log

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- the run


class ChaosConfig(BaseModel):
    """One chaos run: sizes, fault schedule and limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    work_dir: str = Field(description="assets/, run/, drafts/, logs/ go here")
    consumers: int = Field(3, ge=1, description="trainers (consumers c0 … cN-1)")
    replicas: int = Field(
        1, ge=1, description="producer replicas (p0 … pM-1; one: the run's producer)"
    )
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
    kills: int = Field(30, ge=0, description="stop killing after this many kills (0: none)")
    minutes: float | None = Field(None, gt=0, description="or keep killing this long (soak)")
    kill_every_s: tuple[float, float] = Field((0.5, 1.5), description="kill interval range (s)")
    min_age_s: float = Field(1.0, ge=0, description="only kill roles at least this old (s)")
    sample_every_s: float = Field(0.2, gt=0, description="status + windows/ sampling period (s)")
    timeout_s: float = Field(1200.0, gt=0, description="give up (and fail) after this long (s)")
    max_crashes: int = Field(5, ge=0, description="stop restarting a role after this many crashes")
    launcher: Literal["fork", "exec"] = Field("fork", description="how roles are started")
    seed: int = Field(0, description="seeds the kill schedule")
    target_layer_ids: tuple[int, ...] = Field((1, 2), description="verifier layers captured")
    db_path: str | None = Field(
        None, description="coordinator database outside the run dir (a path or postgresql:// URL)"
    )
    cache_dir: str | None = Field(None, description="data-prep cache (default work_dir/cache)")


def producer_names(cfg: ChaosConfig) -> list[str]:
    """The producer roles' names: `producer`, or p0 … pM-1 for `replicas` M > 1."""
    return ["producer"] if cfg.replicas == 1 else [f"p{i}" for i in range(cfg.replicas)]


def role_names(cfg: ChaosConfig) -> list[str]:
    """Every role's name: the producers', then the trainers' c0 … cN-1."""
    return [*producer_names(cfg), *(f"c{i}" for i in range(cfg.consumers))]


class ChaosRun:
    """Set up, run with faults, and check one 1-producer / N-consumer run."""

    def __init__(
        self,
        cfg: ChaosConfig,
        assets: ChaosAssets | None = None,
        prior_kills: dict[str, int] | None = None,
    ) -> None:
        """`prior_kills`: kills per role name in earlier rounds of a soak; the victim
        choice evens out the sum (fanout.chaos.soak)."""
        self.cfg = cfg
        self.prior_kills = dict(prior_kills or {})
        self.work = Path(cfg.work_dir).absolute()
        self.run_dir = self.work / "run"
        self.assets = assets or build_assets(self.work / "assets", cfg.conversations)
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(cfg.seed)
        self.sampler = Sampler(self.run_dir, cfg.max_live_windows, cfg.db_path)
        names = producer_names(cfg)
        self.producers = [
            Role(n, self.producer_argv(replica_rank=i if cfg.replicas > 1 else None),
                 self.work / "logs" / f"{n}.log")
            for i, n in enumerate(names)
        ]  # fmt: skip
        self.producer = self.producers[0]
        self.trainers = [
            Role(f"c{i}", self.trainer_argv(i), self.work / "logs" / f"c{i}.log")
            for i in range(cfg.consumers)
        ]
        self.report = ChaosReport(config=cfg.model_dump(mode="json"))
        self._status_proc: subprocess.Popen[str] | None = None

    @property
    def roles(self) -> list[Role]:
        return [*self.producers, *self.trainers]

    def producer_argv(self, **over: Any) -> list[str]:
        c, a = self.cfg, self.assets
        opts: dict[str, Any] = {
            "run_dir": self.run_dir,
            "verifier_name_or_path": a.verifier,
            "tokenizer": a.tokenizer,
            "data": [a.data],
            "seq_len": c.seq_len,
            "window_rows": c.window_rows,
            "max_live_windows": c.max_live_windows,
            "expected_consumers": c.consumers,
            "epochs": c.epochs,
            "lag_policy": c.lag_policy,
            "capture_layer_ids": c.target_layer_ids,
            "ttl_s": c.ttl_s,
            "heartbeat_s": c.heartbeat_s,
            "workers": 1,
            "cache_dir": c.cache_dir or self.work / "cache",
            "device": "cpu",
            "capture_batch_rows": c.window_rows,
            "db_path": c.db_path,
            "progress": False,
            "replicas": c.replicas,
        }
        opts.update(over)
        return ["produce", *_flags(ProducerConfig, opts)]

    def trainer_argv(self, i: int, **over: Any) -> list[str]:
        c = self.cfg
        opts: dict[str, Any] = {
            "run_dir": self.run_dir,
            "consumer_id": f"c{i}",
            "verifier_name_or_path": self.assets.verifier,
            "num_layers": 1,
            "block_size": 4,
            "max_anchors": 8,
            "rows_per_step": c.rows_per_step,
            "save_path": self.work / "drafts" / f"c{i}",
            "checkpoint_every": 1,
            "heartbeat_s": c.heartbeat_s,
            "acquire_timeout_s": c.timeout_s,
            "seed": i,
            "db_path": c.db_path,
            "resume": True,
        }
        opts.update(over)
        return ["train", *_flags(TrainConfig, opts)]

    # ---- the loop ---------------------------------------------------------------

    def _killing(self, t0: float) -> bool:
        c = self.cfg
        if c.minutes is not None:
            return time.monotonic() - t0 < c.minutes * 60
        return sum(r.kills for r in self.roles) < c.kills

    def _supervise(self, role: Role, killed: set[int]) -> None:
        """Restart a role that died; a trainer that exited 0 is done; so is a producer
        replica once every trainer is (before that it is restarted to serve demand)."""
        if role.done or role.proc is None or (code := role.proc.poll()) is None:
            return
        pid = role.proc.pid
        if pid not in killed and code != 0:
            role.exits.append(code)
            log.warning("%s exited %d on its own:\n%s", role.name, code, role.tail(600))
        producer = role in self.producers
        if code == 0 and (not producer or all(t.done for t in self.trainers)):
            role.done = True
            return
        if len(role.exits) > self.cfg.max_crashes:
            log.error("%s crashed %d times on its own; giving up on it", role.name, len(role.exits))
            role.done = True
            return
        if producer and code == 0 and not self._demand():
            return  # finished its stream; restarted only to serve recapture demand
        role.start(self.cfg.launcher)

    def _demand(self) -> bool:
        co = self.sampler._open()
        return co is not None and co.pending_windows() > 0

    def _kill_one(self, now: float, killed: set[int]) -> float:
        """SIGKILL the role with the fewest kills so far (earlier rounds included; ties in
        a shuffled order), among those running and older than min_age_s: every role gets
        its share, whichever roles a loaded machine keeps restarting. Next kill time."""
        c = self.cfg
        ready = [
            r
            for r in self.roles
            if not r.done and r.running and r.proc is not None
            and now - r.proc.started >= c.min_age_s
        ]  # fmt: skip
        if not ready:
            return now + 0.1
        order = {r.name: i for i, r in enumerate(self.rng.sample(self.roles, len(self.roles)))}
        v = min(ready, key=lambda r: (self.prior_kills.get(r.name, 0) + r.kills, order[r.name]))
        assert v.proc is not None
        v.proc.signal(signal.SIGKILL)
        killed.add(v.proc.pid)
        v.kills += 1
        v.proc.wait(5)
        return now + self.rng.uniform(*c.kill_every_s)

    def pause(self, role: Role, probe_s: float = 1.0) -> bool:
        """SIGSTOP `role`, unless it stopped inside a coordinator write transaction: such a
        process holds the write lock, every other process waits on it, nobody can declare
        it lost until it resumes, and the run stalls for the pause (SQLite: whole
        database; PostgreSQL: the run's advisory lock). That is a stall, not the fault
        a pause scenario means (a process silent past its ttl while the others go on);
        so if the lock cannot be had within `probe_s`, SIGCONT and False: try later."""
        co = self.sampler._open()
        if role.proc is None or co is None:
            return False
        role.proc.signal(signal.SIGSTOP)
        if co.conn.writable(probe_s):
            return True
        role.proc.signal(signal.SIGCONT)
        log.info("%s was stopped holding the coordinator's write lock; resumed", role.name)
        return False

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
        for p in self.producers:
            p.start(c.launcher)
        if start_trainers:
            self.start_trainers()
        next_kill = t0 + self.rng.uniform(*c.kill_every_s)
        next_sample = next_cli = t0
        # Killing starts once the first producer has created the run (stream.json): its
        # first start-up prepares the data and builds the tokenizer cache, which a loaded
        # machine may not finish between two kills; every later start-up is fair game.
        killing_start: float | None = None
        killing_end: float | None = None  # when the kill goal was met
        try:
            while not all(r.done for r in self.roles):
                now = time.monotonic()
                if now - t0 > c.timeout_s:
                    rep.timed_out = True
                    break
                for r in self.roles:
                    self._supervise(r, killed)
                if killing_start is None and RunDir(self.run_dir).stream_info.is_file():
                    killing_start = now
                    next_kill = now + self.rng.uniform(*c.kill_every_s)
                if killing_start is not None and killing_end is None:
                    if not self._killing(killing_start):
                        killing_end = now
                    elif now >= next_kill:
                        next_kill = self._kill_one(now, killed)
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
        end = time.monotonic()
        rep.elapsed_s = round(end - t0, 1)
        if killing_start is not None and (c.kills or c.minutes):
            rep.killing_s = round((killing_end or end) - killing_start, 1)
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
                live = sum(w[state] for state in LIVE)
                self.report.max_live = max(self.report.max_live, live)
                self.report.cli_samples += 1
            self._status_proc = None
        if not launch or not RunDir(self.run_dir).contract.is_file():
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
        info = StreamInfo.read(RunDir(self.run_dir))
        if info is not None and info.total_windows is not None:
            rep.total_windows = info.total_windows
        for t in self.trainers:
            cov = check_cover(read_train_log(self.work / "drafts" / t.name), rep.total_windows)
            rep.covers[t.name] = asdict(cov)
            rep.rows_checked += cov.windows * self.cfg.window_rows
        rep.kills = {r.name: r.kills for r in self.roles}
        rep.starts = {r.name: r.starts for r in self.roles}
        rep.unexpected_exits = {r.name: r.exits for r in self.roles if r.exits}
        rep.samples = s.samples
        rep.max_live = max(rep.max_live, s.max_live)
        rep.max_ready, rep.max_files, rep.over_k_samples = s.max_ready, s.max_files, s.over_k
        rep.files_verified, rep.bad_files = len(s.verified), s.bad_files
        rep.windows_seen = len(s.digest_by_window)
        rep.digest_mismatch = s.digest_mismatch
        rep.final = final_state(self.run_dir, self.cfg.db_path)
        return rep


def _flags(config: type[BaseModel], opts: dict[str, Any]) -> list[str]:
    """The command's flags for the fields `opts` sets (None: left to its default), by
    the one argv writer, fanout.flags.to_flags."""
    return to_flags(config, {k: v for k, v in opts.items() if v is not None})
