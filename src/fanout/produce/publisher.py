"""Publishing captured windows: Store.publish, then the coordinator commit, inline or overlapped.

    pub = Publisher(store, coord, stats, stop, overlap=True, open_coord=lambda: Coordinator.open(...))
    if pub.submit(claim, window, meta, rows=r, tokens=t):
        capturer.flip()          # handed to the background thread: capture into the other slot
    ...
    pub.finish_inflight()        # before the summary: the last window's publish
    pub.shutdown()

Per window: wait for its device→host copies → the capture check
(fanout.produce.capture_check: a window that fails it is not published; its claim is
failed, so it is captured again, and a second failure in a row stops the producer
with CaptureCheckFailed; counted in `ProducerStats.bad_captures`) → renew the claim
(StaleLease: we were superseded, publish nothing) → Store.publish (tmp → fsync → link → dir fsync,
fanout.filesystem.FileSystem.write_atomic) → coordinator commit (a StaleLease there
removes the just-published file: it is an orphan). A full disk (StorageFull) is
waited out with the captured tensors in hand (0.5 → 5 s backoff, renewing the
claim), unless the producer is stopping. Any other StorageError fails the claim
(the window is retried under a new generation).

Overlap: at most one publish runs on a background thread (with its own coordinator
connection) while the next window is captured into the capturer's other buffer
slot; `submit` first waits for the previous one, so the slot it is about to reuse
is free.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fanout.coord.coordinator import Coordinator
from fanout.coord.grants import Claim
from fanout.errors import CaptureCheckFailed, StaleLease, StorageError, StorageFull
from fanout.produce.capture import CapturedWindow
from fanout.produce.stats import ProducerStats
from fanout.produce.stopping import StopFlag
from fanout.store.store import Published, Store, WindowMeta

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Committed:
    published: Published
    device_wait_s: float  # waiting for the window's device→host copies to land
    publish_s: float  # Store.publish + coordinator commit


class Publisher:
    """Publishes and commits captured windows; see the module docstring.

    Args:
        store: where window files go.
        coord: the coordinator of the calling (main) thread.
        stats: counts windows, rows, tokens, bytes, failures, waits.
        stop: once set, a full disk is no longer waited out.
        overlap: publish on one background thread (two buffer slots) instead of inline.
        open_coord: opens the background thread's own coordinator connection.
    """

    def __init__(
        self,
        store: Store,
        coord: Coordinator,
        stats: ProducerStats,
        stop: StopFlag,
        *,
        overlap: bool,
        open_coord: Callable[[], Coordinator],
    ) -> None:
        self.store = store
        self.coord = coord
        self.stats = stats
        self.stop = stop
        self._open_coord = open_coord
        self._pool = ThreadPoolExecutor(1, "fanout-publish") if overlap else None
        self._inflight: tuple[Claim, Future[Committed], int, int] | None = None
        self._thread_state = threading.local()
        self._bad_in_a_row = 0  # capture-check failures since the last window published

    def submit(
        self, claim: Claim, window: CapturedWindow, meta: WindowMeta, *, rows: int, tokens: int
    ) -> bool:
        """Publish and commit `window`. Inline: done when this returns (False). Overlapped:
        after the previous background publish finished, hand it to the background
        thread and return True; the caller must then capture into the other slot."""
        if self._pool is None:
            try:
                done = self._commit(claim, window, meta, self.coord)
            except CaptureCheckFailed as e:
                self._bad_capture(claim, e)
                return False
            self._count(done, rows, tokens)
            return False
        self.finish_inflight()  # its buffers are the other slot's: free after this
        fut = self._pool.submit(self._commit_in_thread, claim, window, meta)
        self._inflight = (claim, fut, rows, tokens)
        return True

    def finish_inflight(self, *, block: bool = True) -> None:
        """Wait for (or, with block=False, poll) the background publish and account for it.

        A StorageError there fails that window's claim (it is retried under a new
        generation), as it would inline, and so does a failed capture check (the second
        in a row raises CaptureCheckFailed); anything else (StaleLease) propagates.
        """
        if self._inflight is None:
            return
        claim, fut, rows, tokens = self._inflight
        if not block and not fut.done():
            return
        self._inflight = None
        try:
            done = fut.result()
        except StorageError as e:
            self.stats.failures += 1
            log.error("window %d: %s; will retry", claim.window, e)
            self.coord.fail(claim, str(e))
            return
        except CaptureCheckFailed as e:
            self._bad_capture(claim, e)
            return
        self._count(done, rows, tokens)

    def _bad_capture(self, claim: Claim, e: CaptureCheckFailed) -> None:
        """A window that failed the capture check: never published, its claim failed
        (so it is captured again, first). A second failure in a row (the retry, or the
        next window) raises CaptureCheckFailed naming the window, layer and row."""
        e = e.in_window(claim.window)
        self.stats.bad_captures += 1
        self._bad_in_a_row += 1
        self.coord.fail(claim, f"capture check: {e}")
        if self._bad_in_a_row >= 2:
            raise e
        log.error("%s; not published, capturing it again", e)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _commit(
        self, claim: Claim, window: CapturedWindow, meta: WindowMeta, coord: Coordinator
    ) -> Committed:
        """Wait for the window's device copies, Store.publish, coordinator commit."""
        t0 = time.monotonic()
        window.wait()
        t1 = time.monotonic()
        window.check()  # CaptureCheckFailed: publish nothing (see _bad_capture)
        coord.renew(claim)  # StaleLease here: we were superseded; publish nothing
        published = self._publish(window.tensors, meta, claim, coord)
        try:
            coord.publish_ready(claim, published)
        except StaleLease:
            self.store.remove(published.name)  # our claim is gone: the file is an orphan
            raise
        return Committed(published, device_wait_s=t1 - t0, publish_s=time.monotonic() - t1)

    def _commit_in_thread(
        self, claim: Claim, window: CapturedWindow, meta: WindowMeta
    ) -> Committed:
        # Coordinator connections are per thread: the publisher keeps its own.
        coord = getattr(self._thread_state, "coord", None)
        if coord is None:
            coord = self._open_coord()
            self._thread_state.coord = coord
        return self._commit(claim, window, meta, coord)

    def _publish(
        self, tensors: dict[str, Any], meta: WindowMeta, claim: Claim, coord: Coordinator
    ) -> Published:
        """Store.publish, waiting out a full disk with the captured tensors in hand: ENOSPC
        is transient (evictions and operators free space) and must not use up the
        window's capture attempts (3 quick failures would fail the window for good).
        Each try writes a fresh temp file, so no fsync is ever retried."""
        delay = 0.5
        while True:
            try:
                return self.store.publish(tensors, meta)
            except StorageFull as e:
                if self.stop:
                    raise
                self.stats.disk_full_waits += 1
                log.error("window %d: %s; disk full, retrying in %.1f s", claim.window, e, delay)
                time.sleep(delay)
                delay = min(2 * delay, 5.0)
                coord.renew(claim)  # StaleLease if we were superseded meanwhile

    def _count(self, done: Committed, rows: int, tokens: int) -> None:
        self._bad_in_a_row = 0
        self.stats.capture_s += done.device_wait_s
        self.stats.publish_s += done.publish_s
        self.stats.windows += 1
        self.stats.rows += rows
        self.stats.tokens += tokens
        self.stats.bytes += done.published.nbytes
