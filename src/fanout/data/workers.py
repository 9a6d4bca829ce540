"""A persistent, warm pool of tokenizer worker processes shared by every caller.

    from fanout.data.workers import shared_pool, usable_cpus
    pool = shared_pool()                 # sized from affinity + cgroup quota (or FANOUT_WORKERS)
    pool.prewarm(spec)                   # tokenizer + template load in the background
    for res in pool.map_ordered(encode_chunk, tasks, inflight=8):   # results in task order
        ...

Why a pool of its own (not `datasets.map(num_proc=…)`): it is started once per
process and stays warm, the tokenizer is loaded once, work is handed out in
chunks of hundreds of rows (raw JSONL bytes in, flat numpy arrays out, so pickling
is per chunk and never per row), results come back in submission order whatever
the worker count, and concurrent callers share one FIFO queue with a bounded
number of chunks in flight each, so none starves the others and there is no
per-batch-size tuning. With one worker the work runs in the calling thread.

Start-up (measured, docs/data.md): loading the 11 MB tokenizer.json costs ~1 s of
CPU, and a `spawn`ed worker pays that plus a fresh interpreter and its imports.
So where it is safe — Linux, and no torch/jax/tensorflow in this process (their
thread pools and CUDA state do not survive fork) — workers are FORKED from this
process after `prewarm` has loaded a dedicated encoder here (one that no parent
thread ever encodes with, so no tokenizer lock can be held at fork time): every
worker starts warm at no extra cost. Otherwise they are `spawn`ed (tokenizers,
jinja2, numpy, pydantic; never torch or transformers) and load it themselves.
`FANOUT_START_METHOD=fork|spawn|forkserver` overrides the choice.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from fanout.data import masks
from fanout.data.chat import ChatFormat, Conversation, to_conversation
from fanout.data.template import ChatEncoder, ChatSpec
from fanout.errors import BadRow, ConfigError

T = TypeVar("T")
R = TypeVar("R")


def _cgroup_cpus(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPU quota in cores from cgroup v2 (`cpu.max`) or v1 (`cpu.cfs_quota_us`), if any."""
    try:
        v2 = root / "cpu.max"
        if v2.is_file():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        for d in (root / "cpu", root / "cpu,cpuacct", root):
            q, p = d / "cpu.cfs_quota_us", d / "cpu.cfs_period_us"
            if q.is_file() and p.is_file():
                quota_us = int(q.read_text())
                return None if quota_us <= 0 else quota_us / int(p.read_text())
    except (OSError, ValueError):
        return None
    return None


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may actually use: affinity mask, capped by the cgroup quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    quota = _cgroup_cpus(cgroup_root)
    if quota is not None:
        n = min(n, max(1, int(quota + 0.5)))  # 1.5 cores of quota → 2 busy processes
    return max(1, n)


def resolve_workers(requested: int | None = None) -> int:
    """--workers, else FANOUT_WORKERS, else usable_cpus()."""
    if requested is None:
        env = os.environ.get("FANOUT_WORKERS")
        if env:
            try:
                requested = int(env)
            except ValueError:
                raise ConfigError(f"FANOUT_WORKERS={env!r}: not an integer") from None
    if requested is None or requested == 0:
        return usable_cpus()
    if requested < 0:
        raise ConfigError(f"workers: must be >= 0 (0 = all usable cores), got {requested}")
    return requested


# --------------------------------------------------------------------------- worker side

_ENCODERS: dict[tuple[str, str, str], ChatEncoder] = {}
# Loaded in the parent only to be inherited by forked workers; never used there.
_FORK_ENCODERS: dict[tuple[str, str, str], ChatEncoder] = {}
_FORK_LOCK = threading.Lock()
# Modules whose runtime state (thread pools, CUDA) makes fork unsafe.
_FORK_UNSAFE = ("torch", "jax", "tensorflow")


def _init_worker() -> None:
    # One process per core already; the Rust thread pool inside would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Forked: an encoder a parent thread was using may hold a tokenizer lock; only the
    # dedicated _FORK_ENCODERS (never used in the parent) are safe to inherit.
    _ENCODERS.clear()
    parent = os.getppid()

    def watch_parent() -> None:  # a parent killed hard (or os._exit) leaves no orphans
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch_parent, daemon=True, name="fanout-parent-watch").start()


def _encoder_key(spec: ChatSpec) -> tuple[str, str, str]:
    # One tokenizer can serve several templates (--chat-template) and mask paths.
    return spec.tokenizer_json, spec.template_fingerprint(), spec.mask_path


def encoder_for(spec: ChatSpec) -> ChatEncoder:
    """The per-process ChatEncoder for a spec (loaded once, then warm)."""
    key = _encoder_key(spec)
    enc = _ENCODERS.get(key)
    if enc is None:
        # A forked worker finds the parent's pre-loaded encoder here (no load at all).
        enc = _FORK_ENCODERS.get(key) or ChatEncoder(spec)
        _ENCODERS[key] = enc
    return enc


