"""The fan-out benchmark: 1 producer → 1 or 3 trainers vs three unshared pairs.

    fanout bench benchmarks/fanout/cpu-tiny.json --out runs/bench-cpu   # ~4 min on 2 cores
    python scripts/benchmark_fanout.py benchmarks/fanout/cpu-tiny.json --json out.json

Scenarios, run one after another on the same data and models:
- `1p1c`: one producer, the first consumer;
- `1p3c`: one producer, every consumer (block sizes 4/8/16), one shared stream;
- `unshared`: one producer + one consumer per draft, each pair its own run dir —
  what online training does today: one verifier pass per draft.
Every role is its own process (`python -m fanout.cli produce|train`, logs under
`<out>/<scenario>/logs/`); a telemetry sampler (fanout.bench.telemetry) watches them
and the run dirs. Numbers come from the trainers' `train_log.jsonl`, the
producer's summary and the coordinator (`fanout.status.snapshot.snapshot`), over each
scenario's steady window (after `warmup_steps`, while every consumer runs).
The coordinator is SQLite in each run dir, or with `database` set PostgreSQL: the
producer gets `--db-path URL?schema=NAME`, a new schema per run dir (`schema_name`),
and the trainers, probe and report find it in the run dir as every command does.
The config and its per-role specs (fanout.bench.config) are fields of the commands'
own configs (ProducerConfig, TrainConfig) with bench defaults, and become flags in one
place (`fanout.flags.to_flags`). Validity rules are checked (fanout.bench.metrics) and stated
in the report (fanout.bench.report); any role failure or broken rule makes the run
invalid and `fanout bench` exit 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from fanout.bench.config import (
    AssetsSpec,
    BenchConfig,
    ConsumerSpec,
    Scenario,
    run_dir_database,
)
from fanout.bench.scenario import Assets, Role, ScenarioRun
from fanout.errors import ConfigError
from fanout.filesystem import FileSystem
from fanout.flags import to_flags
from fanout.produce.config import ProducerConfig
from fanout.train.config import TrainConfig

# --------------------------------------------------------------------------- assets


def resolve_assets(spec: AssetsSpec, work: Path) -> Assets:
    """Build (or find cached) what the config asks for; the data subset goes under `work`."""
    cache = Path(spec.cache_dir)
    mask: int | None = None
    if spec.verifier_dir is not None and spec.data is not None:
        ver = Path(spec.verifier_dir)
        tok = Path(spec.tokenizer_dir or spec.verifier_dir)
        data = list(spec.data)
    else:
        from fanout.bench.assets import AssetSettings, ensure_demo_assets

        settings = AssetSettings(
            n_conversations=spec.demo_conversations, train_steps=spec.demo_train_steps
        )
        demo = ensure_demo_assets(cache, settings)
        mask = demo.mask_token_id
        tok = Path(spec.tokenizer_dir or demo.tokenizer_dir)
        data = list(spec.data or [str(demo.data_path)])
        if spec.verifier_dir is not None:
            ver = Path(spec.verifier_dir)
        elif spec.use_demo_verifier:
            ver = demo.verifier_dir
        else:
            ver = _random_verifier(spec, cache, tok)
    if spec.conversations is not None:
        data = [str(_subset(data, spec.conversations, work / "data"))]
    return Assets(ver, tok, data, mask)


def _random_verifier(spec: AssetsSpec, cache: Path, tok: Path) -> Path:
    from filelock import FileLock
    from tokenizers import Tokenizer

    from fanout.bench.assets import tiny_qwen3_verifier

    vocab = Tokenizer.from_file(str(tok / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    h, n, i = spec.verifier_hidden_size, spec.verifier_num_layers, spec.verifier_intermediate_size
    out = cache / f"bench-verifier-v{vocab}-h{h}-l{n}-i{i}"
    with FileLock(str(out) + ".lock"):
        if not (out / "config.json").is_file():
            tmp = out.with_name(out.name + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tiny_qwen3_verifier(tmp, vocab, hidden_size=h, num_layers=n, intermediate_size=i)
            FileSystem().commit_dir(tmp, out)
    return out


def _subset(files: list[str], n: int, out_dir: Path) -> Path:
    """The first `n` JSONL lines of the files, as one file (same rows in every scenario)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"first-{n}.jsonl"
    lines: list[str] = []
    for f in files:
        if not f.endswith(".jsonl"):
            raise ConfigError(f"assets.conversations needs JSONL data, got {f}")
        with open(f) as fh:
            for line in fh:
                if line.strip():
                    lines.append(line if line.endswith("\n") else line + "\n")
                if len(lines) >= n:
                    break
        if len(lines) >= n:
            break
    out.write_text("".join(lines))
    return out


