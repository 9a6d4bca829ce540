"""`fanout status`'s table: the snapshot (fanout.status.snapshot.snapshot) for people.

    from fanout.status.snapshot import snapshot
    from fanout.status.table import format_table
    print(format_table(snapshot(co)))

The run's lines (its capture, windows, totals, bytes, events), the producer's line and
its replicas' table, then one row per consumer with notes and why each waits under it.
docs/operations.md, "Reading `fanout status`", shows it (tests/test_status.py keeps the
example in the real layout). `--watch` redraws it (fanout.status.watch).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fanout.coord.states import RoleState, W


def _producer_line(s: dict[str, Any]) -> list[str]:
    p, cfg = s["producer"], s["config"]
    lines = [f"producer {p['state']}" + _producer_detail(p)]
    if p["state"] == RoleState.FINISHED:
        end, total = s["stream_end"], cfg["total_windows"]
        if end is None and total is not None and s["produced_windows"] >= total:
            end = total  # a run from before stream ends were recorded
        lines[0] += f"  (stream ended at window {end})" if end is not None else ""
    elif p["state"] == RoleState.STOPPED:
        lines[0] += "  (stopped by a signal: the stream is open, restart it to continue)"
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
    if p["owner"] is None:
        return ""
    if p["replicas"] > 1:
        return f"  {p['replicas']} replicas (below)"
    return f"  {_who(p)}  {_when(p)}  made {p['windows']} windows" + _rate(p)


def _who(p: dict[str, Any]) -> str:
    return f"{p['host']}:{p['pid']}" if p["pid"] is not None else str(p["owner"])


def _when(p: dict[str, Any]) -> str:
    when = {
        RoleState.FINISHED: "exited",
        RoleState.STOPPED: "exited",
        RoleState.LOST: "last heartbeat",
    }.get(RoleState(p["state"]), "heartbeat")
    return f"{when} {p['heartbeat_age_s']:.1f}s ago"


def _rate(p: dict[str, Any]) -> str:
    return "" if p["windows_per_s"] is None else f" ({p['windows_per_s']:.2f}/s)"


def _replica_lines(s: dict[str, Any]) -> list[str]:
    """The replicas' table (only when the run has more than one), then why each one
    that is not capturing waits."""
    if len(s["replicas"]) < 2:
        return []
    lines = [f"{'replica':>7} {'state':<9} {'holder':<22} {'windows':>7} {'rate':>10}  heartbeat"]
    for r in s["replicas"]:
        rate = "-" if r["windows_per_s"] is None else f"{r['windows_per_s']:.3f}/s"
        lines.append(
            f"{r['rank']:>7} {r['state']:<9} {_who(r):<22} {r['windows']:>7} {rate:>10}  {_when(r)}"
        )
    waiting = [r for r in s["replicas"] if r["waiting"] and r["state"] != RoleState.ACTIVE]
    return lines + [f"  replica {r['rank']}: {r['waiting']}" for r in waiting]


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


def _totals_line(s: dict[str, Any]) -> str:
    """`totals   live N/K  producer R windows/s (a of n replicas active)  consumers ...`"""
    t, st = s["totals"], s["stream"]
    length = "∞" if st["length_windows"] is None else str(st["length_windows"])
    rows = "" if st["rows"] is None else f"  {st['rows']} rows × {st['epochs']} epochs"
    return (
        f"totals   live {t['windows_live']}/K={t['max_live_windows']}  "
        f"producer {t['producer_windows_per_s']:.3f} windows/s "
        f"({t['replicas_active']} of {t['replicas']} replicas active)  "
        f"consumers {t['consumers_active']} of {t['consumers']} active  "
        f"stream {length} windows" + (" (ended)" if st["ended"] else "") + rows
    )


def duration(secs: float | None) -> str:
    """An ETA for people: `-` (not known), `42s`, `12m05s`, `3h07m`."""
    if secs is None:
        return "-"
    n = round(secs)
    if n < 60:
        return f"{n}s"
    if n < 3600:
        return f"{n // 60}m{n % 60:02d}s"
    return f"{n // 3600}h{n % 3600 // 60:02d}m"


def _holder(c: dict[str, Any]) -> str:
    return f"{c['host']}:{c['pid']}" if c["pid"] is not None else "-"


def _dp(c: dict[str, Any]) -> str:
    return f"{c['dp_rank']}/{c['dp_world']}" if c["dp_world"] is not None else "-"


def _or_dash(value: Any, fmt: str = "") -> str:
    return "-" if value is None else format(value, fmt)


# the consumer table, one place for its header and its cells: (header, its format spec,
# the separator after it, a consumer's cell); the last column, its leases, is added per line
_CONSUMER_COLUMNS: tuple[tuple[str, str, str, Callable[[dict[str, Any]], str]], ...] = (
    ("consumer", "<24", " ", lambda c: c["id"]),
    ("state", "<9", " ", lambda c: c["state"]),
    ("cursor", ">7", " ", lambda c: str(c["cursor"])),
    ("lag", ">5", " ", lambda c: str(c["lag_windows"])),
    ("hb age", ">8", "  ", lambda c: f"{c['heartbeat_age_s']:.1f}s"),
    ("holder", "<22", " ", _holder),
    ("layers", "<16", " ", lambda c: _layers(c["target_layer_ids"])),
    ("family", "<8", " ", lambda c: c["family"] or "-"),
    ("dp", ">5", " ", _dp),
    ("step", ">7", " ", lambda c: _or_dash(c["step"])),
    ("rows/s", ">8", " ", lambda c: _or_dash(c["rows_per_s"], ".2f")),
    ("eta", ">7", "  ", lambda c: duration(c["eta_s"])),
)
CONSUMER_HEADER = "".join(f"{h:{spec}}{sep}" for h, spec, sep, _ in _CONSUMER_COLUMNS) + "leases"


def _consumer_line(c: dict[str, Any], held: list[str]) -> str:
    cells = "".join(f"{cell(c):{spec}}{sep}" for _, spec, sep, cell in _CONSUMER_COLUMNS)
    return cells + (" ".join(held) or "-")


def format_table(s: dict[str, Any]) -> str:
    cfg = s["config"]
    lines = [
        f"run {s['run_dir']}  stream {s['stream_id']}  K={cfg['max_live_windows']}  "
        f"policy={cfg['lag_policy']}  ttl={cfg['ttl_s']}s",
        f"database {s['db_path']}",
        f"capture  layers {s['capture']['target_layer_ids']}  {s['capture']['storage_dtype']}  "
        f"T={s['capture']['seq_len']}  R={s['capture']['window_rows']}",
        _windows_line(s),
        _totals_line(s),
        f"bytes    ready {_mib(s['ready_bytes'])}  high-water {_mib(s['high_water']['bytes'])} "
        f"({s['high_water']['windows']} windows)",
        f"events   recaptures {s['recaptures']} (windows published again)  "
        f"corrupt {s['corrupt']}  detaches {s['detaches']}  reclaims {s['reclaims']}  "
        f"reclaimed claims {s['claims_reclaimed']}  "
        f"failed captures {s.get('capture_failures', 0)}",
        *_producer_line(s),
        *_replica_lines(s),
        "",
        CONSUMER_HEADER,
    ]
    held: dict[str, list[str]] = {}
    for lease in s["leases"]:
        held.setdefault(lease["consumer"], []).append(f"{lease['window']}.g{lease['generation']}")
    lines += [_consumer_line(c, held.get(c["id"], [])) for c in s["consumers"]]
    if not s["consumers"]:
        lines.append("(no consumers registered)")
    lines += [f"  {c['id']}: {c['state']} {c['note']}" for c in s["consumers"] if c["note"]]
    lines += [f"  {c['id']}: waiting: {c['waiting']}" for c in s["consumers"] if c["waiting"]]
    if f := s.get("follow"):
        lines += ["", f"follow   {f['chunks']} chunks committed: {f['records']} records read, "
                  f"{f['heldout']} held out, {f['skipped']} skipped, {f['split']} split"]  # fmt: skip
    lines += _verifier_lines(s)
    lines += _drift_lines(s.get("drift") or [])
    lines += _promote_lines(s.get("promote"))
    if st := s.get("stalled"):  # near the top too: the first thing a reader must see
        lines.insert(1, f"STALLED  {st['text']}")
    return "\n".join(lines)


def promote_texts(p: dict[str, Any]) -> tuple[str, str | None]:
    """A promote decision's line, and the floor warning when its candidate was at the
    acceptance floor (one wording for the table and the page)."""
    tau = "unmeasured" if p.get("candidate_tau") is None else f"τ {p['candidate_tau']:.2f}"
    did = f"promoted as {p.get('version')}" if p["promoted"] else "not promoted"
    floor = (
        f"FLOOR: its drafts are (next to) never accepted ({tau}); it is not served. "
        "Is its trainer training, on this verifier?"
    )
    return f"{p['time']}: {p['candidate']} ({tau}) {did}", floor if p.get("floor") else None


def _promote_lines(p: dict[str, Any] | None) -> list[str]:
    """`fanout promote --run-dir`'s newest decision; loud when its candidate was at the
    acceptance floor (never served)."""
    if not p:
        return []
    line, floor = promote_texts(p)
    return ["", f"promote  {line}", *([f"  {floor}"] if floor else [])]


def _verifier_lines(s: dict[str, Any]) -> list[str]:
    """A run whose verifier changes (`produce --follow-verifier`): the versions its live
    windows were captured with, and each consumer's version and lag behind the newest."""
    v = s.get("verifier")
    if not v:
        return []
    live = ", ".join(f"v{k}: {n}" for k, n in v["live"].items()) or "none"
    lines = ["", f"verifier newest version {v['newest']}  live windows by version: {live}"]
    for c in s["consumers"]:
        mine = "-" if c.get("verifier_version") is None else c["verifier_version"]
        lag = "-" if c.get("verifier_lag") is None else c["verifier_lag"]
        lines.append(
            f"  {c['id']}: at version {mine}, {lag} behind; "
            f"{c.get('lag_skipped', 0)} windows skipped as too old (--max-verifier-lag)"
        )
    return lines


