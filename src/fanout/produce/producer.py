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
half-done: the window in flight is finished and published, then the loop stops
and the process exits 0, recording the producer 'finished' (during start-up,
before any claim, it exits at once). One producer per run: a second one is refused
(RoleHeld) while the first is live, unless it asks to take over (--takeover).

Stream: row s of the endless stream is row perm_e[s mod N] of the prepared
dataset, e = s div N, perm_e a permutation seeded by (seed, e). Window w holds
rows [w·R, (w+1)·R) of that stream, so a recapture reproduces it exactly.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from fanout.contract import CaptureContract
from fanout.coord.coordinator import DB_NAME, DB_POINTER, Coordinator, RunConfig
from fanout.coord.leases import Claim, ProducerReg
from fanout.coord.liveness import Heartbeat
from fanout.data.draft_vocab import TOKEN_COUNTS, count_tokens, write_token_counts
from fanout.errors import ConfigError, ContractMismatch, StaleLease, StorageError, StorageFull
from fanout.flags import add_model_flags, model_from_args, problems
from fanout.ops.fp8 import FP8
from fanout.produce.capture import CapturedWindow, WindowCapturer
from fanout.filesystem import FileSystem
from fanout.store.store import Published, RunDir, Store, WindowMeta

log = logging.getLogger(__name__)