# --------------------------------------------------------------------------- processes


def _spec_values(spec: BaseModel, config: type[BaseModel]) -> dict[str, Any]:
    """The spec's fields that are fields of the command's config, by name."""
    return {k: getattr(spec, k) for k in type(spec).model_fields if k in config.model_fields}


def _producer_cmd(cfg: BenchConfig, a: Assets, run_dir: Path, device: str, n: int, work: Path, db: str | None) -> list[str]:  # fmt: skip
    values = {
        "run_dir": str(run_dir),
        "verifier_name_or_path": str(a.verifier_dir),
        "tokenizer": str(a.tokenizer_dir),
        "data": a.data,
        **_spec_values(cfg.producer, ProducerConfig),
        "device": device,  # this pair's (unshared_producer_devices)
        "expected_consumers": n,
        "cache_dir": str(work / "cache"),
        "progress": False,
        "exit_when_idle_s": 5,
    }
    if db is not None:
        values["db_path"] = db  # trainers, probe and report find it in the run dir
    flags = to_flags(ProducerConfig, values)
    return [sys.executable, "-m", "fanout.cli", "produce", *flags, *cfg.producer.extra_args]


def _consumer_cmd(cfg: BenchConfig, a: Assets, run_dir: Path, c: ConsumerSpec, save: Path) -> list[str]:  # fmt: skip
    values = {
        "run_dir": str(run_dir),
        "consumer_id": c.id,
        "verifier_name_or_path": str(a.verifier_dir),
        **_spec_values(c, TrainConfig),
        "save_path": str(save),
        "checkpoint_every": 1_000_000_000,
        "heartbeat_s": cfg.trainer_heartbeat_s,
    }
    if a.mask_token_id is not None:
        values["mask_token_id"] = a.mask_token_id
    flags = to_flags(TrainConfig, values)
    return [sys.executable, "-m", "fanout.cli", "train", *flags, *c.extra_args]


def plan(cfg: BenchConfig, scenario: Scenario, a: Assets, work: Path) -> ScenarioRun:
    """The roles of one scenario (nothing started)."""
    d = work / scenario
    shutil.rmtree(d, ignore_errors=True)
    logs = d / "logs"
    logs.mkdir(parents=True)
    if scenario == "unshared":
        devs = cfg.unshared_producer_devices or [cfg.producer.device] * len(cfg.consumers)
        pairs = [
            (d / f"run-{c.id}", dev, [c], f"producer-{c.id}") for c, dev in zip(cfg.consumers, devs)
        ]
    else:
        cons = cfg.consumers[:1] if scenario == "1p1c" else cfg.consumers
        pairs = [(d / "run", cfg.producer.device, cons, "producer")]
    roles: list[Role] = []
    # A new schema name per plan: a schema an earlier bench left behind is never reused.
    token = uuid.uuid4().hex[:8]
    m = cfg.producer.replicas
    for i, (run_dir, dev, cons, pname) in enumerate(pairs):
        db = run_dir_database(cfg, scenario, i, token)
        cmd = _producer_cmd(cfg, a, run_dir, dev, len(cons), work, db)
        for r in range(m):  # one role per replica (--replica-rank r of --replicas m)
            name = pname if m == 1 else f"{pname}-r{r}"
            summary = logs / f"{name}.summary.json"
            rank = [] if m == 1 else ["--replica-rank", str(r)]
            roles.append(
                Role(name, "producer", [*cmd, *rank, "--summary-json", str(summary)],
                     logs / f"{name}.log", run_dir, dev, summary_path=summary)
            )  # fmt: skip
        for c in cons:
            save = d / "drafts" / c.id
            roles.append(
                Role(
                    c.id,
                    "consumer",
                    _consumer_cmd(cfg, a, run_dir, c, save),
                    logs / f"{c.id}.log",
                    run_dir,
                    c.device,
                    save_path=save,
                    spec=c,
                )
            )
    return ScenarioRun(scenario, d, roles, [p[0] for p in pairs])


