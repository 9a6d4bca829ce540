"""The live stream of `fanout produce --follow`: served conversations captured as a gateway logs them.

    fanout produce --follow /var/log/gateway/ --run-dir runs/live \\
        --verifier-name-or-path VERIFIER_DIR --seq-len 2048 --window-rows 8 \\
        --holdout-fraction 0.02 --follow-idle-s 3600

    from fanout.produce.follow import FollowStream
    s = FollowStream.open(make_prep, cfg, run_dir)  # resumes the committed chunks; waits for rows
    s.attach(coord, preg)          # once registered: commits what was cut before, then each chunk
    s.reach(window=5)              # reads what arrived; total_windows (OPEN while following)
    s.ready_windows                # windows whose rows all exist now (claims stop there)
    idx, epoch = s.window_rows_of(5)

The source (`--follow PATH`) is a JSONL file or a directory of JSONL files that a gateway
appends to or drops new files into (rotation included: files are told apart by inode,
so `log.jsonl` renamed to `log.jsonl.1` is read to its end and the new `log.jsonl` from
its start; a file is PATH itself and its siblings named `PATH.*`, or every file in the
directory). A file's position is forgotten only after it was missing from the source
for FORGET_S (a listing taken during a rename may show the file under neither name),
a file opened as another inode than the one listed is left for the next look, and one
that shrank below its position (copytruncate) is read from its start. Only complete
lines are read: a last line without its newline (the writer
mid-append) is waited for, not parsed. A record is any chat format the data stage
reads (fanout.data.chat) or an OpenAI chat-completions log pair (`{"request":
{"messages": [...]}, "response": {"choices": [{"message": {...}}]}}`, or the two
halves side by side), so a gateway's own log is usable as it is; anything else is one
warning line naming its file and byte offset, skipped and counted (`skipped`).

A fixed fraction of conversations (`--holdout-fraction`, by content hash, so the same
conversation is always on the same side) never enters a window; the most recent
`--holdout-keep` of them are kept in RUN_DIR/follow/heldout.jsonl, the evaluation set
of `fanout eval` / `fanout promote --data`.

Records are grouped into chunks (`--follow-chunk-records` records, or fewer once the
newest waited `--follow-flush-s`). Chunk c is written to RUN_DIR/follow/chunk-<c>-<digest>.jsonl
(atomically), prepared (same template and mask rules as --data), and then committed in
the coordinator (fanout.coord.follow_log): one row holding the chunk's index, record
count and file digest, the source position after it (bytes read per file, by
identity) and the counts, written in one transaction fenced by the producer's token.
That row is the commit point and the only record of the position: the coordinator is
where the run's other durable decisions are made, a JSON file beside the chunks would
be a second copy that a kill can leave disagreeing with it, and a trainer or `fanout
status` on another host can read it there. A producer killed with -9 and restarted
rebuilds the rows from the committed chunks (each file checked against its digest) and
reads the source on from the last committed position, so no record is skipped or
captured twice; a chunk file no commit names (written, never committed: its records
are read and written again) is removed once the producer has registered. A file is
named by its content too, so a start never overwrites a file another start cut as
the same chunk (one being taken over with --takeover may still commit it until the
new registration fences it; a start that finds more chunks committed then than it
resumed stops in one line). The chunks cut before the run's database exists (the
first ones: the run's contract needs rows) are committed as soon as the producer has
registered (`attach`). The held-out set is
rewritten with each chunk; a conversation already in it is not added twice (a
restart reads the records after the last commit again).

Chunk c's rows are numbered after the earlier chunks'; window w holds rows [w·R,
(w+1)·R) in that order, each chunk's rows shuffled by (seed, 0, c) as the on-policy
stream's epoch 0 (fanout.produce.onpolicy). While following, only full windows are
claimed; the stream ends (`total_windows` known) after `--follow-idle-s` without a new
record, its last window possibly shorter. One epoch only, one producer (--replicas
would need every replica to cut the same chunks from one moving source).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from fanout.coord.coordinator import Coordinator
from fanout.coord.follow_log import COUNTS, FollowChunk
from fanout.coord.grants import ProducerReg
from fanout.data.cache import PackedDataset
from fanout.data.chat import ChatFormat, Conversation, detect_format, to_conversation
from fanout.data.prepare import PrepareConfig, prepare
from fanout.errors import BadRow, ConfigError, StaleLease
from fanout.filesystem import FileSystem
from fanout.hashing import hasher, hexdigest, labelled
from fanout.produce.onpolicy import OPEN, ChunkRows
from fanout.store.rundir import RunDir
from fanout.store.streaminfo import window_count, window_span

log = logging.getLogger(__name__)

LAYOUT = "fanout-follow-1"  # the row order above; in the dataset fingerprint
POLL_S = 0.5  # how often `open` looks for the first records
FORGET_S = 60.0  # a file missing from the source this long is gone (see _forget)


class FollowOptions(BaseModel):
    """`fanout produce`'s fields for a live source (fanout.produce.follow)."""

    follow: str | None = Field(
        None,
        description="capture a growing source: a JSONL file or a directory of JSONL files a "
        "gateway appends to (chat records or OpenAI request/response log pairs); the "
        "stream stays open (RUN_DIR/follow holds its chunks and held-out set)",
    )
    follow_idle_s: float | None = Field(
        None, gt=0, description="--follow: end the stream after this long without a new record"
    )
    follow_chunk_records: int = Field(
        64, ge=1, description="--follow: records per chunk (prepared and packed together)"
    )
    follow_flush_s: float = Field(
        5.0, gt=0, description="--follow: cut a smaller chunk once its newest record is this old"
    )
    holdout_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="--follow: fraction of conversations (by content hash) that never enter "
        "a window; the newest --holdout-keep are RUN_DIR/follow/heldout.jsonl",
    )
    holdout_keep: int = Field(256, ge=1, description="--follow: held-out conversations kept")


