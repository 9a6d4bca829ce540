"""The heartbeat thread: keeps a producer's or a trainer's heartbeat counter moving.

    from fanout.coord.heartbeat import Heartbeat
    with Heartbeat("runs/demo", reg, interval_s=5.0) as hb:   # own thread, own connection
        train()
        hb.check()            # raises the StaleLease/Detached the heartbeat thread saw

A client of the Coordinator (it opens its own connection: one per thread), so it
sits above fanout.coord.coordinator; the rules that declare a silent process lost
are fanout.coord.liveness's. HeartbeatOptions is the `--heartbeat-s` flag both
`fanout produce` and `fanout train` inherit (declared once, here).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from pydantic import BaseModel, Field

from fanout.coord.coordinator import Coordinator
from fanout.coord.grants import ConsumerReg, ProducerReg
from fanout.errors import CoordinatorUnavailable, FanoutError

log = logging.getLogger(__name__)
WARN_EVERY_S = 10.0  # how often a heartbeat that cannot connect says so


class HeartbeatOptions(BaseModel):
    """How often a process (producer or trainer) says it is alive: a field of both
    commands' configs, declared once."""

    heartbeat_s: float = Field(
        2.0,
        gt=0,
        description="heartbeat interval (s); keep below a third of the run's --ttl-s, so "
        "one late beat does not make this process look lost",
    )


class Heartbeat:
    """Daemon thread: heartbeat every `interval_s` with its own coordinator connection.

    Optionally also runs `reclaim_lost()` (the producer's loop may spend longer than
    ttl/2 inside one verifier forward). Stops at the first fencing error and
    keeps it for `check()` to raise in the owner's thread.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        reg: ConsumerReg | ProducerReg,
        interval_s: float = 5.0,
        *,
        reclaim: bool = False,
        open_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.run_dir, self.reg, self.interval_s, self.reclaim = run_dir, reg, interval_s, reclaim
        self.open_kwargs = open_kwargs or {}
        self.error: BaseException | None = None
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fanout-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def check(self) -> None:
        """Raise the fencing error the heartbeat thread hit, if any."""
        if self.error is not None:
            raise self.error

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _open(self, me: str) -> Coordinator | None:
        """This thread's connection; while the database cannot be reached, a warning
        every few seconds and another try each interval (None once stopped). A thread
        that died here would leave the process beating nothing and `check()` silent
        until the run declared it lost (seen with 256 clients on one PostgreSQL)."""
        said = 0.0
        while not self._stop.is_set():
            try:
                return Coordinator.open(self.run_dir, **self.open_kwargs)
            except CoordinatorUnavailable as e:
                said = self._say_unreachable(me, e, said)
            except FanoutError as e:  # not a database, a schema it does not know: final
                log.error("heartbeat for %s stopped: %s", me, e)
                self.error = e
                return None
            self._stop.wait(self.interval_s)
        return None

    def _say_unreachable(self, me: str, e: Exception, said: float) -> float:
        """Warn that the coordinator is out of reach, at most every WARN_EVERY_S (`said`:
        when it last warned); returns the new `said`."""
        now = time.monotonic()
        if now - said < WARN_EVERY_S:
            return said
        log.warning("heartbeat for %s cannot reach the coordinator (%s); "
                    "trying again every %g s", me, e, self.interval_s)  # fmt: skip
        return now

    def _loop(self) -> None:
        me = self.reg.role_id if isinstance(self.reg, ProducerReg) else self.reg.consumer_id
        coord = self._open(me)
        if coord is None:
            return
        said = 0.0
        try:
            while not self._stop.is_set():
                try:
                    coord.heartbeat(self.reg)
                    self.beats += 1
                    if self.reclaim:
                        coord.reclaim_lost(exclude=[me])
                except CoordinatorUnavailable as e:
                    # The connection went (a database restart, a cut link) and could not
                    # be replaced in time, or went inside the beat's transaction: the next
                    # call connects again. A beat that did not land is harmless to repeat;
                    # an outage longer than ttl gets this process declared lost, and its
                    # first beat that lands is fenced (StaleLease, below). Stopping here
                    # instead made a database restart kill every process caught mid-beat.
                    said = self._say_unreachable(me, e, said)
                except FanoutError as e:
                    log.error("heartbeat for %s stopped: %s", me, e)
                    self.error = e
                    return
                self._stop.wait(self.interval_s)
        finally:
            coord.close()
