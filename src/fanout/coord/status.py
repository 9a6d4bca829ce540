"""`fanout status`, `sweep`, `detach`: look at a run directory, clean it up, release a consumer.

    fanout status --run-dir runs/demo            # compact table
    fanout status --run-dir runs/demo --json     # machine-readable (fanout.coord.status_schema)
    fanout status --run-dir runs/demo --watch    # the table, redrawn (fanout.coord.status_watch)
    fanout status --run-dir runs/demo --serve 9464   # /metrics, / (fanout.coord.status_serve)
    fanout sweep --run-dir runs/demo             # remove temp debris and orphan files
    fanout detach --run-dir runs/demo --consumer-id b8:dp0   # release a stopped consumer

`status` only reads the database (no write transaction, no torch import). A
process the database still calls active is shown `lost` when it has exited
without saying so (it ran on this host and its pid is gone) or its heartbeat is
older than ttl_s by the wall clock; the coordinator itself declares it lost by its
heartbeat counter (fanout.coord.liveness), and `--json` keeps that as `recorded_state`.
`detach` releases a stopped or lost consumer (Coordinator.detach_consumer). `sweep` finishes interrupted evictions, then removes tmp/ debris and window files
no ready or capturing row names (Store.sweep with Coordinator.wants_file); it is
safe while a producer and consumers run.

`build` makes the one versioned snapshot every view shows, read in one
read-only transaction so its numbers are of one instant (the table is
fanout.coord.status_table's); what processes record for it beyond the role tables
(how a replica exited, what a consumer is) is fanout.coord.records'.

Their flags are generated from StatusConfig / SweepConfig (fanout.flags), so both
take `--config FILE` too. This module stays free of torch: `fanout status` is the
command people run in a loop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fanout.coord import records, retention, waits
from fanout.coord.coordinator import Coordinator
from fanout.coord.database import Database, wall
from fanout.coord.liveness import process_gone
from fanout.coord.states import RoleState, W
from fanout.coord.status_schema import STATUS_SCHEMA_VERSION, StatusSnapshot
from fanout.coord.status_table import format_table as format_table  # the table view
from fanout.errors import ConfigError, FanoutError
from fanout.flags import add_model_flags, flag_options, model_from_args
from fanout.store.rundir import RunDir
from fanout.store.streaminfo import StreamInfo


class RunDirOptions(BaseModel):
    """Which run directory `fanout status` / `fanout sweep` open, and how."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_dir: str = Field(".", min_length=1, description="Run directory.")
    db_path: str | None = Field(
        None,
        description="Coordinator database (a path or a postgresql:// URL) if not the one "
        "recorded in the run dir at create; None = the recorded one.",
    )
    allow_network_fs: bool = Field(
        False,
        description="Open a database on a network filesystem anyway (unsafe with WAL; "
        "tests/experts).",
    )


class StatusConfig(RunDirOptions):
    """`fanout status`: show the state of a run directory."""

    # Not SweepConfig's: --json prints a snapshot here, what was removed there.
    as_json: bool = Field(
        False,
        description="Print the whole snapshot as JSON instead of a table (its schema: "
        "fanout.coord.status_schema, docs/operations.md).",
        json_schema_extra=flag_options(flag="--json"),
    )
    watch: bool = Field(
        False,
        description="Redraw the table in place every --interval-s seconds until Ctrl-C "
        "(exit 0); needs a terminal.",
    )
    serve: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Serve Prometheus metrics at /metrics, the snapshot at /status.json and "
        "a page that refreshes itself at / on this TCP port until Ctrl-C (0: any free "
        "port, printed); none = do not serve.",
        json_schema_extra=flag_options(metavar="PORT"),
    )
    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Address --serve binds: loopback by default; 0.0.0.0 = every interface.",
    )
    interval_s: float = Field(
        2.0,
        gt=0,
        description="Seconds between --watch redraws, and between --serve's samples "
        "(its page's plot) and page refreshes.",
    )

    @model_validator(mode="after")
    def _one_view(self) -> StatusConfig:
        views = [f for f, on in (("--json", self.as_json), ("--watch", self.watch),
                                 ("--serve", self.serve is not None)) if on]  # fmt: skip
        if len(views) > 1:
            raise ValueError(f"{' and '.join(views)}: pick one view")
        return self