@dataclass
class _File:
    path: Path
    key: str  # "dev:ino": a file keeps it across a rename (rotation)


def _sources(root: Path) -> list[_File]:
    """The files of the source now, in name order (see the module docstring)."""
    if root.is_dir():
        paths = sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith("."))
    else:
        paths = sorted(p for p in root.parent.glob(f"{root.name}*") if p.is_file())
        paths = [p for p in paths if p == root or p.name.startswith(f"{root.name}.")]
    out = []
    for p in paths:
        try:
            st = p.stat()
        except FileNotFoundError:  # rotated away between the listing and the stat
            continue
        out.append(_File(p, f"{st.st_dev}:{st.st_ino}"))
    return out


def openai_pair(rec: dict[str, Any]) -> dict[str, Any] | None:
    """An OpenAI chat-completions log pair as a chat record ({"messages", "tools"}), or
    None when `rec` is not one."""
    req = rec.get("request", rec)
    resp = rec.get("response", rec)
    msgs, choices = req.get("messages") if isinstance(req, dict) else None, None
    if isinstance(resp, dict):
        choices = resp.get("choices")
    if not isinstance(msgs, list) or not isinstance(choices, list) or not choices:
        return None
    answer = choices[0].get("message") if isinstance(choices[0], dict) else None
    if not isinstance(answer, dict):
        return None
    out: dict[str, Any] = {"messages": [*msgs, answer]}
    if isinstance(req, dict) and req.get("tools"):
        out["tools"] = req["tools"]
    return out


