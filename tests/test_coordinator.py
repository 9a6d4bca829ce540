"""Coordinator behaviour in one process (several connections): fencing, eviction,
lag policies, liveness on an injected clock, corrupt windows, schema, filesystems.

    .venv/bin/pytest tests/test_coordinator.py -x -q
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fanout.cli import main as cli_main
from fanout.contract import CaptureContract
from fanout.coord import retention, schema, sqlitedb, waits
from fanout.coord.coordinator import Coordinator, RunConfig
from fanout.coord.grants import Claim, ProducerReg
from fanout.coord.heartbeat import Heartbeat
from fanout.coord.liveness import Reclaimer
from fanout.errors import (
    AcquireCancelled,
    AcquireTimeout,
    ContractMismatch,
    CoordinatorFull,
    CorruptWindow,
    Detached,
    NoCoordinator,
    SchemaVersionError,
    StaleLease,
    StorageFull,
    UnsupportedFilesystem,
)
from fanout.store.store import Published, RunDir, Store, WindowMeta, window_name
from window_files import window_names


def make_contract(**kw: object) -> CaptureContract:
    base: dict[str, object] = dict(
        verifier_config_hash="cfg",
        verifier_weights_fingerprint="w",
        verifier_num_layers=4,
        hidden_size=8,
        vocab_size=32,
        target_layer_ids=(1, 2),
        dataset_fingerprint="data",
        tokenizer_fingerprint="tok",
        seq_len=4,
        window_rows=2,
        shuffle_seed=0,
    )
    base.update(kw)
    return CaptureContract.model_validate(base)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def new_run(
    tmp_path: Path, db: str | None = None, **cfg: object
) -> tuple[Coordinator, Store, CaptureContract]:
    """A run in tmp_path/run; its coordinator in the run dir (SQLite) or at URL `db`."""
    c = make_contract()
    rd = RunDir(tmp_path / "run").create()
    co = Coordinator.create(rd.root, c, RunConfig.model_validate(cfg), db_path=db)
    return co, Store(rd), c


def produce(co: Coordinator, p: ProducerReg, store: Store, c: CaptureContract) -> Claim:
    """Capture one real window file (tiny tensors) and mark it ready."""
    assert co.wait_for_capacity(p, timeout_s=0.0), "producer unexpectedly at capacity"
    cl = co.claim(p)
    assert cl is not None
    return publish(co, store, c, cl)


def publish(co: Coordinator, store: Store, c: CaptureContract, cl: Claim) -> Claim:
    """Write claim `cl`'s window file (tiny tensors) and mark it ready."""
    t = torch.arange(cl.rows[0], cl.rows[1], dtype=torch.int32).repeat_interleave(4).view(2, 4)
    meta = WindowMeta(c.stream_id, cl.window, cl.generation, 0, *cl.rows)
    co.publish_ready(cl, store.publish({"input_ids": t}, meta))
    return cl


def files(store: Store) -> list[str]:
    return window_names(store)


# ---- transactions, schema, filesystems -------------------------------------------------


def test_every_write_begins_immediate(tmp_path: Path) -> None:
    co, store, c = new_run(tmp_path, max_live_windows=3)
    stmts: list[str] = []
    assert isinstance(co.conn, sqlitedb.SqliteDatabase)
    co.conn.raw.set_trace_callback(stmts.append)
    p = co.register_producer(c)
    reg = co.register_consumer("a")
    produce(co, p, store, c)
    produce(co, p, store, c)
    lease = co.acquire(reg, timeout_s=1)
    assert lease is not None
    co.heartbeat(reg)
    co.heartbeat(p)
    co.ack(lease)
    lease = co.acquire(reg, timeout_s=1)
    assert lease is not None
    co.report_corrupt(lease, "test")
    cl = co.claim(p)
    assert cl is not None
    co.renew(cl)
    co.fail(cl, "boom")
    co.reclaim_lost()
    co.evict()
    co.finish(reg)
    in_txn, writes = False, 0
    for s in stmts:
        head = s.strip().split()[0].upper()
        if head == "BEGIN":
            assert s.strip().upper() == "BEGIN IMMEDIATE", s
            assert not in_txn
            in_txn = True
        elif head in ("COMMIT", "ROLLBACK"):
            in_txn = False
        elif head in ("INSERT", "UPDATE", "DELETE", "REPLACE"):
            assert in_txn, f"write outside BEGIN IMMEDIATE: {s}"
            writes += 1
    assert writes > 20


def test_schema_version_refused(tmp_path: Path) -> None:
    co, _, _ = new_run(tmp_path)
    with co.conn.write() as cur:
        cur.execute("UPDATE meta SET value=99 WHERE key='schema_version'")
    with pytest.raises(SchemaVersionError, match="version 99"):
        Coordinator.open(tmp_path / "run")
    other = tmp_path / "x" / "coordinator.sqlite3"
    other.parent.mkdir()
    sqlite3.connect(other).execute("CREATE TABLE t(a)").connection.commit()
    with pytest.raises(SchemaVersionError, match="not a fanout"):
        Coordinator.open(other.parent)


# The role tables as schema 2 had them (no holder columns, no 'stopped' consumers).
V2_ROLE_TABLES = """
CREATE TABLE consumers(
  id TEXT PRIMARY KEY, expect TEXT NOT NULL, cursor {int} NOT NULL,
  hb_seq {int} NOT NULL DEFAULT 0, hb_wall {real} NOT NULL,
  state TEXT NOT NULL CHECK (state IN ('active','lost','finished','detached')),
  token {int} NOT NULL, note TEXT
) {no_rowid};
CREATE TABLE producer(
  id {int} PRIMARY KEY CHECK (id = 1), token {int} NOT NULL, hb_seq {int} NOT NULL DEFAULT 0,
  hb_wall {real} NOT NULL, state TEXT NOT NULL CHECK (state IN ('active','lost','finished')),
  owner TEXT NOT NULL
)
"""
V2_COLUMNS = {
    "consumers": "id, expect, cursor, hb_seq, hb_wall, state, token, note",
    "producer": "id, token, hb_seq, hb_wall, state, owner",
}