def _load_for_fork(spec: ChatSpec) -> None:
    with _FORK_LOCK:
        key = _encoder_key(spec)
        if key not in _FORK_ENCODERS:
            _FORK_ENCODERS[key] = ChatEncoder(spec)


def start_method() -> str:
    """`fork` on Linux when no fork-unsafe runtime is loaded, else `spawn` (env overrides)."""
    env = os.environ.get("FANOUT_START_METHOD")
    if env:
        if env not in ("fork", "spawn", "forkserver"):
            raise ConfigError(f"FANOUT_START_METHOD={env!r}: expected fork|spawn|forkserver")
        return env
    if sys.platform.startswith("linux") and not any(m in sys.modules for m in _FORK_UNSAFE):
        return "fork"
    return "spawn"


def _warm(spec: ChatSpec) -> int:
    encoder_for(spec)
    return os.getpid()


@dataclass
class ChunkTask:
    """One unit of work: a chunk of rows from one file. Pickled once per chunk."""

    spec: ChatSpec
    fmt: ChatFormat
    file: str
    first_line: int
    items: list[Any]  # (line, raw JSONL bytes) when raw, else parsed records
    raw: bool
    skip_bad: bool
    nbytes: int = 0
    verify: int = 0  # check the mask path against the prefix rule on this many rows


@dataclass
class ChunkResult:
    """Flat arrays for a chunk's documents, in input order."""

    ids: np.ndarray  # int32 [N] all documents concatenated
    mask: np.ndarray  # uint8 [N]
    lengths: np.ndarray  # int64 [D]
    lines: np.ndarray  # int64 [D] source line (or row) of each document
    file: str
    rows_in: int
    nbytes: int
    skipped: dict[str, int] = field(default_factory=dict)
    error: tuple[str, int, str, str] | None = None  # first bad row when not skipping
    mask_path: str = ""  # the path that masked this chunk (fanout.data.masks)
    aligned: int = 0  # rows the prefix rule had to align (templates that rewrite turns)
    verified: int = 0  # rows checked against the prefix rule (fast paths)


_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"|:.*$")


def _reason_key(reason: str) -> str:
    """'unknown role 'bot'' → 'unknown role' (the summary counts by kind, not by value)."""
    return _QUOTED.sub("", reason).strip() or reason


def encode_chunk(task: ChunkTask) -> ChunkResult:
    """Parse → convert → render → tokenize → mask one chunk (runs in a worker)."""
    import json

    enc = encoder_for(task.spec)
    texts: list[str] = []
    spans: list[list[tuple[int, int]] | None] = []
    lines: list[int] = []
    skipped: dict[str, int] = {}
    error = None
    aligned = 0
    sample: list[tuple[int, Conversation]] = []  # (document index, conversation) to verify
    for k, item in enumerate(task.items):
        line = item[0] if task.raw else task.first_line + k
        try:
            try:
                rec = json.loads(item[1]) if task.raw else item
            except ValueError as e:
                raise BadRow(task.file, line, "<json>", f"bad JSON: {e}") from None
            conv = to_conversation(rec, task.fmt, task.file, line)
            bad = enc.check(conv)
            if bad is not None:
                raise BadRow(task.file, line, *bad)
            try:
                text, sp, al = enc.render_for_mask(conv)
            except masks.MaskError as e:
                raise BadRow(task.file, line, e.field, e.reason) from None
            except Exception as e:  # the template's raise_exception, or a type it rejects
                raise BadRow(task.file, line, "<template>", f"chat template failed: {e}") from None
        except BadRow as e:
            if not task.skip_bad:
                error = (e.file, e.line, e.field, e.reason)
                break
            key = _reason_key(e.reason)
            skipped[key] = skipped.get(key, 0) + 1
            continue
        if len(sample) < task.verify:
            sample.append((len(texts), conv))
        texts.append(text)
        spans.append(sp)
        lines.append(line)
        aligned += al
    ids, mask, lengths = enc.encode_rendered(texts, spans)
    verified = verify_against_rule(enc, sample, texts, ids, mask, lengths, task.file, lines)
    return ChunkResult(
        ids=ids,
        mask=mask,
        lengths=lengths,
        lines=np.asarray(lines, dtype=np.int64),
        file=task.file,
        rows_in=len(task.items),
        nbytes=task.nbytes,
        skipped=skipped,
        error=error,
        mask_path=enc.mask_path,
        aligned=aligned,
        verified=verified,
    )


