"""`fanout status`'s snapshot: the run at one instant, the one thing every view shows.

    from fanout.status.snapshot import snapshot
    from fanout.status.table import format_table
    print(format_table(snapshot(co)))     # what `fanout status` prints; --json: snapshot(co)

`build` makes the one versioned snapshot (fanout.status.schema) every view shows
(the table, `--watch`, `--serve`), read in one read-only transaction so its numbers
are of one instant. It only reads the database, through the coordinator's read API
(fanout.coord.reads and the Coordinator's methods; no write transaction, no torch
import). A process the database still calls active is shown `lost` when it has
exited without saying so (it ran on this host and its pid is gone) or its heartbeat
is older than ttl_s by the wall clock; the coordinator itself declares it lost by its
heartbeat counter (fanout.coord.liveness), and `--json` keeps that as
`recorded_state`. What processes record for it beyond the role tables (how a replica
exited, what a consumer is) is fanout.coord.records'.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fanout.coord import reads
from fanout.coord.coordinator import Coordinator
from fanout.coord.states import RoleState, W
from fanout.decode.config import PROMOTE, served_version
from fanout.errors import FanoutError
from fanout.status.schema import STATUS_SCHEMA_VERSION, StatusSnapshot
from fanout.store.rundir import RunDir
from fanout.store.streaminfo import StreamInfo


def shown_state(state: str, age_s: float, ttl_s: float, proc: str | None, pid: int | None) -> str:
    """What status shows for a process the database records in `state`: an 'active' one
    that is gone from this host, or whose heartbeat is older than ttl, is `lost` (for
    people: the reclaimer decides by the heartbeat counter, not by wall clocks)."""
    if state == RoleState.ACTIVE and (reads.process_gone(proc, pid) or age_s > ttl_s):
        return RoleState.LOST.value
    return state


def age_s(now: float, then: float, digits: int = 3) -> float:
    """How long ago `then` was, as status shows every age: rounded to `digits` and never
    below 0 (a heartbeat written after `now` was read, or by a host whose clock runs
    ahead, would print as `-0.0s ago`)."""
    return max(0.0, round(now - then, digits))


def _replica(
    p: dict[str, Any], now: float, ttl: float, exits: dict[int, int | None], ended: bool
) -> dict[str, Any]:
    """One producer replica as `status --json` lists it: who, its state, windows made
    (by that rank, every incarnation) and its rate (this incarnation's windows over its
    time registered, up to now or its exit). A clean exit shows `finished` when it
    ended the stream by design and `stopped` when a signal ended it (the stream is
    open): fanout.coord.records, else (a run from before that record) whether the
    stream's end is recorded."""
    shown = shown_state(p["state"], now - p["hb_wall"], ttl, p["proc"], p["pid"])
    if shown == RoleState.FINISHED:
        by_signal = exits[p["rank"]] is None if p["rank"] in exits else not ended
        shown = RoleState.STOPPED.value if by_signal else shown
    until = now if shown == RoleState.ACTIVE else p["hb_wall"]
    secs = until - p["since_wall"]
    return {
        "rank": p["rank"],
        "state": shown,
        "recorded_state": p["state"],
        "owner": p["owner"],
        "host": p["host"],
        "pid": p["pid"],
        "heartbeats": p["heartbeats"],
        "heartbeat_age_s": age_s(now, p["hb_wall"]),
        "windows": p["made"],
        "windows_per_s": round(p["made_since"] / secs, 4) if secs > 0 else None,
        "waiting": None,
    }


def _replica_waiting(r: dict[str, Any], blocked: dict[str, Any] | None, k: int) -> str | None:
    """Why replica `r` is not making windows now, in words (None while it captures)."""
    if r["state"] == RoleState.ACTIVE:
        if blocked is None:
            return None
        return f"blocked at K={k} live windows {blocked['text'] or '(by nobody)'}"
    again = f"restart it with the same flags (replica rank {r['rank']}) to continue"
    if r["state"] == RoleState.STOPPED:
        return f"stopped by a signal {r['heartbeat_age_s']:.0f} s ago; the stream is open: {again}"
    if r["state"] == RoleState.LOST:
        return f"lost (no heartbeat, no clean exit); {again}"
    return None