class FollowStream:
    """Reads the source into chunks and says which rows each window holds (module doc)."""

    def __init__(
        self, make_prep: Callable[[str], PrepareConfig], opts: Any, run_dir: RunDir
    ) -> None:
        self.make_prep, self.opts = make_prep, opts
        self.root = Path(opts.follow)
        self.dir, self.heldout_path = run_dir.follow, run_dir.heldout
        self.fs = FileSystem()
        self.rows = ChunkRows()
        self.window_rows, self.seed = int(opts.window_rows), int(opts.seed)
        self.fmt = ChatFormat(**{k: getattr(opts, k) for k in ChatFormat.model_fields})
        self.positions: dict[str, int] = {}  # file key -> bytes read (complete lines)
        self.missing: dict[str, float] = {}  # file key -> when a listing first missed it
        self.pending: list[dict[str, Any]] = []  # records read, not yet in a chunk
        self.pending_since: float | None = None
        self.last_record = time.monotonic()
        self.counts = dict.fromkeys(COUNTS, 0)
        self.pending_where: list[str] = []  # each pending record's "file: byte N"
        self.heldout: list[dict[str, Any]] = []
        self.ended = False
        self.coord: Coordinator | None = None  # set by attach: where chunks are committed
        self.preg: ProducerReg | None = None
        self.uncommitted: list[FollowChunk] = []  # cut before attach
        self.files: list[Path] = []  # each chunk's file, in chunk order

    # ---- opening, resuming ----------------------------------------------------------

    @classmethod
    def open(
        cls, make_prep: Callable[[str], PrepareConfig], opts: Any, run_dir: RunDir
    ) -> FollowStream:
        """Resume the chunks the run's coordinator committed (none before the run exists),
        then wait until the stream has rows (a log line every 30 s). `make_prep(chunk
        file)`: the data stage's config for one chunk (the producer's template and mask
        rules). Chunks cut here wait for `attach` to be committed."""
        s = cls(make_prep, opts, run_dir)
        s.fs.makedirs(s.dir)
        co = Coordinator.open_if_created(run_dir.root, db_path=getattr(opts, "db_path", None))
        if co is None:
            s._resume([])
        else:
            with co:
                s._resume(co.follow_chunks())
        said = 0.0
        while s.rows.num_rows == 0:
            s.poll()
            if s.ended:
                raise ConfigError(
                    f"--follow {s.root}: no usable record within --follow-idle-s "
                    f"{opts.follow_idle_s:g} s ({s.counts})"
                )
            if s.rows.num_rows == 0:
                if time.monotonic() - said >= 30:
                    said = time.monotonic()
                    log.info("waiting for records in %s (%s)", s.root, s.counts)
                time.sleep(POLL_S)
        h = hasher(json.dumps({"layout": LAYOUT, "source": str(s.root.resolve()),
                               "holdout": opts.holdout_fraction}, sort_keys=True).encode())  # fmt: skip
        prep = s.make_prep(str(s.files[0]))
        h.update(json.dumps(prep.output_options(), sort_keys=True, default=str).encode())
        h.update(s.rows.first.tokenizer_fingerprint.encode())
        s.rows.fingerprint = labelled(h)
        return s

    def _chunk(self, c: int, digest: str) -> Path:
        return self.dir / chunk_name(c, digest)

    def _resume(self, committed: list[FollowChunk]) -> None:
        """Rebuild the rows of the committed chunks, each file checked against its digest."""
        for c, rec in enumerate(committed):
            data = self._chunk(c, rec.digest)
            try:
                body = data.read_bytes()
            except OSError as e:
                raise ConfigError(
                    f"{data}: committed follow chunk {c} is unreadable ({e.strerror or e}); "
                    "the run's follow state is damaged: start a new --run-dir"
                ) from None
            if rec.chunk != c or hexdigest(body) != rec.digest:
                raise ConfigError(
                    f"{data}: not the follow chunk {c} the coordinator committed (its digest "
                    "differs); the run's follow state is damaged: start a new --run-dir"
                )
            self.files.append(data)
            self._add(self._prepare(data))
        if committed:
            self.positions = dict(committed[-1].positions)
            self.counts = {k: int(committed[-1].counts.get(k, 0)) for k in self.counts}
            log.info("--follow: resumed %d committed chunks (%s), reading on from there",
                     len(committed), self.counts)  # fmt: skip
        elif (self.dir / "chunk-000000.json").is_file():  # the manifests of an older fanout
            raise ConfigError(
                f"{self.dir}: follow chunks with JSON manifests, written before the follow "
                "position moved into the coordinator; start a new --run-dir"
            )
        held = self.heldout_path
        if held.is_file():
            self.heldout = [json.loads(x) for x in held.read_text().splitlines() if x.strip()]

    def attach(self, coord: Coordinator, preg: ProducerReg) -> None:
        """The producer registered: commit the chunks cut before (in order), and every
        later one as it is cut, in `coord` fenced by `preg` (fanout.coord.follow_log)."""
        resumed = len(self.files) - len(self.uncommitted)
        if (have := len(coord.follow_chunks())) != resumed:
            raise StaleLease(
                f"--follow: the run has {have} committed chunks, this producer resumed "
                f"{resumed}: another producer committed while it started; start it again"
            )
        self.coord, self.preg = coord, preg
        todo, self.uncommitted = self.uncommitted, []
        for chunk in todo:
            self._commit(chunk)
        # Files no commit names: cut by a start that was killed before its commit (their
        # records are read again). Removed only now: before this registration fenced
        # it, a producer being taken over could still commit the file it had just cut.
        for stale in set(self.dir.glob("chunk-*.jsonl")) - set(self.files):
            log.info("--follow: %s was never committed; its records were read again", stale)
            stale.unlink(missing_ok=True)

    def _commit(self, chunk: FollowChunk) -> None:
        if self.coord is None or self.preg is None:
            self.uncommitted.append(chunk)
            return
        self.coord.commit_follow_chunk(self.preg, chunk)

    # ---- reading the source -----------------------------------------------------------

    def poll(self) -> None:
        """Read every complete new line of the source; cut chunks that are due; end the
        stream after --follow-idle-s without a record."""
        now = time.monotonic()
        if self._read() and self.pending_since is None:
            self.pending_since = now
        due = self.pending and (
            len(self.pending) >= self.opts.follow_chunk_records
            or now - (self.pending_since or now) >= self.opts.follow_flush_s
        )
        idle = (
            self.opts.follow_idle_s is not None
            and now - self.last_record >= self.opts.follow_idle_s
        )
        if due or (idle and self.pending):
            self._cut()
        if idle and not self.pending:
            self.ended = True

    def _read(self) -> int:
        """New records from every file of the source; returns how many arrived."""
        got = 0
        files = _sources(self.root)
        for f in files:
            start = self.positions.get(f.key, 0)
            try:
                with open(f.path, "rb") as fh:
                    st = os.fstat(fh.fileno())
                    if f"{st.st_dev}:{st.st_ino}" != f.key:
                        continue  # renamed between the listing and the open: next poll
                    if st.st_size < start:  # truncated in place (copytruncate): anew
                        log.warning("--follow: %s shrank below byte %d; read from its start",
                                    f.path, start)  # fmt: skip
                        start = 0
                    fh.seek(start)
                    data = fh.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1  # complete lines only: a partial last line waits
            for off, line in _lines(data[:end], start):
                got += self._take(line, f.path, off)
            self.positions[f.key] = start + end
        self._forget({f.key for f in files})
        if got:
            self.last_record = time.monotonic()
        return got

    def _forget(self, live: set[str]) -> None:
        """Forget the position of a file gone from the source (its bytes were all read
        before; its inode number may be reused by a new file) once it has been missing
        from every listing for FORGET_S: a directory listing taken while a file is being
        renamed (rotation) may show it under neither name, and forgetting it then would
        read it again from its start."""
        now = time.monotonic()
        for k in live:
            self.missing.pop(k, None)
        for k in set(self.positions) - live:
            if now - self.missing.setdefault(k, now) >= FORGET_S:
                del self.positions[k]
                del self.missing[k]

    def _take(self, line: bytes, path: Path, offset: int) -> int:
        """One line: a chat for a chunk, one for the held-out set, or skipped."""
        if not line.strip():
            return 0
        where = f"{path}: byte {offset}"
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
            chat = openai_pair(rec) or rec
            conv = to_conversation(chat, detect_format([chat], self.fmt), str(path), 0)
        except (ValueError, BadRow, ConfigError) as e:
            self.counts["skipped"] += 1
            # a BadRow names a line of a file; here the place is the byte offset above
            why = f"field {e.field!r}: {e.reason}" if isinstance(e, BadRow) else str(e)
            log.warning("--follow: %s: not a chat record, skipped (%s)", where, why)
            return 0
        doc = _as_record(conv)
        self.counts["records"] += 1
        if self._held_out(doc):
            self.counts["heldout"] += 1
            if doc not in self.heldout:  # read again after a restart (module doc)
                self.heldout = [*self.heldout, doc][-self.opts.holdout_keep :]
        else:
            self.pending.append(doc)
            self.pending_where.append(where)
        return 1

    def _held_out(self, doc: dict[str, Any]) -> bool:
        frac = float(self.opts.holdout_fraction)
        if frac <= 0:
            return False
        h = hasher(json.dumps(doc, sort_keys=True).encode()).intdigest()
        return (h % 1_000_000) < frac * 1_000_000

    # ---- chunks ---------------------------------------------------------------------

    def _cut(self) -> None:
        """Write the pending records as the next chunk, prepare it, commit it (module doc)."""
        c = len(self.rows.parts)
        body = "".join(json.dumps(d) + "\n" for d in self.pending).encode()
        data = self._chunk(c, hexdigest(body))
        self.fs.write_atomic(data, body)  # before the commit: a committed chunk has its file
        if self.heldout:
            held = "".join(json.dumps(d) + "\n" for d in self.heldout)
            self.fs.write_atomic(self.heldout_path, held.encode())
        part = self._prepare(data)
        self._say_splits(part, data)
        chunk = FollowChunk(chunk=c, records=len(self.pending), digest=hexdigest(body),
                            positions=dict(self.positions), counts=dict(self.counts))  # fmt: skip
        self._commit(chunk)  # the commit point (before attach: at attach)
        self.files.append(data)
        self.pending, self.pending_where, self.pending_since = [], [], None
        self._add(part)
        log.info("--follow: chunk %d: %d records, %d rows so far (%s)",
                 c, chunk.records, self.rows.num_rows, self.counts)  # fmt: skip

    def _say_splits(self, part: PackedDataset, chunk: Path) -> None:
        """Count the chunk's records longer than --seq-len (split across rows) and name
        each one's place in its source: a split is not silent (#52)."""
        s = part.summary
        self.counts["split"] += int(s.get("split_over_length", 0))
        for _file, line in s.get("split_sources", []):
            n = int(line) - 1  # the chunk's line n+1 is pending record n
            if 0 <= n < len(self.pending_where):  # the chunk is prepared alone
                log.warning("--follow: %s: longer than --seq-len %d tokens, split across "
                            "rows (--over-length split)", self.pending_where[n],
                            part.seq_len)  # fmt: skip

    def _prepare(self, chunk: Path) -> PackedDataset:
        fmt = ChatFormat().model_dump()  # chunks hold {"messages", "tools"} records
        return prepare(self.make_prep(str(chunk)).model_copy(update=fmt))

    def _add(self, part: PackedDataset) -> None:
        self.rows.add(part if part.num_rows else None)
        self.rows.summary = self.summary()

    # ---- what the producer asks ---------------------------------------------------------

    @property
    def counted(self) -> Any:
        """The rows the run's token counts are over: the first chunk with rows."""
        return self.rows.first

    @property
    def total_windows(self) -> int:
        """ceil(N / R) once the stream ended (--follow-idle-s); OPEN while following."""
        return window_count(self.rows.num_rows, self.window_rows) if self.ended else OPEN

    @property
    def ready_windows(self) -> int:
        """Windows whose rows all exist now: full ones while following, all at the end."""
        return self.total_windows if self.ended else self.rows.num_rows // self.window_rows

    def reach(self, window: int) -> int:
        """Read what arrived (the producer asks before each claim); total_windows."""
        if not self.ended:
            self.poll()
        return self.total_windows

    def window_rows_of(self, window: int) -> tuple[np.ndarray, int]:
        """Global row numbers of window `window` (int64 [<= R]); epoch 0."""
        n = self.rows.num_rows
        start, stop = window_span(window, self.window_rows, n if self.ended else None)
        if stop > n:
            raise IndexError(f"window {window} needs rows that have not arrived yet")
        return self.rows.in_order(np.arange(start, stop, dtype=np.int64), self.seed), 0

    def summary(self) -> dict[str, Any]:
        """stream.json's dataset summary: what the source gave so far."""
        return {"follow": LAYOUT, "source": str(self.root), "chunks": len(self.rows.parts),
                "rows_so_far": self.rows.num_rows, **self.counts}  # fmt: skip


