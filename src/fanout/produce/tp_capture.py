"""Tensor-parallel capture: N torchrun ranks run every verifier forward; rank 0 publishes.

    torchrun --nproc-per-node 2 -m fanout.cli produce --tp 2 --run-dir runs/r1 \
        --verifier-name-or-path VERIFIER_DIR --data chat.jsonl ...

Every rank loads its shard of the verifier (fanout.model.tp_shard: transformers' own TP
plan). Rank 0 alone is the producer: it holds the role in the coordinator, claims,
captures and publishes. The other ranks (followers) hold no role and never open the
run directory or the dataset; they only compute. Before each verifier forward rank 0
broadcasts one command on a gloo control group — CAPTURE with the batch's input,
position and document ids, or STOP with its exit code — and every rank then runs
the same forward, whose collectives (row-parallel all-reduces, the vocabulary
gather of the LM head) pair up. Followers decide nothing, so recaptures, a hold at
K and the end of the stream stay in lockstep by construction.

Bounded waits: the process group has a timeout (--tp-timeout-s), and while rank 0
does anything else (prepares data, waits at K, publishes) a keepalive thread sends
IDLE every quarter of it, so a follower waiting for its next command never runs
into the timeout while rank 0 lives. A rank that dies (kill -9: its sockets close)
or hangs past the timeout makes the next collective of every other rank fail; each
stops with one line (RankLost), rank 0 after failing its claim in flight
(fanout.produce.producer), so a restarted TP producer recaptures it like any
restarted producer. torchrun stops the rest of the group when one rank exits.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fanout.errors import ConfigError, RankLost
from fanout.model.tp_shard import check_tp_model
from fanout.model.verifier import Capture, Verifier

log = logging.getLogger(__name__)

IDLE, CAPTURE, STOP = 0, 1, 2


def check_world(tp: int) -> None:
    """ConfigError for `--tp` without torchrun, or a torchrun world of another size."""
    world = os.environ.get("WORLD_SIZE")
    how = f"torchrun --nproc-per-node {tp} -m fanout.cli produce --tp {tp} ..."
    if world is None:
        raise ConfigError(f"--tp {tp} runs one process per rank: start it as `{how}`")
    if int(world) != tp:
        raise ConfigError(
            f"--tp {tp} but torchrun started {world} processes (WORLD_SIZE); "
            f"run `{how}` (one process per tensor-parallel rank)"
        )


def start_process_group(device: str, timeout_s: float) -> tuple[int, Any]:
    """Start torch.distributed (NCCL on CUDA, gloo on CPU) with `timeout_s` bounding
    every collective; returns (rank, a gloo control group of all ranks)."""
    cuda = torch.cuda.is_available() and device != "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    return dist.get_rank(), control


def _is_comm_error(e: BaseException) -> bool:
    """A failed collective: a peer's sockets closed (it died) or the timeout ran out.
    gloo raises these as plain RuntimeErrors, hence the message test."""
    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(m in text for m in _COMM_MARKERS)


_COMM_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout")


def _lost(e: BaseException, who: str, timeout_s: float) -> RankLost:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return RankLost(
        f"{who} is gone (it died, or was silent past --tp-timeout-s {timeout_s:g}); "
        f"stopping: {first[:160]}"
    )


class Leader:
    """Rank 0's side: announces every forward to the followers, keeps them alive while
    it does anything else, and stops them at the end (`close(rc)`)."""

    def __init__(self, verifier: Verifier, control: Any, timeout_s: float) -> None:
        self.verifier = verifier
        self._control = control
        self._timeout_s = timeout_s
        self._interval = timeout_s / 4
        self._lock = threading.Lock()  # one broadcast (or forward) at a time
        self._last = time.monotonic()
        self._error: BaseException | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._keepalive, name="tp-keepalive", daemon=True)
        self._thread.start()

    def _send(self, op: int, b: int = 0, t: int = 0) -> None:
        dist.broadcast(torch.tensor([op, b, t], dtype=torch.int64), 0, group=self._control)
        self._last = time.monotonic()

    def _keepalive(self) -> None:
        while not self._closed.wait(self._interval / 2):
            with self._lock:
                if self._closed.is_set() or self._error is not None:
                    return
                if time.monotonic() - self._last < self._interval:
                    continue
                try:
                    self._send(IDLE)
                except RuntimeError as e:  # a follower is gone: the main thread raises it
                    self._error = e
                    return

    def check(self) -> None:
        """Raise RankLost if the keepalive found a follower gone (the producer's loop
        calls this each turn, so a hold at K does not outlive a dead rank)."""
        if self._error is not None:
            raise _lost(self._error, "a tensor-parallel follower rank", self._timeout_s)

    def capture(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, document_ids: torch.Tensor,
        **kw: Any,
    ) -> Capture:  # fmt: skip
        """`Verifier.capture` on every rank: broadcast the batch, then run it here."""
        with self._lock:
            self.check()
            b, t = input_ids.shape
            batch = torch.stack([input_ids, position_ids, document_ids]).to(torch.int64)
            try:
                self._send(CAPTURE, b, t)
                dist.broadcast(batch, 0, group=self._control)  # [3, B, T]
                return self.verifier.capture(input_ids, position_ids, document_ids, **kw)
            except RuntimeError as e:
                if not _is_comm_error(e):
                    raise
                self._error = e
                raise _lost(e, "a tensor-parallel follower rank", self._timeout_s) from None

    def close(self, rc: int) -> None:
        """Tell the followers to exit with `rc` and wait until each has heard it.

        After a clean run (`rc` 0) a follower found gone raises RankLost, even if
        nothing was computed since it died: a stop that torchrun forwarded because a
        rank died says so, rather than exit 0. After a failed run the error that
        ended it is the one reported; this adds nothing."""
        self._closed.set()
        self._thread.join()  # it sends nothing once closed
        if self._error is not None:
            if rc == 0:
                self.check()
            return
        try:
            self._send(STOP, rc)
            dist.all_reduce(torch.ones(1), group=self._control)  # every follower heard it
        except RuntimeError as e:
            if not _is_comm_error(e):
                raise
            if rc == 0:
                raise _lost(e, "a tensor-parallel follower rank", self._timeout_s) from None
            log.warning("could not stop the tensor-parallel followers: %s", e)


def follow(verifier: Verifier, control: Any, timeout_s: float) -> int:
    """A follower's life: run each forward rank 0 announces until it says STOP; returns
    rank 0's exit code. RankLost if rank 0 dies or stops answering."""
    while True:
        head = torch.zeros(3, dtype=torch.int64)  # [op, B, T]
        try:
            dist.broadcast(head, 0, group=control)
            op, b, t = (int(x) for x in head)
            if op == STOP:
                dist.all_reduce(torch.ones(1), group=control)  # rank 0 waits for every rank
                return b
            if op == CAPTURE:
                batch = torch.empty(3, b, t, dtype=torch.int64)  # input, position, document ids
                dist.broadcast(batch, 0, group=control)
                verifier.capture(batch[0], batch[1], batch[2])  # only the collectives matter
        except RuntimeError as e:
            if not _is_comm_error(e):
                raise
            raise _lost(e, "tensor-parallel rank 0 (the producer)", timeout_s) from None