class ProducerConfig(BaseModel):
    """Every `fanout produce` flag. Fields marked (contract) change what windows mean."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_dir: str = Field(description="run directory (windows/, coordinator.sqlite3, ...)")
    verifier_name_or_path: str = Field(description="local HF verifier directory")
    data: list[str] = Field(min_length=1, description="chat data files (JSON, JSONL, Parquet)")
    tokenizer: str | None = Field(None, description="tokenizer dir (default: the verifier dir)")
    seq_len: int = Field(4096, ge=8, description="tokens per packed row T (contract)")
    allow_seq_len_over_max_positions: bool = Field(
        False,
        description="accept a --seq-len above the verifier's max_position_embeddings, for "
        "verifiers with RoPE scaling that extends it (docs/producer.md)",
    )
    window_rows: int = Field(16, ge=1, description="rows per window R (contract)")
    max_live_windows: int = Field(4, ge=2, description="K: window files alive at once")
    lag_policy: Literal["hold", "recapture", "detach"] = Field(
        "hold", description="what to do about a consumer that holds the producer at K"
    )
    expected_consumers: int = Field(1, ge=1, description="no eviction until this many registered")
    epochs: int = Field(1, ge=1, description="passes over the data (each reshuffled)")
    seed: int = Field(0, description="per-epoch shuffle seed (contract)")
    target_layer_ids: list[int] | None = Field(
        None, description="older name of --capture-layer-ids (same meaning); give one of them"
    )
    capture_layer_ids: list[int | Literal["all"]] | None = Field(
        None,
        description="verifier layers to capture (contract), or 'all': a superset each trainer "
        "picks its own --target-layer-ids from, in one verifier pass; default: the DFlash "
        "rule for --num-draft-layers",
    )

    @field_validator("capture_layer_ids", mode="before")
    @classmethod
    def _all_or_ids(cls, v: Any, info: ValidationInfo) -> Any:
        if info.data.get("target_layer_ids") is not None and v is not None:
            raise ValueError(
                "give --capture-layer-ids or its older name --target-layer-ids, not both"
            )
        if v == "all" or (isinstance(v, list) and v == ["all"]):
            return ["all"]
        if isinstance(v, list) and "all" in v:
            raise ValueError(f"'all' stands alone, got {v}")
        return v

    num_draft_layers: int = Field(5, ge=1, description="draft layers for the DFlash layer rule")
    device: str = Field("auto", description="verifier device: auto | cpu | cuda | cuda:N")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="verifier compute dtype; auto = bf16 on CUDA, fp32 on CPU"
    )
    storage_dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3fn"] = Field(
        "bfloat16",
        description="dtype of hidden_states on disk (contract); float8_e4m3fn halves the "
        "bytes of bf16 with one float32 scale per token and layer (docs/producer.md)",
    )
    store_last_hidden_states: bool = Field(
        False, description="also store final hidden states [R, T, H] (contract)"
    )
    capture_batch_rows: int = Field(4, ge=1, description="rows per verifier forward")
    overlap_publish: Literal["auto", "on", "off"] = Field(
        "auto",
        description="publish window w on a background thread while capturing w+1 (two host "
        "buffers); auto = on when the verifier runs on CUDA",
    )
    ttl_s: float = Field(30.0, gt=0, description="seconds without heartbeat before lost")
    heartbeat_s: float = Field(2.0, gt=0, description="heartbeat interval (seconds)")
    max_windows: int | None = Field(
        None, ge=1, description="stop after publishing this many windows (tests, benchmarks)"
    )
    exit_when_idle_s: float = Field(
        30.0,
        ge=0,
        description="after the stream is fully produced, exit once no demand "
        "arrived for this long (recapture policy keeps serving demand until then)",
    )
    workers: int | None = Field(None, ge=0, description="data-prep workers; default all cores")
    cache_dir: str | None = Field(None, description="data-prep cache root")
    format: Literal["auto", "sharegpt", "openai", "pairs"] = Field(
        "auto", description="input data shape"
    )
    messages_field: str | None = Field(None, description="field holding the turns")
    pair_keys: tuple[str, str] = Field(("user", "bot"), description="pairs: user/bot keys")
    chat_template: str | None = Field(
        None,
        description="chat template file (.jinja, or .json holding chat_template) to use "
        "instead of the tokenizer's",
    )
    on_bad_row: Literal["error", "skip"] = Field("error", description="bad input rows")
    over_length: Literal["split", "drop", "error"] = Field(
        "split", description="conversations longer than seq_len"
    )
    db_path: str | None = Field(
        None,
        description="coordinator database: a SQLite file on a local disk (default: "
        "RUN_DIR/coordinator.sqlite3) or postgresql://user@host/db?schema=NAME for trainers "
        "on other hosts; recorded in the run dir for the other processes",
    )
    takeover: bool = Field(
        False,
        description="take the run's producer role over from a live producer (that one is "
        "fenced off and exits); without it, a live producer makes this one exit",
    )
    progress: bool = Field(True, description="progress bar on stderr")


def window_count(num_rows: int, epochs: int, window_rows: int) -> int:
    return math.ceil(num_rows * epochs / window_rows)


def stream_rows(
    window: int, window_rows: int, num_rows: int, epochs: int, seed: int
) -> tuple[np.ndarray, int]:
    """Dataset row indices of window `window` and the epoch of its first row."""
    start = window * window_rows
    stop = min((window + 1) * window_rows, num_rows * epochs)
    s = np.arange(start, stop, dtype=np.int64)  # stream positions
    epochs_of = s // num_rows
    out = np.empty_like(s)
    for e in np.unique(epochs_of):
        perm = np.random.default_rng([seed, int(e)]).permutation(num_rows)
        sel = epochs_of == e
        out[sel] = perm[s[sel] % num_rows]
    return out, int(start // num_rows)


@dataclass
class ProducerStats:
    windows: int = 0
    rows: int = 0
    tokens: int = 0
    bytes: int = 0
    failures: int = 0
    disk_full_waits: int = 0
    waits_s: float = 0.0
    capture_s: float = 0.0
    publish_s: float = 0.0
    started: float = field(default_factory=time.monotonic)

    def summary(self) -> dict[str, Any]:
        el = max(time.monotonic() - self.started, 1e-9)
        return {
            "windows": self.windows,
            "rows": self.rows,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "failures": self.failures,
            "disk_full_waits": self.disk_full_waits,
            "elapsed_s": round(el, 3),
            "tokens_per_s": round(self.tokens / el, 1),
            "bytes_per_s": round(self.bytes / el, 1),
            "backpressure_wait_s": round(self.waits_s, 3),
            "capture_s": round(self.capture_s, 3),
            "publish_s": round(self.publish_s, 3),
        }


@dataclass(frozen=True, slots=True)
class _Committed:
    published: Published
    device_wait_s: float  # waiting for the window's device→host copies to land
    publish_s: float  # Store.publish + coordinator commit


def check_inputs(cfg: ProducerConfig) -> None:
    """Refuse what would fail later, before anything is created; each message names
    the flag: --data files that do not exist, a verifier directory without a readable
    config.json, a --seq-len above the verifier's max_position_embeddings.

    Why seq_len is the bound: position ids restart at 0 for every document of a packed
    row and over-length conversations are split into pieces of at most seq_len tokens
    (fanout.data.packing), so no position reaches seq_len. The longest document actually
    packed can be shorter, but it is known only after data preparation (minutes, and
    it changes with the data); seq_len is known now and is always safe.
    """
    from fanout.model.verifier import max_position_embeddings

    missing = [f for f in cfg.data if not Path(f).is_file()]
    if missing:
        raise ConfigError(f"--data: no such file: {', '.join(missing)}")
    try:
        limit = max_position_embeddings(cfg.verifier_name_or_path)
    except ConfigError as e:
        raise ConfigError(f"--verifier-name-or-path: {e}") from None
    if limit is None or cfg.seq_len <= limit:
        return
    if cfg.allow_seq_len_over_max_positions:
        log.warning(
            "--seq-len %d is above the verifier's max_position_embeddings %d: positions up "
            "to %d are captured (--allow-seq-len-over-max-positions)",
            cfg.seq_len, limit, cfg.seq_len - 1,
        )  # fmt: skip
        return
    raise ConfigError(
        f"--seq-len {cfg.seq_len} is above the verifier's max_position_embeddings {limit} "
        f"({Path(cfg.verifier_name_or_path) / 'config.json'}): rows would carry positions up "
        f"to {cfg.seq_len - 1}. Use --seq-len {limit} or less, or pass "
        "--allow-seq-len-over-max-positions for a verifier whose RoPE scaling extends it"
    )


# What a producer may create in a run directory (fanout.store.store.RunDir's folders, the data
# cache, the coordinator's files, stream.json, token counts): the only names a producer
# that failed before its first window removes, and only those that were not there before.
_RUN_DIR_NAMES = (
    "windows", "tmp", "quarantine", "telemetry", "logs", "cache", "contract.json",
    "stream.json", TOKEN_COUNTS, DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm", DB_POINTER,
)  # fmt: skip


@dataclass
class _Created:
    """What a producer start created, noted before it creates anything, so that a start
    that fails before the first window leaves no run-dir skeleton behind."""

    root: Path
    root_is_new: bool
    run_existed: bool  # a coordinator database (or a pointer to one) was there: never remove
    new_names: list[str]
    new_db: Path | None  # a SQLite database elsewhere (--db-path) that did not exist

    @classmethod
    def note(cls, root: Path, db_path: str | None) -> _Created:
        root = root.absolute()
        where = Coordinator.resolve_db_path(root, db_path)
        new_db = where if isinstance(where, Path) and not where.exists() else None
        if new_db is not None and new_db.parent == root:
            new_db = None  # one of _RUN_DIR_NAMES
        return cls(
            root=root,
            root_is_new=not root.exists(),
            run_existed=(root / DB_NAME).exists()
            or (root / DB_POINTER).exists()
            or (isinstance(where, Path) and where.exists()),
            new_names=[n for n in _RUN_DIR_NAMES if not (root / n).exists()],
            new_db=new_db,
        )

    def remove(self) -> list[str]:
        """Remove what was created (best effort, never raises); returns what went."""
        import shutil

        paths = [self.root / n for n in self.new_names]
        if self.new_db is not None:
            paths += [self.new_db, Path(f"{self.new_db}-wal"), Path(f"{self.new_db}-shm")]
        removed = []
        for path in paths:
            try:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                elif path.exists() or path.is_symlink():
                    path.unlink()
                else:
                    continue
            except OSError as e:
                log.warning("could not remove %s: %s", path, e)
                continue
            removed.append(path.name)
        if self.root_is_new:
            with contextlib.suppress(OSError):  # not empty: someone else's files stay
                self.root.rmdir()
                removed.append(str(self.root))
        return removed


class Producer:
    """One producer process. Build with `Producer(cfg)`, then `run()`.

    A start that fails (or is interrupted) before it publishes its first window
    removes what it created in the run directory (`discard_if_unused`), so no
    skeleton of a run that never produced anything is left for trainers to find.
    """

    def __init__(self, cfg: ProducerConfig, *, fs: FileSystem | None = None) -> None:
        self.cfg = cfg
        check_inputs(cfg)
        self._created: _Created | None = _Created.note(Path(cfg.run_dir), cfg.db_path)
        self._created_db = False  # this process created the run's coordinator database
        try:
            self._start(fs or FileSystem())
        except BaseException:
            self.discard_if_unused()
            raise

    def discard_if_unused(self) -> bool:
        """After a start that failed or was interrupted: if this producer created the run
        (no coordinator database was there), no window was ever published and no trainer
        has joined, remove what it created in the run dir (folders, database,
        contract.json, stream.json, token counts, data cache) and the run dir itself if
        it made it and it is now empty. Never touches an existing run. True if it
        removed something."""
        created, self._created = self._created, None
        if created is None or created.run_existed:
            return False
        coord = getattr(self, "coord", None)
        if coord is not None:
            if not self._created_db:
                return False
            q = coord.conn.execute
            try:
                published = (
                    "SELECT COUNT(*) FROM windows WHERE state IN ('ready','evicting','evicted')"
                )
                me = f"{socket.gethostname()}:{os.getpid()}"  # the owner run() registers
                used = (
                    q(published).fetchone()[0]
                    + int(coord.meta("evictions"))
                    + q("SELECT COUNT(*) FROM consumers").fetchone()[0]  # trainers joined
                    + q("SELECT COUNT(*) FROM producer WHERE owner <> ?", (me,)).fetchone()[0]
                )  # the last: another producer took the run over (--takeover)
            except Exception:  # the database itself failed: keep it for a post-mortem
                return False
            if used:
                return False
            coord.close()
        removed = created.remove()
        if removed:
            log.info(
                "%s: stopped before publishing a window; removed what this start created: %s",
                created.root,
                ", ".join(removed),
            )
        return bool(removed)

    def _start(self, fs: FileSystem) -> None:
        from fanout.data.prepare import PrepareConfig, prepare
        from fanout.model.verifier import load_verifier

        cfg = self.cfg
        try:
            self.run_dir = RunDir(Path(cfg.run_dir)).create(fs)
        except OSError as e:
            raise ConfigError(
                f"--run-dir {cfg.run_dir}: cannot create the run directory: {e.strerror or e} "
                f"({e.filename})"
            ) from None
        self.store = Store(self.run_dir, fs)
        tokenizer = cfg.tokenizer or cfg.verifier_name_or_path
        try:
            prepare_cfg = PrepareConfig(
                data=cfg.data,
                tokenizer=tokenizer,
                seq_len=cfg.seq_len,
                format=cfg.format,
                messages_field=cfg.messages_field,
                pair_keys=cfg.pair_keys,
                chat_template=cfg.chat_template,
                workers=cfg.workers,
                cache_dir=cfg.cache_dir or str(self.run_dir.root / "cache"),
                on_bad_row=cfg.on_bad_row,
                over_length=cfg.over_length,
                progress=cfg.progress,
            )
        except ValidationError as e:
            raise ConfigError(f"data preparation options: {problems(e)}") from None
        self.dataset = prepare(prepare_cfg)
        if self.dataset.num_rows == 0:
            raise ConfigError(f"{cfg.data}: no usable rows after preparation")
        self.verifier = load_verifier(
            cfg.verifier_name_or_path,
            device=cfg.device,
            dtype=cfg.dtype,
            target_layer_ids=self._capture_layers(),
            num_draft_layers=cfg.num_draft_layers,
            storage_dtype=cfg.storage_dtype,
            store_last_hidden_states=cfg.store_last_hidden_states,
        )
        self.contract = CaptureContract(
            **self.verifier.contract_fields(),
            dataset_fingerprint=self.dataset.fingerprint,
            tokenizer_fingerprint=self.dataset.tokenizer_fingerprint,
            seq_len=cfg.seq_len,
            window_rows=cfg.window_rows,
            shuffle_seed=cfg.seed,
        )
        self.total_windows = window_count(self.dataset.num_rows, cfg.epochs, cfg.window_rows)
        self._check_disk_budget()
        # A changed contract is refused before anything is written; a new run gets its
        # stream.json and token counts before its database, so a trainer that finds
        # the database finds them too.
        existing = self._open_existing_coordinator()
        self._write_stream_info()
        write_token_counts(
            self.run_dir.root,
            count_tokens(self.dataset, self.verifier.vocab_size),
            self.contract.stream_id,
        )
        self.coord = existing or self._create_coordinator()
        self.stats = ProducerStats()
        self.capturer = WindowCapturer(self.verifier, self.dataset, cfg.capture_batch_rows)
        self._stop = False
        overlap = cfg.overlap_publish == "on" or (
            cfg.overlap_publish == "auto" and self.verifier.device.type == "cuda"
        )
        # One publish in flight at most; the capturer alternates between two buffer
        # slots so the window being written is never the one being filled.
        self._publisher = ThreadPoolExecutor(1, "fanout-publish") if overlap else None
        self._inflight: tuple[Claim, Future[_Committed], int, int] | None = None
        self._thread_state = threading.local()

    def _capture_layers(self) -> tuple[int, ...] | Literal["all"] | None:
        """--capture-layer-ids (or its older name --target-layer-ids); None: DFlash rule."""
        ids = self.cfg.capture_layer_ids or self.cfg.target_layer_ids
        if ids == ["all"]:
            return "all"
        return tuple(int(i) for i in ids) if ids else None

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

    def _check_disk_budget(self) -> None:
        """Warn at start when the run dir cannot hold K + 1 windows (the K+1st: the extra
        slot for the slowest consumer's window). Not an error: evictions, an operator or
        another job may free space, and a full disk is waited out, not fatal."""
        need = (self.cfg.max_live_windows + 1) * self.window_bytes()
        free = self.store.fs.free_bytes(self.run_dir.root)
        gib = 2**30
        msg = (
            f"{self.run_dir.root}: up to {self.cfg.max_live_windows} + 1 windows of "
            f"{self.window_bytes() / gib:.2f} GiB need {need / gib:.1f} GiB"
        )
        if free < need:
            log.warning(
                "%s but only %.1f GiB are free: the producer will wait on a full disk. Lower "
                "--max-live-windows or --window-rows, or use --storage-dtype float8_e4m3fn",
                msg,
                free / gib,
            )
        else:
            log.info("%s (%.1f GiB free)", msg, free / gib)

    def _run_config(self) -> RunConfig:
        cfg = self.cfg
        return RunConfig(
            max_live_windows=cfg.max_live_windows,
            lag_policy=cfg.lag_policy,
            expected_consumers=cfg.expected_consumers,
            total_windows=self.total_windows,
            ttl_s=cfg.ttl_s,
        )

    def _open_existing_coordinator(self) -> Coordinator | None:
        """The run's coordinator if the run exists (same contract, else refused); None if new."""
        cfg = self.cfg
        if not Coordinator.exists(self.run_dir.root, cfg.db_path):
            return None
        coord = Coordinator.open(self.run_dir.root, db_path=cfg.db_path, store=self.store)
        if coord.contract != self.contract:  # refuse before touching stream.json
            coord.close()
            raise ContractMismatch(coord.contract.diff(self.contract), where="producer")
        try:
            coord.check_producer_role(cfg.takeover)  # RoleHeld: refused before any write
        except BaseException:
            coord.close()
            raise
        if coord.config != self._run_config():
            log.warning("run settings stored in %s win over flags: %s", coord.db_path, coord.config)
        return coord

    def _create_coordinator(self) -> Coordinator:
        try:
            coord = Coordinator.create(
                self.run_dir.root,
                self.contract,
                self._run_config(),
                db_path=self.cfg.db_path,
                store=self.store,
            )
        except OSError as e:  # the database's directory (--db-path) cannot be made
            raise ConfigError(
                f"--db-path {self.cfg.db_path}: cannot create the coordinator database: "
                f"{e.strerror or e} ({e.filename})"
            ) from None
        self._created_db = True
        return coord

    def _write_stream_info(self) -> None:
        """stream.json: what consumers need to turn `--epochs` into windows."""
        import json

        info = {
            "stream_id": self.contract.stream_id,
            "num_rows": self.dataset.num_rows,
            "window_rows": self.cfg.window_rows,
            "epochs": self.cfg.epochs,
            "total_windows": self.total_windows,
            "dataset_summary": self.dataset.summary,
        }
        path = self.run_dir.root / "stream.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(info, indent=2) + "\n")
        tmp.replace(path)

    # ---- one window ---------------------------------------------------------------

    def produce_one(self, preg: ProducerReg, claim: Claim) -> None:
        """Capture `claim`'s window and publish it (inline, or handed to the publisher)."""
        cfg = self.cfg
        t0 = time.monotonic()
        idx, epoch = stream_rows(
            claim.window, cfg.window_rows, self.dataset.num_rows, cfg.epochs, cfg.seed
        )
        window = self.capturer.capture(idx)
        self.stats.capture_s += time.monotonic() - t0
        tensors = window.tensors
        r = int(tensors["input_ids"].shape[0])
        meta = WindowMeta(
            contract_hash=self.contract.stream_id,
            window=claim.window,
            generation=claim.generation,
            epoch=epoch,
            row_start=claim.rows[0],
            row_end=claim.rows[0] + r,
        )
        tokens = int((tensors["document_ids"] >= 0).sum())
        if self._publisher is None:
            self._count(self._commit(claim, window, meta, self.coord), r, tokens)
            return
        self.finish_inflight()  # its buffers are the other slot's: free after this
        fut = self._publisher.submit(self._commit_in_thread, claim, window, meta)
        self._inflight = (claim, fut, r, tokens)
        self.capturer.flip()  # the window being published keeps its slot

    def _commit(
        self, claim: Claim, window: CapturedWindow, meta: WindowMeta, coord: Coordinator
    ) -> _Committed:
        """Wait for the window's device copies, Store.publish, coordinator commit."""
        t0 = time.monotonic()
        window.wait()
        t1 = time.monotonic()
        coord.renew(claim)  # StaleLease here: we were superseded; publish nothing
        published = self._publish(window.tensors, meta, claim, coord)
        try:
            coord.publish_ready(claim, published)
        except StaleLease:
            self.store.remove(published.name)  # our claim is gone: the file is an orphan
            raise
        return _Committed(published, device_wait_s=t1 - t0, publish_s=time.monotonic() - t1)

    def _commit_in_thread(
        self, claim: Claim, window: CapturedWindow, meta: WindowMeta
    ) -> _Committed:
        # Coordinator connections are per thread: the publisher keeps its own.
        coord = getattr(self._thread_state, "coord", None)
        if coord is None:
            coord = Coordinator.open(self.run_dir.root, db_path=self.cfg.db_path, store=self.store)
            self._thread_state.coord = coord
        return self._commit(claim, window, meta, coord)

    def _count(self, done: _Committed, rows: int, tokens: int) -> None:
        self.stats.capture_s += done.device_wait_s
        self.stats.publish_s += done.publish_s
        self.stats.windows += 1
        self.stats.rows += rows
        self.stats.tokens += tokens
        self.stats.bytes += done.published.nbytes

    def finish_inflight(self, *, block: bool = True) -> None:
        """Wait for (or, with block=False, poll) the background publish and account for it.

        A StorageError there fails that window's claim (it is retried under a new
        generation), as it would inline; anything else (StaleLease) propagates.
        """
        if self._inflight is None:
            return
        claim, fut, rows, tokens = self._inflight
        if not block and not fut.done():
            return
        self._inflight = None
        try:
            done = fut.result()
        except StorageError as e:
            self.stats.failures += 1
            log.error("window %d: %s; will retry", claim.window, e)
            self.coord.fail(claim, str(e))
            return
        self._count(done, rows, tokens)

    def _publish(
        self, tensors: dict[str, Any], meta: WindowMeta, claim: Claim, coord: Coordinator
    ) -> Any:
        """Store.publish, waiting out a full disk with the captured tensors in hand: ENOSPC
        is transient (evictions and operators free space) and must not use up the
        window's capture attempts (3 quick failures would fail the window for good).
        Each try writes a fresh temp file, so no fsync is ever retried."""
        delay = 0.5
        while True:
            try:
                return self.store.publish(tensors, meta)
            except StorageFull as e:
                if self._stop:
                    raise
                self.stats.disk_full_waits += 1
                log.error("window %d: %s; disk full, retrying in %.1f s", claim.window, e, delay)
                time.sleep(delay)
                delay = min(2 * delay, 5.0)
                coord.renew(claim)  # StaleLease if we were superseded meanwhile

    # ---- the loop -----------------------------------------------------------------

    def _install_signals(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            log.warning("signal %d: stopping after releasing the window in flight", signum)
            self._stop = True

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    def _stream_done(self) -> bool:
        q = self.coord.conn.execute
        frontier = int(self.coord.meta("next_window"))
        pending = q("SELECT COUNT(*) FROM windows WHERE state IN ('queued','capturing')").fetchone()
        if frontier < self.total_windows or pending[0]:
            return False
        if self.cfg.lag_policy != "recapture":
            return True
        # Under recapture a laggard may still demand windows: wait for consumers to finish.
        active = q(
            "SELECT COUNT(*) FROM consumers WHERE state='active' AND cursor < ?",
            (self.total_windows,),
        ).fetchone()[0]
        return active == 0

    def run(self) -> dict[str, Any]:
        """Produce until the stream is done, max_windows, or a signal. Returns the summary."""
        from tqdm import tqdm

        self._install_signals()
        owner = f"{socket.gethostname()}:{os.getpid()}"
        preg = self.coord.register_producer(self.contract, owner=owner, takeover=self.cfg.takeover)
        swept = self.coord.sweep()
        log.info("producer %s: %s; swept %s", owner, self.verifier, swept)
        bar = tqdm(
            total=self.total_windows,
            desc="produce",
            unit="win",
            disable=not self.cfg.progress,
            initial=int(self.coord.meta("next_window")),
        )
        idle_since: float | None = None
        with Heartbeat(
            self.run_dir.root,
            preg,
            self.cfg.heartbeat_s,
            reclaim=True,
            open_kwargs={"db_path": self.cfg.db_path},
        ) as hb:
            while not self._stop:
                hb.check()
                self.finish_inflight(block=False)
                started = self.stats.windows + (self._inflight is not None)
                if self.cfg.max_windows and started >= self.cfg.max_windows:
                    break
                w0 = time.monotonic()
                if not self.coord.wait_for_capacity(preg, timeout_s=0.5):
                    self.stats.waits_s += time.monotonic() - w0
                    bar.set_postfix_str("waiting on consumers (K live)")
                    continue
                self.stats.waits_s += time.monotonic() - w0
                claim = self.coord.claim(preg)
                if claim is None:
                    if self._stream_done():
                        break
                    now = time.monotonic()
                    idle_since = idle_since or now
                    if (
                        int(self.coord.meta("next_window")) >= self.total_windows
                        and now - idle_since > self.cfg.exit_when_idle_s
                    ):
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
                except BaseException:
                    self._release(claim)
                    raise
                bar.update(self.stats.windows - done_before)
                if self.cfg.progress:
                    bar.set_postfix_str(self._progress_line())
            n = self.stats.windows
            self.finish_inflight()  # the last window's publish, before the summary
            bar.update(self.stats.windows - n)
        bar.close()
        if self._publisher is not None:
            self._publisher.shutdown(wait=True)
        self.coord.finish_producer(preg)  # a clean exit: `fanout status` shows it finished
        summary = self.stats.summary()
        summary["stream_id"] = self.contract.stream_id
        summary["total_windows"] = self.total_windows
        log.info("producer done: %s", summary)
        return summary

    def _progress_line(self) -> str:
        """live windows/bytes on disk, rates since start, backpressure wait so far."""
        live, live_bytes = self.coord.conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM windows WHERE state='ready'"
        ).fetchone()
        s = self.stats.summary()
        rows_s = self.stats.rows / max(s["elapsed_s"], 1e-9)
        return (
            f"live {live} ({live_bytes / 2**20:.0f} MiB) | {rows_s:.1f} rows/s "
            f"{s['tokens_per_s']:.0f} tok/s {s['bytes_per_s'] / 2**20:.1f} MiB/s | "
            f"waited {s['backpressure_wait_s']:.0f} s"
        )

    def _release(self, claim: Claim) -> None:
        try:
            self.coord.fail(claim, "producer interrupted")
        except Exception as e:  # the claim may already be gone; never mask the original
            log.warning("could not release claim on window %d: %s", claim.window, e)


def add_arguments(p: argparse.ArgumentParser, name: str = "produce") -> None:
    add_model_flags(p, ProducerConfig)
    p.add_argument("--summary-json", default=None, help="write the final summary here (JSON)")


def run(args: argparse.Namespace, name: str = "produce") -> int:
    import json

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = model_from_args(ProducerConfig, args)

    def early_exit(signum: int, _frame: Any) -> None:
        # Before the loop starts nothing is claimed: stopping now loses nothing.
        log.warning("signal %d during start-up: exiting", signum)
        raise SystemExit(0)

    signal.signal(signal.SIGINT, early_exit)
    signal.signal(signal.SIGTERM, early_exit)
    producer = Producer(cfg)  # a failed start removes what it created (discard_if_unused)
    try:
        summary = producer.run()  # installs the in-loop (finish-then-stop) handlers
    except BaseException:
        producer.discard_if_unused()  # e.g. the first capture ran out of device memory
        raise
    text = json.dumps(summary, indent=2)
    print(text)
    if args.summary_json:
        Path(args.summary_json).write_text(text + "\n")
    return 0
