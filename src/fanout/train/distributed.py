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
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataParallel:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device: str = "cpu", timeout_s: float = 1800.0) -> DataParallel:
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
        return cls(rank, world, local)

    def device(self, requested: str) -> torch.device:
        """`cuda` means this rank's GPU (LOCAL_RANK) under torchrun."""
        if self.enabled and requested == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device(requested)

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        if not self.enabled:
            return
        with torch.no_grad():
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
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def mean(self, values: list[float]) -> list[float]:
        """Element-wise mean over ranks (for logged metrics)."""
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self._collective_device())
        dist.all_reduce(t)
        return (t / self.world).tolist()

    def from_main(self, values: list[int]) -> list[int]:
        """Rank 0's `values` on every rank: what one rank decides for all (the stream's
        length as rank 0 read it, so every rank follows one LR schedule)."""
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.int64, device=self._collective_device())
        dist.broadcast(t, src=0)
        return [int(x) for x in t.tolist()]

    def _collective_device(self) -> torch.device:
        return (
            torch.device("cuda", self.local_rank)
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()
