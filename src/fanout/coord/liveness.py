"""Liveness: who is lost (Reclaimer), who holds a role (Holder, RoleWatch).

    from fanout.coord.liveness import Reclaimer, RoleWatch, this_process
    lost = Reclaimer(ttl_s=30).observe(rows)     # [(id, token, hb_seq)] stood still for ttl
    RoleWatch(ttl_s=30).verdict(holder, this_process())   # "free" | "held" | "watch"

Pure rules over what the coordinator stores; fanout.coord.roles applies them, and
the heartbeat thread that keeps a process's counter moving is fanout.coord.heartbeat.

A process is lost when its heartbeat *counter* has not moved for `ttl` seconds on
the reclaimer's OWN monotonic clock. Wall-clock timestamps written by other
hosts or by a process that was paused are never compared: clocks drift, and a
paused process's clock keeps running while it does nothing. If the reclaimer
itself was not watching for a while (it was paused, or its loop stalled), it
forgets what it saw and starts watching afresh, so a reclaimer that wakes from
SIGSTOP does not declare everyone else lost.

Roles are exclusive: the producer, and each consumer id `name:dp<rank>`, is held by
one process at a time. The coordinator stores who (host, pid and `proc`, the
process's identity on its kernel); a newcomer is refused while the holder is live
(RoleWatch) unless it asks to take over, and a holder that is gone from this host,
or whose heartbeat counter stood still for `ttl`, is replaced without asking.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from fanout.coord.database import wall
from fanout.coord.states import RoleState
from fanout.netfs import kernel_identity, proc_stat


class Reclaimer:
    """In-memory observations {(id, token): (last_seen_seq, clock_when_first_seen)}."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._seen: dict[tuple[str, int], tuple[int, float]] = {}
        self._last: float | None = None
        self._own: set[str] = set()

    def own(self, pid: str) -> None:
        """Never declare this process's own registrations lost."""
        self._own.add(pid)

    def observe(
        self, rows: Iterable[tuple[str, int, int]], exclude: Iterable[str] = ()
    ) -> list[tuple[str, int, int]]:
        """Feed (id, token, hb_seq) of every active process; return the lost ones."""
        now = self.clock()
        # Not watching for more than ttl/2 (we were paused, or our caller's loop was
        # slow): what we saw before may be long superseded, so start over.
        if self._last is None or now - self._last > self.ttl_s / 2:
            self._seen.clear()
        self._last = now
        skip = self._own | set(exclude)
        lost, seen = [], {}
        for pid, token, seq in rows:
            key = (pid, int(token))
            prev = self._seen.get(key)
            if prev is None or prev[0] != seq:
                prev = (int(seq), now)
            seen[key] = prev
            if pid not in skip and now - prev[1] >= self.ttl_s:
                lost.append((pid, int(token), int(seq)))
        self._seen = seen
        return lost


# ---- who holds a role -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """A process as the coordinator records a role's holder."""

    host: str  # socket.gethostname(), for people
    pid: int
    proc: str  # "<boot id>/<pid namespace>/<start ticks>"; "" where /proc is missing

    def __str__(self) -> str:
        return f"{self.host} pid {self.pid}"


def this_process() -> ProcessInfo:
    """This process (computed each time: a forked child is another process)."""
    pid = os.getpid()
    kernel = kernel_identity()
    try:
        st = proc_stat(pid) if kernel else None
    except OSError:
        st = None
    return ProcessInfo(socket.gethostname(), pid, f"{kernel}/{st[1]}" if st else "")


def process_gone(proc: str | None, pid: int | None) -> bool | None:
    """Has the process recorded as (`proc`, `pid`) exited? True or False where this
    host can tell (same kernel boot and pid namespace): no such pid, another process
    under it (its start time differs) or a zombie is gone. None where it cannot (the
    holder ran on another host or container, or /proc is missing)."""
    if not proc or pid is None:
        return None
    kernel, _, start = proc.rpartition("/")
    if not kernel or kernel != kernel_identity():
        return None
    try:
        st = proc_stat(pid)
    except OSError:
        return None
    return st is None or st[1] != start or st[0] in ("Z", "X", "x")


def is_same_process(host: str | None, pid: int | None, proc: str | None, me: ProcessInfo) -> bool:
    """Is the process recorded as (`host`, `pid`, `proc`) the process `me`? The pid and,
    where both are known, `proc` (kernel boot, pid namespace and start time) must match:
    `proc` alone does not tell apart processes started in the same clock tick, which a
    barrier or a launcher starting several at once produces. A row from before pids
    were recorded (schema 2) has no pid: there `proc` alone decides."""
    if pid is not None and pid != me.pid:
        return False
    if proc and me.proc:
        return proc == me.proc
    return host == me.host and pid == me.pid


HOLDER_COLUMNS = "state, token, hb_seq, hb_wall, host, pid, proc"  # Holder's fields, in order


@dataclass(frozen=True, slots=True)
class Holder:
    """A role's row as the coordinator stores it (producer or consumers table)."""

    state: str
    token: int
    hb_seq: int
    hb_wall: float  # wall clock of its last heartbeat: display, and a same-host shortcut
    host: str | None
    pid: int | None
    proc: str | None

    def __str__(self) -> str:
        if self.pid is None:
            return "an unknown process (registered by an older fanout)"
        return f"{self.host} pid {self.pid}"

    def is_process(self, me: ProcessInfo) -> bool:
        return is_same_process(self.host, self.pid, self.proc, me)


Verdict = Literal["free", "held", "watch"]


class RoleWatch:
    """May a newcomer take a role now? Feed it the holder's row until it says free or held.

    free: nobody active holds it (never registered, finished, stopped, lost, detached),
    this very process holds it (a re-registration), or the holder is gone from this
    host (a crash: restarts need no flag). held: the holder runs on this host with a
    heartbeat younger than ttl (same clock), or its heartbeat counter moved while we
    watched. Otherwise watch: the holder is on another host (or not beating); it is
    free once its counter stood still for ttl on our own clock, as a reclaimer would
    declare it lost.
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.clock = ttl_s, clock
        self._seen: dict[int, tuple[int, float]] = {}  # token -> (first seq, when)
        self.reason = ""

    def verdict(self, holder: Holder | None, me: ProcessInfo) -> Verdict:
        if holder is None or holder.state != RoleState.ACTIVE:
            self.reason = "not held"
            return "free"
        if holder.is_process(me):
            self.reason = "held by this process"
            return "free"
        gone = process_gone(holder.proc, holder.pid)
        if gone:
            self.reason = "it has exited"
            return "free"
        if gone is False and 0 <= wall() - holder.hb_wall < self.ttl_s:
            self.reason = "it runs on this host"
            return "held"
        now = self.clock()
        seq, since = self._seen.setdefault(holder.token, (holder.hb_seq, now))
        if holder.hb_seq != seq:
            self._seen[holder.token] = (holder.hb_seq, now)
            self.reason = "its heartbeat moved while we watched"
            return "held"
        if now - since >= self.ttl_s:
            self.reason = f"its heartbeat stood still for {self.ttl_s:g} s (ttl_s)"
            return "free"
        return "watch"
