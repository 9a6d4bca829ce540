"""What the coordinator grants: registrations, claims and leases, each with its fencing token.

    from fanout.coord.grants import Lease
    lease = coord.acquire(reg); print(lease.window, lease.path, lease.rows)

Plain frozen values, beside the few things the coordinator's calls take (a producer's
plan, what the window files must provide). Holding a grant
proves nothing by itself; every call that uses one re-checks its token inside the
coordinator's write transaction. The calls that grant them are the coordinator's
parts: claims (a Claim, by fanout.coord.claims), leases (a Lease, by
fanout.coord.leasing), registrations (fanout.coord.roles).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class ConsumerReg:
    """A consumer's registration: pass it to every consumer-side call."""

    consumer_id: str  # name:dp<rank>
    token: int  # epoch token; changes on every (re)registration, reclaim or detach
    cursor: int  # next window it needs, at registration time


@dataclass(frozen=True, slots=True)
class ProducerReg:
    """A producer replica's registration: pass it to every producer-side call."""

    token: int
    owner: str
    rank: int = 0  # its replica rank (0 .. replicas-1); 0 for a run's only producer

    @property
    def role_id(self) -> str:
        """Its id among the roles the reclaimer watches (fanout.coord.roles)."""
        return producer_id(self.rank)


def producer_id(rank: int) -> str:
    """`producer:r<rank>`: a producer replica's id in the reclaimer and in logs."""
    return f"producer:r{rank}"


@dataclass(frozen=True, slots=True)
class ProducerPlan:
    """What every producer replica of a run must present besides the capture contract:
    how many replicas there are and the data plan (flag → value, as text: `--epochs`,
    `--max-windows`, ...). The first replica of a session records it; one that joins
    live replicas with another plan is refused (PlanMismatch naming the flag)."""

    replicas: int = 1
    fields: tuple[tuple[str, str], ...] = ()

    def as_dict(self) -> dict[str, str]:
        return {"--replicas": str(self.replicas), **dict(self.fields)}


@dataclass(frozen=True, slots=True)
class Claim:
    """The producer's right to capture one window under one generation."""

    window: int
    generation: int  # new for every claim: a crashed attempt's file name never collides
    token: int  # claim fencing token
    producer_token: int
    rows: tuple[int, int]  # stream rows [start, stop)
    rank: int = 0  # the producer replica holding it
    end: int | None = None  # the stream's end as the claimer knew it (None: open)


@dataclass(frozen=True, slots=True)
class Lease:
    """A consumer's right to read one window until it acks or releases it."""

    consumer_id: str
    window: int
    generation: int
    name: str
    path: str
    token: int  # lease fencing token
    epoch: int  # the consumer's token when granted
    rows: tuple[int, int]


class WindowFiles(Protocol):
    """What the coordinator needs from fanout.store.store.Store (a seam for tests)."""

    def remove(self, name: str) -> bool: ...
    def quarantine(self, name: str) -> Path: ...
    def sweep(self, is_live: Callable[[int, int], bool]) -> Any: ...
