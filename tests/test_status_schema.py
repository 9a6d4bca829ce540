"""`fanout status --json`'s versioned schema (fanout.status.schema) and what it adds:
totals, a replica stopped by a signal told from one that finished, each consumer's
family, data-parallel group, rate, ETA and why it waits (issue 45.1-3).

    .venv/bin/pytest tests/test_status_schema.py -x -q

A real run's output validating against the model is in tests/test_journey.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fanout.cli import main as cli_main
from fanout.coord.coordinator import Coordinator
from fanout.coord.grants import ProducerPlan
from fanout.status import commands as status_commands
from fanout.status.schema import BEGIN, END, StatusSnapshot
from fanout.status.snapshot import build, snapshot
from fanout.status.table import format_table
from test_coordinator import make_contract, new_run, produce

DOCS = Path(__file__).parents[1] / "docs" / "operations.md"


def test_the_docs_schema_is_the_models() -> None:
    """docs/operations.md's generated block is StatusSnapshot's JSON Schema, exactly."""
    text = DOCS.read_text()
    block = text[text.index(BEGIN) : text.index(END)]
    (body,) = re.findall(r"```json\n(.*?)```", block, re.S)
    assert json.loads(body) == StatusSnapshot.model_json_schema()
    assert StatusSnapshot.model_json_schema()["properties"]["schema_version"]["const"] == 2


def test_status_reads_the_coordinator_without_sql_of_its_own() -> None:
    """fanout.status asks coord's read API (fanout.coord.reads, the Coordinator): no
    statement of its own, which its import-linter contract cannot see (a
    `co.conn.execute` needs no import). The SQL stays in coord/, written once."""
    pkg = Path(status_commands.__file__).parent
    sql = re.compile(r"\.execute\(|\b(SELECT|INSERT|UPDATE|DELETE)\s")
    bad = [
        f"{f.name}:{i}: {line.strip()}"
        for f in sorted(pkg.glob("*.py"))
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if sql.search(line)
    ]
    assert bad == []


def test_live_is_what_k_bounds_and_the_bytes_are_the_ready_ones(
    db: str | None, tmp_path: Path
) -> None:
    """`live` means one thing: the windows K bounds (ready + capturing + evicting).
    The bytes on disk are the ready windows' only, and say so (`ready_bytes`, schema 2;
    the table's `bytes    ready`)."""
    co, store, c = new_run(tmp_path, db, max_live_windows=4)
    p = co.register_producer(c)
    produce(co, p, store, c)  # window 0: ready
    assert co.claim(p) is not None  # window 1: capturing, live but not ready
    s = snapshot(co)
    assert (s["totals"]["windows_live"], s["totals"]["windows_ready"]) == (2, 1)
    assert s["ready_bytes"] == co.ready_windows()[1] > 0 and "live_bytes" not in s
    table = format_table(s)
    assert "totals   live 2/K=4 " in table, table
    assert f"bytes    ready {s['ready_bytes'] / 2**20:.1f} MiB " in table, table


