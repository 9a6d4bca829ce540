"""The seam both coordinator databases implement: a connection (`Database`) and a cursor (`Sql`).

    from fanout.coord.database import Database, Sql
    def body(cur: Sql) -> None: cur.execute("SELECT 1")          # inside db.write()

fanout.coord.sqlitedb and fanout.coord.postgresdb are the two `Database`s; the
tables they hold are fanout.coord.schema's. Kept apart from the schema so that the
modules the schema is built from (fanout.coord.states) can name the seam too, and
the wall clock every stored stamp comes from (`wall`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

Statement = tuple[str, Sequence[Any]]  # one statement of a `batch`, with its parameters
T = TypeVar("T")


def wall() -> float:
    """Wall-clock seconds, the one source of every stamp the coordinator stores (heartbeat
    ages, "blocked since", updated_at): for people to read. Liveness decisions use a
    process's own monotonic clock, never these (fanout.coord.liveness)."""
    return time.time()


class Sql(Protocol):
    """What a transaction body (and a reader) may call: the DB-API subset both drivers share."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any: ...
    def executemany(self, sql: str, seq: Iterable[Sequence[Any]]) -> Any: ...


@dataclass(frozen=True, slots=True)
class Rows:
    """What one statement of a `batch` returned: its rows (RETURNING or SELECT) and how
    many rows it changed (or returned)."""

    rows: list[tuple[Any, ...]]
    rowcount: int

    def fetchone(self) -> tuple[Any, ...] | None:
        return self.rows[0] if self.rows else None

    def fetchall(self) -> list[tuple[Any, ...]]:
        return self.rows


class Database(Sql, Protocol):
    """One connection to a coordinator database (fanout.coord.sqlitedb or fanout.coord.postgresdb).

    Not thread-safe: one per thread. `where` names it in messages (a path, or a URL
    without its password).
    """

    dialect: str
    where: str

    def write(self, *, notify: str | None = "") -> AbstractContextManager[Sql]:
        """One write transaction, serialised against every other writer; rolls back on
        error. `notify`: what its commit tells waiters (a `wait_change` may ignore some
        kinds); None tells nobody (PostgreSQL; SQLite's waiters see every commit)."""
        ...

    def batch(self, statements: Sequence[Statement], notify: str | None = "") -> list[Rows]:
        """One write transaction of `statements`, none of which needs another's result
        (each guards itself in SQL), serialised like `write`: PostgreSQL sends them in
        one pipeline, so the run's write lock is held while the server runs them, not
        across round trips to this client. Returns each statement's rows."""
        ...

    def decide(
        self, body: Callable[[Sql], tuple[T, Sequence[Statement]]], notify: str | None = ""
    ) -> tuple[T, list[Rows]]:
        """One write transaction in two steps: `body` reads and decides under the run's
        write lock, returning a value and the statements that write; those go with the
        COMMIT (PostgreSQL: in one message, so the lock is held for the body's reads and
        one more round trip, not one per write). Returns the value and their rows."""
        ...

    def write_row(self, sql: str, params: Sequence[Any] = ()) -> int:
        """One statement that changes rows of one table and needs no run-wide
        serialisation (a heartbeat counter): PostgreSQL runs it on its own, ordered by
        the row lock; SQLite in a `write`. Tells no waiter. A statement sent just before
        its connection was lost may be applied twice: only for changes where that is
        harmless. Returns how many rows changed."""
        ...

    def arm(self) -> None:
        """Commits from now on wake the next `wait_change` (until it returns), even
        those made before it starts: a waiter calls it before it reads, then reads, then
        waits, and misses nothing."""
        ...

    def disarm(self) -> None:
        """Stop listening for commits (at the next convenient round trip)."""
        ...

    def wait_change(
        self, deadline: float | None, max_s: float, ignore: tuple[str, ...] = ()
    ) -> bool:
        """Sleep until another connection commits, `max_s` passes or monotonic `deadline`;
        True when a commit woke it. `ignore`: kinds of commits (`write`'s `notify`) that
        do not wake it (PostgreSQL only)."""
        ...

    def writable(self, timeout_s: float) -> bool:
        """Whether a write transaction can start within `timeout_s` (nothing is written):
        False while another process holds the write lock, e.g. one stopped inside a
        write (the chaos driver pauses processes only outside one)."""
        ...

    def table_names(self) -> set[str]:
        """The tables this database (PostgreSQL: this schema) holds."""
        ...

    def integrity_check(self) -> str:
        """`ok`, or what the database's own consistency check found wrong."""
        ...

    def close(self) -> None: ...
