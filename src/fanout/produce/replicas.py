"""Producer replicas: several verifiers (each whole, or a --tp group) feeding one run.

    fanout produce ... --replicas 3 --replica-rank 0      # and ranks 1, 2: any hosts
    fanout produce ... --replicas 3                       # each takes the first free rank
    torchrun --nproc-per-node 3 -m fanout.cli produce ... --replicas 3    # the short form
    torchrun --nproc-per-node 2 -m fanout.cli produce ... --tp 2 --replicas 3  # one launch
                                                          # per replica (each a TP group)

Every replica is a whole producer (fanout.produce.producer) on the same run dir with
the same flags: the same capture contract and data plan (`plan`: --replicas,
--epochs, --max-windows), which the coordinator checks (a replica whose contract
or plan differs is refused naming the field). They claim windows through the
coordinator (fanout.coord.claims), so each window is made once, by whichever
replica claims it, and holds the same rows whoever makes it
(fanout.produce.stream). K (--max-live-windows) bounds the live windows of all
replicas together.

Which rank a process is: `--replica-rank`; else under torchrun (`RANK`, one process
per replica, `WORLD_SIZE` = --replicas) its rank; else the first rank no live process
holds (`rank_of` returns None and the coordinator picks). A rank is held by one
live process at a time: a second one, or an M+1th replica, is refused naming the
holder.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, Field, model_validator

from fanout.coord.grants import ProducerPlan
from fanout.errors import ConfigError


class ReplicaOptions(BaseModel):
    """`fanout produce`'s replica fields: how many producers feed the run, which one this is."""

    replicas: int = Field(
        1,
        ge=1,
        description="producer replicas feeding this run (data-parallel capture: each a whole "
        "verifier, or a --tp group; they claim windows through the coordinator, each window "
        "made once); every replica runs with the same flags",
    )
    replica_rank: int | None = Field(
        None,
        ge=0,
        description="this replica's rank, 0 .. --replicas - 1; None = under torchrun its RANK "
        "(one process per replica), else the first rank no live replica holds",
    )

    @model_validator(mode="after")
    def _rank_below_replicas(self) -> ReplicaOptions:
        # a flag-only rule: fanout.cli checks it before the producer imports torch
        problem = rank_problem(self.replicas, self.replica_rank)
        if problem:
            raise ValueError(problem)
        return self


def rank_problem(replicas: int, replica_rank: int | None) -> str | None:
    """What is wrong with `--replica-rank` for `--replicas`, in words; None if nothing."""
    if replica_rank is not None and replica_rank >= replicas:
        return (
            f"--replica-rank {replica_rank} must be below --replicas {replicas} (ranks 0 .. "
            f"{replicas - 1})"
        )
    return None


def plan(cfg: Any) -> ProducerPlan:
    """The data plan every replica of a run must share (a ProducerConfig's fields)."""
    cap = "none" if cfg.max_windows is None else str(cfg.max_windows)
    return ProducerPlan(cfg.replicas, (("--epochs", str(cfg.epochs)), ("--max-windows", cap)))


def rank_of(replicas: int, replica_rank: int | None, tp: int) -> int | None:
    """This process's replica rank: `replica_rank` if given; 0 for a run's only producer;
    under torchrun with one process per replica (tp 1, WORLD_SIZE = replicas) its
    RANK; else None (the first free rank, taken at start). ConfigError for a rank not
    below `replicas`, and for a torchrun world that does not fit: --tp > 1 runs one
    torchrun launch per replica (WORLD_SIZE = --tp), and a torchrun of N processes
    without --tp needs --replicas N."""
    problem = rank_problem(replicas, replica_rank)
    if problem:
        raise ConfigError(problem)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp > 1 and replicas > 1 and "WORLD_SIZE" in os.environ and world != tp:
        raise ConfigError(
            f"--tp {tp} --replicas {replicas}: each replica is its own torchrun launch of "
            f"{tp} processes (WORLD_SIZE {world} here): start `torchrun --nproc-per-node {tp} "
            f"-m fanout.cli produce --tp {tp} --replicas {replicas} ...` once per replica (a "
            "free --master-port each, or --standalone); each takes a free rank"
        )
    # (a --tp world of the wrong size with one replica: fanout.produce.tp_capture.check_world says)
    if tp == 1 and world > 1 and replica_rank is None:
        if world != replicas:
            raise ConfigError(
                f"torchrun started {world} processes (WORLD_SIZE) but --replicas is {replicas}: "
                f"run `torchrun --nproc-per-node {world} -m fanout.cli produce --replicas "
                f"{world} ...`, one process per replica"
            )
        return int(os.environ.get("RANK", "0"))
    if replica_rank is not None:
        return replica_rank
    return 0 if replicas == 1 else None


def bind_device(device: str) -> None:
    """Under torchrun, one replica per local GPU: make cuda:LOCAL_RANK this process's
    device (a `--device` of auto or cuda without an index then lands there)."""
    import torch

    if "LOCAL_RANK" in os.environ and device in ("auto", "cuda") and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
