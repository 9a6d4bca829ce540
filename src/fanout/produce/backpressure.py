"""What a producer blocked at K says: who holds it back, for how long, and the ways out.

    notice = BlockedNotice(coord)
    if not coord.wait_for_capacity(preg, timeout_s=0.5):
        notice.waiting(bar)        # progress bar at once, a log line at most every 30 s
    else:
        notice.clear()

The words are the coordinator's (Coordinator.blocked_by, fanout.coord.waits): the
consumers whose cursors hold the oldest window on disk, with their state and how
long ago they last moved, the expected consumers that have not joined, and, for a
stopped or lost holder, how to continue (resume it, `fanout detach`, a lag policy).
A short block is the normal pace of a run (the producer is ahead by K windows), so
the first line comes once a block is FIRST_AFTER_S old; a holder that is not active
logs at warning, a slower trainer at info.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("fanout.produce.producer")

FIRST_AFTER_S = 5.0  # a block younger than this is the run's normal pace: no line
EVERY_S = 30.0  # at most one log line per this many seconds while blocked


class Blocking(Protocol):
    def blocked_by(self) -> str: ...


class BlockedNotice:
    """Tracks one stretch of being blocked; `clock` is a seam for tests."""

    def __init__(self, coord: Blocking, clock: Callable[[], float] = time.monotonic) -> None:
        self.coord, self.clock = coord, clock
        self.since: float | None = None
        self._logged: float | None = None
        self._text = ""
        self._asked: float | None = None

    def clear(self) -> None:
        if self.since is not None and self._logged is not None:
            log.info("unblocked after %.0f s at K", self.clock() - self.since)
        self.since = self._logged = self._asked = None

    def waiting(self, bar: Any) -> str | None:
        """Another wait at K: refresh the bar's words (every few s), log when due."""
        now = self.clock()
        if self.since is None:
            self.since = now
        if self._asked is None or now - self._asked >= FIRST_AFTER_S:
            self._asked = now
            self._text = self.coord.blocked_by()
            bar.set_postfix_str(self._text[:160])
        if now - self.since < FIRST_AFTER_S:
            return None
        if self._logged is not None and now - self._logged < EVERY_S:
            return None
        self._logged = now
        line = f"{self._text} (for {now - self.since:.0f} s)"
        idle = "ways out" in self._text or "expected consumers" in self._text
        log.log(logging.WARNING if idle else logging.INFO, "%s", line)
        return line
