"""Data parallelism for one trainer: its torchrun ranks are consumers `name:dp<rank>`.

    torchrun --nproc-per-node 4 scripts/train.py --run-dir runs/r1 --consumer-id b16 ...

    dp = DataParallel.from_env()            # RANK / WORLD_SIZE / LOCAL_RANK from torchrun
    dp.broadcast_parameters(model)          # every rank starts from rank 0's weights
    loss.backward(); dp.average_gradients(model)
    stop = dp.agree(stop)                   # one rank stopping stops them all, same step

Each rank registers as its own consumer (`name:dp<rank>`, so the producer's
`--expected-consumers` counts ranks), reads every window, and trains on its own
shard of the window's rows (fanout.train.consumer: rows `order[rank::world]`). All ranks
take the same number of steps over the same windows, so they ack in lock-step and
the run evicts a window once every rank is past it.

Gradients are averaged with one all-reduce of a flat buffer after backward, not
with DistributedDataParallel: DDP's reducer expects `forward()` (the draft trains
through `loss()`) and every trainable parameter to get a gradient each step,
which a step whose rows hold no anchors on one rank does not give. For a draft
of a few layers one collective per step is cheap; DDP's overlap of communication
with backward would buy little. Backend: NCCL on CUDA, gloo on CPU.

A rank that dies (killed, its host lost) makes the next collective of every other
rank fail: at once where its sockets were closed (its kernel lives on: a process
killed), else at the process group's timeout (`timeout_s`: the trainer's
--dp-timeout-s, 30 min unless set: a host gone silent, cut off or frozen). Each
failed collective is RankLost, one line naming the rank that saw it;
the trainer then saves, records `stopped` and exits 1 (fanout.train.ending), and
torchrun ends the rest of the group (docs/operations.md, "Faults on a cluster").
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fanout.errors import RankLost

log = logging.getLogger(__name__)

# The process group's bound on one collective (a peer silent that long is gone); the
# trainer's --dp-timeout-s (fanout.train.config) sets it, this is its default.
TIMEOUT_S = 1800.0
# gloo and NCCL raise a lost peer as a plain RuntimeError (a DistError in newer torch)
# whose text says what failed: a closed socket, a reset, a timeout (as
# fanout.produce.tp_capture's followers judge theirs)
_COMM_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout")


@dataclass(frozen=True)
class DataParallel:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    timeout_s: float = TIMEOUT_S  # the process group's, for RankLost's line

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device: str = "cpu", timeout_s: float = TIMEOUT_S) -> DataParallel:
        """The torchrun environment's ranks (a process group is started when WORLD_SIZE > 1);
        a single process (rank 0 of 1) otherwise."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if not dist.is_initialized():
            cuda = device.startswith("cuda")
            if cuda:
                torch.cuda.set_device(local)
            # The timeout bounds a hang when one rank dies between collectives.
            dist.init_process_group(
                "nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s)
            )
        log.info("data parallel: rank %d of %d (local %d)", rank, world, local)
        return cls(rank, world, local, timeout_s)

    def device(self, requested: str) -> torch.device:
        """`cuda` means this rank's GPU (LOCAL_RANK) under torchrun."""
        if self.enabled and requested == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device(requested)

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        if not self.enabled:
            return
        with torch.no_grad(), self._peers():
            for p in model.parameters():
                dist.broadcast(p.data, src=0)

    def average_gradients(self, model: torch.nn.Module) -> None:
        """Every rank's trainable gradients := their mean over ranks (one all-reduce).
        A parameter without a gradient this step contributes zeros."""
        if not self.enabled:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = _flatten_dense_tensors(grads)  # [sum of numels]
        with self._peers():
            dist.all_reduce(flat)
        flat.div_(self.world)
        for p, g in zip(params, _unflatten_dense_tensors(flat, grads)):
            if p.grad is None:
                p.grad = g
            else:
                p.grad.copy_(g)

    def agree(self, flag: bool) -> bool:
        """True on every rank if it is True on any (stop requests, end of stream)."""
        if not self.enabled:
            return flag
        t = torch.tensor([int(flag)], device=self._collective_device())
        with self._peers():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def mean(self, values: list[float]) -> list[float]:
        """Element-wise mean over ranks (for logged metrics)."""
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self._collective_device())
        with self._peers():
            dist.all_reduce(t)
        return (t / self.world).tolist()

    def from_main(self, values: list[int]) -> list[int]:
        """Rank 0's `values` on every rank: what one rank decides for all (the stream's
        length as rank 0 read it, so every rank follows one LR schedule)."""
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.int64, device=self._collective_device())
        with self._peers():
            dist.broadcast(t, src=0)
        return [int(x) for x in t.tolist()]

    @contextlib.contextmanager
    def _peers(self) -> Iterator[None]:
        """A collective; a peer found gone in it is RankLost (one line), not a traceback
        out of torch, so the trainer saves and records how it ended (fanout.train.ending)."""
        try:
            yield
        except RuntimeError as e:  # torch's DistError is one
            text = str(e).strip()
            if not isinstance(e, dist.DistError) and not any(
                m in text.lower() for m in _COMM_MARKERS
            ):
                raise
            # gloo's first sentence, without its source location: "Connection closed by
            # peer [ADDR]:PORT" names the lost rank's host
            first = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0]) if text else ""
            first = first.split(". ")[0][:200] or type(e).__name__
            raise RankLost(
                f"data-parallel rank {self.rank} of {self.world}: a collective failed, so "
                f"another rank is gone (its process died or its host was lost, or it was "
                f"silent past the process group's timeout, --dp-timeout-s {self.timeout_s:g}): "
                f"{first}"
            ) from None

    def _collective_device(self) -> torch.device:
        return (
            torch.device("cuda", self.local_rank)
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()
