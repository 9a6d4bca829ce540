"""Typed errors a caller can act on. Every message names what and where.

Each class is raised by one component and documented there; they live together
so that a caller (CLI, trainer, harness) can catch them without importing the
heavier modules that raise them. Three derive from these but live beside their one
raiser, which is what describes them: `fanout.contract.LayersNotCaptured` (a
ContractMismatch), `fanout.data.masks.MaskError` (a FanoutError and ValueError,
caught by the data workers) and `fanout.coord.replay.ReadsChanged` (a
CoordinatorUnavailable: a write lost inside its body whose reads changed before it
could run again). Not FanoutErrors, by design: `fanout.filesystem.AtomicWriteError`
(an OSError, handled as the OS error it wraps; the filesystem seam is stdlib only) and
`fanout.regen.openai.Transient` (a retry signal that never leaves its module).
tests/test_docs_match_code.py checks that every other public error class is a FanoutError.
"""

from __future__ import annotations

from typing import Any


class FanoutError(Exception):
    """Base of every error fanout raises on purpose."""


class ContractMismatch(FanoutError):
    """A consumer's (or restarted producer's) capture contract differs from the run's.

    `fields` maps each differing field to (run's value, caller's value).
    """

    def __init__(self, fields: dict[str, tuple[Any, Any]], where: str = "") -> None:
        self.fields = fields
        parts = [f"{k}: run has {a!r}, you asked for {b!r}" for k, (a, b) in sorted(fields.items())]
        loc = f" ({where})" if where else ""
        super().__init__(f"capture contract mismatch{loc}; differing fields: " + "; ".join(parts))


class PlanMismatch(ContractMismatch):
    """A producer replica's data plan (`--replicas`, `--epochs`, `--max-windows`, ...)
    differs from the one the run's live replicas present (fanout.coord.roles).

    `fields` maps each differing flag to (the run's value, the caller's value).
    """

    def __init__(self, fields: dict[str, tuple[Any, Any]], where: str = "") -> None:
        super().__init__(fields, where)
        parts = [f"{k}: run has {a!r}, you asked for {b!r}" for k, (a, b) in sorted(fields.items())]
        loc = f" ({where})" if where else ""
        self.args = (
            f"data plan mismatch{loc}: every producer replica must run with the same "
            "flags; differing: " + "; ".join(parts),
        )


class StaleLease(FanoutError):
    """A write carried a fencing token that is no longer current (the caller was
    reclaimed as lost, detached, or superseded by a newer registration)."""


class Detached(FanoutError):
    """The consumer was detached by the `detach` lag policy; it must re-register."""


class WindowGone(FanoutError):
    """The window a consumer needs will never be served: its capture failed
    `max_attempts` times (`Coordinator.acquire`; the message names the window and the
    last error). Waiting cannot change that; an evicted window is recaptured instead."""


class AcquireTimeout(FanoutError):
    """A blocking coordinator call (acquire, backpressure wait) ran out of time."""


class AcquireCancelled(FanoutError):
    """A blocking acquire was cancelled by its caller (a consumer shutting down)."""


class StorageError(FanoutError):
    """A filesystem call failed while publishing; the window was aborted, nothing committed."""


class RowsRetired(StorageError):
    """A followed run's window whose rows were removed once every consumer registered then
    had acknowledged them (fanout.produce.follow): it cannot be captured again; its claim
    fails, and a consumer that asks for it (a late joiner, a rewind) gets WindowGone."""


class StorageFull(StorageError):
    """ENOSPC/EDQUOT while publishing; the temp file was removed, nothing committed."""


class CoordinatorFull(StorageFull):
    """SQLITE_FULL (or PostgreSQL's disk_full): the coordinator database's disk or quota
    is full. The transaction rolled back; the database is unchanged and usable once
    space is freed."""


class RankLost(FanoutError):
    """A tensor-parallel rank of `fanout produce --tp N` died or stopped answering
    within --tp-timeout-s (fanout.produce.tp_capture). Every other rank stops with this: rank 0
    after failing its claim in flight, so a restart recaptures that window. Also a
    data-parallel trainer's collective whose peer is gone (fanout.train.distributed):
    that trainer saves, records `stopped` and stops in one line."""


class IllegalTransition(FanoutError):
    """A window state change that fanout.coord.states.TRANSITIONS does not allow: a bug
    in fanout, refused before the database changes (fanout.coord.states.move)."""


