"""Role processes for chaos runs: tiny assets, a preloaded forkserver, kill/restart handles.

    from fanout.chaos.procs import Proc, build_assets
    a = build_assets("runs/chaos/assets", conversations=60)
    p = Proc(["status", "--run-dir", "runs/x"], Path("status.log"), launcher="fork")
    p.signal(signal.SIGKILL); p.wait(5)

`launcher="fork"` forks roles from a forkserver that imported torch + transformers
once (a restart costs ~1 s, not ~8 s of imports on a loaded 2-core box); the child
runs `fanout.cli.main(argv)` — the `fanout` command — with stdout/stderr in its
log. `launcher="exec"` runs `python -m fanout.cli` instead.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fanout.filesystem import FileSystem

PRELOAD = [
    "torch",
    "transformers",
    "transformers.models.qwen3.modeling_qwen3",
    "fanout.cli",
    "fanout.produce.producer",
    "fanout.data.prepare",
    "fanout.model.verifier",
    "fanout.train.trainer",
    "fanout.status.commands",
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

    from fanout.bench.assets import (
        build_tokenizer,
        generate_corpus,
        tiny_verifier_for_tokenizer,
        write_jsonl,
    )

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
            tiny_verifier_for_tokenizer(
                out.verifier,
                out.tokenizer,
                hidden_size=32,
                num_layers=4,
                head_dim=8,
                intermediate_size=64,
            )
        if not out.data.is_file():
            corpus = corpus or generate_corpus(4000, 0)
            rows = corpus[:conversations]
            FileSystem().write_atomic(out.data, lambda t: write_jsonl(t.path, rows))
    return out


# ---------------------------------------------------------------- processes


def child_to_log(log_path: str) -> None:
    """In a forked role: stdout/stderr (fds 1, 2 and sys.*) appended to `log_path`, line
    buffered, and one torch thread (4+ roles on 2 cores: oversubscribed threads only spin)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    import torch

    torch.set_num_threads(1)


def _child(argv: list[str], log_path: str) -> None:
    """Body of a forked role: stdout/stderr to its log, one torch thread, the CLI."""
    child_to_log(log_path)
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
