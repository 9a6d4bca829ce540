"""`fanout status --serve`'s page (issue 45) rendered by headless Chromium: the
screenshot is a real render with the plots' colours in it, and the rendered DOM's
numbers (totals, each replica's and each consumer's cells, each plot's newest values)
are /status.json's. Skips when Debian's chromium (/usr/bin/chromium) is not installed
(`apt-get install -y chromium`; CI's .ci/run installs it when it can).

    .venv/bin/pytest tests/test_status_page.py -x -q
"""

from __future__ import annotations

import html
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from fanout.coord.grants import ProducerPlan
from fanout.status.page import COLOURS, DASHES, Sample, nice_ticks, plots_html
from fanout.status.serve import StatusServer
from test_coordinator import new_run, produce
from test_status_serve import AGES, _get, assert_cells_match, page_cells, serving

CHROMIUM = Path("/usr/bin/chromium")
ROUNDS = 8
LOOK = r'<polyline [^>]*stroke="(#\w+)" stroke-width="2"(?: stroke-dasharray="([^"]*)")?'


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={tmp_path / 'chromium'}", *args]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture
def moving_run(tmp_path: Path) -> Iterator[tuple[StatusServer, Path]]:
    """A run that moves while its status server samples it, then settles (so the page's
    numbers stand still): two producer replicas take turns publishing 8 windows; draft
    `a` (dflash) acks each, draft `b` (dspark) has two DP ranks, dp1 behind dp0; a and
    b:dp0 log a rising EAL. One sample per round (each request takes one)."""
    co, store, c = new_run(tmp_path, None, max_live_windows=6, total_windows=12)
    plan = ProducerPlan(2)
    reps = [co.register_producer(c, rank=r, plan=plan) for r in range(2)]
    logs = {n: tmp_path / f"{n}.jsonl" for n in ("a", "b")}
    regs = {
        "a": co.register_consumer("a", about={"family": "dflash", "dp_world": 1,
                                              "metrics_log": str(logs["a"])}),
        "b:dp0": co.register_consumer("b", dp_rank=0, about={
            "family": "dspark", "dp_world": 2, "metrics_log": str(logs["b"])}),
        "b:dp1": co.register_consumer("b", dp_rank=1, about={"family": "dspark",
                                                             "dp_world": 2}),
    }  # fmt: skip
    acks = {"a": lambda i: True, "b:dp0": lambda i: i % 2 == 0, "b:dp1": lambda i: i % 3 == 0}
    run = tmp_path / "run"
    with serving(run, interval_s=60) as srv:  # 60: the page does not reload under test
        for i in range(ROUNDS):
            produce(co, reps[i % 2], store, c)
            for who, reg in regs.items():
                if acks[who](i):
                    lease = co.acquire(reg, timeout_s=1)
                    assert lease is not None
                    co.ack(lease)
            with logs["a"].open("a") as f:
                f.write(json.dumps({"step": 10 * (i + 1), "eal": 1.5 + 0.25 * i}) + "\n")
            if i % 2:
                with logs["b"].open("a") as f:
                    f.write(json.dumps({"step": 10 * (i + 1), "eal": 1.25 + 0.125 * i}) + "\n")
            _get(srv.url + "status.json")
        for reg in regs.values():
            co.stop(reg)
        for p in reps:
            co.finish_producer(p, stream_end=ROUNDS)
        co.close()
        for _ in range(3):  # the settled tail
            _get(srv.url + "status.json")
        yield srv, run


