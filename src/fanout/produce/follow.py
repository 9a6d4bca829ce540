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
oldest waited a quarter of `--follow-flush-s`). Chunk c is written to RUN_DIR/follow/chunk-<c>-<digest>.jsonl
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

Rows across chunks (#52; docs/operations.md "Co-training with RL"): a chunk keeps its
rows of at least FULL_FILL real tokens and carries the records of the others to the head
of the next chunk's file. Its commit names the rows it keeps, the records it carried and
its first lines that were due (`FollowChunk.rows`, `carried`, `due`; packing is
deterministic, so a resume finds the same rows and the newest chunk's carried records).
A record that waited FLUSH_SHARE of `--follow-flush-s` by a cut is due (files hold
records oldest first), and a row holding one is kept however short; a split record's
rows and the stream end's rows are always kept.

Disk stays flat: a chunk whose windows every consumer acknowledged
(Coordinator.acked_by_all) by `--follow-keep-windows` loses its file and its prepared
rows (`retire`; never the newest chunk; $FANOUT_FOLLOW_ARCHIVE: files move there), and
the next chunk's commit deletes its coordinator row (`FollowChunk.retired`), so the
database stays flat too. A resume keeps its row count (each row names where its rows
start: `first_row`); a window of it asked for again raises RowsRetired (its
claim fails, the trainer is told it is gone). Nothing retires before
--expected-consumers registered.

Chunk c's rows are numbered after the earlier chunks'; window w holds rows [w·R,
(w+1)·R) in that order, each chunk's rows shuffled by (seed, 0, c) as the on-policy
stream's epoch 0 (fanout.produce.onpolicy). While following, only full windows are
claimed; the stream ends (`total_windows` known) after `--follow-idle-s` without a new
record, its last window possibly shorter; the lines read since the last chunk are cut
into one more then, even when every one was held out or skipped (a chunk with no rows):
held-out records, counts and the source position are only saved with a chunk. One
epoch only, one producer (--replicas would need every replica to cut the same chunks
from one moving source).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fanout.coord.coordinator import Coordinator
from fanout.coord.follow_log import COUNTS, FollowChunk
from fanout.coord.grants import ProducerReg
from fanout.data.cache import PackedDataset
from fanout.data.chat import ChatFormat, detect_format, to_conversation
from fanout.data.prepare import PrepareConfig, prepare
from fanout.errors import BadRow, ConfigError, RowsRetired, StaleLease
from fanout.filesystem import FileSystem
from fanout.hashing import hasher, hexdigest, labelled
from fanout.produce.follow_options import FollowOptions as FollowOptions  # re-exported
from fanout.produce.follow_options import check_follow as check_follow
from fanout.produce.gateway_log import File as _File  # noqa: F401 (tests list files)
from fanout.produce.gateway_log import as_record as _as_record
from fanout.produce.gateway_log import lines as _lines
from fanout.produce.gateway_log import openai_pair as openai_pair  # re-exported
from fanout.produce.gateway_log import sources as _sources
from fanout.produce.onpolicy import OPEN, ChunkRows
from fanout.store.rundir import RunDir
from fanout.store.streaminfo import window_count, window_span

log = logging.getLogger(__name__)

LAYOUT = "fanout-follow-1"  # the row order above; in the dataset fingerprint
POLL_S = 0.5  # how often `open` looks for the first records
FORGET_S = 60.0  # a file missing from the source this long is gone (see _forget)
# Packing across chunks (module doc, "Rows across chunks"): a row at least FULL_FILL
# real tokens is the chunk's; a shorter one's records are carried into the next chunk,
# unless one of them waited FLUSH_SHARE of --follow-flush-s (then its row is kept: a cut
# after that may be the last before the bound). New records are cut into a
# chunk once the oldest waited CUT_SHARE of it, so full rows go out well inside it.
FULL_FILL = 0.95
CUT_SHARE, FLUSH_SHARE = 0.25, 0.75
RETIRE_EVERY_S = 2.0  # how often `reach` asks the coordinator what every consumer acked
ARCHIVE = "FANOUT_FOLLOW_ARCHIVE"  # a directory retired chunk files move to (module doc)


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
        self.uncut = 0  # lines read since the last cut (held out and skipped ones too)
        self.clock: Callable[[], float] = time.monotonic  # a seam: benchmarks set their own
        self.last_record = self.clock()
        self.counts = dict.fromkeys(COUNTS, 0)
        self.pending_where: list[str] = []  # each pending record's "file: byte N"
        self.carry: list[dict[str, Any]] = []  # in the last chunk's short rows (module doc)
        self.carry_where: list[str] = []
        # when each pending / carried record arrived (self.clock), oldest first
        self.pending_at: list[float] = []
        self.carry_at: list[float] = []
        self.retired = 0  # chunks [0, retired) are removed: every consumer acked them
        self.retire_at = 0.0  # monotonic time of the next look (RETIRE_EVERY_S)
        self.row_tokens = 0  # real tokens in the rows of the chunks whose rows it knows
        self.rows_known = 0
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
            s._resume([], 0)
        else:
            with co:
                keep = int(getattr(opts, "follow_keep_windows", 0))
                s._resume(co.follow_chunks(), max(0, co.acked_by_all() - keep))
        said = 0.0
        # rows, and one prepared chunk to read the tokenizer's fingerprint from
        while s.rows.num_rows == 0 or all(p is None for p in s.rows.parts):
            s.poll()
            # ended with rows (preparing a chunk outlasted --follow-idle-s, and the idle
            # end flushed the carried records into rows): a short stream, not an empty one
            if s.ended and (s.rows.num_rows == 0 or all(p is None for p in s.rows.parts)):
                raise ConfigError(
                    f"--follow {s.root}: no usable record within --follow-idle-s "
                    f"{opts.follow_idle_s:g} s ({s.counts})"
                )
            if s.rows.num_rows == 0 or all(p is None for p in s.rows.parts):
                if time.monotonic() - said >= 30:
                    said = time.monotonic()
                    log.info("waiting for records in %s (%s)", s.root, s.counts)
                time.sleep(POLL_S)
        h = hasher(json.dumps({"layout": LAYOUT, "source": str(s.root.resolve()),
                               "holdout": opts.holdout_fraction}, sort_keys=True).encode())  # fmt: skip
        prep = s.make_prep(str(s.files[-1]))
        h.update(json.dumps(prep.output_options(), sort_keys=True, default=str).encode())
        h.update(s.rows.first.tokenizer_fingerprint.encode())
        s.rows.fingerprint = labelled(h)
        return s

    def _chunk(self, c: int, digest: str) -> Path:
        return self.dir / chunk_name(c, digest)

    def _resume(self, committed: list[FollowChunk], acked: int) -> None:
        """Rebuild the rows of the committed chunks, each file checked against its digest;
        a chunk whose file was removed because every consumer acknowledged the windows
        below `acked` (`retire`) keeps only its row count, and the chunks whose rows the
        coordinator deleted (below the first committed: fanout.coord.follow_log) the
        count of rows before it, on the last of them (each chunk keeps its index)."""
        base = committed[0].chunk if committed else 0
        if base and committed[0].first_row is None:
            raise ConfigError(
                f"{self.dir}: the coordinator holds follow chunks from {base} on without "
                "where their rows start; the run's follow state is damaged: start a new "
                "--run-dir"
            )
        for c in range(base):  # retired: their rows are read no more, only numbered
            self.files.append(self._chunk(c, "retired"))
            self.rows.add(None, rows=committed[0].first_row if c == base - 1 else 0)
        self.retired = base
        for c, rec in enumerate(committed, start=base):
            data = self._chunk(c, rec.digest)
            if rec.first_row not in (None, self.rows.num_rows):
                raise ConfigError(
                    f"{data}: follow chunk {c}'s rows start at {self.rows.num_rows} after the "
                    f"chunks before it, the coordinator committed {rec.first_row}; the run's "
                    "follow state is damaged: start a new --run-dir"
                )
            ends = self.rows.num_rows + (rec.rows or 0)
            gone = not data.exists() and rec is not committed[-1] and rec.rows is not None
            if gone and ends <= acked * self.window_rows and self.retired == c:
                self.files.append(data)
                self.rows.add(None, rows=rec.rows)
                self.retired = c + 1
                continue
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
            part = self._prepare(data)
            keep, carried = _short_rows(part, rec.due if rec.carried else None)
            kept = part.num_rows if keep is None else int(keep.size)
            if len(carried) != rec.carried or rec.rows not in (None, kept):
                raise ConfigError(
                    f"{data}: follow chunk {c} packs into {kept} rows carrying {len(carried)} "
                    f"records, the coordinator committed {rec.rows} and {rec.carried}; the "
                    "run's follow state is damaged: start a new --run-dir"
                )
            self._add(part, keep)
            if rec is committed[-1]:  # its short rows' records wait for the next chunk
                lines = body.decode().splitlines()
                self.carry = [json.loads(lines[n - 1]) for n in carried]
                self.carry_where = [f"{data}: line {n}" for n in carried]
                self.carry_at = [self.clock()] * len(carried)  # arrived: unknown, say now
        if committed:
            self.positions = dict(committed[-1].positions)
            self.counts = {k: int(committed[-1].counts.get(k, 0)) for k in self.counts}
            log.info("--follow: resumed %d committed chunks (%d retired; %s), reading on "
                     "from there", len(self.files), self.retired, self.counts)  # fmt: skip
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
        # the newest chunk's index, not a count of rows: retired chunks' rows are deleted
        if (have := int((coord.follow_position() or {}).get("chunks", 0))) != resumed:
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
        """Read every complete new line of the source; cut chunks that are due (module
        doc, "Rows across chunks"); end the stream after --follow-idle-s without a record."""
        now = self.clock()
        got = self._read()
        self.uncut += got
        self.pending_at += [now] * got
        if got and self.pending_since is None:
            self.pending_since = now
        bound = float(self.opts.follow_flush_s)
        waited = now - min([*self.carry_at[:1], *self.pending_at[:1], now])
        due = bool(self.pending) and (
            len(self.pending) >= self.opts.follow_chunk_records
            or now - (self.pending_since or now) >= CUT_SHARE * bound
        )
        idle = (
            self.opts.follow_idle_s is not None
            and now - self.last_record >= self.opts.follow_idle_s
        )
        if due or ((self.carry or self.pending) and (idle or waited >= bound)):
            self._cut(end=idle)
        if idle and not self.pending and not self.carry:
            if self.uncut:  # read since the last cut, all held out or skipped: a last
                self._cut(end=True)  # chunk, no rows, commits them (heldout.jsonl, counts,
                # positions), or `fanout status` and /metrics never count them
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
            self.last_record = self.clock()
        return got

    def _forget(self, live: set[str]) -> None:
        """Forget the position of a file gone from the source (its bytes were all read
        before; its inode number may be reused by a new file) once it has been missing
        from every listing for FORGET_S: a directory listing taken while a file is being
        renamed (rotation) may show it under neither name, and forgetting it then would
        read it again from its start."""
        now = self.clock()
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
            self.uncut += 1  # its count is committed with a chunk (`poll`'s idle end)
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

    def _cut(self, end: bool = False) -> None:
        """Write the carried and pending records as the next chunk, prepare it, commit it
        with the records of its short rows carried on, but for rows that hold a record
        due (it waited FLUSH_SHARE of --follow-flush-s) and every row at the stream's
        `end` (module doc)."""
        c = len(self.rows.parts)
        docs, where = self.carry + self.pending, self.carry_where + self.pending_where
        at = self.carry_at + self.pending_at  # oldest first: the file's order
        late = self.clock() - FLUSH_SHARE * float(self.opts.follow_flush_s)
        due = len(docs) if end else sum(t <= late for t in at)
        body = "".join(json.dumps(d) + "\n" for d in docs).encode()
        data = self._chunk(c, hexdigest(body))
        self.fs.write_atomic(data, body)  # before the commit: a committed chunk has its file
        if self.heldout:
            held = "".join(json.dumps(d) + "\n" for d in self.heldout)
            self.fs.write_atomic(self.heldout_path, held.encode())
        part = self._prepare(data)
        self._say_splits(part, where)
        keep, carried = _short_rows(part, due)
        rows = part.num_rows if keep is None else int(keep.size)
        chunk = FollowChunk(chunk=c, records=len(docs), digest=hexdigest(body),
                            positions=dict(self.positions), counts=dict(self.counts),
                            rows=rows, carried=len(carried), due=due,
                            first_row=self.rows.num_rows, retired=self.retired)  # fmt: skip
        self._commit(chunk)  # the commit point (before attach: at attach)
        self.files.append(data)
        self.carry = [docs[n - 1] for n in carried]
        self.carry_where = [where[n - 1] for n in carried]
        self.carry_at = [at[n - 1] for n in carried]
        self.pending, self.pending_where, self.pending_since = [], [], None
        self.pending_at = []
        self.uncut = 0
        self._add(part, keep)
        log.info("--follow: chunk %d: %d records (%d carried on), %d rows so far (%s)",
                 c, chunk.records, len(carried), self.rows.num_rows, self.counts)  # fmt: skip
        self.retire()

    def _say_splits(self, part: PackedDataset, where: list[str]) -> None:
        """Count the chunk's records longer than --seq-len (split across rows) and name
        each one's place in its source (`where`: each line's): a split is not silent
        (#52). A split record is never carried (`_short_rows`), so never counted twice."""
        s = part.summary
        self.counts["split"] += int(s.get("split_over_length", 0))
        for _file, line in s.get("split_sources", []):
            n = int(line) - 1  # the chunk's line n+1 is record n
            if 0 <= n < len(where):  # the chunk is prepared alone
                log.warning("--follow: %s: longer than --seq-len %d tokens, split across "
                            "rows (--over-length split)", where[n], part.seq_len)  # fmt: skip

    def _prepare(self, chunk: Path) -> PackedDataset:
        fmt = ChatFormat().model_dump()  # chunks hold {"messages", "tools"} records
        return prepare(self.make_prep(str(chunk)).model_copy(update=fmt), track_rows=True)

    def _add(self, part: PackedDataset, keep: np.ndarray | None = None) -> None:
        tokens = part.summary.get("row_tokens", [])
        kept = range(part.num_rows) if keep is None else keep.tolist()
        self.row_tokens += sum(int(tokens[r]) for r in kept if r < len(tokens))
        self.rows_known += len(kept)
        self.rows.add(part if part.num_rows else None, keep)
        self.rows.summary = self.summary()

    # ---- retiring what every consumer acknowledged --------------------------------------

    def retire(self) -> int:
        """Remove the chunk files and their prepared rows (the run's cache entries) whose
        every window every consumer acknowledged (Coordinator.acked_by_all), never the
        newest chunk (its file holds the carried records and the resume point): disk
        stays flat on an endless stream (#52). Returns the chunks retired so far."""
        if self.coord is None:
            return self.retired
        self.retire_at = self.clock() + RETIRE_EVERY_S
        # rows every consumer is past, less the margin a resume from a checkpoint rewinds
        keep = int(getattr(self.opts, "follow_keep_windows", 0))
        below = max(0, self.coord.acked_by_all() - keep) * self.window_rows
        starts = self.rows.starts
        while self.retired < len(self.rows.parts) - 1 and starts[self.retired + 1] <= below:
            c = self.retired
            part = self.rows.parts[c]
            if ARCHIVE in os.environ:  # kept elsewhere (module doc): tests check them
                Path(os.environ[ARCHIVE]).mkdir(parents=True, exist_ok=True)
                shutil.move(self.files[c], Path(os.environ[ARCHIVE]) / self.files[c].name)
            else:
                self.files[c].unlink(missing_ok=True)
            if part is not None and part.dir.parent.name == "prepared":  # a cache entry
                shutil.rmtree(part.dir, ignore_errors=True)
            self.rows.retire(c)
            self.retired = c + 1
            log.debug("--follow: chunk %d retired (every consumer acknowledged its rows)", c)
        return self.retired

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
        if self.clock() >= self.retire_at:
            self.retire()
        return self.total_windows

    def window_rows_of(self, window: int) -> tuple[np.ndarray, int]:
        """Global row numbers of window `window` (int64 [<= R]); epoch 0."""
        n = self.rows.num_rows
        start, stop = window_span(window, self.window_rows, n if self.ended else None)
        if stop > n:
            raise IndexError(f"window {window} needs rows that have not arrived yet")
        if start < self.rows.starts[self.retired]:  # a late joiner, or a rewind
            raise RowsRetired(
                f"--follow: window {window}'s rows were removed once every consumer then "
                f"registered had acknowledged them (windows below "
                f"{-(-self.rows.starts[self.retired] // self.window_rows)}); start every "
                "trainer of a followed run before they retire (--expected-consumers)"
            )
        return self.rows.in_order(np.arange(start, stop, dtype=np.int64), self.seed), 0

    def summary(self) -> dict[str, Any]:
        """stream.json's dataset summary: what the source gave so far."""
        fill = self.row_tokens / max(1, self.rows_known * int(self.opts.seq_len))
        return {"follow": LAYOUT, "source": str(self.root), "chunks": len(self.rows.parts),
                "rows_so_far": self.rows.num_rows, **self.counts,
                "chunks_retired": self.retired, "carried": len(self.carry),
                "row_fill": round(fill, 4)}  # fmt: skip


def chunk_name(c: int, digest: str) -> str:
    """Chunk c's file name: named by its content too, so a start that cuts chunk c again
    never overwrites the file another start cut (and maybe committed) as chunk c."""
    return f"chunk-{c:06d}-{digest[:16]}.jsonl"


def _short_rows(part: PackedDataset, due: int | None) -> tuple[np.ndarray | None, list[int]]:
    """Which of a chunk's rows it keeps (int64 indices; None: all) and the chunk lines
    (1-based) of the records in the others: rows under FULL_FILL real tokens that hold
    none of the first `due` lines (records that waited long enough; None: every line
    is due). A row holding a piece of a record split across rows (--over-length split)
    is kept: its record is in rows that stay."""
    s = part.summary
    lines: list[list[int]] = s.get("row_lines", [])
    tokens: list[int] = s.get("row_tokens", [])
    if due is None or not lines:
        return None, []
    rows_of: dict[int, int] = {}
    for row in lines:
        for n in set(row):
            rows_of[n] = rows_of.get(n, 0) + 1
    short = {
        r for r, (row, t) in enumerate(zip(lines, tokens, strict=True))
        if t < FULL_FILL * part.seq_len and all(rows_of[n] == 1 and n > due for n in row)
    }  # fmt: skip
    if not short:
        return None, []
    keep = np.array([r for r in range(len(lines)) if r not in short], dtype=np.int64)
    return keep, sorted(n for r in short for n in lines[r])