class CorruptWindow(FanoutError):
    """A window file failed validation (truncated, bad header, checksum mismatch)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"corrupt window {path}: {reason}")


class CorruptPreparedData(FanoutError):
    """A prepared dataset (`fanout prepare`'s packed-row cache, fanout.data.cache) is
    damaged: a truncated shard, a bad header, no manifest. Not a CorruptWindow, which a
    trainer reports to the coordinator to have that window recaptured."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"corrupt prepared dataset {path}: {reason}")


class BadRow(FanoutError):
    """An input row cannot be used. Names file, line (1-based, or row index) and field."""

    def __init__(self, file: str, line: int, field: str, reason: str) -> None:
        self.file = file
        self.line = line
        self.field = field
        self.reason = reason
        super().__init__(f"{file}:{line}: field {field!r}: {reason}")


class WindowFormatError(FanoutError):
    """A window file in a format this fanout no longer reads (fanout.store.windowfile). Not
    corrupt, so never quarantined or recaptured: the run must be produced again."""

    def __init__(self, path: str, found: str, what: str, reads: str) -> None:
        self.path = path
        self.found = found
        super().__init__(
            f"{path}: window format {found!r} ({what}) is not read by this fanout, which "
            f"reads {reads}. Produce the run again with this version, in a new --run-dir"
        )


class UnsupportedFilesystem(FanoutError):
    """The coordinator database was asked to live on a filesystem SQLite WAL cannot use."""


class SchemaVersionError(FanoutError):
    """The coordinator database has a schema version this code does not know."""


class NotACoordinatorDatabase(SchemaVersionError):
    """The coordinator's location holds something else: a file that is not SQLite
    (SQLITE_NOTADB), a damaged one (SQLITE_CORRUPT), or a database with tables but not
    fanout's. Waiting will not fix it: point --run-dir / --db-path at the right run."""


class ConfigError(FanoutError):
    """A configuration value is invalid; the message names the field and the source."""


class FlagError(ConfigError):
    """A flag the parser refused (unknown, a value of the wrong type, a choice not
    offered, a required one missing); `prog` is the command that refused it."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(f"{message} (see `{prog} --help`)")
        self.prog, self.message = prog, message


class NoCoordinator(ConfigError):
    """No coordinator database at the run's location yet: no file, or an empty one (no
    tables: a producer is creating it, or was killed while it did). A trainer started
    before its producer waits on this, up to --acquire-timeout-s."""


class CheckpointError(ConfigError):
    """A draft checkpoint directory that cannot be used as asked: not committed, missing
    files, an older format (e.g. format 1's off-by-one layer ids), or a shape that does
    not fit the verifier. The message names the file and field."""


class CoordinatorBusy(FanoutError):
    """The coordinator database stayed locked past the bounded retry window
    (another process holds a write transaction far longer than any fanout call does)."""


class CoordinatorUnavailable(FanoutError):
    """The PostgreSQL coordinator cannot be reached (connect failed or the connection
    dropped), or the SQLite file cannot be opened or written (SQLITE_CANTOPEN,
    SQLITE_READONLY, SQLITE_PERM, SQLITE_IOERR: permissions, a read-only filesystem,
    an I/O error). Nothing half-done is left: every write is one transaction."""


class RoleHeld(FanoutError):
    """Another live process holds the role this one asked for: the run's producer, or
    a consumer id `name:dp<rank>`. Raised at registration, before anything changed; the
    message names the holder (host, pid, heartbeat age) and how to take over."""


class RoleTaken(StaleLease):
    """This process was fenced off because another process registered its role (a
    `--takeover`, or a restart that found it lost). It must stop: it changes nothing
    from now on. The message names the new holder where the coordinator knows it."""


class TrainerStopped(FanoutError):
    """A trainer stopped before its end for a reason it did not choose (a window that
    did not come within --acquire-timeout-s, one that failed for good, the coordinator
    gone) after saving a checkpoint at its last completed step and recording itself
    'stopped'; the message names the cause, the checkpoint and how to continue."""


class NoSupervisedTokens(ConfigError):
    """A trainer's steps had no supervised token for too long in a row (the draft's
    anchors fit nowhere in the rows: a block near the rows' length, or data whose
    loss mask leaves no room); the message names the steps and what to change."""


class CaptureCheckFailed(FanoutError):
    """A captured window failed the producer's content check (fanout.produce.capture_check):
    a captured layer holds non-finite values, or a row of it is all zero, or the same
    for every token while the verifier's own greedy ids differ. Such a window is never
    published; it is captured again once, and a second failure in a row stops the
    producer with this error (a verifier loaded wrongly must not feed drafts for hours).
    The message names the window, the layer and the row."""

    def __init__(self, layer: int, row: int, reason: str, window: int | None = None) -> None:
        self.layer = layer
        self.row = row
        self.reason = reason
        self.window = window
        where = "" if window is None else f"window {window}: "
        super().__init__(f"{where}captured layer {layer}, row {row}: {reason}")

    def in_window(self, window: int) -> CaptureCheckFailed:
        """The same failure, its message naming `window`."""
        return CaptureCheckFailed(self.layer, self.row, self.reason, window)


class NonFiniteLoss(FanoutError):
    """A trainer's loss was not finite (NaN or inf) for --max-nonfinite-steps steps in a
    row: each was skipped (no optimizer update), and the draft is not learning; the
    message names the steps and what to check."""
