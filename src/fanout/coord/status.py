"""`fanout status`, `sweep`, `detach`: look at a run directory, clean it up, release a consumer.

    fanout status --run-dir runs/demo            # compact table
    fanout status --run-dir runs/demo --json     # machine-readable (see snapshot())
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

Their flags are generated from StatusConfig / SweepConfig (fanout.flags), so both
take `--config FILE` too. This module stays free of torch: `fanout status` is the
command people run in a loop.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fanout.coord import waits
from fanout.coord.coordinator import Coordinator
from fanout.coord.database import wall
from fanout.coord.liveness import process_gone
from fanout.coord.states import RoleState, W
from fanout.flags import add_model_flags, flag_options, model_from_args


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
        description="Print the whole snapshot as JSON instead of a table.",
        json_schema_extra=flag_options(flag="--json"),
    )


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


def _replica(p: dict[str, Any], now: float, ttl: float) -> dict[str, Any]:
    """One producer replica as `status --json` lists it: who, its state, windows made
    (by that rank, every incarnation) and its rate (this incarnation's windows over its
    time registered, up to now or its exit)."""
    shown = shown_state(p["state"], now - p["hb_wall"], ttl, p["proc"], p["pid"])
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
    }


def _producer(replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """The producer side as one line: active if any replica is, else lost if any is,
    else finished; the details of the first replica in that state."""
    for state in (RoleState.ACTIVE, RoleState.LOST, RoleState.FINISHED):
        mine = [r for r in replicas if r["state"] == state]
        if mine:
            return {**mine[0], "replicas": len(replicas)}
    return {"state": "none"}


def snapshot(co: Coordinator) -> dict[str, Any]:
    """Everything `fanout status --json` prints. Heartbeat ages use the wall clock and
    are for people only; liveness decisions never use them."""
    q = co.conn.execute
    now = wall()
    ttl = co.config.ttl_s
    counts = dict(q("SELECT state, COUNT(*) FROM windows GROUP BY state").fetchall())
    windows = {s.value: int(counts.get(s.value, 0)) for s in W}
    windows["evicted"] = int(co.meta("evictions"))  # old evicted rows are compacted away
    live_bytes = co.ready_windows()[1]  # of the readable windows
    frontier = int(co.meta("next_window"))
    captured = list(co.contract.target_layer_ids)
    consumers = [
        {
            "id": cid,
            # the layers it trains on (registered; older registrations read them all)
            "target_layer_ids": json.loads(expect or "{}").get("target_layer_ids", captured),
            "state": shown_state(state, now - hb_wall, ttl, proc, pid),
            "recorded_state": state,
            "host": host,
            "pid": pid,
            "cursor": cursor,
            "lag_windows": max(0, frontier - cursor),
            "heartbeats": hb_seq,
            "heartbeat_age_s": age_s(now, hb_wall),
            "note": note,
        }
        for cid, state, cursor, hb_seq, hb_wall, note, host, pid, proc, expect in q(
            "SELECT id, state, cursor, hb_seq, hb_wall, note, host, pid, proc, expect "
            "FROM consumers ORDER BY id"
        )
    ]
    leases = [
        {"consumer": c, "window": w, "generation": g, "token": t, "age_s": age_s(now, a)}
        for c, w, g, t, a in q(
            "SELECT consumer, window, generation, token, acquired_wall FROM leases ORDER BY window"
        )
    ]
    replicas = [_replica(p, now, ttl) for p in co.producer_replicas()]
    producer = _producer(replicas)
    cfg = co.config
    return {
        "run_dir": str(co.root),
        "stream_end": waits.stream_end(co.conn),
        "blocked": _blocked(co, producer["state"]),
        "db_path": str(co.db_path),
        "stream_id": co.meta("stream_id"),
        "config": cfg.model_dump(mode="json"),
        "capture": {
            "target_layer_ids": list(co.contract.target_layer_ids),
            "storage_dtype": co.contract.storage_dtype,
            "seq_len": co.contract.seq_len,
            "window_rows": co.contract.window_rows,
        },
        "windows": windows,
        "produced_windows": frontier,
        "live_bytes": int(live_bytes),
        "high_water": {"windows": int(co.meta("hw_windows")), "bytes": int(co.meta("hw_bytes"))},
        "consumers": consumers,
        "leases": leases,
        "recaptures": int(co.meta("recaptures")),
        "evictions": int(co.meta("evictions")),
        "corrupt": int(co.meta("corrupt")),
        "detaches": int(co.meta("detaches")),
        "reclaims": int(co.meta("reclaims")),
        "claims_reclaimed": int(co.meta("claims_reclaimed")),
        "producer": producer,
        "replicas": replicas,
    }


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


def _producer_line(s: dict[str, Any]) -> list[str]:
    p, cfg = s["producer"], s["config"]
    lines = [f"producer {p['state']}" + _producer_detail(p)]
    if p["state"] == RoleState.FINISHED:
        end, total = s["stream_end"], cfg["total_windows"]
        if end is None and total is not None and s["produced_windows"] >= total:
            end = total  # a run from before stream ends were recorded
        lines[0] += (
            f"  (stream ended at window {end})"
            if end is not None
            else "  (stopped by a signal: the stream is open, restart it to continue)"
        )
    b = s["blocked"]
    if b is not None:
        when = time.strftime("%H:%M:%S UTC", time.gmtime(b["since_wall"]))
        lines.append(
            f"producer blocked at K={cfg['max_live_windows']} {b['text'] or '(by nobody)'} "
            f"since {when} ({b['for_s']:.0f} s)"
        )
        if b["ways_out"]:
            lines.append(f"         {b['ways_out']}")
    return lines


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _producer_detail(p: dict[str, Any]) -> str:
    if "owner" not in p:
        return ""
    if p["replicas"] > 1:
        return f"  {p['replicas']} replicas (below)"
    return f"  {_who(p)}  {_when(p)}  made {p['windows']} windows" + _rate(p)


def _who(p: dict[str, Any]) -> str:
    return f"{p['host']}:{p['pid']}" if p["pid"] is not None else str(p["owner"])


def _when(p: dict[str, Any]) -> str:
    when = {RoleState.FINISHED: "exited", RoleState.LOST: "last heartbeat"}.get(
        RoleState(p["state"]), "heartbeat"
    )
    return f"{when} {p['heartbeat_age_s']:.1f}s ago"


def _rate(p: dict[str, Any]) -> str:
    return "" if p["windows_per_s"] is None else f" ({p['windows_per_s']:.2f}/s)"


def _replica_lines(s: dict[str, Any]) -> list[str]:
    """The replicas' table (only when the run has more than one)."""
    if len(s["replicas"]) < 2:
        return []
    lines = [f"{'replica':>7} {'state':<9} {'holder':<22} {'windows':>7} {'rate':>10}  heartbeat"]
    for r in s["replicas"]:
        rate = "-" if r["windows_per_s"] is None else f"{r['windows_per_s']:.3f}/s"
        lines.append(
            f"{r['rank']:>7} {r['state']:<9} {_who(r):<22} {r['windows']:>7} {rate:>10}  {_when(r)}"
        )
    return lines


