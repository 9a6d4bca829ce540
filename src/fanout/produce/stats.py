"""What a producer counts: windows, rows, tokens, bytes, failures (publish failures,
windows that failed the capture check) and where the time went.

stats = ProducerStats()  # the loop and the publisher add to it
stats.summary()  # the dict `fanout produce` prints at exit
stats.progress_line(ready, ready_bytes)  # the progress bar's postfix
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ProducerStats:
    windows: int = 0
    rows: int = 0
    tokens: int = 0
    bytes: int = 0
    failures: int = 0
    disk_full_waits: int = 0
    bad_captures: int = 0  # windows that failed the capture check (fanout.produce.capture_check)
    waits_s: float = 0.0
    capture_s: float = 0.0
    publish_s: float = 0.0
    started: float = field(default_factory=time.monotonic)

    def summary(self) -> dict[str, Any]:
        el = max(time.monotonic() - self.started, 1e-9)
        return {
            "windows": self.windows,
            "rows": self.rows,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "failures": self.failures,
            "disk_full_waits": self.disk_full_waits,
            "bad_captures": self.bad_captures,
            "elapsed_s": round(el, 3),
            "tokens_per_s": round(self.tokens / el, 1),
            "bytes_per_s": round(self.bytes / el, 1),
            "backpressure_wait_s": round(self.waits_s, 3),
            "capture_s": round(self.capture_s, 3),
            "publish_s": round(self.publish_s, 3),
        }

    def progress_line(self, ready: int, ready_bytes: int) -> str:
        """Ready windows/bytes on disk (the coordinator's count; not what K bounds, which
        also counts windows being captured or evicted), rates since start, backpressure
        wait so far."""
        s = self.summary()
        rows_s = self.rows / max(s["elapsed_s"], 1e-9)
        return (
            f"ready {ready} ({ready_bytes / 2**20:.0f} MiB) | {rows_s:.1f} rows/s "
            f"{s['tokens_per_s']:.0f} tok/s {s['bytes_per_s'] / 2**20:.1f} MiB/s | "
            f"waited {s['backpressure_wait_s']:.0f} s"
        )
