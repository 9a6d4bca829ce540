"""The page `fanout status --serve PORT` answers at `/`: tables and plots, one HTML page.

    fanout status --run-dir runs/demo --serve 9464   # then open http://localhost:9464/

The tables carry the snapshot's own numbers (each cell's `data-key` names the field of
`status --json`, e.g. `consumers.d:dp0.lag_windows`); the plots are SVG drawn here, on
the server, from the samples the server keeps in memory (fanout.status.serve):
windows live vs K, each replica's rate, each draft's lag and EAL, over time; and, for a
live run, the served draft's τ on new held-out traffic with a warning when it drifted
(from the snapshot's durable drift records, so its history outlives the server). What
the text status says of a live loop is here too, in its words: STALLED first (nothing
trained for longer than --stalled-after-s), `fanout promote`'s newest decision with its
acceptance FLOOR warning, and the verifier versions of a run whose verifier changes. No
script and no network: the page reloads itself (`<meta http-equiv="refresh">`).
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from fanout.status.schema import StatusSnapshot
from fanout.status.table import promote_texts, serving_now_text

# Okabe-Ito's colour-blind-safe colours (its yellow left out: unreadable on white), and
# dash patterns: series i gets both, so two lines differ even in grey or to one who
# cannot tell the two colours apart (7 colours x 4 dashes: 28 lines before a repeat).
COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")
DASHES = ("", "7 3", "2 3", "9 3 2 3")
W, H = 600, 250  # one plot, in px
LEFT, RIGHT, TOP, BOTTOM = 58, 12, 12, 42  # its margins: tick labels and axis labels


@dataclass(frozen=True)
class Sample:
    """What the plots remember of one snapshot."""

    t: float  # when it was taken (Unix seconds)
    live: int
    k: int
    producer_rate: float  # the active replicas' rates, summed (windows/s)
    replica_rates: dict[int, float | None]  # rank -> windows/s
    lag: dict[str, int]  # draft -> windows behind the producer (its rank furthest behind)
    eal: dict[str, float | None]  # draft -> its last logged EAL (its lowest rank's)


def draft_label(name: str, family: str | None) -> str:
    return f"{name} ({family})" if family else name


def sample_of(s: StatusSnapshot) -> Sample:
    """The plots' view of a snapshot. A draft is a trainer (`--consumer-id`): its
    data-parallel ranks are one line, at the lag of the rank furthest behind (the one
    that holds windows live) and the EAL of the lowest rank that logged one."""
    lag: dict[str, int] = {}
    eal: dict[str, float | None] = {}
    for c in sorted(s.consumers, key=lambda c: (c.name, c.dp_rank)):
        key = draft_label(c.name, c.family)
        lag[key] = max(lag.get(key, 0), c.lag_windows)
        if eal.get(key) is None:
            eal[key] = c.eal
    return Sample(
        t=s.taken_wall,
        live=s.totals.windows_live,
        k=s.totals.max_live_windows,
        producer_rate=s.totals.producer_windows_per_s,
        replica_rates={r.rank: r.windows_per_s for r in s.replicas},
        lag=lag,
        eal=eal,
    )


@dataclass(frozen=True)
class Series:
    label: str
    points: list[tuple[float, float | None]]  # (t, value); None: not known then (a gap)
    colour: str
    dash: str = ""


def styled(i: int, label: str, points: list[tuple[float, float | None]]) -> Series:
    """Series number i in the shared palette: colour and dash both cycle."""
    return Series(label, points, COLOURS[i % len(COLOURS)], DASHES[i % len(DASHES)])


def nice_ticks(hi: float, n: int = 5) -> list[float]:
    """Ticks 0, step, 2 step, ... covering [0, hi], step 1, 2 or 5 x 10^k."""
    hi = max(hi, 1e-9)
    raw = hi / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [i * step for i in range(math.ceil(hi / step - 1e-9) + 1)]


def _num(v: float) -> str:
    """A tick or legend number: short, no float noise."""
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def _segments(
    points: list[tuple[float, float | None]],
    x: Callable[[float], float],
    y: Callable[[float], float],
) -> list[list[tuple[float, float]]]:
    """The points in px, split where a value is not known (a gap in the line)."""
    out: list[list[tuple[float, float]]] = [[]]
    for t, v in points:
        if v is None:
            out.append([])
        else:
            out[-1].append((x(t), y(v)))
    return [seg for seg in out if seg]


def plot_svg(key: str, name: str, y_label: str, series: Sequence[Series], t_end: float) -> str:
    """One plot, `<figure id="plot-KEY">`: the series over time, x in seconds (minutes
    past 10 of them) before `t_end`, y from 0, with grid, ticks, axis labels and a
    legend below it (each line's newest value)."""
    known = [v for s in series for _, v in s.points if v is not None]
    times = [t for s in series for t, _ in s.points]
    if len(set(times)) < 2:
        return f'<p class="note">{html.escape(name)}: the plot starts after two samples</p>'
    span = t_end - min(times)
    unit, per = ("min", 60.0) if span >= 600 else ("s", 1.0)
    yt = nice_ticks(1.05 * max(known, default=0.0) or 1.0)  # headroom: no line on the frame
    xt = nice_ticks(span / per, 6)
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def x(t: float) -> float:
        return LEFT + pw * (1 - (t_end - t) / (xt[-1] * per))

    def y(v: float) -> float:
        return TOP + ph * (1 - v / yt[-1])

    parts = [
        f'<svg width="{W}" height="{H}" role="img" aria-label="{html.escape(name)}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>',
    ]
    for v in yt:
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
                     f'stroke="#e4e4e4"/><text x="{LEFT - 4}" y="{y(v) + 4:.1f}" '
                     f'text-anchor="end">{_num(v)}</text>')  # fmt: skip
    for v in xt:
        xx = LEFT + pw * (1 - v / xt[-1])
        parts.append(f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{TOP + ph}" y2="{TOP + ph + 4}" '
                     f'stroke="#999"/><text x="{xx:.1f}" y="{TOP + ph + 15}" '
                     f'text-anchor="middle">{_num(-v) if v else "0"}</text>')  # fmt: skip
    newest = time.strftime("%H:%M:%S", time.localtime(t_end))
    parts.append(f'<text x="{LEFT + pw / 2}" y="{H - 6}" text-anchor="middle">time '
                 f'({unit}, 0 = {newest})</text><text transform="translate(13,{TOP + ph / 2})'
                 f' rotate(-90)" text-anchor="middle">{html.escape(y_label)}</text>')  # fmt: skip
    legend = []
    for s in series:
        dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
        for seg in _segments(s.points, x, y):
            if len(seg) == 1:
                parts.append(f'<circle cx="{seg[0][0]:.1f}" cy="{seg[0][1]:.1f}" r="2.5" '
                             f'fill="{s.colour}"/>')  # fmt: skip
            else:
                line = " ".join(f"{a:.1f},{b:.1f}" for a, b in seg)
                parts.append(f'<polyline points="{line}" fill="none" stroke="{s.colour}" '
                             f'stroke-width="2"{dash}/>')  # fmt: skip
        last = s.points[-1][1] if s.points else None
        if not s.label:  # the other edge of a band: its first edge's legend says it
            continue
        legend.append(
            f'<li><svg width="26" height="8"><line x1="1" x2="25" y1="4" y2="4" '
            f'stroke="{s.colour}" stroke-width="2"{dash}/></svg>{html.escape(s.label)} '
            f"<b>{'-' if last is None else _num(last)}</b></li>"
        )
    parts.append("</svg>")
    return (f'<figure id="plot-{key}"><figcaption>{html.escape(name)}</figcaption>{"".join(parts)}'
            f'<ul class="legend">{"".join(legend)}</ul></figure>')  # fmt: skip