def _layers(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def _windows_line(s: dict[str, Any]) -> str:
    """`windows  produced N/total  <state> <count> ...`: the total is where the stream
    ended once that is recorded, else the run's length, else ∞ (an open-ended stream).
    `evicted` counts files, so a window recaptured and evicted again counts again: said
    when so."""
    total = s["stream_end"] if s["stream_end"] is not None else s["config"]["total_windows"]
    w = s["windows"]
    again = " (incl. recaptured copies)" if s["recaptures"] and w[W.EVICTED] else ""
    counts = [
        f"{k} {w[k]}" + (again if k == W.EVICTED else "")
        for k in W
        if w[k] or k in (W.READY, W.EVICTED)
    ]
    shown = "∞" if total is None else total
    return f"windows  produced {s['produced_windows']}/{shown}  " + "  ".join(counts)


def format_table(s: dict[str, Any]) -> str:
    cfg = s["config"]
    lines = [
        f"run {s['run_dir']}  stream {s['stream_id']}  K={cfg['max_live_windows']}  "
        f"policy={cfg['lag_policy']}  ttl={cfg['ttl_s']}s",
        f"database {s['db_path']}",
        f"capture  layers {s['capture']['target_layer_ids']}  {s['capture']['storage_dtype']}  "
        f"T={s['capture']['seq_len']}  R={s['capture']['window_rows']}",
        _windows_line(s),
        f"bytes    live {_mib(s['live_bytes'])}  high-water {_mib(s['high_water']['bytes'])} "
        f"({s['high_water']['windows']} windows)",
        f"events   recaptures {s['recaptures']} (windows published again)  "
        f"corrupt {s['corrupt']}  detaches {s['detaches']}  reclaims {s['reclaims']}  "
        f"reclaimed claims {s['claims_reclaimed']}",
        *_producer_line(s),
        *_replica_lines(s),
        "",
        f"{'consumer':<24} {'state':<9} {'cursor':>7} {'lag':>5} {'hb age':>8}  "
        f"{'holder':<22} {'layers':<16} leases",
    ]
    held: dict[str, list[str]] = {}
    for lease in s["leases"]:
        held.setdefault(lease["consumer"], []).append(f"{lease['window']}.g{lease['generation']}")
    for c in s["consumers"]:
        holder = f"{c['host']}:{c['pid']}" if c["pid"] is not None else "-"
        lines.append(
            f"{c['id']:<24} {c['state']:<9} {c['cursor']:>7} {c['lag_windows']:>5} "
            f"{c['heartbeat_age_s']:>7.1f}s  {holder:<22} {_layers(c['target_layer_ids']):<16} "
            f"{' '.join(held.get(c['id'], [])) or '-'}"
        )
    if not s["consumers"]:
        lines.append("(no consumers registered)")
    lines += [f"  {c['id']}: {c['state']} {c['note']}" for c in s["consumers"] if c["note"]]
    return "\n".join(lines)


def run(args: argparse.Namespace, name: str = "status") -> int:
    cfg = config_from_args(args, name)
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
        s = snapshot(co)
        print(json.dumps(s, indent=2) if cfg.as_json else format_table(s))
    return 0
