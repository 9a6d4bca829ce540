"""How a trainer's run ends: the state it records, the checkpoint it keeps, its last line.

    end = Ending("b8")
    try:
        ... train; end.reached = True at --max-steps; except FanoutError as e: end.failed(e)
        if steps and not end.fenced: end.saved = trainer.save()
    finally:
        end.close(stream)          # 'finished' / 'stopped' in the run, or nothing if fenced
    end.raise_failure(step, stream)  # TrainerStopped naming the cause and the checkpoint
    log.info("%s", end.last_line(step, stream))  # else: how it ended, and the checkpoint

Every exit that is not a crash keeps what was trained and says so in its last line
(a failure's TrainerStopped line; else `last_line`, and the summary's `checkpoint`):

| how it ends                                   | consumer state | holds windows | checkpoint |
| --------------------------------------------- | -------------- | ------------- | ---------- |
| its own end: stream, --max-steps, --epochs    | finished       | no            | yes        |
| SIGINT / SIGTERM                              | stopped        | yes           | yes        |
| a window that did not come, or failed for good| stopped        | yes           | yes        |
| detached (lag policy or `fanout detach`)      | detached       | no            | yes        |
| fenced off (a takeover, or declared lost)     | unchanged      | -             | no         |

A fenced-off trainer writes nothing: another process may hold its consumer id (and
its save path) now. Exit codes are fanout.train.trainer's: 0 done or stopped by a
signal, 1 with the TrainerStopped line, 3 detached.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fanout.coord.states import RoleState
from fanout.errors import Detached, FanoutError, StaleLease, TrainerStopped

log = logging.getLogger("fanout.train.trainer")


class Ending:
    """What one trainer run's end has been so far."""

    def __init__(self, consumer_id: str) -> None:
        self.consumer_id = consumer_id
        self.reached = False  # stopped at its own stopping condition (--max-steps)
        self.failure: FanoutError | None = None
        self.saved: Path | None = None
        self.unsaved: str | None = None  # why no checkpoint was saved where one could be
        self.unrecorded: str | None = None  # why close() could not record how it ended

    @property
    def fenced(self) -> bool:
        """Fenced off (StaleLease, RoleTaken): no checkpoint, no state is written."""
        return isinstance(self.failure, StaleLease)

    def failed(self, e: FanoutError) -> None:
        self.failure = e

    def state(self, stream: Any) -> str:
        done = stream.finished or self.reached
        return (RoleState.FINISHED if done else RoleState.STOPPED).value

    def close(self, stream: Any) -> None:
        """Close the stream, recording 'finished' or 'stopped' (not when fenced or
        detached: the coordinator no longer takes this registration's writes)."""
        clean = not self.fenced and not isinstance(self.failure, Detached)
        try:
            stream.close(clean=clean, done=self.reached)
        except FanoutError as e:
            if self.failure is None:
                raise
            # the coordinator may be what failed: the failure is the news, not this
            self.unrecorded = str(e)
            log.warning("%s: could not record how it ended: %s", self.consumer_id, e)

    def checkpoint_line(self, step: int, stream: Any, resume: bool = True) -> str:
        """The checkpoint kept (at `step`, the stream's position), and (`resume`) how to
        continue from it."""
        if self.saved is not None:
            return (
                f"saved a checkpoint at step {step} (cursor {stream.state_dict()['cursor']}): "
                f"{self.saved}" + ("; continue with --resume" if resume else "")
            )
        if self.unsaved is not None:
            return self.unsaved
        if not step:
            return "no step was trained, so there is no checkpoint"
        return "rank 0 saved the checkpoint"

    def last_line(self, step: int, stream: Any) -> str:
        """The line a run that ended without a failure logs last: how it ended and the
        checkpoint it kept (a stopped one: how to continue)."""
        state = self.state(stream)
        resume = state == RoleState.STOPPED
        return f"{self.consumer_id}: {state} at step {step}; " + self.checkpoint_line(
            step, stream, resume=resume
        )

    def raise_failure(self, step: int, stream: Any) -> None:
        """Re-raise a controlled failure as one line with the checkpoint in it."""
        e = self.failure
        if e is None:
            return
        if self.fenced:
            raise e
        if isinstance(e, Detached):  # `fanout train` adds how to rejoin (--resume), once
            raise Detached(f"{e}; {self.checkpoint_line(step, stream, resume=False)}") from None
        recorded = (
            "recorded 'stopped' (it holds windows back until resumed or `fanout detach`ed)"
            if self.unrecorded is None
            else "'stopped' not recorded (the coordinator refused it: another process may "
            "hold this consumer now; `fanout status` shows its state)"
        )
        raise TrainerStopped(
            f"{self.consumer_id} stopped: {e}; {recorded}; {self.checkpoint_line(step, stream)}"
        ) from None


def summary(
    trainer: Any, stream: Any, first: dict[str, Any] | None, last: dict[str, Any] | None
) -> dict[str, Any]:
    """The trainer's one summary line (stdout): steps, cursor, how the stream ended."""
    import torch

    params = [p.detach().double().sum() for p in trainer.draft.parameters() if p.requires_grad]
    return {
        "consumer": stream.reg.consumer_id,
        "steps": trainer.state["step"],
        "cursor": stream.state_dict()["cursor"],
        "finished_stream": stream.finished,
        "interrupted": trainer.interrupted,
        "adamw_backend": trainer.backend,
        "first_loss": first and first["loss"],
        "last_loss": last and last["loss"],
        "first_eal": first and first["eal"],
        "last_eal": last and last["eal"],
        "dp_world_size": trainer.dp.world,
        # equal on every data-parallel rank when their weights are in sync
        "param_checksum": float(torch.stack(params).sum()),
    }
