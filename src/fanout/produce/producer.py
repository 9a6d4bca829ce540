"""The producer: run the verifier once per row, publish windows, never outrun consumers.

    fanout produce --run-dir runs/r1 --verifier-name-or-path VERIFIER_DIR \
        --data ../shared/data/chat/fastchat/dummy_conversation.json \
        --tokenizer ../shared/data/tokenizers/qwen3 --seq-len 512 --window-rows 8 \
        --max-live-windows 4 --epochs 1 --expected-consumers 3

Loop: reclaim lost processes → wait for capacity (backpressure at K, lag policy)
→ claim the next window (demand first) → gather its rows from the prepared
dataset in stream order → verifier forward in batches of `capture_batch_rows`
(hooks on the target layers, chunked greedy ids) → Store.publish (tmp → fsync →
link → dir fsync) → coordinator commit. A failed publish fails the claim (the
window is retried under a new generation). SIGINT/SIGTERM leave nothing
half-done: the window in flight is finished and published (one waiting out a full
disk has its claim failed instead, for recapture), then the loop stops and the
process exits 0, recording the producer 'finished' (during start-up, before any
claim, it exits at once). One producer per replica rank: a second one is refused
(RoleHeld) while the first is live, unless it asks to take over (--takeover).

Several producers may feed one run (`--replicas M`, fanout.produce.replicas): each
runs this loop as one replica, claiming windows through the coordinator, so each
window is made once; the stream's end is recorded once, by whichever publishes its
last window, and a replica with nothing left to claim lingers (serving recaptures)
like a lone producer, then exits 0.

Under `torchrun --nproc-per-node N ... --tp N` rank 0 runs this loop and the other
ranks run each of its verifier forwards with it (fanout.produce.tp_capture).

Which rows window w holds: fanout.produce.stream. The rest of the producer is
split by what it does: its flags and the checks of its inputs (config), the run
directory it sets up and, after a failed start, removes (run_start), which replica it
is (replicas), publishing and committing windows inline or overlapped (publisher),
stopping on a signal (stopping), counters (stats).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, cast

from fanout.contract import CaptureContract
from fanout.coord.coordinator import Coordinator, RunConfig
from fanout.coord.grants import Claim, ProducerReg
from fanout.coord.heartbeat import Heartbeat
from fanout.data.cache import PackedDataset
from fanout.data.draft_vocab import count_tokens, write_token_counts
from fanout.errors import CaptureCheckFailed, ConfigError, StorageError
from fanout.filesystem import FileSystem
from fanout.flags import CommandFlags, draws_progress, set_log_role, torchrun_rank
from fanout.model.verifier import Verifier
from fanout.ops.fp8 import FP8
from fanout.produce.backpressure import BlockedNotice
from fanout.produce.capture import WindowCapturer
from fanout.produce.capture_for import capture_fields
from fanout.produce.config import ProducerConfig, check_inputs, prepared_data
from fanout.produce.follow import FollowStream
from fanout.produce.onpolicy import OPEN, OnPolicyStream
from fanout.produce.publisher import Publisher
from fanout.produce.replicas import bind_device, plan, rank_of
from fanout.produce.run_start import (
    CreatedPaths,
    StartNotice,
    check_disk_budget,
    check_plan,
    check_producer_role,
    create_run,
    join_lock,
    open_existing_run,
    take_start_lock,
)
from fanout.produce.stats import ProducerStats
from fanout.produce.stopping import StopFlag
from fanout.produce.stream import stream_rows
from fanout.produce.tp_capture import Leader
from fanout.produce.verifier_follow import VerifierFollower, pinned
from fanout.rows import DOCUMENT_IDS, INPUT_IDS
from fanout.store.rundir import RunDir
from fanout.store.store import Store, WindowMeta
from fanout.store.streaminfo import StreamInfo, window_count
from fanout.tracking import WandbRun, group_for

log = logging.getLogger(__name__)


class Producer:
    """One producer process. Build with `Producer(cfg)`, then `run()`.

    A start that fails (or is interrupted) before it publishes its first window
    removes what it created in the run directory (`discard_if_unused`,
    fanout.produce.run_start), so no skeleton of a run that never produced anything is
    left for trainers to find. Publishing is the Publisher's (fanout.produce.publisher),
    stopping on a signal the StopFlag's (fanout.produce.stopping).
    """

    def __init__(
        self, cfg: ProducerConfig, *, fs: FileSystem | None = None, tp: Leader | None = None
    ) -> None:
        cfg = pinned(cfg)  # --follow-verifier: the live version's directory
        check_inputs(cfg)
        self.cfg = cfg = for_families(cfg)
        self.follower = VerifierFollower.of(cfg)  # None: a verifier that does not change
        self.tp = tp  # with --tp: rank 0's side of every forward (fanout.produce.tp_capture)
        self.plan = plan(cfg)  # what every replica must share (fanout.produce.replicas)
        root, m = Path(cfg.run_dir), cfg.replicas
        # Until it registers, a start says every few seconds what it waits for
        with StartNotice() as self._notice:
            # One start at a time per replica rank, up to its registration
            # (fanout.produce.run_start): RoleHeld naming the producer starting there now
            # (--takeover: wait for it); without a rank, the first free one.
            self._notice.stage("taking a replica rank's start lock")
            self._start_lock, self.rank = take_start_lock(
                root, cfg.db_path, cfg.takeover, rank_of(m, cfg.replica_rank, cfg.tp), m
            )
            self._created: CreatedPaths | None = None
            self._created_db = False  # this process created the run's coordinator database
            self.stop = StopFlag()
            try:
                self._notice.stage(f"checking that replica rank {self.rank} is free")
                self._created = CreatedPaths.note(root, cfg.db_path, self._start_lock, self.rank, m)
                check_producer_role(root, cfg.db_path, cfg.takeover, self.rank, m)
                check_plan(root, cfg.db_path, self.rank, self.plan)
                self._start(fs or FileSystem())
            except BaseException:
                self.discard_if_unused()
                raise
            finally:
                self._start_lock.release()

    @staticmethod
    def _owner() -> str:
        return f"{socket.gethostname()}:{os.getpid()}"

    def discard_if_unused(self) -> bool:
        """After a start that failed or was interrupted: remove what this start created if
        the run was never used (CreatedPaths.discard_if_unused). Runs once; True if it
        removed something."""
        created, self._created = self._created, None
        if created is None:
            return False
        coord = getattr(self, "coord", None)
        return created.discard_if_unused(coord, self._created_db, self._owner())

    def _start(self, fs: FileSystem) -> None:
        from fanout.data.prepare import prepare
        from fanout.data.template import default_cache_root

        cfg = self.cfg
        try:
            self.run_dir = RunDir(Path(cfg.run_dir)).create(fs)
        except OSError as e:
            raise ConfigError(
                f"--run-dir {cfg.run_dir}: cannot create the run directory: {e.strerror or e} "
                f"({e.filename})"
            ) from None
        self.store = Store(self.run_dir, fs)
        verifier: Verifier | None = None
        self.growing: OnPolicyStream | FollowStream | None = None  # rows that grow as it runs
        # --data DIR: fanout prepare's rows, as they are (--follow: its source, growing)
        prepared = None if cfg.follow else prepared_data(cfg)
        if prepared is not None:
            log.info(
                "using prepared rows from %s (fingerprint %s)", prepared.dir, prepared.fingerprint
            )
            self.dataset = prepared
        elif cfg.regenerate:  # the verifier writes the data chunk by chunk as windows stream
            prep = cfg.prepare_config(str(self.run_dir.cache))
            log.info(
                "regenerating --data chunk by chunk into %s; each chunk's rows prepared into %s",
                self.run_dir.regen, prep.cache_root() / "prepared",
            )  # fmt: skip
            self._notice.stage(f"loading the verifier {cfg.verifier_name_or_path}")
            verifier = self._load_verifier()
            self.growing = OnPolicyStream.open(
                prep, cfg, verifier, self.run_dir, self.tp, replica=(self.rank, cfg.replicas)
            )
            self.dataset = cast(PackedDataset, self.growing.rows)
        elif cfg.follow:  # a live source: chunks as records arrive (fanout.produce.follow)
            log.info("following %s; its chunks and held-out set in %s/follow",
                     cfg.follow, self.run_dir.root)  # fmt: skip
            cache = str(self.run_dir.cache)
            # FollowStream.open waits for the first chunk: say so, not the last stage
            self._notice.stage(f"waiting for the first records of --follow {cfg.follow}")
            self.growing = FollowStream.open(
                lambda chunk: cfg.prepare_config(cache, data=[chunk]), cfg, self.run_dir
            )
            self.dataset = cast(PackedDataset, self.growing.rows)
        else:
            # The rows `fanout prepare` cached with these settings are found where it
            # writes them (--cache-dir, else $FANOUT_CACHE); missing, they are prepared
            # into the run's cache (RUN_DIR/cache unless --cache-dir).
            prep = cfg.prepare_config(str(self.run_dir.cache))
            look_in = () if cfg.cache_dir else (default_cache_root(),)
            self._notice.stage("preparing the rows")
            self.dataset = prepare(prep, look_in, announce=True)
        if self.dataset.num_rows == 0:
            raise ConfigError(f"{cfg.data}: no usable rows after preparation")
        self._notice.stage(f"loading the verifier {cfg.verifier_name_or_path}")
        self.verifier: Verifier = verifier or self._load_verifier()
        self.contract = CaptureContract(
            **self._verifier_fields(self.verifier),
            dataset_fingerprint=self.dataset.fingerprint,
            tokenizer_fingerprint=self.dataset.tokenizer_fingerprint,
            seq_len=cfg.seq_len,
            window_rows=cfg.window_rows,
            shuffle_seed=cfg.seed,
        )
        self.total_windows = window_count(self.dataset.num_rows * cfg.epochs, cfg.window_rows)
        if self.growing:  # OPEN until the last chunk is regenerated
            self.total_windows = self.growing.total_windows
        check_disk_budget(self.run_dir.root, fs, cfg.max_live_windows, self.window_bytes())
        self._notice.stage("counting the rows' tokens")
        counts = count_tokens(
            self.growing.counted if self.growing else self.dataset, self.verifier.vocab_size
        )
        # Replicas of one run create it or join it in turn (the join lock): exactly one
        # creates it. A changed contract is refused before anything is written; a new
        # run gets its stream.json and token counts before its database, so a trainer
        # that finds the database finds them too.
        self._notice.stage("waiting for the join lock (another replica creating or joining)")
        with join_lock(self.run_dir.root):
            self._notice.stage(f"joining or creating the run, registering replica {self.rank}")
            existing = open_existing_run(
                self.run_dir.root, self.contract, self._run_config(), cfg.db_path, self.store,
                cfg.takeover, self.rank, cfg.replicas,
            )  # fmt: skip
            self._stream_info().write(self.run_dir, fs)
            write_token_counts(self.run_dir.token_counts, counts, self.contract.stream_id, fs)
            if existing is None:  # or another host's replica creates it now: then joined
                existing, self._created_db = create_run(
                    self.run_dir.root, self.contract, self._run_config(), cfg.db_path, self.store,
                    cfg.takeover, self.rank, cfg.replicas,
                )  # fmt: skip
            self.coord = existing
            # Registered under the start lock: a producer started a moment later finds the
            # role held (RoleHeld), never a run it could still register in too.
            self.preg = self.coord.register_producer(
                self.contract, owner=self._owner(), takeover=cfg.takeover, rank=self.rank,
                plan=self.plan,
            )  # fmt: skip
        if isinstance(self.growing, FollowStream):  # its chunks are committed from now on
            self.growing.attach(self.coord, self.preg)
        self.stats = ProducerStats()
        self.capturer = WindowCapturer(
            self.verifier,
            self.dataset,
            cfg.capture_batch_rows,
            forward=self.tp.capture if self.tp else None,
        )
        overlap = cfg.overlap_publish == "on" or (
            cfg.overlap_publish == "auto" and self.verifier.device.type == "cuda"
        )
        self.publisher = Publisher(
            self.store,
            self.coord,
            self.stats,
            self.stop,
            overlap=overlap,
            open_coord=lambda: Coordinator.open(
                self.run_dir.root, db_path=self.cfg.db_path, store=self.store
            ),
        )

    def _load_verifier(self, path: str | Path | None = None) -> Verifier:
        from fanout.model.verifier import load_verifier

        return self.tp.verifier if self.tp else load_verifier(
            path or self.cfg.verifier_name_or_path,
            capture_layer_ids=self.cfg.capture_layer_ids,
            **self.cfg.verifier_options(),
        )  # fmt: skip

    def _verifier_fields(self, v: Verifier) -> dict[str, Any]:
        """The capture-contract fields `v` decides (--follow-verifier: the follower's)."""
        return v.contract_fields() if self.follower is None else self.follower.contract_fields(v)

    def _follow_verifier(self) -> None:
        """--follow-verifier, between windows: a newly committed version captures every
        window from the next one on (fanout.produce.verifier_follow)."""
        new = self.follower.swap(self._load_verifier, self.contract) if self.follower else None
        if new is not None:
            self.verifier = new
            self.capturer.use(new)

    def window_bytes(self) -> int:
        """Bytes of one full window on disk, header aside (docs/producer.md's arithmetic)."""
        c, v = self.contract, self.verifier
        n, h = len(c.target_layer_ids), c.hidden_size
        per_token = 4 + 4 + 1 + 4 + 4  # target_ids, input_ids, loss_mask, document/position ids
        if v.storage_dtype == FP8:
            per_token += n * h + 4 * n  # fp8 values + one float32 scale per layer
        else:
            per_token += n * h * v.storage_dtype.itemsize
        if c.store_last_hidden_states:
            per_token += h * v.last_hidden_dtype.itemsize
        return c.window_rows * c.seq_len * per_token

    def _stream_info(self) -> StreamInfo:
        """stream.json: what consumers need to turn `--epochs` into windows."""
        return StreamInfo.of(
            self.contract.stream_id,
            # under --regenerate: null until the last chunk is done, then rewritten
            self.dataset.num_rows if self.stream_length is not None else None,
            self.cfg.window_rows,
            self.cfg.epochs,
            self.dataset.summary,
            # recorded so `fanout promote --run-dir` needs neither flag (#52)
            verifier=os.path.abspath(self.cfg.verifier_name_or_path),
            tokenizer=os.path.abspath(self.cfg.tokenizer or self.cfg.verifier_name_or_path),
        )

    @property
    def end(self) -> int:
        """No new window at or past this one: the stream's length (OPEN while an
        on-policy stream is open), capped by --max-windows."""
        cap = self.cfg.max_windows
        return self.total_windows if cap is None else min(self.total_windows, cap)

    def _run_config(self) -> RunConfig:
        return self.cfg.run_config(None if self.growing else self.total_windows)  # open-ended

    # ---- one window ---------------------------------------------------------------

    def produce_one(self, preg: ProducerReg, claim: Claim) -> None:
        """Capture `claim`'s window and publish it (inline, or handed to the publisher)."""
        cfg = self.cfg
        t0 = time.monotonic()
        if self.growing:
            self._reach(claim.window)  # a claim another replica's frontier moved past
            idx, epoch = self.growing.window_rows_of(claim.window)
        else:
            idx, epoch = stream_rows(
                claim.window, cfg.window_rows, self.dataset.num_rows, cfg.epochs, cfg.seed
            )
        window = self.capturer.capture(idx)
        self.stats.capture_s += time.monotonic() - t0
        tensors = window.tensors
        r = int(tensors[INPUT_IDS].shape[0])
        meta = WindowMeta(
            contract_hash=self.contract.stream_id,
            window=claim.window,
            generation=claim.generation,
            epoch=epoch,
            row_start=claim.rows[0],
            row_end=claim.rows[0] + r,
            verifier_version=None if self.follower is None else self.follower.version.number,
        )
        tokens = int((tensors[DOCUMENT_IDS] >= 0).sum())
        if self.publisher.submit(claim, window, meta, rows=r, tokens=tokens):
            self.capturer.flip()  # the window being published keeps its slot

    # ---- the loop -----------------------------------------------------------------

    def _nothing_left(self) -> bool:
        """Every window of the stream claimed and published (by any replica), and none
        on demand."""
        frontier = int(self.coord.meta("next_window"))
        return frontier >= self.end and not self.coord.pending_windows()

    def _done(self, idle_since: float) -> bool:
        """Nothing left to make and no active consumer behind the end (one may still
        demand an evicted window: a resumed or late trainer, under every policy), or,
        with the whole stream claimed, no demand for --exit-when-idle-s."""
        if self._nothing_left() and self.coord.active_consumers_before(self.end) == 0:
            return True
        return (
            int(self.coord.meta("next_window")) >= self.end
            and time.monotonic() - idle_since > self.cfg.exit_when_idle_s
        )

    @property
    def stream_length(self) -> int | None:
        """The stream's windows where anything shows it; None while an on-policy stream
        is still open (total_windows is then the OPEN sentinel, never to be printed)."""
        return None if self.total_windows == OPEN else self.total_windows

    def run(self) -> dict[str, Any]:
        """Produce until the stream is done (its length, --max-windows), or a signal
        (fanout.produce.stopping: the window in flight is finished first). Returns the
        summary."""
        from tqdm import tqdm

        self.stop.install()
        owner = self._owner()
        preg = self.preg  # registered at the end of the start, under the start lock
        swept = self.coord.sweep()
        log.info(
            "producer %s (replica %d of %d): %s; swept %s",
            owner, self.rank, self.cfg.replicas, self.verifier, swept,
        )  # fmt: skip
        bar = tqdm(
            total=self.stream_length,
            desc="produce",
            unit="win",
            disable=not (self.cfg.progress and draws_progress()),  # rank 0 under torchrun
            initial=int(self.coord.meta("next_window")),
        )
        with Heartbeat(
            self.run_dir.root,
            preg,
            self.cfg.heartbeat_s,
            reclaim=True,
            open_kwargs={"db_path": self.cfg.db_path},
        ) as hb:
            self._loop(preg, hb, bar)
            n = self.stats.windows
            self.publisher.finish_inflight()  # the last window's publish, before the summary
            bar.update(self.stats.windows - n)
        bar.close()
        self.publisher.shutdown()
        # A clean exit (`fanout status` shows it finished). Ended by design, the stream
        # ends at `end` for every trainer (recorded once its last window is published,
        # by whichever replica); stopped by a signal, it stays open for a restart.
        self.coord.finish_producer(preg, stream_end=None if self.stop else self.end)
        summary = self.stats.summary()
        summary["stream_id"] = self.contract.stream_id
        summary["total_windows"] = self.stream_length  # null while on-policy is open
        summary["replica"], summary["replicas"] = self.rank, self.cfg.replicas
        if self.follower is not None:  # --follow-verifier
            summary["verifier_version"] = self.follower.version.number
            summary["verifier_swaps"] = self.follower.swaps
        log.info("producer done: %s", summary)
        if self.cfg.wandb_project:  # its summary, in the run's W&B group (fanout.tracking)
            WandbRun.start(
                self.cfg,
                name=f"producer-r{self.rank}",
                group=group_for(self.cfg.run_dir, self.cfg.wandb_group),
                job_type="produce",
                config=self.cfg.model_dump(mode="json"),
                dir=self.run_dir.root,
            ).finish(summary)
        return summary

    def _loop(self, preg: ProducerReg, hb: Heartbeat, bar: Any) -> None:
        """Claim and produce windows until the stream is done (nothing left to claim and
        nothing on demand; lingering for --exit-when-idle-s while a consumer is behind
        the end), or a stop."""
        idle_since: float | None = None
        self.blocked = BlockedNotice(self.coord)
        while not self.stop:
            hb.check()
            if self.tp:
                self.tp.check()  # a dead tensor-parallel rank stops a hold at K too
            self.publisher.finish_inflight(block=False)
            w0 = time.monotonic()
            if not self.coord.wait_for_capacity(preg, timeout_s=0.5):
                self.stats.waits_s += time.monotonic() - w0
                if self._nothing_left():  # held at K, but nothing is left to make
                    idle_since = idle_since or time.monotonic()
                    if self._done(idle_since):
                        break
                self.blocked.waiting(bar)
                continue
            self.blocked.clear()
            self.stats.waits_s += time.monotonic() - w0
            self._follow_verifier()  # between windows: never one captured by two versions
            upto = self._reach(int(self.coord.meta("next_window")))
            claim = self.coord.claim(preg, end=None if self.end == OPEN else self.end, upto=upto)
            if claim is None:
                self.publisher.finish_inflight()  # its window may be the one still pending
                idle_since = idle_since or time.monotonic()
                if self._done(idle_since):
                    break
                time.sleep(0.05)
                continue
            idle_since = None
            done_before = self.stats.windows
            try:
                self.produce_one(preg, claim)
            except StorageError as e:
                self.stats.failures += 1
                log.error("window %d: %s; will retry", claim.window, e)
                self.coord.fail(claim, str(e))
                time.sleep(1.0)
                continue
            except CaptureCheckFailed as e:  # the publisher failed that window's claim
                if e.window != claim.window:
                    self._release(claim)
                raise
            except BaseException:
                self._release(claim)
                raise
            bar.update(self.stats.windows - done_before)
            if self.cfg.progress:
                bar.set_postfix_str(self._progress_line())

    def _reach(self, window: int) -> int | None:
        """--regenerate: regenerate (or wait for other replicas' chunks) until window
        `window`'s rows exist (fanout.produce.onpolicy); with the last chunk done, the
        stream's length (into stream.json too). Returns the bound for new claims while
        the stream is open (no new window past the rows that exist), else None."""
        if self.growing is None or self.total_windows != OPEN:
            return None
        self.total_windows = self.growing.reach(window)
        if self.total_windows != OPEN:
            self._stream_info().write(self.run_dir, self.store.fs)
            return None
        return self.growing.ready_windows

    def _progress_line(self) -> str:
        """ready windows/bytes on disk, rates since start, backpressure wait so far."""
        return self.stats.progress_line(*self.coord.ready_windows())

    def _release(self, claim: Claim) -> None:
        try:
            self.coord.fail(claim, "producer interrupted")
        except Exception as e:  # the claim may already be gone; never mask the original
            log.warning("could not release claim on window %d: %s", claim.window, e)


_FLAGS = CommandFlags(ProducerConfig)  # `fanout produce`'s flags: ProducerConfig's fields
add_arguments, config_from_args = _FLAGS.add_arguments, _FLAGS.config_from_args


def for_families(cfg: ProducerConfig) -> ProducerConfig:
    """`cfg` with the capture its `--capture-for` asks for (fanout.produce.capture_for),
    once its inputs are checked (it reads the verifier's config.json)."""
    if not cfg.capture_for:
        return cfg
    check_inputs(cfg)
    return cfg.model_copy(update=capture_fields(cfg))


def run(args: argparse.Namespace, name: str = "produce") -> int:
    cfg = pinned(config_from_args(args))  # --follow-verifier: its live version's directory

    def early_exit(signum: int, _frame: Any) -> None:
        # Before the loop starts nothing is claimed: stopping now loses nothing.
        log.warning("signal %d during start-up: exiting", signum)
        raise SystemExit(0)

    signal.signal(signal.SIGINT, early_exit)
    signal.signal(signal.SIGTERM, early_exit)
    cfg = for_families(cfg)  # every TP rank loads the layers it names
    if cfg.tp > 1 and torchrun_rank() is not None:  # RANK is the tensor-parallel rank
        set_log_role("produce", f"tp{torchrun_rank()}")
    rank_of(cfg.replicas, cfg.replica_rank, cfg.tp)  # a torchrun world that does not fit: one line
    if cfg.tp == 1:
        bind_device(cfg.device)  # torchrun --replicas: one replica per local GPU
    if cfg.tp > 1:  # every rank loads its shard; rank 0 produces, the others follow it
        from fanout.model.verifier import load_verifier
        from fanout.produce.tp_capture import run_tensor_parallel

        return run_tensor_parallel(
            cfg.tp,
            cfg.device,
            cfg.tp_timeout_s,
            verifier_path=cfg.verifier_name_or_path,
            check=lambda: check_inputs(cfg),
            load=lambda: load_verifier(
                cfg.verifier_name_or_path,
                capture_layer_ids=cfg.capture_layer_ids,
                **cfg.verifier_options(),
            ),
            lead=lambda leader: _produce(cfg, leader),
        )
    return _produce(cfg, None)


def _produce(cfg: ProducerConfig, tp: Leader | None) -> int:
    import json

    producer = Producer(cfg, tp=tp)  # a failed start removes what it created
    if cfg.replicas > 1:  # log lines name the replica rank it took: [produce r1]
        set_log_role("produce", f"r{producer.rank}" + (":tp0" if tp is not None else ""))
    try:
        summary = producer.run()  # installs the in-loop (finish-then-stop) handlers
    except BaseException:
        producer.discard_if_unused()  # e.g. the first capture ran out of device memory
        raise
    text = json.dumps(summary, indent=2)
    print(text)
    if cfg.summary_json:
        Path(cfg.summary_json).write_text(text + "\n")
    return 0
