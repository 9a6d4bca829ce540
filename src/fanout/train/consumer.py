"""The consumer stream: one trainer's ordered, resumable view of a run's windows.

    from fanout.train.consumer import ConsumerConfig, ConsumerStream
    s = ConsumerStream(ConsumerConfig(run_dir="runs/r1", consumer_id="draft-b8",
                                      draft_layer_ids=[1, 17]))
    s.load_state_dict(saved)                        # optional: a checkpoint's position
    with s:                                         # registers at that cursor
        for batch in s.batches(rows_per_step=4):
            loss = step(batch.tensors)                  # forward/backward/optimizer step
            s.ack(batch)                                # only after the optimizer step
            saved = s.state_dict()                      # where the next step starts

Registers with the coordinator (`name:dp<rank>`) when opened, acquires the window at
its cursor, prefetches (acquire + mmap + checksum) the next window in a background
thread while the current one trains, heartbeats in another, and acks a window
only after the step that consumed its last row. Rows within a window are
shuffled with the consumer's own seed (so different drafts see different
orders) yet reproducibly, so a resume at (cursor, rows_done) continues exactly.
A corrupt window is reported (quarantined + recaptured) and waited for again.

Resume: the stream's position is its state, like a data loader's in torchtitan:
`state_dict()` is `{"cursor", "rows_done"}` after the last acked batch, and
`load_state_dict()` (before the stream opens) sets where it registers and skips to.
fanout.checkpoints.save and .resume save and restore it with the draft and the optimizer,
so those two and this module are the whole answer to "how does a trainer resume?". A stream that
loads no state registers at the cursor the coordinator keeps for it (0 when new).

Layers: a consumer reads any subset of the layers the run captured
(`draft_layer_ids`, `--draft-layer-ids`; default: all), in ascending layer order, the order a draft is
served in (`fanout.contract.ascending_layer_ids` sorts any other). Windows store
one tensor per layer, so it maps and verifies only its layers' bytes (and those
of the other row tensors); a batch's `hidden_states` is its layers side by side,
`[B, T, k·H]` (fp8: plus `hidden_states_scale` `[B, T, k]`), the layout a draft's
`fc` reads. Its layer set is recorded with its registration (`fanout status`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import AliasChoices, ConfigDict, Field, field_validator, model_validator

from fanout.contract import ascending_layer_ids
from fanout.coord.coordinator import Coordinator
from fanout.coord.grants import ConsumerReg, Lease
from fanout.coord.heartbeat import Heartbeat, HeartbeatOptions
from fanout.coord.waits import WaitState
from fanout.errors import ConfigError, CorruptWindow
from fanout.filesystem import FileSystem
from fanout.flags import flag_options, limit_flag
from fanout.rows import HIDDEN_STATES, HIDDEN_STATES_SCALE, LAST_HIDDEN_STATES, ROW_TENSORS
from fanout.store.store import RunDir, Store, WindowReader
from fanout.store.streaminfo import windows_per_step
from fanout.store.windowfile import hidden_name, layer_tensor_names, scale_name

log = logging.getLogger(__name__)


class ConsumerOptions(HeartbeatOptions):
    """How one trainer reads a run, as its flags set it: `fanout train` inherits these
    fields (one flag each). ConsumerConfig adds what the trainer works out itself."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_dir: str = Field(description="run directory the producer writes")
    consumer_id: str = Field(description="consumer name (scoped by data-parallel rank)")
    dp_rank: int = Field(
        0,
        ge=0,
        description="data-parallel rank: the consumer id is name:dp<rank> (under torchrun, RANK)",
    )
    db_path: str | None = Field(
        None,
        description="coordinator database (a path or a postgresql:// URL); default: as the "
        "producer recorded it in the run dir",
    )
    acquire_timeout_s: float = Field(600.0, gt=0, description="max wait for one window (s)")
    prefetch: bool = Field(True, description="acquire + verify the next window in background")
    # Named apart from the producer's capture set (--capture-layer-ids) and the
    # verifier's; --target-layer-ids, its older name, still works (flag and key).
    draft_layer_ids: list[int] | None = Field(
        None,
        validation_alias=AliasChoices("draft_layer_ids", "target_layer_ids"),
        description="captured layers the draft reads (a batch's hidden_states is their "
        "concatenation, the context a draft reads), always in ascending layer order: "
        "another order is sorted; any subset of the layers the run captured "
        "(contract.json); default: all of them for a stream read alone, and under "
        "`fanout train` the draft family's (every captured layer for DFlash, DFlash2, "
        "DSpark and XPress; vLLM's three for EAGLE-3 and P-EAGLE; the last for MTP)",
        json_schema_extra=flag_options(aliases=("--target-layer-ids",)),
    )
    takeover: bool = Field(
        False,
        description="take this consumer id over from a live process that holds it (that "
        "one is fenced off and exits); without it, a live holder makes this one exit",
    )

    @field_validator("draft_layer_ids")
    @classmethod
    def _ascending(cls, v: list[int] | None) -> list[int] | None:
        # the one layer order (DESIGN.md "Layer order is ascending"), decided here
        return None if v is None else ascending_layer_ids(v)


