"""`fanout status --serve PORT` and `--watch` (issue 45): Prometheus metrics checked with
prometheus_client's own parser, a page whose numbers are `--json`'s, a terminal view that
Ctrl-C ends with exit 0, and the misuses (a port in use, `--watch` without a terminal,
a run dir that is not a run), one line and exit 1 each.

    .venv/bin/pytest tests/test_status_serve.py -x -q
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import pty
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fanout.cli import main as cli_main
from fanout.coord.coordinator import Coordinator
from fanout.status.serve import StatusServer
from test_coordinator import new_run, produce

AGES = ("heartbeat_age_s", "taken_wall")  # the wall clock moves between two requests


def page_cells(page: str) -> dict[str, str]:
    """The status page's table cells by their data-key (totals.X, replicas.<rank>.X,
    consumers.<id>.X): what tests/test_status_page.py and test_journey_postgres.py read."""
    cells = re.findall(r'<td data-key="([^"]+)">([^<]*)</td>', page)
    return {html.unescape(k): html.unescape(v) for k, v in cells}


def assert_cells_match(cells: dict[str, str], want: dict[str, Any], skip: tuple[str, ...]) -> int:
    """Every cell shows its field of `want` (`status --json`; "-" for none), the fields
    in `skip` aside (they move with the clock); returns how many were compared."""
    flat = {f"totals.{k}": v for k, v in want["totals"].items()}
    for r in want["replicas"]:
        flat |= {f"replicas.{r['rank']}.{k}": v for k, v in r.items()}
    for c in want["consumers"]:
        flat |= {f"consumers.{c['id']}.{k}": v for k, v in c.items()}
    checked = 0
    for key, shown in cells.items():
        if key.rsplit(".", 1)[1] in skip:
            continue
        v = flat[key]
        assert shown == ("-" if v is None else str(v)), (key, shown, v)
        checked += 1
    return checked


@pytest.fixture
def settled_run(tmp_path: Path) -> Path:
    """A run whose numbers stand still: 3 windows made by a producer that finished, a
    DP rank of a dspark draft that acked 2 and stopped (so every rate is fixed)."""
    co, store, c = new_run(tmp_path, None, max_live_windows=4, total_windows=6)
    p = co.register_producer(c)
    log = tmp_path / "train_log.jsonl"
    log.write_text('{"step": 4, "eal": 2.25}\n')
    reg = co.register_consumer(
        "d", dp_rank=0,
        about={"family": "dspark", "dp_world": 2, "max_windows": None, "metrics_log": str(log)},
    )  # fmt: skip
    for _ in range(3):
        produce(co, p, store, c)
    for _ in range(2):
        lease = co.acquire(reg, timeout_s=1)
        assert lease is not None
        co.ack(lease)
    co.stop(reg)
    co.finish_producer(p, stream_end=6)
    co.close()
    return tmp_path / "run"


@contextlib.contextmanager
def serving(run_dir: Path, interval_s: float = 0.1) -> Iterator[StatusServer]:
    """The server in a thread that opens its own coordinator connection (as the CLI's),
    shut down on leaving."""
    ready: queue.Queue[StatusServer | BaseException] = queue.Queue()

    def serve() -> None:
        try:
            with Coordinator.open(run_dir) as co:
                srv = StatusServer(co, "127.0.0.1", 0, interval_s)
                ready.put(srv)
                srv.run()
        except BaseException as e:  # surfaced by the test
            ready.put(e)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    srv = ready.get(timeout=60)
    assert isinstance(srv, StatusServer), srv
    try:
        yield srv
    finally:
        srv.shutdown()
        t.join(30)
    assert not t.is_alive()


@pytest.fixture
def server(settled_run: Path) -> Iterator[StatusServer]:
    with serving(settled_run) as srv:
        yield srv


def _get(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode(), r.headers["Content-Type"]


def _json(run: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert cli_main(["status", "--run-dir", str(run), "--json"]) == 0
    return dict(json.loads(capsys.readouterr().out))


def strip(x: Any, skip: tuple[str, ...] | set[str] = AGES) -> Any:
    """`status --json` output without the fields in `skip` (they move with the clock),
    at every depth (tests/test_journey_postgres.py compares with it too)."""
    if isinstance(x, dict):
        return {k: strip(v, skip) for k, v in x.items() if k not in skip}
    if isinstance(x, list):
        return [strip(v, skip) for v in x]
    return x


def test_metrics_page_and_json_agree_with_status_json(
    server: StatusServer, settled_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    want = _json(settled_run, capsys)
    served, kind = _get(server.url + "status.json")
    assert kind.startswith("application/json")
    assert strip(json.loads(served)) == strip(want)

    text, kind = _get(server.url + "metrics")
    assert kind.startswith("text/plain; version=0.0.4")
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for f in fams.values():  # Prometheus' conventions
        assert f.name.startswith("fanout_"), f.name
        if f.type == "counter":
            assert all(s.name.endswith("_total") for s in f.samples), f
        assert not re.search(r"_s$|_ms$|_secs?$", f.name), f.name  # base units, spelled out

    def value(name: str, **labels: Any) -> float:
        fam = fams[name.removesuffix("_total")]
        (v,) = [s.value for s in fam.samples
                if all(s.labels.get(k) == str(x) for k, x in labels.items())]  # fmt: skip
        return float(v)

    t = want["totals"]
    assert value("fanout_windows_made_total") == t["windows_made"] == 3
    assert value("fanout_windows_live") == t["windows_live"]
    assert value("fanout_windows_ready") == t["windows_ready"]
    assert value("fanout_ready_bytes") == want["ready_bytes"]
    assert value("fanout_max_live_windows") == t["max_live_windows"] == 4
    assert value("fanout_producer_windows_per_second") == t["producer_windows_per_s"]
    assert value("fanout_stream_length_windows") == want["stream"]["length_windows"] == 6
    (r,) = want["replicas"]
    assert value("fanout_replica_state", rank=0, state="finished") == 1
    assert value("fanout_replica_state", rank=0, state="active") == 0
    assert value("fanout_replica_windows_total", rank=0) == r["windows"] == 3
    assert value("fanout_replica_windows_per_second", rank=0) == r["windows_per_s"]
    (c,) = want["consumers"]
    who = {"consumer": "d:dp0", "family": "dspark", "dp_rank": 0}
    assert value("fanout_consumer_state", **who, state="stopped") == 1
    assert value("fanout_consumer_cursor", **who) == c["cursor"] == 2
    assert value("fanout_consumer_lag_windows", **who) == c["lag_windows"] == 1
    assert value("fanout_consumer_step", **who) == c["step"] == 4
    assert value("fanout_consumer_eal", **who) == c["eal"] == 2.25
    assert value("fanout_consumer_rows_per_second", **who) == c["rows_per_s"]
    assert c["rows_per_s"] is not None and c["rows_per_s"] > 0

    page, kind = _get(server.url)
    assert kind.startswith("text/html") and 'http-equiv="refresh"' in page
    cells = page_cells(page)
    assert cells, page
    checked = assert_cells_match(cells, want, AGES)
    assert checked >= 20 and cells["consumers.d:dp0.family"] == "dspark"
    time.sleep(0.3)  # a few samples: the plot is drawn
    page, _ = _get(server.url)
    assert "<svg" in page and "windows live" in page
    with pytest.raises(urllib.error.HTTPError):
        _get(server.url + "nope")


def test_a_port_in_use_a_run_that_is_not_one_and_watch_without_a_terminal(
    settled_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line on stderr and exit 1 each."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = cli_main(["status", "--run-dir", str(settled_run), "--serve", str(port)])
        err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert f"--serve {port}: cannot listen on 127.0.0.1:{port}" in err
    (tmp_path / "empty").mkdir()
    (tmp_path / "a-file").write_text("not a run\n")
    for not_a_run in ("empty", "a-file", "missing"):  # a folder, a file, nothing there
        where = str(tmp_path / not_a_run)
        code = cli_main(["status", "--run-dir", where, "--serve", "0", "--wait-s", "0"])
        err = capsys.readouterr().err
        assert code == 1 and err.count("\n") == 1, err
        assert f"{where}: no coordinator database" in err and "Traceback" not in err, err
    code = cli_main(["status", "--run-dir", str(settled_run), "--watch"])  # capsys: no tty
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert "--watch redraws a terminal, and stdout is not one" in err


def test_watch_redraws_in_a_terminal_and_ctrl_c_exits_0(settled_run: Path) -> None:
    """In a pseudo-terminal: the table, redrawn (rich moves the cursor up over it, no
    clear-screen), until SIGINT, then exit 0."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fanout.cli", "status", "--run-dir", str(settled_run),
         "--watch", "--interval-s", "0.2"],
        stdin=slave, stdout=slave, stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + 60
    while seen.count(b"Ctrl-C to stop") < 3 and time.monotonic() < deadline:
        try:
            seen += os.read(master, 65536)
        except OSError:
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    os.close(master)
    assert proc.returncode == 0, err
    text = seen.decode(errors="replace")
    assert text.count("Ctrl-C to stop") >= 3, text[-2000:]
    assert "d:dp0" in text and "producer finished" in text
    assert "\x1b[2J" not in text  # never cleared: redrawn in place