def run_tensor_parallel(
    tp: int,
    device: str,
    timeout_s: float,
    *,
    verifier_path: str,
    check: Callable[[], None],
    load: Callable[[], Verifier],
    lead: Callable[[Leader], int],
) -> int:
    """This rank's part of a `--tp` producer: refuse what cannot work (`check`, the
    verifier's split, the torchrun world) before any weight loads, start the group,
    `load` the shard; then rank 0 runs `lead(leader)` and the others follow it.
    Returns the exit code."""
    try:
        check_world(tp)
        check()  # the producer's input checks, on every rank
        check_tp_model(verifier_path, tp)
    except ConfigError:
        if os.environ.get("RANK", "0") != "0":
            raise SystemExit(1) from None  # every rank finds the same; rank 0 says it
        raise
    rank, control = start_process_group(device, timeout_s)
    verifier: Verifier | None = None
    leader: Leader | None = None
    try:
        verifier = load()
        if rank != 0:
            # A signal goes to every rank (terminal, torchrun): rank 0 decides when to stop
            # (it finishes the window in flight, which needs every rank's forward).
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda s, _f: log.info("rank %d: signal %d; following", rank, s))
            log.info("tensor-parallel rank %d of %d: following rank 0", rank, tp)
            return follow(verifier, control, timeout_s)
        leader = Leader(verifier, control, timeout_s)
        rc = 1
        try:
            rc = lead(leader)
        except SystemExit as e:  # a signal during start-up exits 0 (fanout.produce.producer)
            rc = e.code if isinstance(e.code, int) else 1
            raise
        finally:
            leader.close(rc)
        return rc
    finally:
        # Drop the sharded model (its device mesh refers to the group) before the group
        # goes, so nothing that needs it is freed at interpreter shutdown, where gloo's
        # teardown can abort ("terminate called without an active exception").
        verifier = leader = None
        dist.destroy_process_group()
