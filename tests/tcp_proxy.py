"""A userspace TCP proxy that adds latency and loss, for tests (this kernel has no netem).

    from tcp_proxy import Proxy
    with Proxy(("10.213.7.254", 0), ("10.213.7.2", 5432), delay_s=0.1, loss=0.02) as px:
        url = f"postgresql://postgres@{px.addr[0]}:{px.addr[1]}/postgres"   # through it

Every chunk read from one side is written to the other `delay_s` later (each way, so a
round trip takes 2 * delay_s more), in order. Loss: TCP never hands an application a
hole, it retransmits; what a lost segment does to a connection is hold everything
behind it for a retransmission timeout. So with probability `loss` a chunk (and the
bytes queued after it) is held `rto_s` more (Linux's minimum RTO is 200 ms). The
proxy runs in the calling process (threads: a reader and a writer per direction of
each connection) and stops with the context manager, closing every connection.
"""

from __future__ import annotations

import contextlib
import queue
import random
import socket
import threading
import time
from typing import Any


class Proxy:
    """Listen on `listen` (port 0: any), forward each connection to `target`."""

    def __init__(
        self,
        listen: tuple[str, int],
        target: tuple[str, int],
        *,
        delay_s: float = 0.0,
        loss: float = 0.0,
        rto_s: float = 0.2,
        seed: int = 0,
    ) -> None:
        self.target, self.delay_s, self.loss, self.rto_s = target, delay_s, loss, rto_s
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self._server = socket.create_server(listen)
        self.addr: tuple[str, int] = self._server.getsockname()[:2]
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self.connections = 0
        self.held = 0  # chunks held back as "lost" (for the test's report)
        self._thread = threading.Thread(target=self._accept, daemon=True, name="proxy-accept")

    def __enter__(self) -> Proxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._server.close()
        for s in list(self._socks):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            self.connections += 1
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._socks.append(s)
            self._pipe(client, upstream)
            self._pipe(upstream, client)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        """src → dst, each chunk released at its due time, in order."""
        chunks: queue.Queue[tuple[float, bytes] | None] = queue.Queue()

        def read() -> None:
            due = 0.0
            while True:
                try:
                    data = src.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    chunks.put(None)
                    return
                with self._rng_lock:
                    lost = self.loss > 0 and self._rng.random() < self.loss
                if lost:
                    self.held += 1
                # never before the chunk ahead of it: TCP delivers in order
                due = max(due, time.monotonic() + self.delay_s + (self.rto_s if lost else 0.0))
                chunks.put((due, data))

        def write() -> None:
            while True:
                item = chunks.get()
                if item is None:
                    break
                due, data = item
                if (left := due - time.monotonic()) > 0:
                    time.sleep(left)
                try:
                    dst.sendall(data)
                except OSError:
                    break
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        for target in (read, write):
            threading.Thread(target=target, daemon=True, name=f"proxy-{target.__name__}").start()

    def stats(self) -> dict[str, Any]:
        return {"connections": self.connections, "held_as_lost": self.held}
