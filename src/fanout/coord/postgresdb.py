"""The coordinator on PostgreSQL: for trainers (or a producer) on more than one host.

    fanout produce --run-dir /shared/run1 --db-path 'postgresql://fanout@db-host/fanout?schema=run1' ...
    python scripts/train.py --run-dir /shared/run1 ...   # finds the URL in run1/coordinator.dbpath

    from fanout.coord.postgresdb import PostgresDatabase
    db = PostgresDatabase("postgresql://fanout@db-host/fanout?schema=run1")
    with db.write() as cur: cur.execute("UPDATE counters SET value=value+1 WHERE key=?", ("x",))

SQLite's WAL needs every process on one host (shared memory), so across hosts
the same tables live in a PostgreSQL schema (`?schema=NAME`, default `fanout`;
one run per schema, created if missing) and the coordinator runs the same
statements with the same semantics:
- writes are serialised like SQLite's `BEGIN IMMEDIATE`: each write transaction
  first takes a transaction-scoped advisory lock keyed by the schema. Under READ
  COMMITTED every later statement then sees everything committed before, so the
  rules in fanout.coord.retention / fanout.coord.claims read and decide exactly as on SQLite
  (no serialization-failure retries to reason about). The lock waits at most
  `lock_timeout_s`, then CoordinatorBusy;
- the lock is kept off the network where a call allows (issue #55): BEGIN and the
  lock go in one message, NOTIFY and COMMIT in another; `batch` sends the lock,
  statements that check their own preconditions, and the COMMIT as one message,
  and `decide` sends a transaction's writes with its COMMIT, so the lock is not
  held across a round trip per statement; `write_row` (a heartbeat) takes no run
  lock at all;
- `wait_change` is LISTEN/NOTIFY: every write transaction notifies the schema's
  channel at commit (its payload says what kind of change, for waits that skip
  some; a write with `notify=None` tells nobody), and a waiting consumer or
  producer wakes on it (SQLite polls `PRAGMA data_version` instead); `arm()`
  listens from before a waiter's read, so nothing committed after it is missed;
- statements are written with `?` placeholders (fanout.coord.schema); `_translate`
  turns them into psycopg's `%s` and quotes the column `window` (reserved here).

The URL (its schema, password and TCP settings) is fanout.coord.pgurl's.
Needs `psycopg` 3 (`pip install 'fanout[postgres]'`), imported only here.
"""

from __future__ import annotations

import logging
import re
import time
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from functools import lru_cache
from typing import Any

from fanout.coord.database import Rows, Statement, T
from fanout.coord.pgurl import TCP_DEFAULTS, parse_url, redact, tcp_settings
from fanout.coord.pgurl import is_url as is_url  # for callers of postgresdb.is_url
from fanout.coord.replay import ReadsChanged, Replay
from fanout.errors import ConfigError, CoordinatorBusy, CoordinatorFull, CoordinatorUnavailable

log = logging.getLogger("fanout.coord.coordinator")

_LOCK_CLASS = 0x66616E6F  # "fano": namespaces fanout's advisory locks among others'


STILL_LOST_EVERY_S = 10.0  # how often a reconnect that keeps failing says so
REPLAYS = 3  # a write body's connection lost this many times running: the outage wins


def _one_line(e: BaseException) -> str:
    """libpq's message on one line (it spreads "server closed the connection
    unexpectedly" over three): errors are one line (docs/operations.md)."""
    return " ".join(str(e).split())


_REACHED: set[str] = set()  # the servers (conninfo) this process has connected to


def _transient(e: BaseException) -> bool:
    """A connect failure an outage explains (refused, timed out, the server starting or
    shutting down: no SQLSTATE, class 08 or 57P), not a wrong password or database."""
    state = getattr(e, "sqlstate", None)
    return state is None or str(state).startswith(("08", "57P"))