# The producer side's state: the first of these any replica is in.
PRODUCER_ORDER = (RoleState.ACTIVE, RoleState.LOST, RoleState.STOPPED, RoleState.FINISHED)
# a readable window nobody has read past for this long: `fanout status` says the run is
# stalled (nothing trained), not healthy (#52); --stalled-after-s changes it
STALLED_AFTER_S = 600.0


def _producer(replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """The producer side as one line: active if any replica is, else lost, else stopped,
    else finished; the details of the first replica in that state."""
    for state in PRODUCER_ORDER:
        mine = [r for r in replicas if r["state"] == state]
        if mine:
            return {**mine[0], "replicas": len(replicas)}
    return {"state": "none"}


def _last_record(path: str | None) -> dict[str, Any]:
    """The last JSON line of a trainer's train log (fanout.train.trainlog), {} when this
    host cannot read it (another host's disk) or it has none yet."""
    if not path:
        return {}
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            tail = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return {}
    for line in reversed(tail):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            return rec
    return {}


def _consumer(
    row: dict[str, Any], co: Coordinator, now: float, starts: dict[str, dict[str, Any]],
    length: int | None, frontier: int, versions: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """One consumer as `status --json` lists it: what the database (`row`:
    fanout.coord.reads.consumer_rows) and its registration record
    (fanout.coord.records) say, its rate and ETA, and what its trainer logged."""
    cid, state, cursor, hb_wall = row["id"], row["state"], row["cursor"], row["hb_wall"]
    host, pid, proc = row["host"], row["pid"], row["proc"]
    shown = shown_state(state, now - hb_wall, co.config.ttl_s, proc, pid)
    about = starts.get(cid, {})
    rate = None
    if "since_wall" in about:
        secs = (now if shown == RoleState.ACTIVE else hb_wall) - float(about["since_wall"])
        moved = cursor - int(about.get("since_cursor", cursor))
        rate = round(max(0, moved) / secs, 4) if secs > 0 else None
    ends = [e for e in (about.get("max_windows"), length) if e is not None]
    end = min(ends) if ends else None
    eta = None
    if shown == RoleState.FINISHED:
        eta = 0.0
    elif shown == RoleState.ACTIVE and end is not None and rate:
        eta = round(max(0, end - cursor) / rate, 1)
    waiting = None
    at_work = shown == RoleState.ACTIVE and (end is None or cursor < end)
    if at_work and reads.window_state(co.conn, cursor) != W.READY:
        waiting = reads.consumer_wait(co.conn, co.config, cid, cursor).text
    logged = _last_record(about.get("metrics_log"))
    name, _, rank = str(cid).rpartition(":dp")
    captured = list(co.contract.target_layer_ids)
    return {
        "id": cid,
        "name": name,
        "dp_rank": int(rank) if rank.isdigit() else 0,
        "dp_world": about.get("dp_world"),
        "family": about.get("family"),
        # the layers it trains on (registered; older registrations read them all)
        "target_layer_ids": json.loads(row["expect"] or "{}").get("target_layer_ids", captured),
        "state": shown,
        "recorded_state": state,
        "host": host,
        "pid": pid,
        "cursor": cursor,
        "lag_windows": max(0, frontier - cursor),
        "heartbeats": row["heartbeats"],
        "heartbeat_age_s": age_s(now, hb_wall),
        "note": row["note"],
        "step": logged.get("step"),
        "eal": logged.get("eal"),
        "windows_per_s": rate,
        "rows_per_s": None if rate is None else round(rate * co.contract.window_rows, 3),
        "end_window": end,
        "eta_s": eta,
        "waiting": waiting,
        **_consumer_version(co, cid, cursor, versions),
    }


def _consumer_version(
    co: Coordinator, cid: str, cursor: int, versions: dict[str, Any]
) -> dict[str, Any]:
    """A consumer's verifier version (of the window at its cursor, else the one before
    it), its lag behind the newest, and the windows it skipped as too old."""
    mine = reads.window_verifier_version(co.conn, cursor)
    if mine is None and cursor > 0:
        mine = reads.window_verifier_version(co.conn, cursor - 1)
    newest = versions["newest"]
    lag = None if mine is None or newest is None else max(0, newest - mine)
    return {
        "verifier_version": mine,
        "verifier_lag": lag,
        "lag_skipped": versions["skipped"].get(cid, 0),
    }


def _stream(co: Coordinator, end: int | None) -> dict[str, Any]:
    """The stream: its length once known (the recorded end, else the run's
    total_windows, else stream.json's), its rows and epochs (stream.json)."""
    try:
        info = StreamInfo.read(RunDir(co.root))
    except FanoutError:  # unreadable: status still shows the rest
        info = None
    length = end if end is not None else co.config.total_windows
    if length is None and info is not None:
        length = info.total_windows
    return {
        "stream_id": str(co.meta("stream_id")),
        "length_windows": length,
        "ended": end is not None,
        "rows": None if info is None else info.num_rows,
        "epochs": None if info is None else info.epochs,
        "window_rows": co.contract.window_rows,
    }


def build(co: Coordinator, stalled_after_s: float = STALLED_AFTER_S) -> StatusSnapshot:
    """The run now, as the versioned StatusSnapshot (fanout.status.schema), read
    at one instant (fanout.coord.reads.one_instant). Heartbeat ages and rates use the wall clock and are
    for people only; liveness decisions never use them."""
    with reads.one_instant(co.conn):
        return _build(co, stalled_after_s)


def _build(co: Coordinator, stalled_after_s: float) -> StatusSnapshot:
    now = reads.wall()
    ttl = co.config.ttl_s
    windows = reads.windows_by_state(co.conn)
    windows["evicted"] = int(co.meta("evictions"))  # old evicted rows are compacted away
    ready_bytes = co.ready_windows()[1]  # of the readable windows
    frontier = int(co.meta("next_window"))
    end = reads.stream_end(co.conn)
    stream = _stream(co, end)
    starts = reads.consumer_starts(co.conn)
    versions: dict[str, Any] = {  # produce --follow-verifier's (none recorded: nothing to show)
        "newest": reads.newest_verifier_version(co.conn),
        "live": reads.verifier_versions(co.conn),
        "skipped": reads.lag_skipped(co.conn),
    }
    consumers = [
        _consumer(row, co, now, starts, stream["length_windows"], frontier, versions)
        for row in reads.consumer_rows(co.conn)
    ]
    leases = [
        {"consumer": x["consumer"], "window": x["window"], "generation": x["generation"],
         "token": x["token"], "age_s": age_s(now, x["acquired_wall"])}
        for x in reads.lease_rows(co.conn)
    ]  # fmt: skip
    exits = reads.producer_exits(co.conn)
    replicas = [_replica(p, now, ttl, exits, end is not None) for p in co.producer_replicas()]
    any_active = any(r["state"] == RoleState.ACTIVE for r in replicas)
    blocked = _blocked(co, RoleState.ACTIVE.value if any_active else "none")
    k = co.config.max_live_windows
    for r in replicas:
        r["waiting"] = _replica_waiting(r, blocked, k)
    producer = _producer(replicas)
    active = [r for r in replicas if r["state"] == RoleState.ACTIVE]
    totals = {
        "windows_made": frontier,
        "windows_live": reads.live_windows(co.conn),
        "windows_ready": windows[W.READY],
        "max_live_windows": k,
        "producer_windows_per_s": round(sum(r["windows_per_s"] or 0.0 for r in active), 4),
        "replicas": len(replicas),
        "replicas_active": len(active),
        "consumers": len(consumers),
        "consumers_active": sum(c["state"] == RoleState.ACTIVE for c in consumers),
    }
    return StatusSnapshot.model_validate(
        {
            "schema_version": STATUS_SCHEMA_VERSION,
            "taken_wall": now,
            "run_dir": str(co.root),
            "db_path": str(co.db_path),
            "stream_id": str(co.meta("stream_id")),
            "totals": totals,
            "stream": stream,
            "stream_end": end,
            "blocked": blocked,
            "config": co.config.model_dump(mode="json"),
            "capture": {
                "target_layer_ids": list(co.contract.target_layer_ids),
                "storage_dtype": co.contract.storage_dtype,
                "seq_len": co.contract.seq_len,
                "window_rows": co.contract.window_rows,
            },
            "windows": windows,
            "produced_windows": frontier,
            "ready_bytes": int(ready_bytes),
            "high_water": {
                "windows": int(co.meta("hw_windows")),
                "bytes": int(co.meta("hw_bytes")),
            },
            "recaptures": int(co.meta("recaptures")),
            "evictions": int(co.meta("evictions")),
            "corrupt": int(co.meta("corrupt")),
            "detaches": int(co.meta("detaches")),
            "reclaims": int(co.meta("reclaims")),
            "claims_reclaimed": int(co.meta("claims_reclaimed")),
            "capture_failures": int(co.meta("capture_failures")),
            "producer": producer,
            "replicas": replicas,
            "consumers": consumers,
            "leases": leases,
            "drift": _drift(RunDir(co.root).drift),
            "promote": _promote_look(Path(co.root) / "follow" / PROMOTE),
            "stalled": _stalled(co, now, stalled_after_s),
            "follow": co.follow_position(),
            "verifier": None
            if versions["newest"] is None
            else {
                "newest": versions["newest"],
                "live": {str(v): n for v, n in sorted(versions["live"].items())},
            },
        }
    )


def _drift(path: Path, last: int = 20) -> list[dict[str, Any]]:
    """The newest drift records `fanout promote --run-dir` wrote (none: not a live run)."""
    if not path.is_file():
        return []
    lines = [x for x in path.read_text().splitlines() if x.strip()][-last:]
    points = [json.loads(x) for x in lines]
    # which version is served now is read from the served dir a record names, never
    # guessed from the records (a rollback, or a second promoter, changes it)
    now = {d["served"]: served_version(d["served"]) for d in points if d.get("served")}
    return [d | {"serving_now": now.get(d.get("served") or "")} for d in points]


def _promote_look(path: Path) -> dict[str, Any] | None:
    """`fanout promote --run-dir`'s newest decision (None: it wrote none, or a torn one)."""
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) else None


def _stalled(co: Coordinator, now: float, after_s: float) -> dict[str, Any] | None:
    """Nothing trained for longer than `after_s` (reads.oldest_unread), else None."""
    got = reads.oldest_unread(co.conn)
    if got is None or now - got[1] < after_s:
        return None
    window, at, behind = got
    waited = round(now - at, 1)
    who = ", ".join(behind) or "no trainer has registered"
    return {
        "window": window, "waited_s": waited, "after_s": after_s, "behind": behind,
        "text": f"nothing trained for {waited:.0f} s (> {after_s:g} s): window {window} has "
        f"been ready that long, not read past by {who}",
    }  # fmt: skip


def snapshot(co: Coordinator, stalled_after_s: float = STALLED_AFTER_S) -> dict[str, Any]:
    """Everything `fanout status --json` prints (`build`'s model, as JSON-ready dicts)."""
    return build(co, stalled_after_s).model_dump(mode="json")


def _blocked(co: Coordinator, producer_state: str) -> dict[str, Any] | None:
    """Who holds an active producer at K (fanout.coord.waits' words), None while it is not."""
    since = reads.blocked_since(co.conn)
    if (
        producer_state != RoleState.ACTIVE
        or since is None
        or not reads.is_blocked(co.conn, co.config)
    ):
        return None
    now = reads.wall()
    text, _ = reads.block_text(co.conn, co.config)
    held = reads.holders(co.conn)
    return {
        "since_wall": since,
        "for_s": age_s(now, since, 1),
        "by": [h.consumer_id for h in held],
        "missing_consumers": reads.missing_consumers(co.conn, co.config.expected_consumers),
        "text": text,
        "ways_out": reads.ways_out(held, str(co.root)),
    }
