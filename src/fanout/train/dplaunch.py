"""torchrun with one line for a failure: how scripts/launch.sh starts a data-parallel trainer.

    python -m fanout.train.dplaunch --standalone --nproc-per-node 2 -m fanout.cli train ...
    python -m fanout.train.dplaunch --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint node3:29400 --rdzv-id 4242 -m fanout.cli train ...

Every flag is torchrun's (`torch.distributed.run`'s own parser reads them) and so is
what runs: its elastic agent, in this process, starting and watching this node's ranks,
whose stdout and stderr stay this process's (the log). What differs is how it ends.
torchrun reports a rank that exits non-zero as an uncaught `ChildFailedError`: a Python
traceback of the agent and a box of "Root Cause" text. Here that is one line on stderr,
exit 1 (torchrun's status):

    fanout dp-launch: error: rank 1 (local 1) on node4 exited with code 1: fanout train: error: ...

naming the first rank that failed, its host and exit code (or signal), and that rank's
own one-line error where it left one: `fanout.cli` writes its error line to the file
torchrun's agent gives each rank (`TORCHELASTIC_ERROR_FILE`, `tell_agent`), the file
torch's `@record` would fill with a traceback. The agent's own failures (a rendezvous
that cannot be reached, a signal to the agent) are one line too. Nothing is retried
that torchrun would not retry (`--max-restarts`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from typing import Any

# The exit status of a failed launch: torchrun's (its uncaught exception's), so a
# scheduler that read torchrun's reads this the same.
FAILED = 1
# A rank's own line, as much of it as one line of this launcher carries
_MAX_RANK_LINE = 2000


def tell_agent(line: str) -> None:
    """Leave `line` (a rank's one-line error) where torchrun's agent reads why the rank
    failed: the JSON error file it names in TORCHELASTIC_ERROR_FILE, in the form torch's
    ErrorHandler writes (a message and a timestamp). Outside torchrun, nothing. Never
    raises: the rank's exit must not depend on this file."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            # torch reads the message and the whole second; `time_ns` orders ranks that
            # failed within one second (failure_line)
            json.dump(
                {"message": line, "timestamp": int(time.time()), "time_ns": time.time_ns()}, f
            )
    except OSError:
        pass


def failed(prog: str, e: BaseException) -> int:
    """A command's one-line error (`PROG: error: E`) on stderr and, under torchrun, in
    the file its agent reads (`tell_agent`); returns the exit status, 1."""
    line = f"{prog}: error: {e}"
    print(line, file=sys.stderr)
    tell_agent(line)
    return FAILED


def failure_line(failures: dict[int, Any], host: str) -> str:
    """One line for the ranks of this node that failed (`ChildFailedError.failures`:
    global rank -> torch's ProcessFailure): the first to fail, its exit, its own line."""
    # The first to fail is the earliest by torch's whole seconds; within one second, a
    # rank that failed on its own beats one the agent then signalled to stop (whose time
    # is when the agent saw it), then the earlier line (`_failed_at`). A rank can be both:
    # it wrote its line and was still exiting (a process group torn down, a loaded host)
    # when another rank's exit made the agent stop the group.
    order = {r: i for i, r in enumerate(failures)}

    def first(r: int) -> tuple[int, bool, float, int]:
        f = failures[r]
        at = _failed_at(f)
        return int(at), f.exitcode < 0 and not _own_line(f), at, order[r]

    rank = min(failures, key=first)
    f = failures[rank]
    said = _own_line(f)
    if f.exitcode >= 0:
        how = f"exited with code {f.exitcode}"
    elif said:
        how = f"failed, then was stopped by {f.signal_name()}"
    else:
        how = f"was killed by {f.signal_name()}"
    line = f"rank {rank} (local {f.local_rank}) on {host} {how}"
    if said:
        line += f": {said}"
    # the rest of this node's ranks: mostly the agent's SIGTERM as it stops the group
    others = [f"rank {r} ({_exit(failures[r])})" for r in sorted(failures) if r != rank]
    if others:
        line += f"; then {', '.join(others)}"
    return line


def _failed_at(failure: Any) -> float:
    """When a rank failed, in seconds: its own line's stamp where fanout wrote it
    (`tell_agent`'s `time_ns`), else torch's whole second (its @record file's, or when the
    agent saw the exit)."""
    data = failure.error_file_data
    ns = data.get("time_ns") if isinstance(data, dict) else None
    return ns / 1e9 if isinstance(ns, int) else float(failure.timestamp)


def _exit(failure: Any) -> str:
    code: int = failure.exitcode
    return str(failure.signal_name()) if code < 0 else f"code {code}"


def _own_line(failure: Any) -> str:
    """The rank's own error from its error file: fanout's one line (tell_agent), or the
    last line of what torch's @record wrote (`Type: message` then a traceback); "" when
    it left none (torch then fills in a pointer to its docs, not the rank's words)."""
    if failure.error_file_data is None or "message" not in failure.error_file_data:
        return ""
    message = failure.error_file_data["message"]
    if isinstance(message, dict):
        message = message.get("message", "")
    if not isinstance(message, str) or message in ("", "<NONE>"):
        return ""
    lines = [x.strip() for x in message.strip().splitlines() if x.strip()]
    return lines[-1][:_MAX_RANK_LINE] if lines else ""


def _agent_line(e: BaseException) -> str:
    """The agent's own failure (its rendezvous store gone, say) in one line, with the
    first line of its cause where torch chains one ("See inner exception")."""

    def first(x: BaseException) -> str:
        lines = str(x).strip().splitlines()
        text = lines[0].strip()[:_MAX_RANK_LINE] if lines else ""
        return f"{type(x).__name__}: {text}" if text else type(x).__name__

    cause = e.__cause__ or e.__context__
    return f"{first(e)} ({first(cause)})" if cause is not None else first(e)


def _not_said_twice(record: logging.LogRecord) -> bool:
    """Drops the agent's own error line for a failed rank ("failed (exitcode: 1)
    local_rank: 0 ..."): the launcher's line says it, with the rank's words."""
    return not str(record.msg).startswith("failed (exitcode")


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.api import logger as agent_log
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    agent_log.addFilter(_not_said_twice)
    # torchrun's parser: its flags, its --help, its usage errors (exit 2)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    host = socket.gethostname()
    try:
        run(args)
    except ChildFailedError as e:
        print(f"fanout dp-launch: error: {failure_line(e.failures, host)}", file=sys.stderr)
        return FAILED
    except SignalException as e:
        # SIGTERM/SIGINT to the agent: it has stopped its ranks (each says how it ended)
        print(f"fanout dp-launch: stopped by {e.sigval.name} on {host}", file=sys.stderr)
        return FAILED
    except KeyboardInterrupt:
        print(f"fanout dp-launch: interrupted on {host}", file=sys.stderr)
        return 130
    except Exception as e:  # the agent's own failure: torch's, no fanout frame in it
        print(f"fanout dp-launch: error: the torchrun agent on {host} failed: {_agent_line(e)}",
              file=sys.stderr)  # fmt: skip
        return FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