class SweepConfig(RunDirOptions):
    """`fanout sweep`: remove temp debris and orphan window files from a run directory."""

    as_json: bool = Field(
        False,
        description="Print what was removed and kept as JSON instead of a line.",
        json_schema_extra=flag_options(flag="--json"),
    )


class DetachConfig(RunDirOptions):
    """`fanout detach`: release a stopped or lost consumer so it no longer holds the
    producer back (it may register again later, e.g. with --resume)."""

    consumer_id: str = Field(
        min_length=1,
        description="Consumer to detach: name:dp<rank>, or a name (every rank of it).",
    )
    force: bool = Field(
        False,
        description="Detach it even while it is active (it is fenced off and exits 3).",
    )


CONFIGS: dict[str, type[StatusConfig] | type[SweepConfig] | type[DetachConfig]] = {
    "status": StatusConfig,
    "sweep": SweepConfig,
    "detach": DetachConfig,
}


def add_arguments(parser: argparse.ArgumentParser, name: str = "status") -> None:
    add_model_flags(parser, CONFIGS[name])


def config_from_args(
    args: argparse.Namespace, name: str = "status"
) -> StatusConfig | SweepConfig | DetachConfig:
    """StatusConfig (SweepConfig, DetachConfig for `name` "sweep", "detach") from
    `--config FILE` and flags."""
    return model_from_args(CONFIGS[name], args)


def shown_state(state: str, age_s: float, ttl_s: float, proc: str | None, pid: int | None) -> str:
    """What status shows for a process the database records in `state`: an 'active' one
    that is gone from this host, or whose heartbeat is older than ttl, is `lost` (for
    people: the reclaimer decides by the heartbeat counter, not by wall clocks)."""
    if state == RoleState.ACTIVE and (process_gone(proc, pid) or age_s > ttl_s):
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
    row: tuple[Any, ...], co: Coordinator, now: float, starts: dict[str, dict[str, Any]],
    length: int | None, frontier: int,
) -> dict[str, Any]:  # fmt: skip
    """One consumer as `status --json` lists it: what the database and its registration
    record (fanout.coord.records) say, its rate and ETA, and what its trainer logged."""
    cid, state, cursor, hb_seq, hb_wall, note, host, pid, proc, expect = row
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
    if shown == RoleState.ACTIVE and (end is None or cursor < end):
        w = co.conn.execute("SELECT state FROM windows WHERE window=?", (cursor,)).fetchone()
        if w is None or w[0] != W.READY:
            waiting = waits.consumer_wait(co.conn, co.config, cid, cursor).text
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
        "target_layer_ids": json.loads(expect or "{}").get("target_layer_ids", captured),
        "state": shown,
        "recorded_state": state,
        "host": host,
        "pid": pid,
        "cursor": cursor,
        "lag_windows": max(0, frontier - cursor),
        "heartbeats": hb_seq,
        "heartbeat_age_s": age_s(now, hb_wall),
        "note": note,
        "step": logged.get("step"),
        "eal": logged.get("eal"),
        "windows_per_s": rate,
        "rows_per_s": None if rate is None else round(rate * co.contract.window_rows, 3),
        "end_window": end,
        "eta_s": eta,
        "waiting": waiting,
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


@contextmanager
def _one_instant(db: Database) -> Iterator[None]:
    """Every read of one snapshot in one read-only transaction: its numbers are of one
    instant (totals are the sum of the rows beside them, a window counted as made is
    published by some replica or still claimed), not of a moving run read in several
    autocommitted statements. PostgreSQL: REPEATABLE READ (one snapshot for the whole
    transaction); SQLite (WAL): a deferred transaction reads one snapshot from its first
    read. Neither blocks a writer."""
    begin = (
        "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY" if db.dialect == "postgres" else "BEGIN"
    )
    db.execute(begin)
    try:
        yield
    finally:
        db.execute("COMMIT")  # nothing was written: the end of the snapshot


def build(co: Coordinator) -> StatusSnapshot:
    """The run now, as the versioned StatusSnapshot (fanout.coord.status_schema), read
    at one instant (`_one_instant`). Heartbeat ages and rates use the wall clock and are
    for people only; liveness decisions never use them."""
    with _one_instant(co.conn):
        return _build(co)