def test_serve_started_before_the_run_waits_for_it(tmp_path: Path) -> None:
    """#52: `status --serve` started before the producer created the run exited 1; a
    monitor waits for it, as trainers do (saying so), then serves it."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fanout.cli", "status", "--run-dir", str(run), "--serve", "0",
         "--wait-s", "120", "--interval-s", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None and proc.stdout is not None
        first = proc.stderr.readline()
        assert "waiting for a producer to create the run" in first, first
        assert proc.poll() is None  # still waiting, not refused
        co, _, _ = new_run(tmp_path)
        co.close()
        line = proc.stdout.readline()
        url = re.search(r"serving (http://\S+/)", line)
        assert url, line
        metrics, _ = _get(url.group(1) + "metrics")
        assert "fanout_windows_live" in metrics
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)  # waits, and closes both pipes


def test_metrics_count_what_a_followed_source_gave(settled_run: Path) -> None:
    """#52: /metrics had no follow counters; an operator alerts on bad traffic (records
    skipped or split) from them. Checked with prometheus_client's parser."""
    from fanout.status.schema import FollowPosition
    from fanout.status.serve import metrics_text
    from fanout.status.snapshot import build

    with Coordinator.open(settled_run) as co:
        s = build(co)
    assert "fanout_follow_" not in metrics_text(s)  # not a live run: no such family
    f = FollowPosition(chunks=3, records=40, heldout=4, skipped=2, split=1, committed_wall=1.0)
    text = metrics_text(s.model_copy(update={"follow": f}))
    got = {
        fam.name: fam.samples[0].value
        for fam in text_string_to_metric_families(text)
        if fam.name.startswith("fanout_follow_")
    }
    assert got == {"fanout_follow_chunks": 3, "fanout_follow_records": 40,
                   "fanout_follow_heldout": 4, "fanout_follow_skipped": 2,
                   "fanout_follow_split": 1}, got  # fmt: skip