def chunk_name(c: int, digest: str) -> str:
    """Chunk c's file name: named by its content too, so a start that cuts chunk c again
    never overwrites the file another start cut (and maybe committed) as chunk c."""
    return f"chunk-{c:06d}-{digest[:16]}.jsonl"


def _lines(data: bytes, start: int) -> list[tuple[int, bytes]]:
    """(byte offset in the file, line) for each line of `data`, read from `start`."""
    out, pos = [], 0
    while pos < len(data):
        nl = data.index(b"\n", pos)
        out.append((start + pos, data[pos:nl]))
        pos = nl + 1
    return out


def _as_record(conv: Conversation) -> dict[str, Any]:
    rec: dict[str, Any] = {"messages": conv.messages}
    if conv.tools:
        rec["tools"] = conv.tools
    return rec


def check_follow(opts: Any) -> None:
    """What --follow refuses, in one line each, before anything is created."""
    if opts.follow is None:
        return
    root = Path(opts.follow)
    if not root.exists():
        raise ConfigError(f"--follow {root}: no such file or directory")
    if not os.access(root, os.R_OK | (os.X_OK if root.is_dir() else 0)):
        raise ConfigError(f"--follow {root}: not readable")
    if opts.replicas > 1:
        raise ConfigError(
            "--follow with --replicas: the replicas would all have to cut the same chunks "
            "from one moving source; run one producer per source"
        )
    if opts.regenerate:
        raise ConfigError("--follow with --regenerate: follow served traffic, which is "
                          "already the verifier's own answers")  # fmt: skip
    if opts.epochs != 1:
        raise ConfigError(f"--follow with --epochs {opts.epochs}: a live stream has one epoch")