def serving_now_text(d: dict[str, Any]) -> str:
    """What a drift record's served dir serves now, read from the dir (one wording for the
    table and the page): the measured version, another one, or "unknown"."""
    if not d.get("served"):
        return "served now: unknown (the newest drift record names no served dir)"
    now = d.get("serving_now")
    if now is None:
        return f"served now: unknown ({d['served']}/current points at no version)"
    if now == d["version"]:
        return f"served now: {now} ({d['served']})"
    return f"served now: {now} ({d['served']}; the look above measured {d['version']})"


def _drift_lines(points: list[dict[str, Any]]) -> list[str]:
    """The served draft on the newest held-out traffic, and a warning when it drifted."""
    if not points:
        return []
    d = points[-1]
    ci = d["ci95"]
    shown = f"τ {d['tau']:.2f}" + (f" ({ci[0]:.2f}–{ci[1]:.2f})" if ci else "")
    out = [
        "",
        f"served   {d['version']} {shown} on the newest {d['prompts']} held-out "
        f"conversations ({d['time']}; {len(points)} looks)",
        "  " + serving_now_text(d),
    ]
    if d["below"]:
        b = d["baseline_ci95"]
        out.append(
            f"  drift: below the {b[0]:.2f}–{b[1]:.2f} it was promoted with: the traffic "
            "moved; a candidate trained on it is due (fanout promote decides)"
        )
    return out
