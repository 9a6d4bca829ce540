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
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol


def wall() -> float:
    """Wall-clock seconds, the one source of every stamp the coordinator stores (heartbeat
    ages, "blocked since", updated_at): for people to read. Liveness decisions use a
    process's own monotonic clock, never these (fanout.coord.liveness)."""
    return time.time()


class Sql(Protocol):
    """What a transaction body (and a reader) may call: the DB-API subset both drivers share."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any: ...
    def executemany(self, sql: str, seq: Iterable[Sequence[Any]]) -> Any: ...


class Database(Sql, Protocol):
    """One connection to a coordinator database (fanout.coord.sqlitedb or fanout.coord.postgresdb).

    Not thread-safe: one per thread. `where` names it in messages (a path, or a URL
    without its password).
    """

    dialect: str
    where: str

    def write(self) -> AbstractContextManager[Sql]:
        """One write transaction, serialised against every other writer; rolls back on error."""
        ...

    def wait_change(self, deadline: float | None, max_s: float) -> None:
        """Sleep until another connection commits, `max_s` passes or monotonic `deadline`."""
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