# The producer table as schema 3 had it (one row, id 1: no replicas).
V3_PRODUCER = """
CREATE TABLE producer(
  id {int} PRIMARY KEY CHECK (id = 1), token {int} NOT NULL, hb_seq {int} NOT NULL DEFAULT 0,
  hb_wall {real} NOT NULL, state TEXT NOT NULL CHECK (state IN ('active','lost','finished')),
  owner TEXT NOT NULL, host TEXT, pid {int}, proc TEXT
)
"""
V3_COLUMNS = "token, hb_seq, hb_wall, state, owner, host, pid, proc"


def _downgrade_to_v3(cur: Any, dialect: str) -> None:
    """Rewrite a schema-5 run as schema 3 had it (rank 0's row as `producer`, no
    claim_rank, no claims_reclaimed counter, no follow_chunks), keeping its rows."""
    cur.execute("DROP TABLE follow_chunks")
    rows = cur.execute(f"SELECT {V3_COLUMNS} FROM producers WHERE rank=0").fetchall()
    cur.execute("DROP TABLE producers")
    cur.execute(V3_PRODUCER.format(**schema.DIALECTS[dialect]))
    marks = ",".join("?" * len(V3_COLUMNS.split(",")))
    cur.executemany(f"INSERT INTO producer(id, {V3_COLUMNS}) VALUES (1, {marks})", rows)
    cur.execute("ALTER TABLE windows DROP COLUMN claim_rank")
    cur.execute("DELETE FROM counters WHERE key='claims_reclaimed'")
    cur.execute("UPDATE meta SET value='3' WHERE key='schema_version'")


def _downgrade_to_v2(cur: Any, dialect: str) -> None:
    """Rewrite a schema-5 run's role tables as schema 2 had them, keeping their rows."""
    _downgrade_to_v3(cur, dialect)
    rows = {t: cur.execute(f"SELECT {cols} FROM {t}").fetchall() for t, cols in V2_COLUMNS.items()}
    for table in V2_COLUMNS:
        cur.execute(f"DROP TABLE {table}")
    for stmt in V2_ROLE_TABLES.format(**schema.DIALECTS[dialect]).split(";"):
        cur.execute(stmt)
    for table, cols in V2_COLUMNS.items():
        marks = ",".join("?" * len(cols.split(",")))
        cur.executemany(f"INSERT INTO {table}({cols}) VALUES ({marks})", rows[table])
    cur.execute("UPDATE meta SET value='2' WHERE key='schema_version'")


def test_schema_version_1_is_migrated_in_place(tmp_path: Path) -> None:
    """A run made by a fanout whose counters lived in `meta` (schema 1) opens, keeps its
    counters and windows, and carries on."""
    # ttl 2 s: schema 1 recorded no holder's host or pid, so the migrated producer row
    # is watched for a whole ttl before this process may register again.
    co, store, c = new_run(tmp_path, ttl_s=2.0)
    p = co.register_producer(c)
    produce(co, p, store, c)
    counters = dict(co.conn.execute("SELECT key, value FROM counters").fetchall())
    with co.conn.write() as cur:  # back to the version-1 layout (untyped meta.value)
        _downgrade_to_v2(cur, "sqlite")
        cur.execute("ALTER TABLE meta RENAME TO meta2")
        cur.execute("CREATE TABLE meta(key TEXT PRIMARY KEY, value) WITHOUT ROWID")
        cur.execute("INSERT INTO meta SELECT key, value FROM meta2")
        cur.execute("DROP TABLE meta2")
        cur.execute("INSERT INTO meta SELECT key, value FROM counters")
        cur.execute("DROP TABLE counters")
        cur.execute("UPDATE meta SET value=1 WHERE key='schema_version'")
    co.close()
    with Coordinator.open(tmp_path / "run") as again:
        assert dict(again.conn.execute("SELECT key, value FROM counters").fetchall()) == counters
        assert (
            again.meta("schema_version") == str(schema.SCHEMA_VERSION)
            and again.meta("next_window") == 1
        )
        assert again.conn.execute("SELECT COUNT(*) FROM meta").fetchone()[0] == 5  # + plan
        p = again.register_producer(c)
        assert produce(again, p, store, c).window == 1


def test_schema_version_2_is_migrated_in_place(db: str | None, tmp_path: Path) -> None:
    """A schema-2 run (no role holders, no 'stopped' state) opens on both backends: its
    consumers keep cursors and tokens, and the new columns and state work."""
    co, store, c = new_run(tmp_path, db, ttl_s=2.0)  # the unknown holder: watched for ttl
    p = co.register_producer(c)
    produce(co, p, store, c)
    a = co.register_consumer("a")
    lease = co.acquire(a, timeout_s=1)
    assert lease is not None
    co.ack(lease)
    with co.conn.write() as cur:
        _downgrade_to_v2(cur, co.conn.dialect)
    co.close()
    with Coordinator.open(tmp_path / "run", db_path=db) as again:
        assert again.meta("schema_version") == str(schema.SCHEMA_VERSION)
        row = again.conn.execute("SELECT cursor, token, state, pid FROM consumers").fetchone()
        assert row == (1, a.token, "active", None)
        again.stop(a)  # the old registration is still this process's own token
        assert again.conn.execute("SELECT state FROM consumers").fetchone()[0] == "stopped"
        b = again.register_consumer("a", takeover=False)  # stopped: free to take
        assert b.cursor == 1
        pid = again.conn.execute("SELECT pid FROM consumers").fetchone()[0]
        assert pid == os.getpid()
        p = again.register_producer(c)
        assert produce(again, p, store, c).window == 1