def verify_against_rule(
    enc: ChatEncoder,
    sample: list[tuple[int, Conversation]],
    texts: list[str],
    ids: np.ndarray,
    mask: np.ndarray,
    lengths: np.ndarray,
    file: str,
    lines: list[int],
) -> int:
    """Check a fast path's masks against the prefix rule on `sample`; ConfigError on any
    difference (a fast path must never silently differ). Returns rows compared."""
    if enc.mask_path == masks.RULE or not sample:
        return 0
    offs = np.concatenate([[0], np.cumsum(lengths)])  # [D+1]
    done = 0
    for d, conv in sample:
        try:
            text, sp, _ = enc.rule_spans(conv)
        except masks.MaskError:
            continue  # the rule cannot place a turn here: nothing to compare with
        _, want, _ = enc.encode_spans([text], [sp])
        got = mask[offs[d] : offs[d + 1]]
        if text != texts[d] or not np.array_equal(got, want):
            bad = np.flatnonzero(got != want) if got.shape == want.shape else np.array([0])
            raise ConfigError(
                f"{file}:{lines[d]}: loss mask path {enc.mask_path} disagrees with the prefix rule "
                f"(token {int(bad[0])} of {got.shape[0]}); pass --mask-path prefix-rule "
                "to use the rule, and report the template"
            )
        done += 1
    return done


# --------------------------------------------------------------------------- pool


class WorkerPool:
    """`workers` processes (started lazily once, kept warm); 1 worker = in-process."""

    def __init__(self, workers: int, method: str | None = None) -> None:
        if workers < 1:
            raise ConfigError(f"workers: need >= 1, got {workers}")
        self.workers = workers
        self.method = method  # None: start_method() when the processes start
        self._ex: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._warming: list[Future[int]] = []
        self._loader: threading.Thread | None = None

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._ex is None:
                self.method = self.method or start_method()
                if self.method == "fork":
                    self._ex = self._fork_workers()
                else:
                    self._ex = ProcessPoolExecutor(
                        self.workers, mp_context=get_context(self.method), initializer=_init_worker
                    )
            return self._ex

    def _fork_workers(self) -> ProcessPoolExecutor:
        """Fork every worker now, after the prewarm load finished (they inherit it warm)."""
        warm = self._loader is not None
        if self._loader is not None:
            self._loader.join()  # the load is needed anyway; no tokenizer call runs during fork
        ex = ProcessPoolExecutor(
            self.workers, mp_context=get_context("fork"), initializer=_init_worker
        )
        # Children must not use rayon threads (one process per core already), and
        # tokenizers prints a warning at fork unless the variable is set: set it for
        # the fork only, so this process keeps its own setting.
        old = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            with _FORK_LOCK:  # no _load_for_fork half-done in another thread
                # With fork, Python starts all processes at the first submit.
                started = ex.submit(os.getpid)
        finally:
            if old is None:
                del os.environ["TOKENIZERS_PARALLELISM"]
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = old
        # Not prewarmed: the workers load the tokenizer themselves, so map_ordered does
        # the first chunk here meanwhile (as with spawn). Prewarmed: they are warm now.
        self._warming = [] if warm else [started]
        return ex

    def prewarm(self, spec: ChatSpec) -> None:
        """Load the tokenizer (here for in-process / forked workers, else in each spawned
        worker) in the background; returns at once."""
        if self.workers == 1:
            target: Callable[[ChatSpec], Any] = encoder_for
        elif (self.method or start_method()) == "fork":
            target = _load_for_fork
        else:
            ex = self._executor()
            self._warming = [ex.submit(_warm, spec) for _ in range(self.workers)]
            return
        with self._lock:
            if self._loader is None and self._ex is None:
                self._loader = threading.Thread(
                    target=target, args=(spec,), daemon=True, name="fanout-prewarm"
                )
                self._loader.start()

    def is_warm(self) -> bool:
        return all(f.done() for f in self._warming)

    def map_ordered(
        self, fn: Callable[[T], R], tasks: Iterable[T], inflight: int | None = None
    ) -> Iterator[R]:
        """Apply fn to each task; yield results in task order, at most `inflight` pending.

        Bounded in-flight work keeps memory flat for any input size and lets several
        callers share the queue; each caller only ever waits on its own futures.
        """
        if self.workers == 1:
            if self._loader is not None:
                self._loader.join()
            for t in tasks:
                yield fn(t)
            return
        ex = self._executor()
        limit = inflight or 2 * self.workers + 2
        pending: deque[Future[R]] = deque()
        it = iter(tasks)
        try:
            if not self.is_warm():
                # Cold start: queue the next chunks for the workers, but do the first
                # one here while they are still starting, so the first rows come sooner.
                first = next(it, None)
                if first is None:
                    return
                for t in it:
                    pending.append(ex.submit(fn, t))
                    if len(pending) >= limit - 1:
                        break
                yield fn(first)
            for t in it:
                pending.append(ex.submit(fn, t))
                if len(pending) >= limit:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:  # caller stopped early: don't leave work queued
                f.cancel()

    def close(self) -> None:
        with self._lock:
            if self._ex is not None:
                self._ex.shutdown(wait=True, cancel_futures=True)
                self._ex = None


_POOLS: dict[int, WorkerPool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(workers: int | None = None) -> WorkerPool:
    """The process-wide pool for this worker count (created once, reused by every caller)."""
    n = resolve_workers(workers)
    with _POOLS_LOCK:
        pool = _POOLS.get(n)
        if pool is None:
            pool = _POOLS[n] = WorkerPool(n)
        return pool


@atexit.register
def _shutdown_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