@pytest.mark.skipif(
    not CHROMIUM.exists(), reason=f"{CHROMIUM} is not installed (apt-get install -y chromium)"
)
def test_the_page_renders_in_chromium_with_the_numbers_of_status_json(
    moving_run: tuple[StatusServer, Path], tmp_path: Path
) -> None:
    srv, _ = moving_run
    png = tmp_path / "page.png"
    _chromium(tmp_path, f"--screenshot={png}", "--window-size=1280,2000", srv.url)
    dom = _chromium(tmp_path, "--dump-dom", srv.url).stdout
    want = json.loads(_get(srv.url + "status.json")[0])  # the run stands still now

    # the screenshot: a real render, with the plots' lines in it
    img = np.asarray(Image.open(png).convert("RGB")).astype(np.int16)  # (H, W, 3)
    assert img.shape == (2000, 1280, 3)
    ink = int((img.min(axis=2) < 200).sum())
    assert ink > 10_000, f"{ink} non-white pixels: blank?"
    # blue: windows live, replica 0, draft a; vermillion: K, replica 1, draft b. A line
    # across a plot is ~900 px of its colour (2 px wide); the legends' four swatches
    # of a colour hold < 200 px together, so the count shows lines were plotted
    for colour in COLOURS[:2]:
        want_rgb = np.frombuffer(bytes.fromhex(colour[1:]), np.uint8).astype(np.int16)
        n = int((np.abs(img - want_rgb).max(axis=2) <= 40).sum())
        assert n > 600, f"{n} pixels of {colour}: the plots' lines are not drawn"

    # the DOM: every cell's number is /status.json's (ages and the time taken move)
    cells = page_cells(dom)
    checked = assert_cells_match(cells, want, AGES)
    assert checked == 9 + 2 * 7 + 3 * 12, sorted(cells)  # every cell but the ages
    assert cells["totals.windows_made"] == str(ROUNDS) == str(want["totals"]["windows_made"])
    assert [cells[f"replicas.{r}.windows"] for r in (0, 1)] == ["4", "4"]
    assert cells["consumers.b:dp1.lag_windows"] == str(ROUNDS - 3)
    assert cells["consumers.a:dp0.eal"] == str(1.5 + 0.25 * (ROUNDS - 1))

    # the plots: four figures, each line's newest value in its legend is /status.json's
    figs = dict(re.findall(r'<figure id="plot-(\w+)">(.*?)</figure>', dom, re.S))
    assert sorted(figs) == ["eal", "lag", "live", "rates"]

    def legend(fig: str) -> dict[str, float | None]:
        items = re.findall(r"</svg>([^<]+?) <b>([^<]*)</b>", figs[fig])
        return {html.unescape(k): None if v == "-" else float(v) for k, v in items}

    def near(a: float | None, b: float | None) -> bool:  # the legend shows 3 digits
        if a is None or b is None:
            return a is b
        return abs(a - b) <= 0.005 * abs(b)

    t = want["totals"]
    assert legend("live") == {"windows live": t["windows_live"], "K (max live)": 6}
    rates = legend("rates")
    assert sorted(rates) == ["active replicas, summed", "replica 0", "replica 1"]
    for r in want["replicas"]:
        assert near(rates[f"replica {r['rank']}"], r["windows_per_s"]), (rates, r)
    assert rates["active replicas, summed"] == t["producer_windows_per_s"] == 0  # finished
    cons: dict[str, list[dict[str, Any]]] = {}
    for c in want["consumers"]:
        cons.setdefault(f"{c['name']} ({c['family']})", []).append(c)
    assert legend("lag") == {d: max(c["lag_windows"] for c in cs) for d, cs in cons.items()}
    assert legend("lag") == {"a (dflash)": 0, "b (dspark)": ROUNDS - 3}
    eal = legend("eal")
    assert sorted(eal) == ["a (dflash)", "b (dspark)"]
    for d, cs in cons.items():
        assert near(eal[d], cs[0]["eal"]), (eal, cs)  # b: dp0's (dp1 logs none)
    for fig in figs.values():  # lines distinguishable: colour and dash, drawn, labelled
        assert "<polyline" in fig and "time (s, 0 = " in fig
    looks = re.findall(LOOK, figs["lag"])
    assert sorted(set(looks)) == [(COLOURS[0], DASHES[0]), (COLOURS[1], DASHES[1])], looks


def test_plots_draw_gaps_ticks_and_cycle_colour_and_dash() -> None:
    """Without a browser: a value not known splits the line, ticks are round, and the
    ninth line differs from the first in dash when its colour repeats."""
    assert nice_ticks(7) == [0, 2, 4, 6, 8]
    assert nice_ticks(0.37) == pytest.approx([0, 0.1, 0.2, 0.3, 0.4])
    rates: list[float | None] = [1.0, None, 2.0, 2.5, None, None]
    samples = [
        Sample(
            t=100.0 + i,
            live=i,
            k=4,
            producer_rate=1.0,
            replica_rates={0: v},
            lag={f"d{j}": j for j in range(9)},
            eal={"d0": None},
        )
        for i, v in enumerate(rates)
    ]
    page = plots_html(samples)
    figs = dict(re.findall(r'<figure id="plot-(\w+)">(.*?)</figure>', page, re.S))
    # replica 0: a point alone (a dot), then a two-point line; never a line across a gap
    assert figs["rates"].count("<circle") == 1 and figs["rates"].count("<polyline") == 1
    assert "<polyline" not in figs["eal"] and "d0 <b>-</b>" in figs["eal"]
    looks = re.findall(LOOK, figs["lag"])
    assert len(looks) == 9 and len(set(looks)) == 9, looks
    assert looks[7] == (COLOURS[0], DASHES[3]) and looks[0] == (COLOURS[0], "")
    assert plots_html(samples[:1]).count("start after two samples") == 1
