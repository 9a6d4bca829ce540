"""A background thread that calls a function every N seconds until stopped (stdlib only).

    with Ticker(notice.tick, 1.0, name="start-notice"):   # tick every 1 s, in a thread
        load_the_verifier()                                 # exit: stop, and join it

    sampler = Ticker(write_one, 0.5, name="fanout-telemetry", at_once=True,
                     at_stop=write_one).start()             # a sample now, one every 0.5 s,
    ...; sampler.stop()                                     # and a closing one at stop()

The one loop behind the periodic threads a process runs beside its work: a waiting
trainer's notice (fanout.train.progress.WaitNotice), a starting producer's
(fanout.produce.run_start.StartNotice) and the benchmarks' telemetry sampler
(fanout.bench.telemetry.Sampler). The thread is a daemon (a process that exits without
`stop()` is not held up by it); `stop()` wakes it at once, waits for it to end and may
be called more than once. Ticks keep a steady rate: the wait after one is the period
less the time the tick took (none when it took longer). An exception in a tick ends the
thread; threading's excepthook reports it, and `stop()` still returns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Ticker:
    """Calls `tick()` every `every_s` seconds on a daemon thread named `name`, from
    `start()` (or `with`) until `stop()`: the first call after one period, or at once
    with `at_once`; `at_stop`, if given, is called once more on the thread after the
    stop (a closing sample)."""

    def __init__(
        self,
        tick: Callable[[], object],
        every_s: float,
        *,
        name: str,
        at_once: bool = False,
        at_stop: Callable[[], object] | None = None,
    ) -> None:
        if every_s <= 0:
            raise ValueError(f"Ticker.every_s must be > 0, got {every_s}")
        self.tick, self.every_s, self.name = tick, every_s, name
        self.at_once, self.at_stop = at_once, at_stop
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        # at_once ticks even if stop() came first: a sampler always has its first sample
        wait_s = self._tick() if self.at_once else self.every_s
        while not self._stopped.wait(wait_s):
            wait_s = self._tick()
        if self.at_stop is not None:
            self.at_stop()

    def _tick(self) -> float:
        """One tick; the wait until the next one (a steady rate, not a steady gap)."""
        t0 = time.monotonic()
        self.tick()
        return max(0.0, self.every_s - (time.monotonic() - t0))

    def start(self) -> Ticker:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the ticks and wait for the thread (and `at_stop`) to end."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Ticker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
