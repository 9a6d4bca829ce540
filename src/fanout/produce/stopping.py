"""How a producer stops on SIGINT/SIGTERM: the window in flight is finished, then the loop ends.

    stop = StopFlag()
    stop.install()              # in Producer.run(), once the loop is about to start
    while not stop: ...         # the loop checks it before claiming the next window

What a signal does, by phase:
- Start-up (before the loop; `fanout produce` installs its own handlers): the
  process exits 0 at once. Nothing is claimed yet, so nothing is lost.
- In the loop: the flag is set and nothing is interrupted. The window being
  captured is captured, published and committed; a publish running on the
  background thread (overlap) is waited for. Then the loop ends, the producer is
  recorded finished and the process exits 0. No claim is left behind and no
  window is published twice.
- Except a publish waiting out a full disk: it gives up instead of waiting for
  space, and its claim is failed, so the next producer captures that window again
  under a new generation.
A second signal changes nothing (it sets the same flag).
"""

from __future__ import annotations

import logging
import signal
from typing import Any

log = logging.getLogger(__name__)


class StopFlag:
    """Set by SIGINT/SIGTERM once `install()`ed, or by `request()`; true once set."""

    def __init__(self) -> None:
        self._set = False  # a plain bool: safe to set from a signal handler

    def __bool__(self) -> bool:
        return self._set

    def request(self) -> None:
        self._set = True

    def install(self) -> None:
        """Route SIGINT and SIGTERM here (main thread only)."""

        def handler(signum: int, _frame: Any) -> None:
            log.warning(
                "signal %d: stopping once the window in flight is published (one waiting "
                "on a full disk is released for recapture instead)",
                signum,
            )
            self._set = True

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)
