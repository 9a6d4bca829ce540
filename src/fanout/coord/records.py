"""What processes record for `fanout status` beyond the role tables, in `meta` keys.

    from fanout.coord import records
    with db.write() as cur:
        records.record_producer_exit(cur, rank=1, stream_end=None)      # a signal
        records.record_consumer_start(cur, "b8:dp0", cursor=12, about={"family": "dflash"})
    records.producer_exits(db)       # {1: None}: rank 1 last exited by a signal
    records.consumer_starts(db)      # {"b8:dp0": {"since_wall": ..., "since_cursor": 12, ...}}

Two records, each one key per process, written and read only here (no schema change:
a run written before them reads as "not recorded", and status falls back to what the
tables say):

- `producer_exit.r<rank>`: how replica `rank`'s last clean exit ended — the stream end
  it knew (it ended the stream by design: `finished`) or `signal` (SIGINT/SIGTERM: the
  stream stays open, `stopped`). Written just before the replica's row turns
  `finished`, so a `finished` row always has its own exit's record.
- `consumer.<id>`: when its current incarnation registered and at which cursor (its
  rate is the cursor's movement since then, like a replica's), plus what the trainer
  said about itself at registration (`about`: draft family, data-parallel world, rows
  per step, its window budget, its train log's path).
"""

from __future__ import annotations

import json
from typing import Any

from fanout.coord.database import wall
from fanout.coord.schema import Sql

PRODUCER_EXIT = "producer_exit.r"  # + rank
CONSUMER_START = "consumer."  # + consumer id
SIGNAL = "signal"


def _put(cur: Sql, key: str, value: str) -> None:
    cur.execute("DELETE FROM meta WHERE key=?", (key,))
    cur.execute("INSERT INTO meta(key, value) VALUES (?, ?)", (key, value))


def _with_prefix(cur: Sql, prefix: str) -> list[tuple[str, str]]:
    # LIKE's `_` matches any character; startswith below keeps only this prefix
    rows = cur.execute("SELECT key, value FROM meta WHERE key LIKE ?", (prefix + "%",)).fetchall()
    return [(str(k)[len(prefix) :], str(v)) for k, v in rows if str(k).startswith(prefix)]


def record_producer_exit(cur: Sql, rank: int, stream_end: int | None) -> None:
    """Replica `rank` exits cleanly: by design at `stream_end` windows, or (None) by a
    signal."""
    _put(cur, f"{PRODUCER_EXIT}{rank}", SIGNAL if stream_end is None else str(stream_end))


def producer_exits(cur: Sql) -> dict[int, int | None]:
    """{rank: the stream end its last clean exit knew, None for a signal} of every
    replica whose exit was recorded."""
    out: dict[int, int | None] = {}
    for rank, value in _with_prefix(cur, PRODUCER_EXIT):
        if rank.isdigit():
            out[int(rank)] = None if value == SIGNAL else int(value)
    return out


def record_consumer_start(
    cur: Sql, consumer_id: str, cursor: int, about: dict[str, Any] | None = None
) -> None:
    """Consumer `consumer_id` registers at `cursor` now; `about` is what it says of
    itself (JSON-serialisable; a rejoin without it keeps the last one's)."""
    key = f"{CONSUMER_START}{consumer_id}"
    if about is None:
        row = cur.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        old = json.loads(row[0]) if row is not None else {}
        about = {k: v for k, v in old.items() if k not in ("since_wall", "since_cursor")}
    _put(cur, key, json.dumps({**about, "since_wall": wall(), "since_cursor": int(cursor)}))


def consumer_starts(cur: Sql) -> dict[str, dict[str, Any]]:
    """{consumer id: {"since_wall", "since_cursor", and its `about` keys}} of every
    consumer that registered since these records exist."""
    out: dict[str, dict[str, Any]] = {}
    for cid, value in _with_prefix(cur, CONSUMER_START):
        try:
            rec = json.loads(value)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out[cid] = rec
    return out
