"""Liveness: heartbeats out, lost-process detection in.

    from fanout.liveness import Heartbeat
    with Heartbeat("runs/demo", reg, interval_s=5.0) as hb:   # own thread, own connection
        train()
        hb.check()            # raises the StaleLease/Detached the heartbeat thread saw

A process is lost when its heartbeat *counter* has not moved for `ttl` seconds on
the reclaimer's OWN monotonic clock. Wall-clock timestamps written by other
hosts or by a process that was paused are never compared: clocks drift, and a
paused process's clock keeps running while it does nothing. If the reclaimer
itself was not watching for a while (it was paused, or its loop stalled), it
forgets what it saw and starts watching afresh, so a reclaimer that wakes from
SIGSTOP does not declare everyone else lost.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from fanout.errors import FanoutError

if TYPE_CHECKING:
    from fanout.coordinator import ConsumerReg, ProducerReg

log = logging.getLogger(__name__)


class Reclaimer:
    """In-memory observations {(id, token): (last_seen_seq, clock_when_first_seen)}."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._seen: dict[tuple[str, int], tuple[int, float]] = {}
        self._last: float | None = None
        self._own: set[str] = set()

    def own(self, pid: str) -> None:
        """Never declare this process's own registrations lost."""
        self._own.add(pid)

    def observe(
        self, rows: Iterable[tuple[str, int, int]], exclude: Iterable[str] = ()
    ) -> list[tuple[str, int, int]]:
        """Feed (id, token, hb_seq) of every active process; return the lost ones."""
        now = self.clock()
        # Not watching for more than ttl/2 (we were paused, or our caller's loop was
        # slow): what we saw before may be long superseded, so start over.
        if self._last is None or now - self._last > self.ttl_s / 2:
            self._seen.clear()
        self._last = now
        skip = self._own | set(exclude)
        lost, seen = [], {}
        for pid, token, seq in rows:
            key = (pid, int(token))
            prev = self._seen.get(key)
            if prev is None or prev[0] != seq:
                prev = (int(seq), now)
            seen[key] = prev
            if pid not in skip and now - prev[1] >= self.ttl_s:
                lost.append((pid, int(token), int(seq)))
        self._seen = seen
        return lost


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

    def _loop(self) -> None:
        from fanout.coordinator import Coordinator, ProducerReg

        coord = Coordinator.open(self.run_dir, **self.open_kwargs)
        me = "producer" if isinstance(self.reg, ProducerReg) else self.reg.consumer_id
        try:
            while not self._stop.is_set():
                try:
                    coord.heartbeat(self.reg)
                    self.beats += 1
                    if self.reclaim:
                        coord.reclaim_lost(exclude=[me])
                except FanoutError as e:
                    log.error("heartbeat for %s stopped: %s", me, e)
                    self.error = e
                    return
                self._stop.wait(self.interval_s)
        finally:
            coord.close()
