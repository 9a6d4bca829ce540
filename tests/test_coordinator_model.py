"""Coordinator against a simple model (hypothesis RuleBasedStateMachine).

    .venv/bin/pytest tests/test_coordinator_model.py -x -q

Producer and two consumers, each with its own connection, share an injected
clock (ttl runs in fake seconds). Rules: produce, acquire, ack, crash (drop out
without acking, stop heartbeating), restart (from the checkpoint cursor, maybe
one behind the database's), tick (time passes, live processes heartbeat, the
producer's reclaimer runs), evict, sweep. Invariants: no window a counted cursor
or a lease still needs is evicted; each consumer acks windows in order without
gaps (a repeat only right after a restart from an older checkpoint); at most K
windows live (K+1 only for the window the slowest consumer waits on).
"""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from fanout.contract import CaptureContract
from fanout.coord.coordinator import Coordinator, RunConfig
from fanout.coord.leases import ConsumerReg, Lease
from fanout.errors import AcquireTimeout, StaleLease
from fanout.store.store import Published, RunDir, window_name

K, TTL = 3, 10.0
NAMES = ("a", "b")


def contract() -> CaptureContract:
    return CaptureContract(
        verifier_config_hash="c", verifier_weights_fingerprint="w", verifier_num_layers=2,
        hidden_size=4, vocab_size=8, target_layer_ids=(0,), dataset_fingerprint="d",
        tokenizer_fingerprint="t", seq_len=2, window_rows=1, shuffle_seed=0,
    )  # fmt: skip


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


