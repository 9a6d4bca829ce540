"""`fanout produce`'s config, and the checks of its inputs made before anything starts.

    cfg = ProducerConfig(run_dir="runs/r1", verifier_name_or_path=VERIFIER_DIR, data=[...])
    check_inputs(cfg)          # ConfigError naming the flag, before anything is created
    ds = prepared_data(cfg)    # `fanout prepare --out` rows, or None for conversation files

The producer (fanout.produce.producer) runs it; flags are generated from its fields.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationError, model_validator

from fanout.coord.coordinator import RunConfig
from fanout.coord.heartbeat import HeartbeatOptions
from fanout.coord.retention import RunOptions
from fanout.data.cache import PackedDataset
from fanout.data.prepare import DataOptions, PrepareConfig
from fanout.data.template import VerifierTokenizer
from fanout.errors import ConfigError, CorruptPreparedData
from fanout.flags import limit_flag, problems
from fanout.model.capture_layers import CaptureLayers
from fanout.model.verifier import VerifierOptions
from fanout.produce.capture_for import CaptureForOptions
from fanout.produce.follow import FollowOptions, check_follow
from fanout.produce.onpolicy import OnPolicyOptions
from fanout.produce.replicas import ReplicaOptions
from fanout.produce.verifier_follow import FollowVerifierOptions
from fanout.regen.engine import RegenOptions
from fanout.tracking import TrackingOptions, check_available

log = logging.getLogger(__name__)


class ProducerConfig(
    DataOptions,
    VerifierOptions,
    CaptureLayers,
    CaptureForOptions,
    RunOptions,
    RegenOptions,
    OnPolicyOptions,
    FollowOptions,
    FollowVerifierOptions,
    ReplicaOptions,
    HeartbeatOptions,
    TrackingOptions,
):
    """Every `fanout produce` flag. Fields marked (contract) change what windows mean.

    Composed, not copied: the chat format and data-stage fields are DataOptions'
    (fanout.data.prepare), where its summary goes in W&B TrackingOptions'
    (fanout.tracking), how the verifier runs is VerifierOptions'
    (fanout.model.verifier), which layers it captures CaptureLayers'
    (fanout.model.capture_layers) and CaptureForOptions' (the families it is for,
    fanout.produce.capture_for), a live source (--follow) FollowOptions'
    (fanout.produce.follow), a verifier that changes (--follow-verifier)
    FollowVerifierOptions' (fanout.produce.verifier_follow), how the run shares windows is
    RunOptions'
    (fanout.coord.retention), --regenerate OnPolicyOptions' (fanout.produce.onpolicy),
    --replicas ReplicaOptions' (fanout.produce.replicas); each is declared once there.
    These are the producer's own.
    """

    # fields a before-validator fills from another flag: --help says so (fanout.flags)
    required_unless: ClassVar[dict[str, str]] = {"data": "--follow"}

    @model_validator(mode="before")
    @classmethod
    def _follow_is_the_data(cls, v: Any) -> Any:
        """--follow PATH: PATH is the data (no --data needed)."""
        if isinstance(v, dict) and v.get("follow") and not v.get("data"):
            return v | {"data": [v["follow"]]}
        return v

    # Not ConsumerOptions': the producer creates the run that a trainer reads.
    run_dir: str = Field(description="run directory (windows/, coordinator.sqlite3, ...)")
    verifier_name_or_path: str = Field(description="local HF verifier directory")
    # Not PrepareConfig's: optional here (the verifier directory holds a tokenizer).
    tokenizer: VerifierTokenizer = None
    # Not PrepareConfig's: part of the capture contract, and a row needs room for a block.
    seq_len: int = Field(4096, ge=8, description="tokens per packed row T (contract)")
    allow_seq_len_over_max_positions: bool = Field(
        False,
        description="accept a --seq-len above the verifier's max_position_embeddings, for "
        "verifiers with RoPE scaling that extends it (docs/producer.md)",
    )
    window_rows: int = Field(16, ge=1, description="rows per window R (contract)")
    epochs: int = Field(1, ge=1, description="passes over the data (each reshuffled)")
    # Not PrepareConfig's shuffle seed: the seed of the per-epoch stream permutation.
    seed: int = Field(0, description="per-epoch shuffle seed (contract)")
    capture_batch_rows: int = Field(4, ge=1, description="rows per verifier forward")
    overlap_publish: Literal["auto", "on", "off"] = Field(
        "auto",
        description="publish window w on a background thread while capturing w+1 (two host "
        "buffers); auto = on when the verifier runs on CUDA",
    )
    max_windows: int | None = limit_flag(
        "end the stream after this many windows (every replica's together; tests, "
        "benchmarks); a later producer without it continues the stream"
    )
    summary_json: str | None = Field(
        None, description="also write the final summary (printed as JSON) to this file"
    )
    exit_when_idle_s: float = Field(
        30.0,
        ge=0,
        description="after the stream is fully produced, while an active consumer is "
        "still behind its end (it may want an evicted window again, under any policy): exit "
        "once no demand arrived for this long. With none behind the end (all finished, "
        "stopped, detached or lost) the producer exits at once; restart it with the same "
        "flags to serve a later --resume",
    )
    # Not ConsumerOptions': where to create the database (recorded in the run dir); a
    # trainer's only overrides where to find it.
    db_path: str | None = Field(
        None,
        description="coordinator database: a SQLite file on a local disk (default: "
        "RUN_DIR/coordinator.sqlite3) or postgresql://user@host/db?schema=NAME for trainers "
        "on other hosts; recorded in the run dir for the other processes",
    )
    # Not ConsumerOptions': this one takes the producer role, a trainer's its consumer id.
    takeover: bool = Field(
        False,
        description="take the run's producer role (this --replica-rank's) over from a live "
        "producer (that one is fenced off and exits); without it, a live producer makes "
        "this one exit",
    )

    def prepare_config(
        self, default_cache_dir: str, data: list[str] | None = None
    ) -> PrepareConfig:
        """The data stage's config: the DataOptions fields as given (`data`: other input
        files, e.g. a --follow chunk), the tokenizer (default: the verifier's), seq_len,
        and the cache in `default_cache_dir` unless given."""
        given = {} if data is None else {"data": data}
        try:
            return PrepareConfig(
                **self.data_options() | given | {"cache_dir": self.cache_dir or default_cache_dir},
                tokenizer=self.tokenizer or self.verifier_name_or_path,
                seq_len=self.seq_len,
            )
        except ValidationError as e:
            raise ConfigError(f"data preparation options: {problems(e, PrepareConfig)}") from None

    def run_config(self, total_windows: int | None) -> RunConfig:
        """The run's RunConfig: the RunOptions fields as given and the stream's length."""
        options = {k: getattr(self, k) for k in RunOptions.model_fields}
        return RunConfig(**options, total_windows=total_windows)


def prepared_data(cfg: ProducerConfig) -> PackedDataset | None:
    """`--data DIR` that `fanout prepare --out` wrote: its rows, used as they are, once
    checked against this producer (fanout.data.prepare.check_prepared: --seq-len, the
    tokenizer, any row option given); None when --data names conversation files.
    ConfigError naming --data for a directory that is not a prepared dataset, one given
    beside other --data, or one under --regenerate (which rewrites conversations)."""
    from fanout.data.prepare import ROW_OPTIONS, check_prepared, is_prepared_dir
    from fanout.data.template import TOKENIZER_FILES

    dirs = [d for d in cfg.data if Path(d).is_dir()]
    if not dirs:
        return None
    label = f"--data {dirs[0]}"
    if not is_prepared_dir(dirs[0]):
        raise ConfigError(
            f"{label}: a directory, but not one `fanout prepare --out` wrote (no manifest.json)"
        )
    if len(cfg.data) > 1:
        raise ConfigError(
            f"{label}: a prepared directory is the whole dataset: give it as the only --data "
            "(or prepare every file into one with `fanout prepare --data A B ...`)"
        )
    if cfg.regenerate:
        raise ConfigError(
            f"{label}: --regenerate rewrites conversations: give it the files `fanout "
            "prepare` read, not the prepared directory"
        )
    try:
        ds = PackedDataset(dirs[0])
    except (CorruptPreparedData, KeyError, ValueError) as e:
        raise ConfigError(f"{label}: not a readable prepared dataset: {e}") from None
    tok, flag = cfg.tokenizer, "--tokenizer"
    verifier = Path(cfg.verifier_name_or_path)
    if tok is None and any((verifier / n).is_file() for n in TOKENIZER_FILES):
        tok, flag = str(verifier), "the verifier's, --verifier-name-or-path"
    options = (*ROW_OPTIONS, "chat_template", "mask_path")
    given = cfg.model_dump(mode="json", include=set(options) & cfg.model_fields_set)
    check_prepared(ds, label, seq_len=cfg.seq_len, tokenizer=tok, tokenizer_flag=flag, given=given)
    return ds


def check_inputs(cfg: ProducerConfig) -> None:
    """Refuse what would fail later, before anything is created or loaded; each message
    names the flag: --data files that do not exist (or a prepared directory that does
    not fit this producer: prepared_data), a verifier directory without a
    readable config.json or without weight files, a tokenizer directory (default: the
    verifier's) without tokenizer files — under --regenerate with the hf engine, one
    that does not load or has no chat template —, a --seq-len above the verifier's
    max_position_embeddings.

    Why seq_len is the bound: position ids restart at 0 for every document of a packed
    row and over-length conversations are split into pieces of at most seq_len tokens
    (fanout.data.packing), so no position reaches seq_len. The longest document actually
    packed can be shorter, but it is known only after data preparation (minutes, and
    it changes with the data); seq_len is known now and is always safe.
    """
    from fanout.data.template import tokenizer_dir
    from fanout.model.verifier import check_verifier_dir, max_position_embeddings

    if cfg.wandb_project:
        check_available("--wandb-project")
    prepared = None
    if cfg.follow:  # a source that grows as it runs (its files need not exist yet)
        check_follow(cfg)
    else:
        prepared = prepared_data(cfg)  # --data DIR that fanout prepare wrote, checked
        missing = [f for f in cfg.data if not Path(f).is_file()]
        if missing and prepared is None:
            raise ConfigError(f"--data: no such file: {', '.join(missing)}")
    try:
        limit = max_position_embeddings(cfg.verifier_name_or_path)
        check_verifier_dir(cfg.verifier_name_or_path)
    except ConfigError as e:
        raise ConfigError(f"--verifier-name-or-path: {e}") from None
    # prepared rows need no tokenizer here: they carry their own (checked against one given)
    if prepared is None or cfg.tokenizer:
        tok = tokenizer_dir(cfg.tokenizer, cfg.verifier_name_or_path)
    if cfg.regenerate and cfg.engine == "hf":  # the engine's tokenizer: a second or so
        from fanout.regen.hf import load_tokenizer

        load_tokenizer(tok)
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