def plots_html(samples: Sequence[Sample]) -> str:
    """The four plots over the samples, oldest first."""
    if len(samples) < 2:
        return '<p class="note">the plots start after two samples</p>'
    t_end = samples[-1].t
    live = [
        Series("windows live", [(p.t, p.live) for p in samples], COLOURS[0]),
        Series("K (max live)", [(p.t, p.k) for p in samples], COLOURS[1], DASHES[1]),
    ]
    ranks = sorted({r for p in samples for r in p.replica_rates})
    rates = [styled(i, f"replica {r}", [(p.t, p.replica_rates.get(r)) for p in samples])
             for i, r in enumerate(ranks)]  # fmt: skip
    if len(ranks) > 1:
        total: list[tuple[float, float | None]] = [(p.t, p.producer_rate) for p in samples]
        rates.append(Series("active replicas, summed", total, "#777777", DASHES[2]))
    drafts = sorted({d for p in samples for d in p.lag})
    lag = [styled(i, d, [(p.t, p.lag.get(d)) for p in samples]) for i, d in enumerate(drafts)]
    eal = [styled(i, d, [(p.t, p.eal.get(d)) for p in samples]) for i, d in enumerate(drafts)]
    figs = [
        plot_svg("live", "windows live vs K", "windows", live, t_end),
        plot_svg("rates", "producer rate per replica", "windows / s", rates, t_end),
        plot_svg("lag", "lag per draft (windows behind the producer)", "windows", lag, t_end),
        plot_svg("eal", "EAL per draft (expected acceptance length)", "tokens / step", eal, t_end),
    ]
    return f'<div class="plots">{"".join(figs)}</div>'