def _build(co: Coordinator) -> StatusSnapshot:
    q = co.conn.execute
    now = wall()
    ttl = co.config.ttl_s
    counts = dict(q("SELECT state, COUNT(*) FROM windows GROUP BY state").fetchall())
    windows = {s.value: int(counts.get(s.value, 0)) for s in W}
    windows["evicted"] = int(co.meta("evictions"))  # old evicted rows are compacted away
    live_bytes = co.ready_windows()[1]  # of the readable windows
    frontier = int(co.meta("next_window"))
    end = waits.stream_end(co.conn)
    stream = _stream(co, end)
    starts = records.consumer_starts(co.conn)
    consumers = [
        _consumer(row, co, now, starts, stream["length_windows"], frontier)
        for row in q(
            "SELECT id, state, cursor, hb_seq, hb_wall, note, host, pid, proc, expect "
            "FROM consumers ORDER BY id"
        ).fetchall()
    ]
    leases = [
        {"consumer": c, "window": w, "generation": g, "token": t, "age_s": age_s(now, a)}
        for c, w, g, t, a in q(
            "SELECT consumer, window, generation, token, acquired_wall FROM leases ORDER BY window"
        )
    ]
    exits = records.producer_exits(co.conn)
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
        "windows_live": retention.live_windows(co.conn),
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
            "live_bytes": int(live_bytes),
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
            "producer": producer,
            "replicas": replicas,
            "consumers": consumers,
            "leases": leases,
            "drift": _drift(RunDir(co.root).drift),
            "follow": co.follow_position(),
        }
    )


def _drift(path: Path, last: int = 20) -> list[dict[str, Any]]:
    """The newest drift records `fanout promote --run-dir` wrote (none: not a live run)."""
    if not path.is_file():
        return []
    lines = [x for x in path.read_text().splitlines() if x.strip()][-last:]
    return [json.loads(x) for x in lines]


def snapshot(co: Coordinator) -> dict[str, Any]:
    """Everything `fanout status --json` prints (`build`'s model, as JSON-ready dicts)."""
    return build(co).model_dump(mode="json")


def _blocked(co: Coordinator, producer_state: str) -> dict[str, Any] | None:
    """Who holds an active producer at K (fanout.coord.waits), None while it is not."""
    since = waits.blocked_since(co.conn)
    if (
        producer_state != RoleState.ACTIVE
        or since is None
        or not waits.is_blocked(co.conn, co.config)
    ):
        return None
    now = wall()
    text, _ = waits.block_text(co.conn, co.config)
    held = waits.holders(co.conn)
    return {
        "since_wall": since,
        "for_s": age_s(now, since, 1),
        "by": [h.consumer_id for h in held],
        "missing_consumers": waits.missing_consumers(co.conn, co.config.expected_consumers),
        "text": text,
        "ways_out": waits.ways_out(held, str(co.root)),
    }


def run(args: argparse.Namespace, name: str = "status") -> int:
    cfg = config_from_args(args, name)
    if isinstance(cfg, StatusConfig) and cfg.watch and not sys.stdout.isatty():
        raise ConfigError(
            "--watch redraws a terminal, and stdout is not one; use --json (in a loop) or "
            "--serve PORT for a dashboard"
        )
    with Coordinator.open(
        cfg.run_dir, db_path=cfg.db_path, allow_network_fs=cfg.allow_network_fs
    ) as co:
        if isinstance(cfg, DetachConfig):
            for line in co.detach_consumer(cfg.consumer_id, force=cfg.force):
                print(line)
            return 0
        if name == "sweep":
            report = co.sweep()
            if cfg.as_json:
                print(json.dumps({"tmp_removed": report.tmp_removed,
                                  "orphans_removed": report.orphans_removed,
                                  "kept": report.kept}))  # fmt: skip
            else:
                print(
                    f"sweep {co.root}: {report.removed} removed "
                    f"({len(report.tmp_removed)} temp, {len(report.orphans_removed)} orphan), "
                    f"{report.kept} live kept"
                )
            return 0
        if isinstance(cfg, StatusConfig) and cfg.serve is not None:
            from fanout.coord.status_serve import StatusServer

            server = StatusServer(build, co, cfg.host, cfg.serve, cfg.interval_s)
            print(f"fanout status: serving {server.url} (metrics at {server.url}metrics); "
                  "Ctrl-C to stop", flush=True)  # fmt: skip
            return server.run()
        if isinstance(cfg, StatusConfig) and cfg.watch:
            from fanout.coord.status_watch import watch

            return watch(lambda: format_table(snapshot(co)), cfg.interval_s)
        s = snapshot(co)
        print(json.dumps(s, indent=2) if cfg.as_json else format_table(s))
    return 0