def test_a_signal_stop_shows_stopped_until_the_replica_rejoins(
    db: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two replicas: rank 1 stopped by a signal shows `stopped` (and how to restart it)
    even after rank 0 ends the stream by design; rank 0 shows `finished`; rank 1
    rejoining shows `active` again. The database records both exits as `finished`."""
    co, store, c = new_run(tmp_path, db, max_live_windows=4, total_windows=2)
    plan = ProducerPlan(replicas=2)
    other = Coordinator.open(tmp_path / "run", db_path=db)
    p0 = co.register_producer(c, rank=0, plan=plan)
    p1 = other.register_producer(make_contract(), rank=1, plan=plan)
    produce(co, p0, store, c)
    other.finish_producer(p1, stream_end=None)  # SIGINT
    s = snapshot(co)
    assert [(r["rank"], r["state"], r["recorded_state"]) for r in s["replicas"]] == [
        (0, "active", "active"), (1, "stopped", "finished"),
    ]  # fmt: skip
    assert s["replicas"][1]["waiting"].startswith("stopped by a signal")
    assert "replica rank 1" in s["replicas"][1]["waiting"]
    assert s["producer"]["state"] == "active"
    table = format_table(s)
    assert "      1 stopped" in table and "  replica 1: stopped by a signal" in table, table

    produce(co, p0, store, c)
    co.finish_producer(p0, stream_end=2)  # the stream's end, by design
    s = snapshot(co)
    assert s["stream_end"] == 2
    assert [r["state"] for r in s["replicas"]] == ["finished", "stopped"]
    assert s["producer"]["state"] == "stopped"  # one is down: say so before "finished"
    assert s["totals"]["producer_windows_per_s"] == 0.0  # none active

    again = Coordinator.open(tmp_path / "run", db_path=db)
    again.register_producer(make_contract(), rank=1, plan=plan)
    assert [r["state"] for r in snapshot(co)["replicas"]] == ["finished", "active"]

    # one producer stopped by a signal: `stopped`, in the table's words
    co2, _, c2 = new_run(tmp_path / "one", None, max_live_windows=4)  # (same rule on both)
    p = co2.register_producer(c2)
    co2.finish_producer(p)
    s2 = snapshot(co2)
    assert (s2["producer"]["state"], s2["producer"]["recorded_state"]) == ("stopped", "finished")
    assert "producer stopped" in format_table(s2) and "stopped by a signal" in format_table(s2)


def test_consumers_carry_family_group_rate_eta_and_why_they_wait(
    db: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A consumer registered with what a trainer says of itself (family, rows per step,
    its train log; the stream adds its data-parallel world and budget) shows it; its
    rate is the cursor's movement since it registered, from one snapshot; the ETA is its
    remaining windows at that rate; the totals are the sum of the replica rows."""
    co, store, c = new_run(tmp_path, db, max_live_windows=4, total_windows=8)
    p = co.register_producer(c)
    log = tmp_path / "save" / "train_log.jsonl"
    log.parent.mkdir()
    log.write_text('{"step": 1, "eal": 1.5}\n{"step": 2, "eal": 1.75}\n')
    about = {"family": "dspark", "rows_per_step": 2, "metrics_log": str(log),
             "dp_world": 2, "max_windows": 6}  # fmt: skip
    reg = co.register_consumer("d", dp_rank=1, about=about)
    for _ in range(3):
        produce(co, p, store, c)
    for w in range(2):
        lease = co.acquire(reg, timeout_s=1)
        assert lease is not None and lease.window == w
        co.ack(lease)
    with co.conn.write() as cur:  # it registered 100 s ago (the record's clock is the wall's)
        key = "consumer.d:dp1"
        rec = json.loads(cur.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()[0])
        rec["since_wall"] -= 100
        cur.execute("UPDATE meta SET value=? WHERE key=?", (json.dumps(rec), key))
    snap = build(co)
    (d,) = snap.consumers
    assert (d.id, d.name, d.dp_rank, d.dp_world, d.family) == ("d:dp1", "d", 1, 2, "dspark")
    assert (d.step, d.eal, d.cursor, d.end_window) == (2, 1.75, 2, 6)  # its budget < 8
    assert d.windows_per_s is not None
    assert d.windows_per_s == pytest.approx(2 / 100, rel=1e-2)
    assert d.rows_per_s == pytest.approx(d.windows_per_s * 2, rel=1e-2)
    assert d.eta_s == pytest.approx(4 / d.windows_per_s, rel=1e-2)
    assert d.waiting is None  # window 2 is ready
    t = snap.totals
    assert (t.windows_made, t.windows_ready, t.max_live_windows) == (3, 1, 4)
    assert t.windows_live == 1 and (t.replicas, t.replicas_active) == (1, 1)
    active = [r.windows_per_s or 0.0 for r in snap.replicas if r.state == "active"]
    assert t.producer_windows_per_s == pytest.approx(sum(active), abs=1e-3) and active[0] > 0
    assert (snap.stream.length_windows, snap.stream.ended) == (8, False)

    lease = co.acquire(reg, timeout_s=1)
    assert lease is not None
    co.ack(lease)  # window 3 is not made: it waits, and says for what
    (d,) = build(co).consumers
    assert d.waiting is not None and "the producer is capturing" in d.waiting, d.waiting
    run = ["status", "--run-dir", str(co.root), *(["--db-path", db] if db else [])]
    assert cli_main(run) == 0
    table = capsys.readouterr().out
    row = next(x for x in table.splitlines() if x.startswith("d:dp1 "))
    assert " dspark " in row and " 1/2 " in row and "      2 " in row, row
    assert "  d:dp1: waiting: the producer is capturing" in table
    assert cli_main([*run, "--json"]) == 0
    out = StatusSnapshot.model_validate_json(capsys.readouterr().out)
    assert out.schema_version == 2 and out.consumers[0].cursor == 3

    co.finish(reg)
    (d,) = build(co).consumers
    assert (d.state, d.eta_s, d.waiting) == ("finished", 0.0, None)
    rate = d.windows_per_s  # up to its exit, not to now: it stays put
    assert rate is not None and build(co).consumers[0].windows_per_s == rate
