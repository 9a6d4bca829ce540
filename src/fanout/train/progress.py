"""What a trainer tells its operator: what it waits for, per-step progress, where its
start-up went (its metrics log: fanout.train.trainlog).

    notice = WaitNotice(600.0).start()          # "waiting for window 12 from the producer ..."
    contract = wait_for_run(run_dir, None, 600.0)
    clock = StartupClock(); clock.mark("run"); ...   # then "ready", "registered", "first_batch"
    log.info(clock.line("b8"))                  # at the first step: how long each stretch took
    bar = ProgressBar(total=200, initial=0, desc="b8", show=True); bar.update(rec, batch, cursor)

Lines for people go to stderr (above the progress bar when one is drawn); the trainer's
summary stays alone on stdout. `clock` and `write` seams let tests run WaitNotice on a
fake clock (tests/test_startup.py).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fanout.contract import CaptureContract
from fanout.errors import ConfigError, CoordinatorBusy, NoCoordinator
from fanout.flags import log_role, torchrun_rank
from fanout.store.rundir import RunDir
from fanout.ticker import Ticker
from fanout.train.consumer import Batch

log = logging.getLogger(__name__)

WAIT_NOTICE_EVERY_S = 5.0  # a waiting trainer says on stderr what it waits for this often
# ... and this often while it waits for another consumer (not counted toward the timeout)
NOT_COUNTED_EVERY_S = 30.0


def _secs(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}"


def _say(line: str) -> None:
    """One line on stderr, above the progress bar if one is drawn; under torchrun it
    names the rank that says it (`[train b16:dp1] waiting for ...`), as log lines do."""
    from tqdm import tqdm

    if torchrun_rank() is not None:
        line = f"[{log_role()}] {line}"
    tqdm.write(line, file=sys.stderr)


class WaitNotice:
    """Says on stderr what the trainer is waiting for, while it waits, e.g.

        waiting for window 12 from the producer (15 s of 600 s; --acquire-timeout-s)

    `begin(what, after_s, counts)` and `end()` bracket a wait; the first line comes once
    the wait is `after_s` old, then one every `every_s`. The seconds shown against the
    timeout are those that count toward it, as the coordinator counts them: while
    `counts()` says the wait does not count (another consumer holds the producer), the
    line says so, every NOT_COUNTED_EVERY_S, and once some of the wait did not count the
    line gives both figures. Each `tick()` adds the time since the last one to the
    counted or the uncounted seconds, by what `counts()` says now; it prints a line when one is due:
    the waiting loop calls it, or for a wait that blocks inside a call (acquiring a
    window) the thread that `start()` runs does. `clock` and `write` are seams for tests.
    """

    def __init__(
        self,
        limit_s: float,
        *,
        every_s: float = WAIT_NOTICE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        write: Callable[[str], None] = _say,
    ) -> None:
        self.limit_s = limit_s
        self.every_s = every_s
        self.clock = clock
        self.write = write
        self._lock = threading.Lock()
        self._what: Callable[[], str] | None = None
        self._counts: Callable[[], bool] | None = None
        self._since = self._due = self._last = 0.0
        self._counted = self._uncounted = 0.0  # seconds of this wait, by counts()
        self._ticker: Ticker | None = None

    def begin(
        self,
        what: Callable[[], str],
        *,
        after_s: float = 0.0,
        counts: Callable[[], bool] | None = None,
    ) -> None:
        with self._lock:
            self._what, self._counts, self._since = what, counts, self.clock()
            self._due = self._since + after_s
            self._last, self._counted, self._uncounted = self._since, 0.0, 0.0

    def end(self) -> None:
        with self._lock:
            self._what = None

    def tick(self) -> str | None:
        """Print (and return) the line if one is due."""
        with self._lock:
            now = self.clock()
            if self._what is None:
                return None
            counting = self._counts is None or self._counts()
            if counting:
                self._counted += now - self._last
            else:
                self._uncounted += now - self._last
            self._last = now
            if now < self._due:
                return None
            waited, counted = _secs(now - self._since), _secs(self._counted)
            limit = _secs(self.limit_s)
            if not counting:
                self._due = now + max(self.every_s, NOT_COUNTED_EVERY_S)
                line = (
                    f"waiting for {self._what()} ({waited} s, {counted} s of {limit} s "
                    "counted; a wait for another consumer does not count toward "
                    "--acquire-timeout-s)"
                )
            elif self._uncounted:
                self._due = now + self.every_s
                line = (
                    f"waiting for {self._what()} ({counted} s of {limit} s counted toward "
                    f"--acquire-timeout-s; {waited} s in all: a wait for another consumer "
                    "does not count)"
                )
            else:
                self._due = now + self.every_s
                line = f"waiting for {self._what()} ({counted} s of {limit} s; --acquire-timeout-s)"
        self.write(line)
        return line

    def start(self, period_s: float = 0.5) -> WaitNotice:
        self._ticker = Ticker(self.tick, period_s, name="fanout-wait-notice").start()
        return self

    def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.stop()


def wait_for_run(
    run_dir: Path, db_path: str | None, timeout_s: float, notice: WaitNotice | None = None
) -> CaptureContract:
    """Wait up to `timeout_s` (--acquire-timeout-s) until a producer has created the run,
    saying so on stderr at once and then every few seconds (`WaitNotice`).

    Waits only on what a producer that is starting explains: no database yet
    (NoCoordinator: no file, or its tables not committed yet; on a run dir on a network
    filesystem too, while nothing says where the database will be) or one the create
    holds locked (CoordinatorBusy). Anything else (not a database, an unknown schema version,
    an unreachable server) fails at once: waiting would not fix it.
    """
    from fanout.coord.coordinator import Coordinator
    from fanout.coord.postgresdb import redact

    def what() -> str:
        rd = RunDir(run_dir.absolute())
        if db_path is None and not rd.db_pointer.exists() and not rd.database.exists():
            # nothing says yet which database the run will use (a PostgreSQL run's
            # pointer is written by the producer that creates it): do not name one
            return f"a producer to create {rd.database} (or {rd.db_pointer.name}, naming another)"
        where = Coordinator.resolve_db_path(rd.root, db_path)
        return f"a producer to create {redact(where) if isinstance(where, str) else where}"

    notice = notice or WaitNotice(timeout_s)
    notice.begin(what)
    try:
        with Coordinator.open_when_created(
            run_dir, timeout_s, db_path=db_path, on_wait=lambda _: notice.tick()
        ) as coord:
            return coord.contract
    except (NoCoordinator, CoordinatorBusy) as e:
        raise ConfigError(
            f"{run_dir}: no run after waiting {_secs(timeout_s)} s (--acquire-timeout-s): {e}"
        ) from None
    finally:
        notice.end()


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), None where that is unknown."""
    try:
        stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - int(stat[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """Where the time to the first step went (docs/operations.md, "Trainer start-up").

    Monotonic stamps: `init` (the trainer is being built; `process`, when the process
    started, where /proc says), then the trainer `mark`s `run` (the run exists), `ready`
    (draft, optimizer, resume done), `registered` (a consumer of the run) and
    `first_batch`; `line()` at the first step says how long each stretch took.
    """

    def __init__(self) -> None:
        age = process_age_s()
        self.stamps: dict[str, float] = {"init": time.monotonic()}
        if age is not None:
            self.stamps["process"] = self.stamps["init"] - age

    def mark(self, name: str) -> None:
        """Stamp `name` now, the first time only."""
        self.stamps.setdefault(name, time.monotonic())

    def line(self, consumer_id: str) -> str:
        st, now = self.stamps, time.monotonic()
        parts = [
            ("waiting for the run", st["run"] - st["init"]),
            ("draft + optimizer", st["ready"] - st["run"]),
            ("registering", st["registered"] - st["ready"]),
            ("first window", st["first_batch"] - st["registered"]),
            ("first step", now - st["first_batch"]),
        ]
        if "process" in st:
            parts.insert(0, ("interpreter + imports", st["init"] - st["process"]))
        since = "the process started" if "process" in st else "the trainer was built"
        return (
            f"{consumer_id}: first step {now - st.get('process', st['init']):.2f} s after "
            f"{since} ({', '.join(f'{k} {v:.2f} s' for k, v in parts)})"
        )


class ProgressBar:
    """tqdm on stderr: step, loss, EAL, rows/s and % of the time spent waiting for windows
    (both since the bar was made), the newest window of the step, the cursor. `show`
    False: nothing is drawn."""

    def __init__(self, *, total: int | None, initial: int, desc: str, show: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            disable=not show,
        )
        self.rows_seen, self.waited_s, self.t0 = 0, 0.0, time.perf_counter()

    def update(self, rec: dict[str, Any], batch: Batch, cursor: int) -> None:
        self.rows_seen += len(batch.rows)
        self.waited_s += batch.wait_s
        if self.bar.disable:
            return
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(
            f"loss {rec['loss']:.4f} EAL {rec['eal']:.2f} | {self.rows_seen / elapsed:.1f} "
            f"rows/s | waiting {100 * self.waited_s / elapsed:.0f}% | window "
            f"{rec['windows'][-1]} cursor {cursor}",
            refresh=False,
        )
        self.bar.update(1)

    def set_total(self, total: int) -> None:
        """The steps the bar counts to, learned during the run (the stream's length)."""
        self.bar.total = total
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