def _env(cfg: BenchConfig, kind: str) -> dict[str, str]:
    # Passive OMP waits: with more threads than free cores, spinning threads would
    # steal the cores the other roles need (and make numbers depend on the OMP build).
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_WAIT_POLICY="PASSIVE")
    n = cfg.threads_per_role
    if kind == "producer" and cfg.producer.threads:
        n = cfg.producer.threads
    if n:
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[k] = str(n)
    return env


def _coordinator_probe(run_dirs: list[Path]) -> Callable[[], dict[str, Any]]:
    """Sampler probe: ready windows / bytes per run dir, read-only, each opened once its
    producer has created it (SQLite or PostgreSQL: the run dir records which)."""
    from fanout.coord.coordinator import Coordinator

    opened: dict[Path, Coordinator] = {}

    def probe() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for r in run_dirs:
            if r not in opened:
                co = Coordinator.open_if_created(r)
                if co is None:
                    continue
                opened[r] = co
            ready, ready_bytes = opened[r].ready_windows()
            out[str(r)] = {
                "ready_windows": ready,
                "ready_bytes": ready_bytes,
                "produced": int(opened[r].meta("next_window")),
            }
        return out

    return probe


def _stop(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)  # the role and its data-prep workers


def execute(
    cfg: BenchConfig, run: ScenarioRun, *, stop_after_s: float | None = None, echo: Any = None
) -> Path:
    """Start every role, sample telemetry, wait; returns the telemetry JSONL path.

    A role that exits non-zero stops the others (SIGTERM, then SIGKILL). With
    `stop_after_s` (the demo), trainers get SIGINT at that age and the producers
    SIGTERM once the trainers are gone; those exits count as clean.
    """
    from fanout.bench.telemetry import Sampler

    tel = run.dir / "telemetry.jsonl"
    sampler = Sampler(
        tel,
        run_dirs=run.run_dirs,
        interval_s=cfg.telemetry_interval_s,
        probe=_coordinator_probe(run.run_dirs),
    )
    run.started_wall = time.time()
    t0 = time.monotonic()
    with sampler:
        for r in run.roles:
            _start(cfg, r)
            assert r.proc is not None
            sampler.add_role(r.name, r.proc.pid)
        try:
            while not _reap(run, echo):
                age = time.monotonic() - t0
                if stop_after_s is not None:
                    _stop_on_time(run, age > stop_after_s)
                if age > cfg.scenario_timeout_s:
                    run.timed_out = True
                    run.notes.append(f"timed out after {cfg.scenario_timeout_s:.0f} s")
                    break
                time.sleep(0.2)
        finally:
            _shutdown(run)
    run.ended_wall = time.time()
    return tel


def _start(cfg: BenchConfig, r: Role) -> None:
    """Start role `r` in its own session (so a stop reaches its data-prep workers too)."""
    with r.log.open("wb") as logf:
        r.proc = subprocess.Popen(
            r.cmd,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=_env(cfg, r.kind),
            start_new_session=True,
        )


