"""`fanout status --watch`: the status table, redrawn in place until Ctrl-C.

    fanout status --run-dir runs/demo --watch --interval-s 2

rich's Live display rewrites the lines it drew (no clear-screen, so no flicker); the
table is the one `fanout status` prints (fanout.status.table.format_table), with the
time it was taken. Ctrl-C ends it with exit 0. Without a terminal on stdout the
command refuses before opening anything (fanout.status.commands.run).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def watch(render: Callable[[], str], interval_s: float) -> int:
    """Redraw `render()` every `interval_s` seconds until Ctrl-C; returns 0."""
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    def frame() -> Text:
        stamp = time.strftime("%H:%M:%S")
        return Text(f"{render()}\n\n{stamp}  every {interval_s:g} s  Ctrl-C to stop",
                    no_wrap=True, overflow="crop")  # fmt: skip

    console = Console()
    try:
        with Live(frame(), console=console, auto_refresh=False, transient=False) as live:
            while True:
                time.sleep(interval_s)
                live.update(frame(), refresh=True)
    except KeyboardInterrupt:
        pass
    return 0
