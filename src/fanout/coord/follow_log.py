"""The commit log of a followed source: which chunks of `fanout produce --follow` are in the stream.

    from fanout.coord.follow_log import FollowChunk
    coord.commit_follow_chunk(preg, FollowChunk(chunk=3, records=64, digest="xxh3:…",
                              positions={"2049:131": 81920}, counts={"records": 70, ...}))
    coord.follow_chunks()          # the committed ones not retired, in order (a resume)
    coord.follow_position()        # the newest one's counts, for `fanout status`

A followed source has no end and no replay: what was read from it is known only from
what the producer kept. The producer (fanout.produce.follow) writes each chunk of
records to RUN_DIR/follow/chunk-<c>-<digest>.jsonl (atomically), then commits it here: one row
of `follow_chunks` (stream id, chunk index, its record count and file digest, the
source position after it — bytes read per file, keyed by file identity `dev:ino` —
and the running counts), written in one transaction fenced by the producer's token.
That row is the commit point: a chunk is in the stream once its row is, and the
position in the newest row is where a restarted producer reads on. A chunk file
without a row (the producer died between the file and the commit) is not in the
stream and is written again from the source; a committed one is never rewritten
(its digest says so on resume).

Chunks are committed in order, each one the next (`chunk` = the newest row's + 1): a
second committer is refused by the fencing token first and by the order second.

Rows stay few on an endless stream (#52): a chunk's commit names the chunks below it
whose files the producer removed (`retired`: every consumer acknowledged their windows,
fanout.produce.follow `retire`) and deletes their rows in the same transaction, never
the newest. Only the newest row's position and counts are read (a resume, `fanout
status`), and a resume needs the rows of the chunks whose files remain; each row
names where its rows start in the stream (`first_row`), so a resume numbers the rows
after the deleted chunks as before.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fanout.coord.core import RunDb
from fanout.coord.database import wall
from fanout.coord.grants import ProducerReg
from fanout.coord.roles import Roles
from fanout.coord.schema import Sql
from fanout.errors import StaleLease

# what `counts` holds (fanout.produce.follow): records read, held out, skipped as not
# chats, and split because longer than --seq-len
COUNTS = ("records", "heldout", "skipped", "split")


class FollowChunk(BaseModel):
    """One committed chunk of a followed source (the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    chunk: int = Field(ge=0, description="RUN_DIR/follow/chunk-<chunk>-<digest>.jsonl")
    records: int = Field(ge=0, description="its lines (records that enter windows)")
    digest: str = Field(description="fanout.hashing digest of the chunk file's bytes")
    positions: dict[str, int] = Field(
        description="bytes read per source file (dev:ino) after it; kept for the newest "
        "chunk only (an older chunk's is {})"
    )
    counts: dict[str, int] = Field(description="records, heldout, skipped, split so far")
    rows: int | None = Field(
        None, ge=0, description="its rows in the stream (None: committed by an older fanout)"
    )
    carried: int = Field(
        0, ge=0, description="its records in short rows, carried into the next chunk's file"
    )
    due: int = Field(
        0, ge=0, description="its first lines that waited --follow-flush-s: their rows stay"
    )
    first_row: int | None = Field(
        None, ge=0, description="the stream's row number of its first row (None: committed "
        "by an older fanout, which deleted no row)"
    )  # fmt: skip
    retired: int = Field(
        0, ge=0, description="chunks below this one whose files were removed when it was "
        "cut: their rows are deleted at its commit"
    )  # fmt: skip
    stream: str = Field("", description="the run's stream id (filled in at commit)")
    committed_wall: float = Field(0.0, description="when it was committed (display only)")


_COLUMNS = "stream, chunk, records, digest, positions, counts, committed_wall"
# `rows`, `carried`, `due`, `first_row` and `retired` ride in the counts column (JSON) under
# these keys: no new column, so no schema migration, and a row an older fanout wrote reads
# as rows=None, carried=0, first_row=None
_ROWS, _CARRIED, _DUE, _FIRST, _RETIRED = "_rows", "_carried", "_due", "_first", "_retired"


def _row(r: tuple[Any, ...]) -> FollowChunk:
    stream, chunk, records, digest, positions, counts, at = r
    counts = json.loads(counts)
    rows, first = counts.pop(_ROWS, None), counts.pop(_FIRST, None)
    carried, due = int(counts.pop(_CARRIED, 0)), int(counts.pop(_DUE, 0))
    retired = int(counts.pop(_RETIRED, 0))
    return FollowChunk(
        stream=str(stream), chunk=int(chunk), records=int(records), digest=str(digest),
        positions=json.loads(positions), counts=counts, committed_wall=float(at),
        rows=None if rows is None else int(rows), carried=carried, due=due,
        first_row=None if first is None else int(first), retired=retired,
    )  # fmt: skip


def _counts_column(chunk: FollowChunk) -> str:
    extra = {_CARRIED: chunk.carried, _DUE: chunk.due, _RETIRED: chunk.retired}
    extra |= {} if chunk.rows is None else {_ROWS: chunk.rows}
    extra |= {} if chunk.first_row is None else {_FIRST: chunk.first_row}
    return json.dumps(chunk.counts | extra, sort_keys=True)


class FollowLog:
    """The Coordinator's part for a followed source's chunks (module docstring)."""

    def __init__(self, run: RunDb, roles: Roles) -> None:
        self.run, self.roles = run, roles

    def _stream(self, cur: Sql) -> str:
        return str(self.run.meta(cur, "stream_id"))

    def commit(self, preg: ProducerReg, chunk: FollowChunk) -> FollowChunk:
        """Commit `produce --follow`'s next chunk (its file already written) and the
        source position after it, in one transaction fenced by the producer's token,
        and only as the next chunk of the stream; the rows of the chunks below
        `chunk.retired` go in it too (module doc). Returns it as stored."""
        with self.run.write() as cur:
            self.roles.check_producer(cur, preg.token, preg.rank)
            stream = self._stream(cur)
            (top,) = cur.execute(
                "SELECT MAX(chunk) FROM follow_chunks WHERE stream=?", (stream,)
            ).fetchone()
            n = 0 if top is None else int(top) + 1  # chunks committed, deleted rows too
            if n != chunk.chunk:
                raise StaleLease(
                    f"follow chunk {chunk.chunk}: the run has {n} committed chunks; another "
                    "producer follows this source"
                )
            stored = chunk.model_copy(update={"stream": stream, "committed_wall": wall()})
            cur.execute(
                f"INSERT INTO follow_chunks({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (stream, stored.chunk, stored.records, stored.digest,
                 json.dumps(stored.positions, sort_keys=True),
                 _counts_column(stored), stored.committed_wall),
            )  # fmt: skip
            # Only the newest chunk's positions are read (a producer resumes there). Each
            # row kept every file ever followed: over a half-hour soak of a rotated log
            # (1,700 files, 5,760 chunks) the rows grew quadratically, to 116 MB.
            cur.execute(
                "UPDATE follow_chunks SET positions='{}' WHERE stream=? AND chunk=?",
                (stream, stored.chunk - 1),
            )
            # A row per chunk grew the table with the stream (~200 B a chunk, forever):
            # a retired chunk's row is read by nothing (module doc); never the newest.
            cur.execute(
                "DELETE FROM follow_chunks WHERE stream=? AND chunk<?",
                (stream, min(stored.retired, stored.chunk)),
            )
        return stored

    def chunks(self) -> list[FollowChunk]:
        """The run's committed chunks whose rows remain, in chunk order (empty: not a
        followed run): a producer resumes here. The newest is the last; rows below the
        first were deleted (module doc)."""
        q = self.run.conn.execute
        stream = self._stream(self.run.conn)
        rows = q(
            f"SELECT {_COLUMNS} FROM follow_chunks WHERE stream=? ORDER BY chunk", (stream,)
        ).fetchall()
        return [_row(r) for r in rows]

    def position(self) -> dict[str, Any] | None:
        """`fanout status`'s view: chunks committed and the newest one's counts (records
        read, held out, skipped), or None when the run follows no source."""
        q = self.run.conn.execute
        stream = self._stream(self.run.conn)
        row = q(
            f"SELECT {_COLUMNS} FROM follow_chunks WHERE stream=? ORDER BY chunk DESC LIMIT 1",
            (stream,),
        ).fetchone()
        if row is None:
            return None
        last = _row(row)
        counts = {k: int(last.counts.get(k, 0)) for k in COUNTS}
        return {"chunks": last.chunk + 1, **counts, "committed_wall": last.committed_wall}