class ConsumerConfig(ConsumerOptions):
    """How one trainer reads a run: ConsumerOptions plus what the trainer derives (its
    world size under torchrun, its row seed, the windows its --epochs come to)."""

    dp_world_size: int = Field(
        1, ge=1, description="data-parallel ranks: each reads rows order[rank::world] of a window"
    )
    row_shuffle_seed: int = Field(0, description="seed of the row order within each window")
    max_windows: int | None = limit_flag("stop after this cursor (window)")

    @model_validator(mode="after")
    def _rank_in_world(self) -> ConsumerConfig:
        if self.dp_rank >= self.dp_world_size:
            raise ValueError(f"dp_rank {self.dp_rank} >= dp_world_size {self.dp_world_size}")
        return self


@dataclass
class OpenWindow:
    lease: Lease
    reader: WindowReader
    order: np.ndarray  # row indices in consumption order

    @property
    def window(self) -> int:
        return self.lease.window

    @property
    def verifier_version(self) -> int | None:
        """The verifier version it was captured with (`produce --follow-verifier`)."""
        return self.reader.meta.verifier_version


@dataclass
class Batch:
    """Rows for one optimizer step and what to ack once the step is done."""

    tensors: dict[str, torch.Tensor]  # each [B, ...]
    rows: list[tuple[int, int]]  # (window, row-in-window) of every row, in order
    completes: list[OpenWindow] = field(default_factory=list)  # ack these after the step
    next_position: tuple[int, int] = (0, 0)  # (cursor window, rows done in it) after the step
    wait_s: float = 0.0  # time spent waiting for windows while assembling this batch
    # the verifier version its rows were captured with (one per batch; None: a fixed one)
    verifier_version: int | None = None


