"""A `fanout …` process forked from the warm forkserver, behind subprocess.Popen's face.

    from forked_cli import ForkedPopen
    p = ForkedPopen(["produce", ...], log)   # pid, poll(), wait(t), kill(), send_signal()

fanout.chaos.procs starts the chaos runs' roles this way: a real process (its own pid,
exit code, signal handlers and log file; stdout and stderr both go to the log) forked
from a server that imported torch, transformers and fanout once per test session. A
`python -m fanout.cli` process pays those imports itself, ~1.5-6 s on 2 shared cores,
before its first line (#54: most of what the process tests that start several roles
spent). The command line started by `python -m fanout.cli` is checked by the tests that
start it that way (test_roles, test_cli_errors, the torchrun tests).
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from fanout.chaos.procs import Proc


class ForkedPopen:
    """The Popen face (pid, poll, wait, kill, send_signal) of a forked `fanout` process."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self._p = Proc(argv, log, "fork")  # the first one starts the server (its imports)
        self.pid = self._p.pid

    def poll(self) -> int | None:
        return self._p.poll()

    def wait(self, timeout: float) -> int:
        code = self._p.wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(["fanout"], timeout)
        return code

    def send_signal(self, sig: int) -> None:
        self._p.signal(sig)

    def kill(self) -> None:
        self._p.signal(signal.SIGKILL)