class CoordinatorModel(RuleBasedStateMachine):
    postgres: str | None = None  # a server URL: run on PostgreSQL, a new schema per example

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory(prefix="fanout-model-")
        rd = RunDir(Path(self.tmp.name)).create()
        self.clock = Clock()
        cfg = RunConfig(max_live_windows=K, expected_consumers=2, ttl_s=TTL)
        db = None if self.postgres is None else f"{self.postgres}&schema=m_{uuid.uuid4().hex}"
        self.co = Coordinator.create(rd.root, contract(), cfg, db_path=db, clock=self.clock)
        self.p = self.co.register_producer(contract())
        self.conns = {n: Coordinator.open(rd.root, clock=self.clock) for n in NAMES}
        self.regs: dict[str, ConsumerReg] = {n: self.conns[n].register_consumer(n) for n in NAMES}
        self.lease: dict[str, Lease | None] = dict.fromkeys(NAMES)
        self.crashed: dict[str, bool] = dict.fromkeys(NAMES, False)
        self.acked: dict[str, list[int]] = {n: [] for n in NAMES}
        self.checkpoint: dict[str, int] = dict.fromkeys(NAMES, 0)
        self.restart_from: dict[str, int | None] = dict.fromkeys(NAMES)
        self.last_gen = 0
        self.gone_before: set[int] = set()

    def teardown(self) -> None:
        for c in [self.co, *self.conns.values()]:
            c.close()
        self.tmp.cleanup()

    def _q(self, sql: str) -> list[tuple[int, ...]]:
        return self.co.conn.execute(sql).fetchall()

    # ---- rules -----------------------------------------------------------------------

    @rule()
    def produce(self) -> None:
        live = self._q("SELECT COUNT(*) FROM windows WHERE state IN ('ready','capturing')")[0][0]
        if not self.co.wait_for_capacity(self.p, 0.0):
            return
        cl = self.co.claim(self.p)
        assert cl is not None
        assert cl.generation > self.last_gen  # every claim a new generation
        self.last_gen = cl.generation
        if live >= K:  # the extra slot: only for the window the slowest consumer waits on
            low = self._q("SELECT MIN(cursor) FROM consumers WHERE state IN ('active','lost')")
            assert live == K and cl.window == low[0][0]
        name = window_name(cl.window, cl.generation)
        self.co.publish_ready(cl, Published(name, self.co.root / "windows" / name, 1, "x"))

    @precondition(lambda self: any(not self.crashed[n] for n in NAMES))
    @rule(who=st.sampled_from(NAMES))
    def acquire(self, who: str) -> None:
        if self.crashed[who] or self.lease[who] is not None:
            return
        try:
            lease = self.conns[who].acquire(self.regs[who], timeout_s=0.0)
        except AcquireTimeout:
            return
        except StaleLease:
            self._reclaimed(who)
            return
        assert lease is not None
        cursor = self.checkpoint[who]
        assert lease.window == cursor, (who, lease, cursor)
        self.lease[who] = lease

    @rule(who=st.sampled_from(NAMES))
    def ack(self, who: str) -> None:
        lease = self.lease[who]
        if self.crashed[who] or lease is None:
            return
        try:
            self.conns[who].ack(lease)
        except StaleLease:
            self._reclaimed(who)
            return
        seen = self.acked[who]
        start = self.restart_from[who]
        if seen and start is None:
            assert lease.window == seen[-1] + 1, (who, seen, lease.window)  # no gaps, no repeats
        elif seen:
            assert lease.window == start  # a repeat only right after a restart
        self.restart_from[who] = None
        seen.append(lease.window)
        self.lease[who] = None
        self.checkpoint[who] = lease.window + 1

    def _reclaimed(self, who: str) -> None:
        """It was declared lost (we let too much fake time pass): like a crash."""
        self.crashed[who] = True
        self.lease[who] = None

    @rule(who=st.sampled_from(NAMES))
    def crash(self, who: str) -> None:
        self.crashed[who] = True
        self.lease[who] = None  # the lease stays in the database until reclaimed

    @rule(who=st.sampled_from(NAMES), behind=st.booleans())
    def restart(self, who: str, behind: bool) -> None:
        if not self.crashed[who]:
            return
        cursor = self.checkpoint[who]
        if behind and cursor > 0:  # crashed between ack and checkpoint: one window again
            cursor -= 1
        self.regs[who] = self.conns[who].register_consumer(who, cursor=cursor)
        self.checkpoint[who] = cursor
        self.restart_from[who] = cursor if self.acked[who] else None
        self.crashed[who] = False
        self.lease[who] = None

    @rule(dt=st.sampled_from([TTL / 8, TTL / 4, TTL / 2.5]))
    def tick(self, dt: float) -> None:
        self.clock.t += dt
        for n in NAMES:
            if not self.crashed[n]:
                self.conns[n].heartbeat(self.regs[n])
        lost = self.co.reclaim_lost()
        assert all(self.crashed[x.split(":")[0]] for x in lost), lost  # only the silent

    @rule()
    def evict(self) -> None:
        self.co.evict()

    @rule()
    def sweep(self) -> None:
        self.co.sweep()  # no files: finishes interrupted evictions, removes nothing live

    # ---- invariants ------------------------------------------------------------------

    @invariant()
    def nothing_needed_is_evicted(self) -> None:
        low = self._q("SELECT MIN(cursor) FROM consumers WHERE state IN ('active','lost')")[0][0]
        gone = {w for (w,) in self._q("SELECT window FROM windows WHERE state IN "
                                      "('evicting','evicted')")}  # fmt: skip
        # Newly evicted windows: every counted cursor is past them. (A restart from an
        # older checkpoint may move a cursor back onto an old eviction: that window is
        # then queued for recapture on acquire, never skipped.)
        for w in gone - self.gone_before:
            assert low is None or w < low, (w, low)
        self.gone_before = gone
        for (w,) in self._q("SELECT window FROM leases"):
            state = self._q(f"SELECT state FROM windows WHERE window={w}")
            assert state == [("ready",)], (w, state)

    @invariant()
    def at_most_k_live(self) -> None:
        live = self._q("SELECT COUNT(*) FROM windows WHERE state IN ('ready','capturing')")[0][0]
        assert live <= K + 1


CoordinatorModel.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCoordinatorModel = CoordinatorModel.TestCase


def test_same_model_on_postgres(postgres_server: str) -> None:
    """The same rules and invariants with the tables on PostgreSQL (fewer examples:
    every statement is a round trip to the server there)."""

    class OnPostgres(CoordinatorModel):
        postgres = postgres_server

    run_state_machine_as_test(
        OnPostgres,
        settings=settings(
            max_examples=40,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
