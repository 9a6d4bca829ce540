"""What every part of the coordinator shares: one connection to a run, its settings, tokens.

    run = RunDb(conn, root, db_path)          # fanout.coord.coordinator.Coordinator builds it
    with run.write() as cur:
        token = run.bump(cur, "next_token")   # ids and tokens: one counter each, never reused

The Coordinator is composed of parts, one per responsibility (fanout.coord.roles,
.leasing, .claims, .retention, .reads, .follow_log); each holds this RunDb and nothing else in
common. It owns the connection, the run's RunConfig and CaptureContract (stored in
`meta` at create time), the window-file store, the id/token counters and the
monotonic clock that decisions use; the wall-clock stamps stored for display are
fanout.coord.database.wall's (beside the database seam, the lowest module, so the
state machine and liveness stamp with the same clock).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from fanout.contract import CaptureContract
from fanout.coord import schema
from fanout.coord.database import Rows, Statement
from fanout.coord.grants import WindowFiles
from fanout.coord.retention import RunConfig
from fanout.store.rundir import RunDir
from fanout.store.streaminfo import window_span

Location = Path | str  # a SQLite file, or a postgresql:// URL (without its password)


class RunDb:
    """One connection to a run's coordinator database. Not thread-safe: one per thread."""

    def __init__(
        self,
        conn: schema.Database,
        root: Path,
        db_path: Location,
        *,
        store: WindowFiles | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.conn, self.root, self.db_path, self.clock = conn, root, db_path, clock
        try:
            schema.check_schema(conn)
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        except BaseException:
            conn.close()
            raise
        self.config = RunConfig.model_validate_json(meta["config"])
        self.contract = CaptureContract.model_validate_json(meta["contract"])
        self._store = store

    @property
    def store(self) -> WindowFiles:
        if self._store is None:
            # Imported lazily: `fanout status` must not pay for torch.
            from fanout.filesystem import FileSystem
            from fanout.store.store import Store

            self._store = Store(RunDir(self.root), FileSystem())
        return self._store

    def write(self, notify: str | None = "") -> AbstractContextManager[schema.Sql]:
        """One serialised write transaction (rolls back on error); `notify`: the kind of
        change its commit tells waiters (fanout.coord.database.Database.write)."""
        return self.conn.write(notify=notify)

    def batch(self, statements: Sequence[Statement], notify: str | None = "") -> list[Rows]:
        """One serialised write transaction of self-guarding statements, sent at once
        (fanout.coord.database.Database.batch)."""
        return self.conn.batch(statements, notify=notify)

    def wait_change(
        self, deadline: float | None, max_s: float = 0.05, ignore: tuple[str, ...] = ()
    ) -> bool:
        """Sleep until another connection commits, `max_s` passes or monotonic `deadline`;
        True when a commit (not of a kind in `ignore`) woke it."""
        return self.conn.wait_change(deadline, max_s, ignore)

    @staticmethod
    def bump(cur: schema.Sql, key: str, n: int = 1) -> int:
        """Add `n` to counter `key` (schema.COUNTERS) and return its new value."""
        row = cur.execute(
            "UPDATE counters SET value = value + ? WHERE key=? RETURNING value", (n, key)
        ).fetchone()
        if row is None and key in schema.LATE_COUNTERS:  # a run made before it existed
            cur.execute("INSERT INTO counters(key, value) VALUES (?, ?)", (key, n))
            return n
        return int(row[0])

    @staticmethod
    def meta(cur: schema.Sql, key: str) -> Any:
        """A counter (schema.COUNTERS, an int) or a stored run setting (text, or None)."""
        if key in schema.COUNTERS:
            got = cur.execute("SELECT value FROM counters WHERE key=?", (key,)).fetchone()
            if got is None and key in schema.LATE_COUNTERS:
                return 0  # a run made before the counter existed, none bumped yet
            return int(got[0])
        row = cur.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else row[0]

    def rows(self, window: int) -> tuple[int, int]:
        """The stream rows [start, stop) window `window` holds (a full window's: the
        coordinator does not know where a stream ends; the window file does)."""
        return window_span(window, self.contract.window_rows)
