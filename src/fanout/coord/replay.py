"""A write transaction's body so far, kept to run again on a new connection (PostgreSQL).

    from fanout.coord.replay import Replay
    done = Replay(db.where)          # at BEGIN
    out = call(); done.ran(call, out)  # each statement of the body, as it runs
    done.again()                     # new connection, BEGIN again: ReadsChanged if any answer differs

A connection lost inside a write's body, before its COMMIT was sent, took the
transaction with it: the server rolled it back, for sure. The body itself (the
caller's `with` block) cannot be run again from inside fanout.coord.postgresdb's
context manager, but its statements can. Run again on a new connection under the
run's lock, each returning what it returned before, they leave the body's decisions
(made on those answers) as true as they were, so the body goes on as if the
connection had never gone, its Python side effects having run once: the same as the
whole call retried. Where an answer differs, another process committed in between
and the body's decisions may not hold: ReadsChanged, nothing written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fanout.errors import CoordinatorUnavailable


class ReadsChanged(CoordinatorUnavailable):
    """A write's connection was lost inside its body (the server rolled it back), and
    its statements so far, run again on a new connection, did not all return what they
    had: the body cannot go on. Nothing of it was written."""


def _outcome(result: Any) -> tuple[Any, ...]:
    """What a statement returned, to compare with its replay: a cursor's result as the
    server sent it (its cells are read only if a replay compares them), or a value."""
    pg = getattr(result, "pgresult", None)
    return ("value", result) if pg is None else ("rows", int(result.rowcount), pg)


def _answer(o: tuple[Any, ...]) -> tuple[Any, ...]:
    if o[0] == "value":
        return o
    _, n, pg = o
    cells = [pg.get_value(r, c) for r in range(pg.ntuples) for c in range(pg.nfields)]
    return n, pg.status, pg.command_status, cells


class Replay:
    """The calls a write's body made, in order, each with what it returned. A call is
    a closure that reads the connection when called, so that run again it runs on
    whatever connection replaced the lost one."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.calls: list[tuple[Callable[[], Any], tuple[Any, ...]]] = []

    def ran(self, call: Callable[[], Any], result: Any) -> None:
        self.calls.append((call, _outcome(result)))

    def again(self) -> None:
        """Run every call again (the caller has begun the transaction again); raise
        ReadsChanged at the first that answers otherwise than it did."""
        for call, was in self.calls:
            if _answer(_outcome(call())) != _answer(was):
                raise ReadsChanged(
                    f"coordinator database {self.where}: the connection was lost inside a "
                    "write (the server rolled it back), and what it had read changed before "
                    "it could run again; nothing of it was written"
                )