def _reap(run: ScenarioRun, echo: Any) -> bool:
    """Record the exit codes of roles that exited. True when the scenario is over:
    every role exited, or one failed (exited non-zero without being stopped by us)."""
    failed = False
    for r in run.roles:
        if r.rc is None and r.proc is not None and (rc := r.proc.poll()) is not None:
            r.rc = rc
            if echo:
                echo(f"  {run.name}: {r.name} exited {rc}")
        failed |= r.rc not in (0, None) and not r.stopped_by_us
    return failed or all(r.rc is not None for r in run.roles)


def _stop_on_time(run: ScenarioRun, past_limit: bool) -> None:
    """A time-limited run (`stop_after_s`): SIGINT each trainer once past the limit; once
    every trainer is gone, SIGTERM each producer still held (once each: a second signal
    could land during the interpreter's shutdown, after its handlers are reset)."""
    consumers = [r for r in run.roles if r.kind == "consumer"]
    for r in consumers if past_limit else []:
        if r.rc is None and not r.stopped_by_us and r.proc is not None:
            r.stopped_by_us = True
            _stop(r.proc, signal.SIGINT)
    if all(r.rc is not None for r in consumers):
        for r in run.roles:
            if r.rc is None and r.proc is not None and not r.stopped_by_us:
                r.stopped_by_us = True
                _stop(r.proc, signal.SIGTERM)


def _shutdown(run: ScenarioRun) -> None:
    live = [r for r in run.roles if r.proc is not None and r.proc.poll() is None]
    for r in live:
        assert r.proc is not None
        _stop(r.proc, signal.SIGTERM)
    deadline = time.monotonic() + 20
    for r in live:
        assert r.proc is not None
        try:
            r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _stop(r.proc, signal.SIGKILL)
            r.proc.wait()
        if r.rc is None:  # stopped as a consequence (failure elsewhere, timeout): not a cause
            r.rc, r.stopped_by_us = r.proc.returncode, True


# --------------------------------------------------------------------------- whole run


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def run_bench(
    cfg: BenchConfig,
    out: str | os.PathLike[str],
    *,
    stop_after_s: float | None = None,
    echo: Any = print,
) -> dict[str, Any]:
    """Run every scenario of `cfg` under `out`; write report.json/.md + plots; return the report."""
    from fanout.bench.report import build_report, write_report

    work = Path(out)
    work.mkdir(parents=True, exist_ok=True)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN and _main_thread():
        # Started in the background (nohup, `&`): SIGINT is ignored and our trainers
        # would inherit that, so the time limit's SIGINT would not stop them.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    echo(f"bench {cfg.name}: assets …")
    assets = resolve_assets(cfg.assets, work)
    runs: list[tuple[ScenarioRun, Path]] = []
    for sc in cfg.scenarios:
        run = plan(cfg, sc, assets, work)
        echo(f"bench {cfg.name}: scenario {sc} ({len(run.roles)} processes) …")
        tel = execute(cfg, run, stop_after_s=stop_after_s, echo=echo)
        runs.append((run, tel))
    report = build_report(cfg, assets, runs, work)
    write_report(report, runs, work)
    return report


def add_arguments(p: argparse.ArgumentParser, name: str = "bench") -> None:
    p.add_argument("config", help="benchmark config JSON (e.g. benchmarks/fanout/cpu-tiny.json)")
    p.add_argument(
        "--out", default=None, help="report directory (default: runs/bench/<name>-<timestamp>)"
    )
    p.add_argument("--json", default=None, help="also copy report.json here")


def run(args: argparse.Namespace, name: str = "bench") -> int:
    cfg = BenchConfig.load(args.config)
    out = args.out or f"runs/bench/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    report = run_bench(cfg, out)
    from fanout.bench.report import format_table

    print(format_table(report))
    print(f"report: {Path(out) / 'report.md'}  (JSON: {Path(out) / 'report.json'})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["valid"] else 1