def row_order(window: int, rows: int, seed: int, rank: int = 0, world: int = 1) -> np.ndarray:
    """Consumption order of a window's rows: a permutation seeded by (seed, window);
    data-parallel rank `rank` of `world` takes every world-th row of it. Every rank
    gets the same number of rows (a window whose rows do not divide by `world`, e.g.
    a finite stream's last one, loses its remainder), so ranks step in lock-step."""
    order = np.random.default_rng([seed, window]).permutation(rows)
    if world == 1:
        return order
    return order[rank::world][: rows // world]


class ConsumerStream:
    """Iterate a run's windows for one consumer. Not thread-safe; one per trainer process."""

    def __init__(
        self,
        cfg: ConsumerConfig,
        expect: dict[str, Any] | None = None,
        about: dict[str, Any] | None = None,
    ) -> None:
        """Nothing is opened or registered yet: `open()` (or `with`, or the first
        `windows()`) does it, at the position `load_state_dict` set. `about` is what
        `fanout status` shows of this consumer besides its data-parallel world and
        window budget (fanout.coord.records: the trainer's family, rows per step, log)."""
        self.cfg = cfg
        self._expect = expect
        self._about = {
            **(about or {}),
            "dp_world": cfg.dp_world_size,
            "max_windows": cfg.max_windows,
        }
        self._cursor: int | None = None  # None: the coordinator's stored cursor (0 if new)
        self._rows_done = 0
        self._opened = False

    # ---- position (resume) --------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this consumer's next step starts: window `cursor`, after `rows_done` of
        its rows (in this consumer's row order). JSON-serialisable."""
        return {"cursor": self._cursor, "rows_done": self._rows_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`'s output (a checkpoint's). Only before the stream
        opens: the cursor is where it registers."""
        if self._opened:
            raise ConfigError("ConsumerStream.load_state_dict after the stream was opened")
        cursor, rows = state.get("cursor"), state.get("rows_done", 0)
        if (cursor is not None and (not isinstance(cursor, int) or cursor < 0)) or (
            not isinstance(rows, int) or rows < 0
        ):
            raise ConfigError(
                f"consumer stream state {state!r}: cursor and rows_done are ints >= 0"
            )
        self._cursor, self._rows_done = cursor, rows

    def open(self) -> ConsumerStream:
        """Register with the coordinator at the loaded cursor and start heartbeating
        (once; later calls return at once). Raises RoleHeld, ContractMismatch,
        LayersNotCaptured before anything is registered."""
        if self._opened:
            return self
        cfg = self.cfg
        self.run_dir = RunDir(Path(cfg.run_dir))
        self.store = Store(self.run_dir, FileSystem())
        self.coord = Coordinator.open(self.run_dir.root, db_path=cfg.db_path, store=self.store)
        try:
            expect = self._read_layers(self._expect)
            self.reg: ConsumerReg = self.coord.register_consumer(
                cfg.consumer_id,
                cfg.dp_rank,
                expect=expect,
                cursor=self._cursor,
                takeover=cfg.takeover,
                about=self._about,
            )
        except BaseException:  # RoleHeld, ContractMismatch: nothing was registered
            self.coord.close()
            raise
        self._opened = True
        self._cursor = self.reg.cursor
        self._skip = self._rows_done
        self._hb = Heartbeat(
            self.run_dir.root, self.reg, cfg.heartbeat_s, open_kwargs={"db_path": cfg.db_path}
        ).start()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fanout-prefetch")
        self._closing = threading.Event()  # set by close(): cancels a waiting prefetch
        self._local = threading.local()
        self._held: dict[int, OpenWindow] = {}  # leased, not yet acked (incl. prefetched)
        self.finished = False
        self.wait_s = 0.0
        self._version: int | None = None  # of the rows batches() is gathering
        self.waiting_for: int | None = None  # the window windows() is waiting for, if any
        self.wait_state: WaitState | None = None  # why it is not ready (the coordinator's)
        return self

    @property
    def contract_hash(self) -> str:
        return self.coord.contract.stream_id

    def _read_layers(self, expect: dict[str, Any] | None) -> dict[str, Any]:
        """Settle which layers this consumer reads (`self.layers`) and the tensors it
        maps and verifies per window (`self.read_names`); return `expect` with the
        layers in it, so registration checks them (a subset of the captured ones) and
        records them (`fanout status`)."""
        contract = self.coord.contract
        expect = dict(expect or {})
        asked, given = self.cfg.draft_layer_ids, expect.get("target_layer_ids")
        if asked is not None and given is not None and list(asked) != list(given):
            raise ConfigError(
                f"draft_layer_ids {list(asked)} in the consumer config, {list(given)} expected"
            )
        layers = asked if asked is not None else given
        if layers is None:
            layers = contract.target_layer_ids
        self.layers = ascending_layer_ids(layers, f"consumer {self.cfg.consumer_id} layers")
        expect["target_layer_ids"] = self.layers
        self.fp8 = contract.storage_dtype == "float8_e4m3fn"
        self.row_names = list(ROW_TENSORS)  # + hidden states, read per layer (below)
        if contract.store_last_hidden_states:
            self.row_names.append(LAST_HIDDEN_STATES)
        self.read_names = self.row_names + layer_tensor_names(self.layers, self.fp8)
        return expect

    def take_rows(self, reader: WindowReader, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows `idx` of an open window as a batch part: the row tensors, and this
        consumer's layers side by side, `hidden_states` [b, T, k·H] (fp8:
        `hidden_states_scale` [b, T, k]) in `self.layers` order."""
        out = {n: reader.get(n).index_select(0, idx) for n in self.row_names}
        out[HIDDEN_STATES] = torch.cat(
            [reader.get(hidden_name(i)).index_select(0, idx) for i in self.layers], dim=-1
        )  # [b, T, k·H]
        if self.fp8:
            out[HIDDEN_STATES_SCALE] = torch.stack(
                [reader.get(scale_name(i)).index_select(0, idx) for i in self.layers], dim=-1
            )  # [b, T, k]
        return out

    # ---- windows ------------------------------------------------------------------

    def _thread_coord(self) -> Coordinator:
        # Coordinator connections are per thread; the prefetch thread gets its own.
        c = getattr(self._local, "coord", None)
        if c is None:
            c = Coordinator.open(self.run_dir.root, db_path=self.cfg.db_path, store=self.store)
            self._local.coord = c
        return c

    def _open(self, window: int) -> OpenWindow | None:
        """Acquire + open + verify `window` (any thread). None at the end of the stream."""
        on_main = threading.current_thread() is threading.main_thread()
        coord = self.coord if on_main else self._thread_coord()
        while True:
            lease = coord.acquire(
                self.reg,
                timeout_s=self.cfg.acquire_timeout_s,
                window=window,
                cancel=None if on_main else self._closing,
                on_wait=self._waiting,
            )
            if lease is None:
                return None
            try:
                reader = self.store.open(  # maps all, verifies only what this consumer reads
                    lease.name,
                    expect_contract=self.contract_hash,
                    expect_window=lease.window,
                    tensors=self.read_names,
                )
            except CorruptWindow as e:
                log.error("%s: %s — reported; waiting for its recapture", self.reg.consumer_id, e)
                coord.report_corrupt(lease, e.reason)
                continue
            cfg = self.cfg
            world = cfg.dp_world_size
            order = row_order(lease.window, reader.rows, cfg.row_shuffle_seed, cfg.dp_rank, world)
            if reader.rows % world:
                log.warning(
                    "%s: window %d has %d rows for %d ranks: %d rows not trained on",
                    self.reg.consumer_id, lease.window, reader.rows, world, reader.rows % world,
                )  # fmt: skip
            ow = OpenWindow(lease, reader, order)
            self._held[lease.window] = ow
            return ow

    def stop_at(self, max_windows: int) -> None:
        """End the stream before window `max_windows` (windows() checks before every
        window): --epochs of an on-policy stream, decided once its rows are counted. A
        window prefetched past it is released at close()."""
        self.cfg = self.cfg.model_copy(update={"max_windows": max_windows})

    def _waiting(self, why: WaitState) -> None:
        self.wait_state = why  # read by the trainer's wait notice (another thread)

    def windows(self) -> Iterator[OpenWindow]:
        """Windows from the cursor on, in order; the next one prefetched meanwhile."""
        self.open()
        w = self.reg.cursor
        pending: Future[OpenWindow | None] | None = None
        while self.cfg.max_windows is None or w < self.cfg.max_windows:
            self._hb.check()
            t0 = time.monotonic()
            self.waiting_for = w
            cur = pending.result() if pending is not None else self._open(w)
            self.waiting_for = self.wait_state = None
            self.wait_s += time.monotonic() - t0
            if cur is None:
                self.finished = True
                return
            nxt = w + 1
            if self.cfg.prefetch and (self.cfg.max_windows is None or nxt < self.cfg.max_windows):
                pending = self._pool.submit(self._open, nxt)
            else:
                pending = None
            yield cur
            w = nxt
        self.finished = True

    def batches(self, rows_per_step: int) -> Iterator[Batch]:
        """Batches of `rows_per_step` rows; a batch may span windows (acks follow), never
        verifier versions (`produce --follow-verifier`): the rows before a window of
        another version end their batch early, so a step trains on one version's rows."""
        if rows_per_step < 1:
            raise ValueError(f"rows_per_step must be >= 1, got {rows_per_step}")
        self.open()
        self._check_span(rows_per_step)
        parts: list[dict[str, torch.Tensor]] = []
        rows: list[tuple[int, int]] = []
        completes: list[OpenWindow] = []
        waited = self.wait_s
        skip = self._skip
        for ow in self.windows():
            if rows and ow.verifier_version != self._version:  # the rows so far: one step
                yield self._assemble(parts, rows, completes, (ow.window, 0), self.wait_s - waited)
                parts, rows, completes, waited = [], [], [], self.wait_s
            self._version = ow.verifier_version
            order = ow.order[skip:]
            skip = 0
            start = 0
            if len(order) == 0:  # a data-parallel shard of a window with fewer rows than ranks
                completes.append(ow)  # acked with the next batch
                continue
            while start < len(order):
                take = order[start : start + rows_per_step - len(rows)]
                parts.append(self.take_rows(ow.reader, torch.from_numpy(take)))
                rows.extend((ow.window, int(i)) for i in take)
                start += len(take)
                done_window = start >= len(order)
                if done_window:
                    completes.append(ow)
                if len(rows) == rows_per_step:
                    consumed = len(ow.order) - len(order) + start  # rows of this window so far
                    pos = (ow.window + 1, 0) if done_window else (ow.window, consumed)
                    yield self._assemble(parts, rows, completes, pos, self.wait_s - waited)
                    parts, rows, completes, waited = [], [], [], self.wait_s
        if rows:  # the stream's last partial batch
            last = rows[-1][0]
            yield self._assemble(parts, rows, completes, (last + 1, 0), self.wait_s - waited)
        elif completes:  # the stream ends on shards with no rows: no step to wait for
            self._done(completes, (completes[-1].window + 1, 0))

    def _check_span(self, rows_per_step: int) -> None:
        """Refuse a step that holds more windows at once than the run keeps live (K):
        its last window could only get room from this trainer's own ack, after the step
        (fanout.coord.retention). ConfigError in one line naming both flags."""
        share = self.coord.contract.window_rows // self.cfg.dp_world_size  # rows per window
        k = self.coord.config.max_live_windows
        if share < 1:
            return  # this rank reads no rows of any window (warned per window)
        span = windows_per_step(rows_per_step, share)
        if span > k:
            raise ConfigError(
                f"{self.reg.consumer_id}: a step of {rows_per_step} rows (--rows-per-step) "
                f"holds up to {span} windows of {share} rows each, more than the run's "
                f"--max-live-windows K={k}: the step would wait for a window only its own "
                f"ack makes room for; use --rows-per-step {share * k} or a divisor of it "
                f"(steps aligned to windows), or a producer with --max-live-windows >= {span}"
            )

    def _assemble(
        self,
        parts: list[dict[str, torch.Tensor]],
        rows: list[tuple[int, int]],
        completes: list[OpenWindow],
        pos: tuple[int, int],
        wait_s: float,
    ) -> Batch:
        tensors = {n: torch.cat([p[n] for p in parts]) for n in parts[0]}  # [B, ...]
        return Batch(tensors, list(rows), list(completes), pos, wait_s, self._version)

    # ---- acks and shutdown --------------------------------------------------------

    def ack(self, batch: Batch) -> None:
        """After the optimizer step that consumed `batch`: ack its completed windows; the
        stream's position (`state_dict`) moves past the batch."""
        self._done(batch.completes, batch.next_position)

    def _done(self, completes: list[OpenWindow], position: tuple[int, int]) -> None:
        """Ack `completes` and move the stream's position (window, rows done) on."""
        for ow in completes:
            self.coord.ack(ow.lease)
            self._held.pop(ow.window, None)
            ow.reader.close()
        self._cursor, self._rows_done = position

    def close(self, clean: bool | None = None, *, done: bool = False) -> None:
        """Release leases held (prefetched), stop threads, and record how it ended:
        'finished' if the stream ended or the caller reached its own end (`done`: its
        --max-steps), so it no longer holds windows back; 'stopped' after a clean exit
        before that. Not clean (`clean` False, or by default when an exception is
        propagating: close() called from a `finally`), the registration is left alone:
        the consumer reads as lost once its heartbeat expires, and a fenced-off one
        must not write at all."""
        if not self._opened:
            return
        if clean is None:
            clean = sys.exc_info()[0] is None
        # A prefetch may be waiting for a window the producer has not made yet (up to
        # acquire_timeout_s): cancel it rather than hold the trainer's exit that long.
        self._closing.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._hb.stop()
        try:
            for ow in list(self._held.values()):  # un-acked: give back so eviction proceeds
                self.coord.release(ow.lease)
                ow.reader.close()
            self._held.clear()
            if clean and (self.finished or done):
                self.coord.finish(self.reg)
            elif clean:
                self.coord.stop(self.reg)
        finally:
            self.coord.close()

    def __enter__(self) -> ConsumerStream:
        return self.open()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(clean=exc_type is None)