@lru_cache(maxsize=512)
def _translate(sql: str) -> str:
    """`?` → `%s`, a literal `%` → `%%`, `window` → `"window"` (fanout's statements
    have no `?` or `window` inside string literals, so a lexer would buy nothing)."""
    sql = sql.replace("%", "%%").replace("?", "%s")
    return re.sub(r"\bwindow\b", '"window"', sql)


def _lock_key(schema: str) -> int:
    """One advisory lock per run (a crc32 collision only serialises two runs' writes)."""
    return (_LOCK_CLASS << 32) | zlib.crc32(schema.encode())  # < 2**63: a valid bigint


class PostgresDatabase:
    """A `schema.Database` in one PostgreSQL schema. `raw` is the psycopg connection.

    A lost connection (server restart, failover, a dropped TCP link) is replaced on
    the next call, waiting up to `reconnect_s` for the server to come back: a read is
    run again; a write lost before its COMMIT was sent (the server rolled it back) is
    begun again and its body's statements so far replayed (`_in_body`). Lost at its
    COMMIT, a write's outcome is unknown: CoordinatorUnavailable, and the process
    restarts as after a crash (claims released, trainers from their checkpoints).
    """

    dialect = "postgres"

    def __init__(
        self,
        url: str,
        *,
        lock_timeout_s: float = 60.0,
        connect_timeout_s: int = 10,
        reconnect_s: float = 60.0,
    ):
        try:
            import psycopg
        except ImportError:
            raise ConfigError(
                f"{redact(url)}: a PostgreSQL coordinator needs psycopg 3 "
                "(pip install 'fanout[postgres]')"
            ) from None
        self._psycopg = psycopg
        self._errors = psycopg.errors
        self._sql = psycopg.sql
        self._conninfo, self.schema, self.where = parse_url(url)
        self._channel_name = f"fanout_{self.schema}"
        self._channel = self._sql.Identifier(self._channel_name)
        self._lock = _lock_key(self.schema)
        # BEGIN and the run's lock in one round trip (a literal key: a simple query may
        # hold several statements only without parameters)
        self._begin_locked = f"BEGIN; SELECT pg_advisory_xact_lock({self._lock}::bigint)"
        self._commits: dict[tuple[str | None, bool], Any] = {}  # (notify, unlisten) → SQL
        self._lock_timeout_s = lock_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._reconnect_s = reconnect_s
        # inside a write: its body's calls so far, and whether its BEGIN took the lock
        self._done: Replay | None = None
        self._locked = True
        self.reconnects = 0
        try:
            self._connect()
        except psycopg.OperationalError as e:
            # A server this process reached before and now refuses (a restart, a
            # failover): an outage, ridden out like a lost connection (a trainer's
            # prefetch thread opens its connection mid-run). At first contact, fail
            # fast: a wrong host, port or password is not going to heal.
            if self._conninfo not in _REACHED or not _transient(e):
                raise CoordinatorUnavailable(
                    f"cannot connect to the coordinator database {self.where}: {_one_line(e)}"
                ) from None
            self._reconnect(e)
        _REACHED.add(self._conninfo)

    def _connect(self) -> None:
        from psycopg.conninfo import conninfo_to_dict, make_conninfo

        self.raw = self._psycopg.connect(
            make_conninfo(self._conninfo, **tcp_settings(self._conninfo)),
            autocommit=True,
            connect_timeout=self._connect_timeout_s,
        )
        # Like a sqlite3 connection, one dropped unclosed closes itself, when collected
        # or at interpreter exit (psycopg would warn; __del__ order at exit is arbitrary).
        weakref.finalize(self, self.raw.close)
        self._pid = self.raw.info.backend_pid
        self._listening = False  # LISTEN on since arm() (a new connection listens to nothing)
        self._unlisten_pending = False  # disarm()ed: UNLISTEN with the next commit
        self.raw.execute(
            self._sql.SQL("SET search_path TO {}").format(self._sql.Identifier(self.schema))
        )
        self.raw.execute(f"SET lock_timeout = {int(self._lock_timeout_s * 1000)}")
        # The server's end of the same bounds: a client cut off inside a write holds the
        # run's lock until its backend notices, which the kernel's defaults make two
        # hours, so every other process of the run would stop at lock_timeout_s. With
        # these the backend ends in about half a minute and the lock goes with it.
        tcp = TCP_DEFAULTS | {
            k: str(v) for k, v in conninfo_to_dict(self._conninfo).items() if k in TCP_DEFAULTS
        }
        self.raw.execute(
            f"SET tcp_keepalives_idle = {int(tcp['keepalives_idle'])}; "
            f"SET tcp_keepalives_interval = {int(tcp['keepalives_interval'])}; "
            f"SET tcp_keepalives_count = {int(tcp['keepalives_count'])}"
        )
        with suppress(self._errors.UndefinedObject):  # PostgreSQL < 12 has no such setting
            self.raw.execute(f"SET tcp_user_timeout = {int(tcp['tcp_user_timeout'])}")

    def _lost(self, e: Exception | None = None) -> bool:
        """Whether the connection is gone (error `e` said so, or psycopg marked it). A
        client-side error (no SQLSTATE: "connection socket closed" when the server
        dropped it between two statements, which psycopg does not always mark broken)
        or a connection / shutdown class (08, 57P) means lost; a lock timeout does not."""
        if self.raw.closed or self.raw.broken:
            return True
        state = getattr(e, "sqlstate", "") if e is not None else ""
        return e is not None and (state is None or state.startswith(("08", "57P")))

    def _reconnect(self, cause: Exception) -> None:
        """Replace a lost connection, retrying for up to `reconnect_s`."""
        log.warning(
            "coordinator database %s: connection lost (%s); reconnecting",
            self.where, _one_line(cause),
        )  # fmt: skip
        if hasattr(self, "raw"):  # not yet, where the first connect failed
            with suppress(self._psycopg.Error):
                self.raw.close()
        start = time.monotonic()
        deadline, said = start + self._reconnect_s, start
        delay = 0.2
        while True:
            try:
                self._connect()
                self.reconnects += 1
                log.warning("coordinator database %s: reconnected", self.where)
                return
            except self._psycopg.OperationalError as e:
                now = time.monotonic()
                if now + delay > deadline:
                    raise CoordinatorUnavailable(
                        f"coordinator database {self.where} unreachable for "
                        f"{self._reconnect_s:.0f} s: {_one_line(e)}"
                    ) from None
                if now - said >= STILL_LOST_EVERY_S:  # cut off: say so while it lasts
                    said = now
                    log.warning(
                        "coordinator database %s: still unreachable after %.0f s (%s); "
                        "trying until %.0f s", self.where, now - start, _one_line(e),
                        self._reconnect_s,
                    )  # fmt: skip
                time.sleep(delay)
                delay = min(2 * delay, 5.0)

    # ---- the Database protocol -----------------------------------------------------

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        query, args = _translate(sql), tuple(params)
        return self._run(lambda: self.raw.execute(query, args))

    def _run(self, call: Callable[[], Any]) -> Any:
        """Run one statement. Outside a write transaction (a read, LISTEN) a lost
        connection is replaced and the statement run once more; inside one, see
        `_in_body`."""
        if self._done is not None:
            return self._in_body(call, self._done)
        try:
            return call()
        except self._errors.OperationalError as e:
            if not self._lost(e):
                raise self._typed(e) from None
            self._reconnect(e)
        try:
            return call()
        except self._errors.OperationalError as e:
            raise self._typed(e) from None

    def _in_body(self, call: Callable[[], Any], done: Replay) -> Any:
        """Run one statement of a write's body. A connection lost here, before the
        COMMIT was sent, took the transaction with it (rolled back, for sure), so it is
        begun again on a new connection, the body's statements so far run again
        (fanout.coord.replay: ReadsChanged where one answers otherwise), then this one.
        At most REPLAYS times, each reconnect bounded by `reconnect_s`."""
        for attempt in range(REPLAYS + 1):
            try:
                if attempt:
                    self.raw.execute(self._begin_locked if self._locked else "BEGIN")
                    done.again()
                    log.warning(
                        "coordinator database %s: a write lost before its COMMIT was begun "
                        "again (%d statements run again, each answering as before)",
                        self.where, len(done.calls),
                    )  # fmt: skip
                out = call()
            except self._errors.OperationalError as e:
                if attempt == REPLAYS or not self._lost(e):
                    raise self._typed(e) from None
                self._reconnect(e)
                continue
            done.ran(call, out)
            return out
        raise AssertionError("unreachable")  # the loop returns or raises

    def executemany(self, sql: str, seq: Iterable[Sequence[Any]]) -> Any:
        query, rows = _translate(sql), [tuple(p) for p in seq]

        def call() -> Any:
            cur = self.raw.cursor()
            cur.executemany(query, rows)
            return cur

        if self._done is not None:  # in a write's body: replayed like execute
            return self._in_body(call, self._done)
        try:
            return call()  # not retried: in autocommit, each row may have committed
        except self._errors.OperationalError as e:
            raise self._typed(e) from None

    def close(self) -> None:
        self.raw.close()

    def _begin(self, lock: bool = True) -> None:
        """BEGIN and take the run's advisory lock (`lock`), in one round trip; on a lost
        connection (nothing has run yet) reconnect and begin again."""
        for attempt in (0, 1):
            try:
                self.raw.execute(self._begin_locked if lock else "BEGIN")
                return
            except self._errors.OperationalError as e:
                if attempt or not self._lost(e):
                    self._rollback()
                    raise self._typed(e) from None
                self._reconnect(e)

    def _rollback(self) -> None:
        if self._lost():
            return  # the server rolled back when the connection went
        with suppress(self._errors.OperationalError):  # it went just now: same
            self.raw.execute("ROLLBACK")

    def _commit_sql(self, notify: str | None) -> Any:
        """NOTIFY (unless `notify` is None; its payload when not empty) and COMMIT in one
        message, with the UNLISTEN a disarm() left pending."""
        key = (notify, self._unlisten_pending)
        if key not in self._commits:
            sql = self._sql
            parts = [sql.SQL("UNLISTEN {}").format(self._channel)] if self._unlisten_pending else []
            if notify == "":
                parts.append(sql.SQL("NOTIFY {}").format(self._channel))
            elif notify is not None:
                parts.append(sql.SQL("NOTIFY {}, {}").format(self._channel, sql.Literal(notify)))
            self._commits[key] = sql.SQL("; ").join([*parts, sql.SQL("COMMIT")])
        return self._commits[key]

    def _committed(self) -> None:
        if self._unlisten_pending:
            self._listening = self._unlisten_pending = False

    @contextmanager
    def write(self, notify: str | None = "") -> Iterator[PostgresDatabase]:
        """BEGIN and take the run's advisory lock; body; NOTIFY and COMMIT (ROLLBACK on
        error): the lock and the commit each cost one round trip, not two."""
        with self._transaction():
            yield self
            self.raw.execute(self._commit_sql(notify))
            self._committed()

    @contextmanager
    def _transaction(self, lock: bool = True) -> Iterator[None]:
        """BEGIN (and the run's lock unless not `lock`) for a write's body; on an error
        ROLLBACK, a database error raised typed (fanout.coord.database)."""
        self._begin(lock=lock)
        self._done, self._locked = Replay(self.where), lock
        try:
            yield
        except self._errors.OperationalError as e:
            self._rollback()
            raise self._typed(e) from None
        except BaseException:
            self._rollback()
            raise
        finally:
            self._done = None

    def batch(self, statements: Sequence[Statement], notify: str | None = "") -> list[Rows]:
        """BEGIN (its own round trip, without the lock: a connection found lost there is
        replaced, nothing has run), then the run's lock, `statements`, NOTIFY and COMMIT
        as one message (parameters bound here, as literals, so that one simple query can
        hold them all): the server runs them back to back, so the lock is held for the
        server's time alone, never across a round trip to this client, however slowly
        this process is scheduled. An error in any rolls back all."""
        with self._transaction(lock=False):
            lock = f"SELECT pg_advisory_xact_lock({self._lock}::bigint)"
            return self._send(statements, notify, lock)

    def decide(
        self, body: Callable[[Any], tuple[T, Sequence[Statement]]], notify: str | None = ""
    ) -> tuple[T, list[Rows]]:
        """BEGIN and the lock (one round trip), `body`'s reads, then its statements,
        NOTIFY and COMMIT as one message (one round trip). `body` only reads and decides,
        so where its connection was lost and its reads changed (ReadsChanged) the whole
        call runs again, on the new connection."""
        for attempt in range(REPLAYS):
            try:
                with self._transaction():
                    value, statements = body(self)
                    return value, self._send(statements, notify)
            except ReadsChanged:
                if attempt == REPLAYS - 1:
                    raise
        raise AssertionError("unreachable")  # the loop returns or raises

    def _send(
        self, statements: Sequence[Statement], notify: str | None, first: str = ""
    ) -> list[Rows]:
        """`first` (a statement without parameters, its result skipped), `statements`
        (their parameters bound here, as literals: one simple query may then hold them
        all), NOTIFY and COMMIT, as one message; each statement's rows."""
        from psycopg import ClientCursor

        bind = ClientCursor(self.raw)
        parts = [first] if first else []
        parts += [bind.mogrify(_translate(sql), tuple(args)) for sql, args in statements]
        parts.append(self._commit_sql(notify).as_string(self.raw))
        cur = self.raw.cursor()
        cur.execute("; ".join(parts))
        self._committed()
        out = []
        for i in range(len(statements)):  # one result per statement, in order
            if i or first:
                cur.nextset()
            if cur.description is None:
                out.append(Rows([], int(cur.rowcount)))
            else:
                rows = [tuple(r) for r in cur.fetchall()]
                out.append(Rows(rows, len(rows)))
        return out

    def write_row(self, sql: str, params: Sequence[Any] = ()) -> int:
        """One statement on its own (autocommit): its row lock orders it against the
        transactions that change that row; no run lock, no NOTIFY. Retried once on a
        new connection when the old one was lost (hence: only where twice is harmless)."""
        query, args = _translate(sql), tuple(params)
        return int(self._run(lambda: self.raw.execute(query, args)).rowcount)

    def arm(self) -> None:
        """LISTEN (once; it stays on until disarm()) and drop what was heard before now."""
        self._unlisten_pending = False
        if not self._listening:
            self._run(lambda: self.raw.execute(self._sql.SQL("LISTEN {}").format(self._channel)))
            self._listening = True
        try:
            for _ in self.raw.notifies(timeout=0):
                pass
        except self._errors.OperationalError:
            pass  # lost: the next call reconnects (and a later arm() listens again)

    def disarm(self) -> None:
        """UNLISTEN with the next commit (no round trip of its own)."""
        if self._listening:
            self._unlisten_pending = True

    def writable(self, timeout_s: float) -> bool:
        self.raw.execute("BEGIN")
        try:
            self.raw.execute(f"SET LOCAL lock_timeout = {max(1, int(timeout_s * 1000))}")
            self.raw.execute("SELECT pg_advisory_xact_lock(%s::bigint)", (self._lock,))
            return True
        except self._errors.LockNotAvailable:
            return False
        finally:
            self._rollback()

    def _typed(self, e: Exception) -> Exception:
        if isinstance(e, self._errors.DiskFull):
            return CoordinatorFull(
                f"coordinator database {self.where}: disk full ({e}); the transaction rolled "
                "back and nothing changed. Free space on the database server and start the "
                "process again."
            )
        if isinstance(e, (self._errors.LockNotAvailable, self._errors.QueryCanceled)):
            return CoordinatorBusy(
                f"coordinator database {self.where} stayed locked for "
                f"{self._lock_timeout_s:.0f} s: {e}"
            )
        return CoordinatorUnavailable(f"coordinator database {self.where}: {_one_line(e)}")

    def wait_change(
        self, deadline: float | None, max_s: float = 0.05, ignore: tuple[str, ...] = ()
    ) -> bool:
        """Wait for another connection's commit notification (ours, and those whose
        payload is in `ignore`, are skipped); True if one came.

        Armed (arm()): what arrived since arm() counts, and the connection stays
        listening. Else LISTEN, wait, UNLISTEN: listening only while waiting keeps
        notifications from piling up in the driver, but a commit between the caller's
        last read and LISTEN is not seen: the wait then lasts `max_s` (50 ms) instead
        of returning at once, and the caller re-reads.
        """
        end = time.monotonic() + max_s
        if deadline is not None:
            end = min(end, deadline)
        if self._listening and not self._unlisten_pending:
            return self._heard(end, ignore)
        self._run(lambda: self.raw.execute(self._sql.SQL("LISTEN {}").format(self._channel)))
        try:
            return self._heard(end, ignore)
        finally:
            self._listening = self._unlisten_pending = False
            try:
                if not self._lost():
                    self.raw.execute(self._sql.SQL("UNLISTEN {}").format(self._channel))
            except self._errors.OperationalError:
                pass  # lost: the listen went with the connection; the next call reconnects

    def _heard(self, end: float, ignore: tuple[str, ...]) -> bool:
        """Wait until monotonic `end` for a notification of another connection whose
        payload is not in `ignore`."""
        try:
            while (left := end - time.monotonic()) > 0:
                got = list(self.raw.notifies(timeout=left, stop_after=1))
                if not got:
                    return False
                if any(n.pid != self._pid and n.payload not in ignore for n in got):
                    return True
        except self._errors.OperationalError:
            return True  # lost while waiting: the caller re-reads, and that reconnects
        return False

    # ---- creating and finding a run's tables -----------------------------------------

    def has_tables(self) -> bool:
        return "meta" in self.table_names()

    def table_names(self) -> set[str]:
        """The tables of this run's schema (none yet: the run is not created)."""
        rows = self._run(
            lambda: self.raw.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema=%s",
                (self.schema,),
            ).fetchall()
        )
        return {str(r[0]) for r in rows}

    def server_version(self) -> str:
        """The server's version, as `PostgreSQL <version>` (for benchmark tables)."""
        return "PostgreSQL " + str(self.execute("SHOW server_version").fetchone()[0])

    def integrity_check(self) -> str:
        """PostgreSQL keeps its own files consistent (WAL, checksums): nothing to check
        from a client; the run's invariants are fanout.coord.reads.audit's."""
        return "ok"

    def create_namespace(self) -> bool:
        """CREATE SCHEMA if missing (needs the CREATE privilege on the database). True if
        this call created it (so that dropping the run may drop the schema too). Under
        the run's lock: two hosts' IF NOT EXISTS at once can both pass the check, and the
        second then fails on the catalog's unique index (seen in a race test)."""
        with self.raw.transaction():
            self.raw.execute("SELECT pg_advisory_xact_lock(%s::bigint)", (self._lock,))
            existed = self.raw.execute(
                "SELECT 1 FROM information_schema.schemata WHERE schema_name=%s", (self.schema,)
            ).fetchone()
            self.raw.execute(
                self._sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
                    self._sql.Identifier(self.schema)
                )
            )
        return existed is None

    def drop_namespace(self) -> None:
        """DROP SCHEMA, RESTRICT: refused by the server unless the schema is empty, so
        nothing but what fanout created can go with it."""
        self.raw.execute(
            self._sql.SQL("DROP SCHEMA IF EXISTS {} RESTRICT").format(
                self._sql.Identifier(self.schema)
            )
        )


def exists(url: str) -> bool:
    """Does the URL's schema hold a coordinator's tables? (PostgreSQL's DDL is
    transactional, so a producer killed inside create leaves nothing behind.)"""
    db = PostgresDatabase(url)
    try:
        return db.has_tables()
    finally:
        db.close()