def _wall(stamp: str) -> float | None:
    """A drift record's ISO time ("2026-12-05T20:41:07Z") as Unix seconds; None if not one."""
    try:
        return datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None


def drift_html(s: StatusSnapshot) -> str:
    """The served draft on the newest held-out traffic (`fanout promote --run-dir`, its
    every look in RUN_DIR/follow/drift.jsonl): τ with its interval over time against
    the interval it was promoted with, and a warning when it fell below it. Empty when
    the run has no such records."""
    if not s.drift:
        return ""
    d = s.drift[-1]
    ci = f" ({d.ci95[0]:.2f}–{d.ci95[1]:.2f})" if d.ci95 else ""
    base = f"{d.baseline_ci95[0]:.2f}–{d.baseline_ci95[1]:.2f}" if d.baseline_ci95 else "-"
    warn = (
        f'<p class="warn" data-key="drift.below">drift: τ fell below the {base} '
        f"{html.escape(d.version)} was promoted with: the traffic moved; a candidate trained "
        "on it is due (fanout promote decides)</p>"
        if d.below
        else ""
    )
    head = (
        f'<p>served <span data-key="drift.version">{html.escape(d.version)}</span>: τ '
        f'<span data-key="drift.tau">{d.tau:.2f}</span>{ci} on the newest {d.prompts} '
        f"held-out conversations ({html.escape(d.time)}; {len(s.drift)} looks; promoted "
        f"with {base})</p>"
        f'<p data-key="drift.serving_now">{html.escape(serving_now_text(d.model_dump()))}</p>'
    )
    walls = [_wall(p.time) for p in s.drift]
    plot = ""
    if all(w is not None for w in walls) and len(walls) > 1:
        pts = list(zip([w for w in walls if w is not None], s.drift, strict=True))
        series = [
            Series("τ served", [(t, p.tau) for t, p in pts], COLOURS[0]),
            Series("its 95% interval", [(t, p.ci95[0] if p.ci95 else None) for t, p in pts],
                   COLOURS[0], DASHES[2]),
            Series("", [(t, p.ci95[1] if p.ci95 else None) for t, p in pts], COLOURS[0],
                   DASHES[2]),
            Series("interval it was promoted with",
                   [(t, p.baseline_ci95[0] if p.baseline_ci95 else None) for t, p in pts],
                   COLOURS[1], DASHES[1]),
            Series("", [(t, p.baseline_ci95[1] if p.baseline_ci95 else None) for t, p in pts],
                   COLOURS[1], DASHES[1]),
        ]  # fmt: skip
        plot = plot_svg("drift", "served draft on new held-out traffic", "τ (tokens / verify)",
                        series, pts[-1][0])  # fmt: skip
    return f"<h2>drift</h2>{warn}{head}{plot}"


def stalled_html(s: StatusSnapshot) -> str:
    """The run is STALLED (the text status's first line after the header): a warning at
    the top of the page; empty while healthy."""
    if s.stalled is None:
        return ""
    return (
        f'<p class="warn">STALLED: <span data-key="stalled.text">'
        f"{html.escape(s.stalled.text)}</span></p>"
    )


def promote_html(s: StatusSnapshot) -> str:
    """`fanout promote --run-dir`'s newest decision, and the FLOOR warning when its
    candidate was at the acceptance floor (not served); empty when none was recorded."""
    if s.promote is None:
        return ""
    p = s.promote
    line, floor = promote_texts(p.model_dump(mode="json"))
    warn = f'<p class="warn" data-key="promote.floor">{html.escape(floor)}</p>' if floor else ""
    return (
        f'<h2>promote</h2>{warn}<p data-key="promote.decision">{html.escape(line)}</p>'
        f'<p class="note">{html.escape(p.why)} · served dir {html.escape(p.served_dir)}</p>'
    )


