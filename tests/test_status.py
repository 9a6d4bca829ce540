"""`fanout status`: how it ended, for the producer and each consumer.

    .venv/bin/pytest tests/test_status.py -x -q

A clean exit is recorded (producer `finished`; consumer `finished` at the end of
its stream, `stopped` before it); a process that vanished without one shows `lost`
at once when it ran on this host (its pid is gone), else once its heartbeat is older
than ttl. Real child processes, both backends. The real `fanout produce` exiting 0
is in tests/test_roles.py.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from fanout.cli import main as cli_main
from fanout.coord.coordinator import Coordinator, RunConfig
from fanout.status.snapshot import snapshot
from fanout.status.table import format_table
from fanout.store.store import RunDir
from test_coordinator import make_contract

CTX = mp.get_context("spawn")


def _child(root: str, db: str | None, clean: bool, ready: Any) -> None:
    """Take the producer role and consumers a and b; then end cleanly (b read its
    stream to the end, a stopped before it, the producer finished) or hang until
    SIGKILLed."""
    co = Coordinator.open(root, db_path=db)
    p = co.register_producer(make_contract())
    a, b = co.register_consumer("a"), co.register_consumer("b")
    if clean:
        co.finish(b)
        co.stop(a)
        co.finish_producer(p, stream_end=0)  # by design (a signal: `stopped`, test_status_schema)
        co.close()
    ready.put(os.getpid())
    if not clean:
        time.sleep(600)


def _run_child(co: Coordinator, db: str | None, clean: bool) -> int:
    ready = CTX.Queue()
    p = CTX.Process(target=_child, args=(str(co.root), db, clean, ready))
    p.start()
    pid = int(ready.get(timeout=120))
    if not clean:
        os.kill(pid, signal.SIGKILL)
    p.join(60)
    assert p.exitcode == (0 if clean else -signal.SIGKILL)
    return pid


def _states(co: Coordinator) -> dict[str, tuple[str, str]]:
    s = snapshot(co)
    out = {c["id"]: (c["state"], c["recorded_state"]) for c in s["consumers"]}
    out["producer"] = (s["producer"]["state"], s["producer"]["recorded_state"])
    return out


def test_clean_exits_are_recorded_and_vanished_processes_show_lost(
    db: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rd = RunDir(tmp_path / "run").create()
    co = Coordinator.create(rd.root, make_contract(), RunConfig(ttl_s=600), db_path=db)
    run = ["status", "--run-dir", str(rd.root), *(["--db-path", db] if db else [])]

    pid = _run_child(co, db, clean=True)
    assert _states(co) == {
        "a:dp0": ("stopped", "stopped"),
        "b:dp0": ("finished", "finished"),
        "producer": ("finished", "finished"),
    }
    assert cli_main(run) == 0
    table = capsys.readouterr().out
    assert f"producer finished  {socket.gethostname()}:{pid}  exited" in table

    # Every role was released: a new process takes them all without --takeover.
    pid = _run_child(co, db, clean=False)  # then SIGKILLed: no clean exit recorded
    states = _states(co)
    assert states == {
        "a:dp0": ("lost", "active"),
        "b:dp0": ("lost", "active"),
        "producer": ("lost", "active"),
    }  # at once (pid gone on this host), with 600 s of ttl still to run
    assert cli_main(run) == 0
    table = capsys.readouterr().out
    assert "producer lost" in table and "last heartbeat" in table
    assert [line.split()[1] for line in table.splitlines() if line.startswith("a:dp0")] == ["lost"]

    # A live one is active; one on another host shows lost once its heartbeat is
    # older than ttl (the wall clock, for people: the reclaimer uses the counter).
    co.register_consumer("c")
    assert _states(co)["c:dp0"] == ("active", "active")
    with co.conn.write() as cur:
        cur.execute(
            "UPDATE consumers SET host='elsewhere', pid=7, proc='other-boot/pid:[1]/3' "
            "WHERE id='c:dp0'"
        )
    assert _states(co)["c:dp0"] == ("active", "active")
    with co.conn.write() as cur:
        cur.execute("UPDATE consumers SET hb_wall=hb_wall-601 WHERE id='c:dp0'")
    assert _states(co)["c:dp0"] == ("lost", "active")
    assert cli_main([*run, "--json"]) == 0
    c = json.loads(capsys.readouterr().out)["consumers"][2]
    assert (c["id"], c["host"], c["pid"], c["state"]) == ("c:dp0", "elsewhere", 7, "lost")


def _docs_example() -> list[str]:
    """The first table under "Reading `fanout status`" in docs/operations.md."""
    text = (Path(__file__).parents[1] / "docs" / "operations.md").read_text()
    section = text[text.index("## Reading `fanout status`") :]
    return section.split("```\n", 2)[1].splitlines()


def test_the_docs_status_example_has_the_real_tables_layout(tmp_path: Path) -> None:
    """docs/operations.md's `fanout status` example cannot drift from format_table: the
    same lines in the same order, the consumer header (every column, `layers` too)
    verbatim, and each consumer row in its columns."""
    rd = RunDir(tmp_path / "run").create()
    co = Coordinator.create(rd.root, make_contract(), RunConfig(ttl_s=600))
    co.register_producer(make_contract())
    co.register_consumer("draft-b8", expect={"target_layer_ids": [2]})
    real = format_table(snapshot(co)).splitlines()
    docs = _docs_example()
    header = next(x for x in real if x.startswith("consumer "))
    assert header in docs, (header, docs)

    def labels(lines: list[str]) -> list[str]:
        top = lines[: lines.index("")]
        return list(dict.fromkeys(x.split()[0] for x in top))  # "producer" twice: blocked

    assert labels(docs) == labels(real)

    def shape(line: str) -> str:  # what the code prints, its values aside
        line = re.sub(r"/\S+|\[[^]]*\]", "X", line)  # paths, layer lists
        return re.sub(r"\b[0-9a-f]{16}\b|\d+(\.\d+)?", "N", line)  # stream ids, numbers

    for label in ("run ", "database ", "capture ", "bytes ", "events "):
        (want,) = [shape(x) for x in real if x.startswith(label)]
        (got,) = [shape(x) for x in docs if x.startswith(label)]
        assert got == want, (got, want)
    rows = docs[docs.index(header) + 1 :]
    columns = [header.index(c) for c in ("state", "holder", "layers", "leases")]
    for row in (x for x in rows if not x.startswith("  ")):
        for at in columns:  # each column starts where the header's does
            assert row[at - 1] == " " and row[at] != " ", (row, at)


def test_an_age_is_never_negative_even_when_the_heartbeat_is_ahead(tmp_path: Path) -> None:
    """Issue 45.8: a heartbeat written after status read its clock (or by a host whose
    clock runs ahead) showed as `heartbeat -0.0s ago`; every age is clamped at 0."""
    import math

    from fanout.status.snapshot import age_s

    assert age_s(100.0, 100.0004) == 0.0 and math.copysign(1, age_s(100.0, 100.0004)) == 1
    assert age_s(100.0, 130.0, 1) == 0.0 and age_s(130.0, 100.0, 1) == 30.0
    rd = RunDir(tmp_path / "run").create()
    co = Coordinator.create(rd.root, make_contract(), RunConfig(ttl_s=600))
    co.register_producer(make_contract())
    co.register_consumer("a")
    with co.conn.write() as cur:  # both heartbeats from a clock 5 s ahead
        cur.execute("UPDATE consumers SET hb_wall=hb_wall+5")
        cur.execute("UPDATE producers SET hb_wall=hb_wall+5")
    s = snapshot(co)
    ages = [s["producer"]["heartbeat_age_s"], *(c["heartbeat_age_s"] for c in s["consumers"])]
    assert ages == [0.0, 0.0] and all(math.copysign(1, a) == 1 for a in ages), ages
    table = format_table(s)
    assert "heartbeat 0.0s ago" in table and not re.search(r"-\d+(\.\d+)?s\b", table), table


def test_drift_records_of_a_live_run_are_in_the_snapshot_and_the_table(tmp_path: Path) -> None:
    """`fanout promote --run-dir` appends the served draft's τ on each newest held-out
    slice to RUN_DIR/follow/drift.jsonl: status shows the newest, and says when it fell
    below the interval the draft was promoted with."""
    rd = RunDir(tmp_path / "run").create()
    co = Coordinator.create(rd.root, make_contract(), RunConfig(ttl_s=600))
    assert snapshot(co)["drift"] == [] and "served " not in format_table(snapshot(co))
    rd.drift.parent.mkdir(parents=True)
    ok = {"time": "t1", "version": "v0002", "tau": 3.1, "ci95": [2.9, 3.3], "prompts": 32,
          "heldout_seen": 40, "baseline_ci95": [2.8, 3.2], "below": False}  # fmt: skip
    low = ok | {"time": "t2", "tau": 2.0, "ci95": [1.8, 2.2], "heldout_seen": 80, "below": True}
    rd.drift.write_text(json.dumps(ok) + "\n" + json.dumps(low) + "\n")
    s = snapshot(co)
    assert [d["time"] for d in s["drift"]] == ["t1", "t2"]
    table = format_table(s)
    assert "served   v0002 τ 2.00 (1.80–2.20) on the newest 32 held-out" in table, table
    assert "drift: below the 2.80–3.20 it was promoted with" in table, table
    from fanout.status.serve import metrics_text
    from fanout.status.snapshot import build

    text = metrics_text(build(co))
    assert "fanout_served_tau 2.0" in text and "fanout_served_drift 1" in text, text
    # the page: the newest look, the warning, and a plot once the times are real ones
    from fanout.status.page import page_html

    page = page_html(build(co), [], 5)
    assert 'data-key="drift.tau">2.00<' in page and 'class="warn" data-key="drift.below"' in page
    assert 'id="plot-drift"' not in page  # "t1", "t2" are no times to plot against
    ok["time"], low["time"] = "2026-12-05T20:00:00Z", "2026-12-05T20:05:00Z"
    rd.drift.write_text(json.dumps(ok) + "\n" + json.dumps(low) + "\n")
    page = page_html(build(co), [], 5)
    assert 'id="plot-drift"' in page and page.count("<polyline") == 5, page
    rd.drift.write_text(json.dumps(ok) + "\n")  # back within its interval: no warning
    assert "drift.below" not in page_html(build(co), [], 5)


def test_the_served_version_is_read_from_the_served_dir_a_drift_record_names(
    tmp_path: Path,
) -> None:
    """#52: status named the served version from the newest drift record, which did not
    say which served dir it measured: after a rollback it showed the rolled-back version.
    Now a record names its served dir and status reads that dir's `current`; a record
    that names none says the version is unknown."""
    rd = RunDir(tmp_path / "run").create()
    co = Coordinator.create(rd.root, make_contract(), RunConfig(ttl_s=600))
    served = tmp_path / "served"
    for v in ("v0001", "v0002"):  # committed, as promote makes them (a version without
        (served / "versions" / v).mkdir(parents=True)  # its marker is never read)
        (served / "versions" / v / "COMMITTED").write_text("")
    (served / "current").symlink_to("versions/v0002")
    rd.drift.parent.mkdir(parents=True)
    rec = {"time": "t1", "version": "v0002", "tau": 3.1, "ci95": [2.9, 3.3], "prompts": 32,
           "heldout_seen": 40, "baseline_ci95": None, "below": False}  # fmt: skip
    rd.drift.write_text(json.dumps(rec) + "\n")
    assert "served now: unknown (the newest drift record names no served dir)" in format_table(
        snapshot(co)
    )
    rd.drift.write_text(json.dumps(rec | {"served": str(served)}) + "\n")
    assert f"served now: v0002 ({served})" in format_table(snapshot(co))
    (served / "current").unlink()
    (served / "current").symlink_to("versions/v0001")  # a rollback after the look
    s = snapshot(co)
    assert s["drift"][-1]["serving_now"] == "v0001"
    assert f"served now: v0001 ({served}; the look above measured v0002)" in format_table(s)


def test_a_run_where_nothing_trained_for_too_long_shows_stalled_not_healthy(
    tmp_path: Path,
) -> None:
    """#52: a trainer that never trains looked healthy. A readable window nobody has read
    past for longer than --stalled-after-s makes the run STALLED: in the table (at the
    top), the snapshot and /metrics; reading past it ends that. Its publish stamp is set
    back in the database instead of waiting (no timing in the test)."""
    from fanout.status.serve import metrics_text
    from fanout.status.snapshot import build
    from test_coordinator import new_run, produce

    co, store, c = new_run(tmp_path, max_live_windows=3)
    p = co.register_producer(c)
    produce(co, p, store, c)  # window 0 ready, no trainer yet
    assert snapshot(co)["stalled"] is None  # just published
    with co.conn.write() as cur:  # published 1000 s ago
        cur.execute("UPDATE windows SET updated_at = updated_at - 1000")
    s = snapshot(co)
    assert s["stalled"] == {**s["stalled"], "window": 0, "behind": [], "after_s": 600.0}
    assert s["stalled"]["waited_s"] >= 1000
    table = format_table(s)
    assert table.splitlines()[1].startswith("STALLED  nothing trained for"), table
    assert "fanout_stalled 1" in metrics_text(build(co))
    reg = co.register_consumer("a")
    assert snapshot(co)["stalled"]["behind"] == ["a:dp0"]
    assert snapshot(co, stalled_after_s=5000)["stalled"] is None  # a looser bound
    lease = co.acquire(reg, timeout_s=1)
    assert lease is not None
    co.ack(lease)  # trained on it: nothing is unread now
    s = snapshot(co)
    assert s["stalled"] is None and "STALLED" not in format_table(s)
    assert "fanout_stalled 0" in metrics_text(build(co))
    co.close()