def test_the_page_shows_stalled_and_the_acceptance_floor_as_the_text_status_does(
    tmp_path: Path,
) -> None:
    """#52: the text status put STALLED first and a FLOOR warning under `fanout promote`'s
    decision, /status.json carried both, the page neither: an operator watching the page
    saw a healthy run. Now the page says both in the table's words, and neither once the
    run trains again and a candidate is above the floor. A window's publish stamp is set
    back in the database (no timing in the test)."""
    from fanout.decode.config import PROMOTE
    from fanout.status.table import format_table

    co, store, c = new_run(tmp_path, None, max_live_windows=3)
    produce(co, co.register_producer(c), store, c)  # window 0 ready, no trainer
    with co.conn.write() as cur:  # published 1000 s ago: nothing trained since
        cur.execute("UPDATE windows SET updated_at = updated_at - 1000")
    run = tmp_path / "run"
    (run / "follow").mkdir(parents=True, exist_ok=True)
    look = {"time": "2026-12-07T15:00:00Z", "candidate": "/d/c0/checkpoint-4",
            "candidate_tau": 1.0, "served_dir": "/srv/served", "promoted": False,
            "floor": True, "why": "candidate τ 1.000 is at the floor"}  # fmt: skip
    (run / "follow" / PROMOTE).write_text(json.dumps(look))
    with serving(run) as srv:
        page = _get(srv.url)[0]
        want = json.loads(_get(srv.url + "status.json")[0])
    assert want["stalled"]["window"] == 0 and want["promote"]["floor"] is True
    table = format_table(want)
    stalled = table.splitlines()[1].removeprefix("STALLED  ")
    floor = next(x.strip() for x in table.splitlines() if "FLOOR:" in x)
    assert stalled.startswith("nothing trained for"), table
    shown = {k: html.unescape(v) for k, v in re.findall(r'data-key="([^"]+)">([^<]*)<', page)}
    assert shown["stalled.text"] == stalled == want["stalled"]["text"]
    assert shown["promote.floor"] == floor
    assert page.index('data-key="stalled.text"') < page.index("<h2>")  # the first warning
    assert 'class="warn" data-key="promote.floor"' in page
    # trained past it, and a candidate above the floor: no warning left
    lease = co.acquire(co.register_consumer("a"), timeout_s=1)
    assert lease is not None
    co.ack(lease)
    co.close()
    (run / "follow" / PROMOTE).write_text(
        json.dumps(look | {"candidate_tau": 2.5, "floor": False, "promoted": True,
                           "version": "v0001", "why": "nothing served yet"})
    )  # fmt: skip
    with serving(run) as srv:
        page = _get(srv.url)[0]
    assert "STALLED" not in page and "FLOOR" not in page
    assert "(τ 2.50) promoted as v0001" in page