def verifier_html(s: StatusSnapshot) -> str:
    """A run whose verifier changes: the newest version, live windows by version, and each
    consumer's version, lag and windows skipped as too old; empty for another run."""
    v = s.verifier
    if v is None:
        return ""
    live = ", ".join(f"v{k}: {n}" for k, n in v.live.items()) or "none"
    rows = "".join(
        f"<tr><td>{html.escape(c.id)}</td>"
        f"<td>{'-' if c.verifier_version is None else c.verifier_version}</td>"
        f"<td>{'-' if c.verifier_lag is None else c.verifier_lag}</td>"
        f"<td>{c.lag_skipped}</td></tr>"
        for c in s.consumers
    )
    head = "<tr><th>consumer</th><th>at version</th><th>behind</th><th>skipped as too old</th></tr>"
    return (
        f'<h2>verifier</h2><p>newest version <span data-key="verifier.newest">{v.newest}</span>'
        f" · live windows by version: {html.escape(live)}</p><table>{head}{rows}</table>"
    )


def _cell(key: str, value: object) -> str:
    shown = "-" if value is None else value
    return f'<td data-key="{html.escape(key)}">{html.escape(str(shown))}</td>'


def _table(rows: list[dict[str, Any]], cols: list[str], prefix: str, id_key: str) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(_cell(f"{prefix}.{r[id_key]}.{c}", r.get(c)) for c in cols) + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


REPLICA_COLS = ["rank", "state", "host", "pid", "windows", "windows_per_s", "heartbeat_age_s",
                "waiting"]  # fmt: skip
CONSUMER_COLS = ["id", "family", "dp_rank", "dp_world", "state", "cursor", "lag_windows",
                 "step", "eal", "rows_per_s", "eta_s", "waiting"]  # fmt: skip
STYLE = """body{font:14px sans-serif;margin:1em;color:#222}td,th{padding:2px 8px;text-align:right}
table{border-collapse:collapse;margin:.5em 0}tr:nth-child(even){background:#f4f4f4}
.note{color:#666}.warn{color:#B00;font-weight:bold}.plots{display:flex;flex-wrap:wrap;gap:4px 16px}
figure{margin:0}figcaption{font-weight:bold;margin:.3em 0}
.legend{list-style:none;padding:0;margin:0 0 .4em;max-width:600px;font-size:12px}
.legend li{display:inline-block;margin-right:14px}.legend svg{vertical-align:middle;margin-right:4px}"""


def page_html(s: StatusSnapshot, samples: Sequence[Sample], refresh_s: float) -> str:
    """One page with the same numbers as `--json` (each cell's `data-key` names the
    field) and the plots, refreshing itself every `refresh_s` seconds."""
    t = s.totals.model_dump()
    totals = "".join(
        f"<tr><th>{html.escape(k)}</th>{_cell('totals.' + k, v)}</tr>" for k, v in t.items()
    )
    producer = f"{s.producer.state}" + (f" ({s.blocked.text})" if s.blocked else "")
    dump = s.model_dump(mode="json")
    span = samples[-1].t - samples[0].t if len(samples) > 1 else 0.0
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{refresh_s:g}">
<title>fanout status {html.escape(s.run_dir)}</title><style>{STYLE}</style></head><body>
<h1>fanout run {html.escape(s.run_dir)}</h1>
{stalled_html(s)}
<p>stream {html.escape(s.stream_id)} · length {s.stream.length_windows or "∞"} windows ·
producer <span data-key="producer.state">{html.escape(producer)}</span> ·
taken {time.strftime("%H:%M:%S", time.localtime(s.taken_wall))}</p>
{plots_html(samples)}
<p class="note">{len(samples)} samples over the last {span:.0f} s, one every
{refresh_s:g} s and one per request, kept in this server's memory</p>
{promote_html(s)}
{drift_html(s)}
{verifier_html(s)}
<h2>totals</h2><table>{totals}</table>
<h2>replicas</h2>{_table(dump["replicas"], REPLICA_COLS, "replicas", "rank")}
<h2>consumers</h2>{_table(dump["consumers"], CONSUMER_COLS, "consumers", "id")}
<p class="note">the same numbers: <a href="status.json">status.json</a> ·
<a href="metrics">metrics</a> · refreshes every {refresh_s:g} s</p>
</body></html>
"""