MOUNTINFO = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
40 27 0:50 / {nfs} rw,relatime - nfs4 server:/export rw,vers=4.2
41 40 0:51 / {nfs}/local\\040disk rw - ext4 /dev/vdb rw
"""


def test_network_filesystem_refused(tmp_path: Path) -> None:
    nfs = tmp_path / "shared"
    info = MOUNTINFO.format(nfs=nfs)
    assert sqlitedb.filesystem_type(nfs / "run", info) == ("nfs4", str(nfs))
    local = nfs / "local disk"  # octal-escaped space, longest prefix wins
    assert sqlitedb.filesystem_type(local / "run", info) == ("ext4", str(local))
    with pytest.raises(UnsupportedFilesystem, match=r"nfs4.*--db-path"):
        Coordinator.create(nfs / "run", make_contract(), mountinfo=info)
    assert not (nfs / "run" / "coordinator.sqlite3").exists()
    # Artifacts on NFS, database on a local disk: fine, and open() finds it again.
    co = Coordinator.create(
        nfs / "run", make_contract(), db_path=local / "db.sqlite3", mountinfo=info
    )
    co.close()
    assert Coordinator.open(nfs / "run", mountinfo=info).db_path == local / "db.sqlite3"
    url = f"sqlite://{local}/db.sqlite3"  # the URL form names the same file
    assert Coordinator.resolve_db_path(nfs / "run", url) == local / "db.sqlite3"
    with pytest.raises(UnsupportedFilesystem):
        Coordinator.open(nfs / "run", db_path=nfs / "x.sqlite3", mountinfo=info)
    Coordinator.create(nfs / "r2", make_contract(), mountinfo=info, allow_network_fs=True)


def test_contract_mismatch_names_fields(db: str | None, tmp_path: Path) -> None:
    co, _, _ = new_run(tmp_path, db)
    with pytest.raises(ContractMismatch, match=r"seq_len.*target_layer_ids") as e:
        co.register_consumer("a", expect={"seq_len": 8, "target_layer_ids": [1, 3]})
    assert set(e.value.fields) == {"seq_len", "target_layer_ids"}
    co.register_consumer("a", expect={"seq_len": 4, "target_layer_ids": [1, 2]})
    with pytest.raises(ContractMismatch, match="hidden_size"):
        co.register_producer(make_contract(hidden_size=16))


# ---- consumer flow, fencing, eviction ------------------------------------------------


def test_two_consumers_every_window_in_order_then_evicted(db: str | None, tmp_path: Path) -> None:
    co, store, c = new_run(tmp_path, db, max_live_windows=4, expected_consumers=2, total_windows=6)
    p = co.register_producer(c)
    a, b = Coordinator.open(tmp_path / "run"), Coordinator.open(tmp_path / "run")
    ra = a.register_consumer("a")
    produce(co, p, store, c)
    co.evict()
    assert len(files(store)) == 1  # only one consumer registered yet: nothing evicted
    rb = b.register_consumer("b", dp_rank=1)
    assert rb.consumer_id == "b:dp1"
    seen: dict[str, list[int]] = {"a": [], "b": []}
    done: set[str] = set()
    for step in range(100):
        while co.wait_for_capacity(p, 0.0) and (cl := co.claim(p)) is not None:
            t = torch.zeros(2, 4, dtype=torch.int32)
            meta = WindowMeta(c.stream_id, cl.window, cl.generation, 0, *cl.rows)
            co.publish_ready(cl, store.publish({"x": t}, meta))
        assert len(files(store)) <= 4  # K, the last slot b's next needed window
        for who, co_, reg in (("a", a, ra), ("b", b, rb)):
            if who in done or (who == "b" and step % 2):  # b is half as fast
                continue
            try:
                lease = co_.acquire(reg, timeout_s=0.001)
            except AcquireTimeout:
                continue  # held back: a is 4 windows ahead of b
            if lease is None:
                done.add(who)
                continue
            seen[who].append(lease.window)
            co_.ack(lease)
    assert done == {"a", "b"}
    assert seen == {"a": list(range(6)), "b": list(range(6))}
    assert files(store) == []
    assert co.meta("evictions") == 6


def test_discard_run_drops_only_a_run_nothing_used(db: str | None, tmp_path: Path) -> None:
    """A failed start drops its run only while nothing used it, checked in the drop's
    own transaction. Unused: the tables go (PostgreSQL: the schema too), and a retry at
    the same place starts clean. Used (a trainer joined through another connection):
    the run stays intact."""
    co, _, c = new_run(tmp_path, db)
    co.register_producer(c, owner="me")
    assert co.discard_run("me") is True
    with pytest.raises(NoCoordinator):
        Coordinator.open(co.root, db_path=db).close()
    if db is None:
        (co.root / "coordinator.sqlite3").unlink()  # the file is the caller's (rundir)
    co = Coordinator.create(co.root, c, RunConfig(), db_path=db)
    co.register_producer(c, owner="me")
    other = Coordinator.open(co.root, db_path=db)
    other.register_consumer("a")
    assert co.discard_run("me") is False
    assert other.consumers_registered() == 1 and other.audit()["integrity_check"] == "ok"
    other.close()
    co.close()


def test_writable_is_false_while_another_connection_writes(db: str | None, tmp_path: Path) -> None:
    """The chaos driver's probe (ChaosRun.pause): a write transaction held open by
    another connection makes `writable` False within its timeout; released, True."""
    co, _, _ = new_run(tmp_path, db)
    other = Coordinator.open(tmp_path / "run", db_path=db)
    assert co.conn.writable(0.2)
    with other.conn.write() as cur:
        cur.execute("SELECT COUNT(*) FROM windows")
        assert not co.conn.writable(0.2)
    assert co.conn.writable(0.2)
    other.close()
    co.close()


def test_named_reads_and_the_audit_on_either_database(db: str | None, tmp_path: Path) -> None:
    """What callers outside fanout.coord ask instead of SQL: live and pending windows,
    who still reads, whether a run was used, and the end-of-run audit."""
    co, store, c = new_run(tmp_path, db, max_live_windows=3, total_windows=2)
    p = co.register_producer(c, owner="me")
    assert not co.run_was_used("me") and co.run_was_used("someone else")
    cl = co.claim(p)
    assert cl is not None
    assert co.pending_windows() == 1 and co.ready_windows() == (0, 0)
    publish(co, store, c, cl)
    n, nbytes = co.ready_windows()
    assert n == 1 and nbytes > 0 and co.pending_windows() == 0 and co.run_was_used("me")
    reg = co.register_consumer("a")
    assert co.consumers_registered() == 1
    assert (co.active_consumers_before(2), co.active_consumers_before(0)) == (1, 0)
    lease = co.acquire(reg, timeout_s=1)
    assert lease is not None
    audit = co.audit()
    assert audit["integrity_check"] == "ok" and audit["leases_left"] == 1
    assert audit["consumers"] == {"a:dp0": "active"} and audit["failed_windows"] == 0
    assert audit["counters"]["next_window"] == 1 and audit["counters"]["evictions"] == 0
    with co.conn.write() as cur:  # what a torn write would leave: a lease on no window
        cur.execute("DELETE FROM windows WHERE window=?", (lease.window,))
    assert co.audit()["integrity_check"] == "1 leases name no ready window"


def test_ack_is_fenced_and_never_moves_cursor_back(db: str | None, tmp_path: Path) -> None:
    co, store, c = new_run(tmp_path, db, max_live_windows=4)
    p = co.register_producer(c)
    for _ in range(3):
        produce(co, p, store, c)
    r1 = co.register_consumer("a")
    l0 = co.acquire(r1, timeout_s=1)
    assert l0 is not None
    assert co.acquire(r1, timeout_s=1) == l0  # re-acquire returns the same lease
    r2 = co.register_consumer("a")  # a restart supersedes the old incarnation
    with pytest.raises(StaleLease):
        co.ack(l0)
    with pytest.raises(StaleLease):
        co.heartbeat(r1)
    l0b = co.acquire(r2, timeout_s=1)
    l1 = co.acquire(r2, timeout_s=1, window=1)  # read-ahead
    assert l0b is not None and l1 is not None
    co.ack(l1)
    co.ack(l0b)
    cursor = co.conn.execute("SELECT cursor FROM consumers").fetchone()[0]
    assert cursor == 2
    with pytest.raises(StaleLease):
        co.ack(l0b)  # twice
    assert co.release(l0b) is False


def test_acquire_times_out_then_resumes_with_recapture(db: str | None, tmp_path: Path) -> None:
    co, store, c = new_run(tmp_path, db, max_live_windows=2)
    p = co.register_producer(c)
    r = co.register_consumer("a")
    with pytest.raises(AcquireTimeout, match="window 0"):
        co.acquire(r, timeout_s=0.05)
    for _ in range(2):
        produce(co, p, store, c)
        lease = co.acquire(r, timeout_s=1)
        assert lease is not None
        co.ack(lease)
    assert files(store) == []
    # The trainer's checkpoint says cursor 0: window 0 is gone, so it is captured again.
    r = co.register_consumer("a", cursor=0)
    with pytest.raises(AcquireTimeout, match="recapture"):
        co.acquire(r, timeout_s=0.01)
    cl = produce(co, p, store, c)
    assert (cl.window, cl.generation) == (0, 3)
    lease = co.acquire(r, timeout_s=1)
    assert lease is not None and lease.generation == 3
    assert co.meta("recaptures") == 1


def test_corrupt_window_is_quarantined_and_recaptured(db: str | None, tmp_path: Path) -> None:
    co, store, c = new_run(tmp_path, db, max_live_windows=2)
    p = co.register_producer(c)
    r = co.register_consumer("a")
    first = produce(co, p, store, c)
    path = store.path(window_name(0, first.generation))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # flip a data bit
    path.write_bytes(bytes(raw))
    lease = co.acquire(r, timeout_s=1)
    assert lease is not None
    with pytest.raises(CorruptWindow) as e:
        store.open(lease.name, expect_contract=c.stream_id, expect_window=0)
    co.report_corrupt(lease, e.value.reason)
    assert files(store) == []
    assert len(list((tmp_path / "run" / "quarantine").iterdir())) == 1
    with pytest.raises(AcquireTimeout):
        co.acquire(r, timeout_s=0.01)  # never handed the corrupt file again
    again = produce(co, p, store, c)
    assert again.window == 0 and again.generation > first.generation
    lease = co.acquire(r, timeout_s=1)
    assert lease is not None and lease.generation == again.generation
    with store.open(lease.name, expect_contract=c.stream_id, expect_window=0) as w:
        assert w.get("input_ids").tolist() == [[0, 0, 0, 0], [1, 1, 1, 1]]
    assert co.meta("corrupt") == 1 and co.meta("recaptures") == 1


def test_failed_capture_requeues_then_fails(db: str | None, tmp_path: Path) -> None:
    co, _, c = new_run(tmp_path, db, max_attempts=2)
    p = co.register_producer(c)
    gens = []
    for _ in range(2):
        cl = co.claim(p)
        assert cl is not None and cl.window == 0
        gens.append(cl.generation)
        co.fail(cl, "verifier OOM")
    assert gens[1] > gens[0]
    r = co.register_consumer("a")
    with pytest.raises(Exception, match="verifier OOM"):
        co.acquire(r, timeout_s=1)


def test_new_producer_fences_old_one(db: str | None, tmp_path: Path) -> None:
    co, store, c = new_run(tmp_path, db)
    p1 = co.register_producer(c)
    cl = co.claim(p1)
    assert cl is not None
    p2 = Coordinator.open(tmp_path / "run").register_producer(c)
    fake = Published("x", store.path("x"), 1, "xxh3_128:0")
    with pytest.raises(StaleLease):
        co.publish_ready(cl, fake)
    cl2 = co.claim(p2)
    assert cl2 is not None and cl2.window == 0 and cl2.generation > cl.generation
    assert co.wants_file(0, cl2.generation) and not co.wants_file(0, cl.generation)


# ---- backpressure and lag policies ---------------------------------------------------


def _two_consumers(tmp_path: Path, db: str | None, **cfg: object) -> tuple[Any, ...]:
    co, store, c = new_run(tmp_path, db, max_live_windows=3, expected_consumers=2, **cfg)
    p = co.register_producer(c)
    fast, slow = Coordinator.open(tmp_path / "run"), Coordinator.open(tmp_path / "run")
    return (
        co,
        store,
        c,
        p,
        fast,
        fast.register_consumer("fast"),
        slow,
        slow.register_consumer("slow"),
    )


def test_hold_blocks_producer_at_k(db: str | None, tmp_path: Path) -> None:
    co, store, c, p, fast, rf, _slow, _rs = _two_consumers(tmp_path, db)
    for _ in range(2):
        produce(co, p, store, c)
        lease = fast.acquire(rf, timeout_s=1)
        assert lease is not None
        fast.ack(lease)
    # K = 3, 2 live: the last slot is slow's next needed window, the first at or after
    # its cursor (0) that is not live: window 2. Then nothing more until slow reads.
    assert co.wait_for_capacity(p, timeout_s=0.1) is True
    assert produce(co, p, store, c).window == 2
    assert co.wait_for_capacity(p, timeout_s=0.1) is False
    assert co.claim(p) is None
    assert len(files(store)) == 3


def test_recapture_policy_evicts_what_only_laggards_need(db: str | None, tmp_path: Path) -> None:
    co, store, c, p, fast, rf, slow, rs = _two_consumers(tmp_path, db, lag_policy="recapture")
    for _ in range(6):
        produce(co, p, store, c)
        assert len(files(store)) <= 2
        lease = fast.acquire(rf, timeout_s=1)
        assert lease is not None
        fast.ack(lease)
    assert co.meta("evictions") == 4  # windows 1-4: passed by the leader, not slow's next
    # Window 0 is the laggard's next read, so it stayed: slow reads the original.
    lease = slow.acquire(rs, timeout_s=1)
    assert lease is not None and (lease.window, lease.generation) == (0, 1)
    slow.ack(lease)
    # Its later windows were evicted: each is recaptured on demand once, in order, with
    # a new generation; nothing is evicted and recaptured twice (no churn).
    for w in range(1, 5):
        with pytest.raises(AcquireTimeout):
            slow.acquire(rs, timeout_s=0.01)
        cl = produce(co, p, store, c)
        assert cl.window == w and cl.generation == 6 + w
        assert len(files(store)) <= 2
        lease = slow.acquire(rs, timeout_s=1)
        assert lease is not None and lease.generation == 6 + w
        slow.ack(lease)
    assert co.meta("recaptures") == 4
    lease = slow.acquire(rs, timeout_s=1)  # window 5 was kept for it too
    assert lease is not None and (lease.window, lease.generation) == (5, 6)


def test_recapture_victim_is_the_window_needed_furthest_ahead(
    db: str | None, tmp_path: Path
) -> None:
    """Three consumers at cursors 0, 2 and 5 over ready windows 0-5 (K = 7). Distance
    to the next reader behind each window: 0, 1, 0, 1, 2 (5 is the leader's own). The
    victim is 4, then 1 and 3 (ties: oldest first); then nothing while the leader has
    its next window (5) to read: 0 and 2 are what the others read next. Once the
    leader has passed 5 and waits for 6, 5 goes, and the consumers' next reads too,
    when nothing else is left (so a paused laggard cannot hold the leader at K)."""
    co, store, c = new_run(tmp_path, db, max_live_windows=7, expected_consumers=3)
    p = co.register_producer(c)
    regs = [co.register_consumer(n) for n in ("a", "b", "lead")]
    for _ in range(6):
        produce(co, p, store, c)
    for reg, cursor in zip(regs, (0, 2, 5)):
        for _ in range(cursor):
            lease = co.acquire(reg, timeout_s=1)
            assert lease is not None
            co.ack(lease)

    def victims(n: int) -> list[int]:
        order = []
        for _ in range(n):
            with co.conn.write() as cur:
                order += [w for w, _ in retention.recapture_victim(cur)]
        return order

    assert victims(4) == [4, 1, 3]
    lease = co.acquire(regs[2], timeout_s=1)
    assert lease is not None and lease.window == 5
    co.ack(lease)
    assert victims(4) == [5, 0, 2]


def test_a_catching_up_laggard_gets_each_window_recaptured_at_most_once(
    db: str | None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A deterministic leader + laggard schedule under `recapture` (K = 3, 40 windows):
    per tick the producer takes up to two steps (it runs ahead of the readers), the
    leader reads one window, and the laggard, starting at tick 10 from window 0, reads
    one. Every window the laggard missed is recaptured once, never evicted again before
    it reads it. Golden: 39 recaptures, at most 2 captures of any window, 88 ticks;
    evicting the laggard's next window whenever nothing else was left (the previous
    rule) took 68 recaptures, one window captured 31 times, in 117 ticks."""
    total = 40
    co, store, c = new_run(
        tmp_path, db, max_live_windows=3, expected_consumers=2, lag_policy="recapture",
        total_windows=total,
    )  # fmt: skip
    p = co.register_producer(c)
    regs = {n: co.register_consumer(n) for n in ("lead", "lag")}
    read: dict[str, list[int]] = {n: [] for n in regs}
    ticks = made = 0
    caplog.set_level("INFO", logger="fanout.coord.coordinator")
    while any(len(r) < total for r in read.values()):
        ticks += 1
        assert ticks < 400, f"stuck: {read}"
        for _ in range(2):
            if co.wait_for_capacity(p, timeout_s=0.0) and (cl := co.claim(p)) is not None:
                publish(co, store, c, cl)
                made += 1
        for name, reg in regs.items():
            if (name == "lag" and ticks < 10) or len(read[name]) == total:
                continue
            try:
                lease = co.acquire(reg, timeout_s=0.0)
            except AcquireTimeout:
                continue
            assert lease is not None
            co.ack(lease)
            read[name].append(lease.window)
    assert all(r == list(range(total)) for r in read.values())
    captures = dict(co.conn.execute("SELECT window, captures FROM windows").fetchall())
    assert max(captures.values()) <= 2, captures
    recaptured = sum(n - 1 for n in captures.values())
    assert co.meta("recaptures") == recaptured <= total, (co.meta("recaptures"), ticks)
    # the policy's evictions too: one count and one line per file published again
    assert recaptured == made - total == caplog.text.count(" recaptured as generation ")


def test_recapture_churn_with_three_consumers_at_different_speeds(
    db: str | None, tmp_path: Path
) -> None:
    """A deterministic schedule: per tick the producer captures one window if it may,
    and consumers read up to 1.0, 0.95 and 0.9 windows (K = 4, 60 windows). Everyone
    reads every window once, in order, and recaptures stay few. Golden: 5 recaptures
    in 67 ticks (9 in 73 before a window some consumer reads next went last); the first
    rule (evict the oldest passed window) took 31 in 94."""
    total = 60
    co, store, c = new_run(
        tmp_path, db, max_live_windows=4, expected_consumers=3, lag_policy="recapture",
        total_windows=total,
    )  # fmt: skip
    p = co.register_producer(c)
    speeds = {"lead": 1.0, "mid": 0.95, "lag": 0.9}
    regs = {n: co.register_consumer(n) for n in speeds}
    credit = dict.fromkeys(speeds, 0.0)
    read: dict[str, list[int]] = {n: [] for n in speeds}
    ticks = 0
    while any(len(r) < total for r in read.values()):
        ticks += 1
        assert ticks < 400, f"stuck: {read}"
        if co.wait_for_capacity(p, timeout_s=0.0) and (cl := co.claim(p)) is not None:
            publish(co, store, c, cl)
        for name, speed in speeds.items():
            credit[name] += speed
            while credit[name] >= 1 and len(read[name]) < total:
                try:
                    lease = co.acquire(regs[name], timeout_s=0.0)
                except AcquireTimeout:
                    break
                assert lease is not None
                co.ack(lease)
                read[name].append(lease.window)
                credit[name] -= 1
            credit[name] = min(credit[name], 1.0)  # a blocked reader banks no more than one
    assert all(r == list(range(total)) for r in read.values())
    assert co.meta("recaptures") <= 12, (co.meta("recaptures"), ticks)
    assert ticks <= 80


def test_every_recapture_is_counted_and_logged_once(
    db: str | None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 32 #4, the user's run: `b` stops at cursor 3 and is detached, `a` reads on
    to the end (90 windows; every one evicted once `a` passed it, and the rows of the
    oldest compacted away), then `b` resumes from its checkpoint at cursor 3. Every
    window `b` reads again is recaptured, whether its row was kept or compacted, and so
    is a window a consumer found corrupt; a claim that was never published (a capture
    that failed and was retried, a claim a restarted producer released) is not a
    recapture, nor counted twice when it is one. `recaptures` = files published −
    windows in the stream, and each recapture has one log line, each demand one."""
    import re
    from collections import Counter

    from fanout.status.snapshot import snapshot
    from fanout.status.table import format_table

    total = 90
    co, store, c = new_run(
        tmp_path, db, max_live_windows=4, expected_consumers=2, total_windows=total
    )
    p = co.register_producer(c)
    a, b = co.register_consumer("a"), co.register_consumer("b")
    made = 0  # files published: what the producers' summaries' `windows` add up to
    disturb: dict[int, str] = {}  # window: what happens to its next claim

    def pump() -> None:
        nonlocal made, p
        while co.wait_for_capacity(p, timeout_s=0.0) and (cl := co.claim(p)) is not None:
            what = disturb.pop(cl.window, None)
            if what == "fail":
                co.fail(cl, "a capture error")  # requeued with demand, retried
            elif what == "lose":
                p = co.register_producer(c)  # a producer restarted: the claim is released
            else:
                publish(co, store, c, cl)
                made += 1

    def read(reg: Any, until: int, corrupt: int | None = None) -> None:
        """`reg` reads its windows in order up to `until`; `corrupt`: found corrupt once."""
        q = "SELECT cursor FROM consumers WHERE id=?"
        w = int(co.conn.execute(q, (reg.consumer_id,)).fetchone()[0])
        for _ in range(10 * total):
            if w == until:
                return
            pump()
            try:
                lease = co.acquire(reg, timeout_s=0.0)
            except AcquireTimeout:
                continue  # queued for recapture: the next pump captures it
            assert lease is not None and lease.window == w
            if w == corrupt:
                co.report_corrupt(lease, "checksum")
                corrupt = None
                continue
            co.ack(lease)
            w += 1
        raise AssertionError(f"{reg.consumer_id} stuck at window {w}")

    with caplog.at_level("INFO", logger="fanout.coord.coordinator"):
        for w in range(3):
            read(a, w + 1)
            read(b, w + 1)
        co.stop(b)
        assert co.detach_consumer("b")[0].startswith("b:dp0: detached")
        disturb.update({10: "lose", 20: "fail"})  # fresh windows: never published yet
        read(a, total, corrupt=30)
        assert co.conn.execute("SELECT COUNT(*) FROM windows WHERE window < 20").fetchone()[0] == 0
        b = co.register_consumer("b", cursor=3)  # `fanout train ... --resume`
        disturb.update({5: "fail", 50: "lose"})  # recaptures: each still counted once
        read(b, total)
    assert not disturb
    logs = caplog.text
    recaptured = Counter(int(w) for w in re.findall(r"window (\d+) recaptured as gen", logs))
    wanted = Counter(int(w) for w in re.findall(r"window (\d+) wanted by b:dp0 after ev", logs))
    assert recaptured == Counter([30, *range(3, total)])  # 30: corrupt, then `b` wanted it
    assert wanted == Counter(range(3, total))  # compacted rows (3..24) as well as kept ones
    s = snapshot(co)
    assert s["recaptures"] == made - total == sum(recaptured.values()) == 88
    table = format_table(s)
    assert f"produced {total}/{total}" in table
    # every file published was evicted but the quarantined one: more than `produced`
    assert f"evicted {made - 1} (incl. recaptured copies)" in table, table
    assert "recaptures 88 (windows published again)" in table


def test_detach_policy_drops_the_laggard_after_detach_after(db: str | None, tmp_path: Path) -> None:
    clock = FakeClock()
    c = make_contract()
    rd = RunDir(tmp_path / "run").create()
    cfg = RunConfig(max_live_windows=3, expected_consumers=2, lag_policy="detach", ttl_s=10)
    co = Coordinator.create(rd.root, c, cfg, db_path=db, clock=clock)
    store = Store(rd)
    p = co.register_producer(c)
    rf, rs = co.register_consumer("fast"), co.register_consumer("slow")
    for _ in range(3):  # K windows: the last one in the slot kept for slow's next need
        produce(co, p, store, c)
        lease = co.acquire(rf, timeout_s=1)
        assert lease is not None
        co.ack(lease)
    assert co.wait_for_capacity(p, 0.0) is False  # blocked: starts the detach clock
    clock.t += 9.9
    assert co.wait_for_capacity(p, 0.0) is False
    clock.t += 0.2
    assert co.wait_for_capacity(p, 0.0) is True
    assert files(store) == []
    with pytest.raises(Detached):
        co.acquire(rs, timeout_s=1)
    assert co.meta("detaches") == 1
    again = co.register_consumer("slow")  # it may come back (as a new joiner)
    assert again.cursor == 0


def test_full_coordinator_disk_is_a_typed_error_and_changes_nothing(tmp_path: Path) -> None:
    """SQLITE_FULL (here from PRAGMA max_page_count, as a full disk gives it) becomes
    CoordinatorFull naming the database; the transaction rolled back, and once there
    is room again the same connection carries on with every earlier row intact."""
    co, store, c = new_run(tmp_path)
    p = co.register_producer(c)
    produce(co, p, store, c)
    pages = co.conn.execute("PRAGMA page_count").fetchone()[0]
    co.conn.execute(f"PRAGMA max_page_count={pages}")
    with pytest.raises(CoordinatorFull, match=r"run\.sqlite3|disk full") as err:
        for i in range(10_000):
            co.register_consumer(f"consumer-{i}-" + "x" * 200)
    assert str(co.db_path) in str(err.value) and "--db-path" in str(err.value)
    assert isinstance(err.value, StorageFull)  # callers that handle a full disk catch it
    registered = co.conn.execute("SELECT COUNT(*) FROM consumers").fetchone()[0]
    assert registered == i  # the failing registration left nothing behind
    co.conn.execute("PRAGMA max_page_count=1073741823")
    produce(co, p, store, c)  # usable again, on the same connection
    assert co.conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with Coordinator.open(tmp_path / "run") as again:
        states = again.conn.execute("SELECT window, state FROM windows ORDER BY window")
        assert states.fetchall() == [(0, "ready"), (1, "ready")]


# ---- liveness ------------------------------------------------------------------------


def test_lost_consumer_reclaimed_on_own_clock_only(db: str | None, tmp_path: Path) -> None:
    clock = FakeClock()
    c = make_contract()
    rd = RunDir(tmp_path / "run").create()
    co = Coordinator.create(
        rd.root, c, RunConfig(max_live_windows=2, ttl_s=10), db_path=db, clock=clock
    )
    store = Store(rd)
    p = co.register_producer(c)
    produce(co, p, store, c)
    zombie = Coordinator.open(rd.root)
    rz = zombie.register_consumer("a")
    lease = zombie.acquire(rz, timeout_s=1)
    assert lease is not None
    for _ in range(5):  # watched continuously, 9.5 s < ttl: not lost
        assert co.reclaim_lost() == []
        clock.t += 1.9
    zombie.heartbeat(rz)  # the counter moved: the ttl restarts
    for _ in range(5):
        assert co.reclaim_lost() == []
        clock.t += 1.9
    clock.t += 0.6
    assert co.reclaim_lost() == ["a:dp0"]
    assert co.conn.execute("SELECT COUNT(*) FROM leases").fetchone()[0] == 0
    co.evict()
    assert len(files(store)) == 1  # a lost consumer still holds its cursor's windows
    with pytest.raises(StaleLease):
        zombie.ack(lease)
    r2 = zombie.register_consumer("a")
    assert r2.cursor == 0
    lease = zombie.acquire(r2, timeout_s=1)
    assert lease is not None
    zombie.ack(lease)
    assert files(store) == []


def test_reclaimer_forgets_what_it_saw_while_not_watching() -> None:
    clock = FakeClock()
    rec = Reclaimer(ttl_s=10, clock=clock)
    assert rec.observe([("a", 1, 5)]) == []
    clock.t += 100  # the reclaimer itself was paused: no conclusions from that
    assert rec.observe([("a", 1, 5)]) == []
    for _ in range(4):  # a: watched 16 s; b: first seen 4 s later, watched 12 s
        clock.t += 4
        lost = rec.observe([("a", 1, 5), ("b", 2, 0)])
    assert lost == [("a", 1, 5), ("b", 2, 0)]
    rec.own("b")
    assert rec.observe([("a", 1, 5), ("b", 2, 0)], exclude=["a"]) == []


def test_a_heartbeat_that_cannot_connect_keeps_trying_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The heartbeat thread opened its connection outside its error handling: one
    failed connect (a database under 256 clients) killed the thread with a traceback,
    `check()` stayed silent and the process beat nothing until it was declared lost.
    Now it says so and tries again."""
    from fanout.coord import heartbeat
    from fanout.errors import CoordinatorUnavailable

    co, _, _ = new_run(tmp_path)
    reg = co.register_consumer("a")
    real = heartbeat.Coordinator.open
    fails = [2]

    def flaky(*a: Any, **kw: Any) -> Coordinator:
        if fails[0] > 0:
            fails[0] -= 1
            raise CoordinatorUnavailable("connection refused (injected)")
        return real(*a, **kw)

    monkeypatch.setattr(heartbeat.Coordinator, "open", flaky)
    with (
        caplog.at_level(logging.WARNING, logger="fanout"),
        Heartbeat(tmp_path / "run", reg, interval_s=0.01) as hb,
    ):
        for _ in range(500):
            if hb.beats >= 2:
                break
            co.run.wait_change(None, 0.01)
        assert hb.beats >= 2 and hb._thread.is_alive()
        hb.check()  # no error: the connect failures were transient
    assert any("cannot reach the coordinator" in r.getMessage() for r in caplog.records)


def test_heartbeat_thread_beats_and_reports_fencing(db: str | None, tmp_path: Path) -> None:
    co, _, _ = new_run(tmp_path, db)
    reg = co.register_consumer("a")
    with Heartbeat(tmp_path / "run", reg, interval_s=0.01) as hb:
        for _ in range(500):
            if hb.beats >= 3:
                break
            co.run.wait_change(None, 0.01)
        assert hb.beats >= 3
        co.register_consumer("a")  # supersede: the thread's next beat is fenced
        hb._thread.join(timeout=5)
        with pytest.raises(StaleLease):
            hb.check()
    seq = co.conn.execute("SELECT hb_seq FROM consumers").fetchone()[0]
    assert seq >= 3


# ---- status / sweep CLI --------------------------------------------------------------


def test_status_json_and_sweep_cli(
    db: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    co, store, c = new_run(tmp_path, db, max_live_windows=3)
    p = co.register_producer(c)
    r = co.register_consumer("a")
    produce(co, p, store, c)
    produce(co, p, store, c)
    lease = co.acquire(r, timeout_s=1)
    assert lease is not None
    (tmp_path / "run" / "tmp" / "00000009.g9.safetensors.1-ab.tmp").write_bytes(b"x")
    (tmp_path / "run" / "windows" / window_name(7, 99)).write_bytes(b"orphan")
    run = str(tmp_path / "run")
    assert cli_main(["status", "--run-dir", run, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["windows"]["ready"] == 2 and s["ready_bytes"] > 0
    assert s["high_water"]["windows"] == 2
    assert s["consumers"][0]["id"] == "a:dp0" and s["consumers"][0]["lag_windows"] == 2
    assert s["leases"][0]["window"] == 0
    assert s["producer"]["state"] == "active"
    assert s["capture"] == {
        "target_layer_ids": [1, 2], "storage_dtype": "bfloat16", "seq_len": 4, "window_rows": 2
    }  # fmt: skip
    assert cli_main(["status", "--run-dir", run]) == 0
    human = capsys.readouterr().out
    assert "a:dp0" in human and "ready" in human and "layers [1, 2]  bfloat16" in human
    assert f"database {co.db_path}\n" in human
    assert cli_main(["sweep", "--run-dir", run]) == 0
    out = capsys.readouterr().out
    assert "2 removed" in out
    assert files(store) == [window_name(0, 1), window_name(1, 2)]
    assert list((tmp_path / "run" / "tmp").iterdir()) == []


def test_retention_metadata_stays_flat(db: str | None, tmp_path: Path) -> None:
    """Metadata-only windows: rows and database size stop growing (slow soak: 100k)."""
    _retention_soak(tmp_path, 3000 if db is None else 200, db)


@pytest.mark.slow
def test_retention_flat_over_100k_windows(tmp_path: Path) -> None:
    _retention_soak(tmp_path, 100_000)


def _retention_soak(tmp_path: Path, n: int, db: str | None = None) -> None:
    co, store, c = new_run(tmp_path, db, max_live_windows=4)
    p = co.register_producer(c)
    r = co.register_consumer("a")
    sizes = []
    for i in range(n):
        assert co.wait_for_capacity(p, 0.0)
        cl = co.claim(p)
        assert cl is not None
        name = window_name(cl.window, cl.generation)  # no file: eviction's unlink is a no-op
        co.publish_ready(cl, Published(name, store.path(name), 10, "xxh3_128:0"))
        lease = co.acquire(r, timeout_s=1)
        assert lease is not None and lease.window == i
        co.ack(lease)
        if i in (n // 3, n - 1) and db is None:
            co.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            sizes.append(Path(co.db_path).stat().st_size)
    rows = co.conn.execute("SELECT COUNT(*) FROM windows").fetchone()[0]
    assert rows <= 64 + 5
    if db is None:
        assert sizes[1] <= sizes[0] * 1.2 + 8192, sizes
    assert co.meta("evictions") == n


def test_the_last_slot_takes_the_window_after_the_one_a_trainer_holds(
    db: str | None, tmp_path: Path
) -> None:
    """Issue #47 at K = 2: the trainer holds window 0 (its cursor window) and its
    prefetch asks for window 1. The producer captures window 1 (2 files, within K)
    instead of waiting for the trainer that waits for it; then, at K, the prefetch
    of window 2 waits for this trainer's own ack, says so, and that wait does not
    count toward its timeout."""
    co, store, c = new_run(tmp_path, db, max_live_windows=2)
    p = co.register_producer(c)
    r = co.register_consumer("t")
    produce(co, p, store, c)
    held = co.acquire(r, timeout_s=1)
    assert held is not None and held.window == 0
    assert produce(co, p, store, c).window == 1  # the reserved slot: its next needed window
    assert len(files(store)) == 2
    assert co.wait_for_capacity(p, 0.0) is False  # K files
    heard: list[waits.WaitState] = []
    cancel = threading.Event()
    t0 = time.monotonic()

    def on_wait(why: waits.WaitState) -> None:
        heard.append(why)
        if time.monotonic() - t0 > 0.3:  # 6x its timeout: a counted wait raised by now
            cancel.set()

    with pytest.raises(AcquireCancelled):  # never AcquireTimeout
        co.acquire(r, timeout_s=0.05, window=2, cancel=cancel, on_wait=on_wait)
    assert {w.counts for w in heard} == {False}, heard
    assert "waits for this trainer to finish window 0" in heard[-1].text, heard[-1].text
    co.ack(held)
    assert co.wait_for_capacity(p, 0.0) is True  # its ack made the room
    assert produce(co, p, store, c).window == 2


def test_k_1_takes_turns(db: str | None, tmp_path: Path) -> None:
    """K = 1 works: one window file at a time, the next captured once the trainer acks."""
    co, store, c = new_run(tmp_path, db, max_live_windows=1, total_windows=3)
    p = co.register_producer(c)
    r = co.register_consumer("t")
    for w in range(3):
        assert produce(co, p, store, c).window == w
        assert co.wait_for_capacity(p, 0.0) is False
        lease = co.acquire(r, timeout_s=1)
        assert lease is not None and lease.window == w
        co.ack(lease)
        assert files(store) == []
    assert co.acquire(r, timeout_s=1) is None  # the end of the stream
