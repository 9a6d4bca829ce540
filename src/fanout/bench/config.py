"""What a benchmark is: its JSON config (BenchConfig) and the per-role specs in it.

    from fanout.bench.config import BenchConfig
    cfg = BenchConfig.load("benchmarks/fanout/cpu-tiny.json")   # ConfigError names the field
    cfg.producer.window_rows, [c.block_size for c in cfg.consumers], cfg.scenarios

The per-role specs (ProducerSpec, ConsumerSpec) are fields of the commands' own
configs (`fanout produce`'s ProducerConfig, `fanout train`'s TrainConfig) with bench
defaults: constraints, descriptions and flags as declared there; fanout.bench.bench
turns them into the roles' flags. AssetsSpec says where the verifier, tokenizer and
data come from. With `database` set, each run dir gets a PostgreSQL schema of its own
(`schema_name`, `run_dir_database`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.fields import FieldInfo

from fanout.coord.postgresdb import is_url
from fanout.errors import ConfigError
from fanout.families.registry import FamilyName
from fanout.flags import limit_flag
from fanout.model.verifier import DTypeName
from fanout.produce.config import ProducerConfig
from fanout.train.config import TrainConfig

Scenario = Literal["1p1c", "1p3c", "unshared"]
SCENARIOS: tuple[Scenario, ...] = ("1p1c", "1p3c", "unshared")


def scenario_title(name: str, drafts: int) -> str:
    """What a scenario runs, in words, for output, reports and plot titles (its name, e.g.
    `1p3c`, stays the key in report.json and the folder name): `1p3c` with 6 drafts is
    "1 producer → 6 drafts"."""
    s = "" if drafts == 1 else "s"
    if name == "unshared":
        return f"{drafts} unshared producer → draft pair{s}"
    if name in ("1p1c", "1p3c"):
        return f"1 producer → {drafts} draft{s}"
    return name


class AssetsSpec(BaseModel):
    """Where the verifier, tokenizer and data come from."""

    model_config = ConfigDict(extra="forbid")

    cache_dir: str = Field("runs/assets", description="cache of built assets (relative: to cwd)")
    verifier_dir: str | None = Field(
        None, description="existing HF verifier dir; default: build a random tiny Qwen3"
    )
    tokenizer_dir: str | None = Field(
        None, description="tokenizer dir; default: the verifier's, or the demo tokenizer"
    )
    data: list[str] | None = Field(None, description="chat data files; default: demo corpus")
    conversations: int | None = limit_flag("use only the first N conversations (JSONL) of the data")
    demo_conversations: int = Field(4000, ge=1, description="size of the generated corpus")
    demo_train_steps: int = Field(
        200, ge=1, description="training steps of the demo verifier (only if it is used)"
    )
    use_demo_verifier: bool = Field(
        False, description="use the briefly trained demo verifier instead of a random one"
    )
    verifier_hidden_size: int = Field(128, ge=16, description="random verifier hidden size")
    verifier_num_layers: int = Field(16, ge=4, description="random verifier layers")
    verifier_intermediate_size: int = Field(512, ge=16, description="random verifier MLP width")


def _field(config: type[BaseModel], name: str, default: Any) -> Any:
    """Field `name` of a command's config (`fanout produce`'s ProducerConfig, `fanout
    train`'s TrainConfig) as declared there — constraints, description, flag — with
    only the default changed to the bench's. The spec's annotation must be the
    command's too (tests/test_bench.py checks every spec field)."""
    return FieldInfo.merge_field_infos(config.model_fields[name], default=default)


class ProducerSpec(BaseModel):
    """`fanout produce` settings shared by every scenario: fields of ProducerConfig
    (bench defaults), passed as its flags, and bench-only `threads` and `extra_args`."""

    model_config = ConfigDict(extra="forbid")

    seq_len: int = _field(ProducerConfig, "seq_len", 256)
    window_rows: int = _field(ProducerConfig, "window_rows", 4)
    max_live_windows: int = _field(ProducerConfig, "max_live_windows", 4)
    lag_policy: Literal["hold", "recapture", "detach"] = _field(
        ProducerConfig, "lag_policy", "hold"
    )
    epochs: int = _field(ProducerConfig, "epochs", 1)
    num_draft_layers: int | None = _field(ProducerConfig, "num_draft_layers", 1)
    capture_for: list[FamilyName] | None = _field(ProducerConfig, "capture_for", None)
    capture_batch_rows: int = _field(ProducerConfig, "capture_batch_rows", 4)
    # Producer replicas per run dir (each a `fanout produce --replica-rank i`).
    replicas: int = _field(ProducerConfig, "replicas", 1)
    # The verifier's device in 1p1c and 1p3c (unshared: BenchConfig.unshared_producer_devices).
    device: str = _field(ProducerConfig, "device", "cpu")
    dtype: DTypeName = _field(ProducerConfig, "dtype", "auto")
    workers: int | None = _field(ProducerConfig, "workers", 1)
    threads: int | None = Field(
        None, ge=1, description="torch/OMP threads of producers; None: threads_per_role"
    )
    extra_args: list[str] = Field(default_factory=list, description="more `produce` flags")


class ConsumerSpec(BaseModel):
    """One trainer: fields of `fanout train`'s TrainConfig (bench defaults), passed as
    its flags; `id` is its --consumer-id, `extra_args` more flags."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="consumer id (also a file name)")
    draft_family: FamilyName = _field(TrainConfig, "draft_family", "dflash")
    block_size: int = _field(TrainConfig, "block_size", 8)
    max_anchors: int = _field(TrainConfig, "max_anchors", 16)
    lr: float = _field(TrainConfig, "lr", 3e-4)
    seed: int = _field(TrainConfig, "seed", 0)
    device: str = _field(TrainConfig, "device", "cpu")
    rows_per_step: int = _field(TrainConfig, "rows_per_step", 2)
    num_layers: int = _field(TrainConfig, "num_layers", 1)
    # A draft that ends before the stream does (the others train on: issue #27).
    max_steps: int | None = _field(TrainConfig, "max_steps", None)
    extra_args: list[str] = Field(default_factory=list, description="more `train` flags")


class BenchConfig(BaseModel):
    """A benchmark (benchmarks/fanout/*.json). Unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="benchmark name (report title)")
    description: str = Field("", description="what it measures, for the report")
    assets: AssetsSpec = Field(default_factory=AssetsSpec)
    producer: ProducerSpec = Field(default_factory=ProducerSpec)
    consumers: list[ConsumerSpec] = Field(min_length=1, description="the drafts (1p3c uses all)")
    scenarios: list[Scenario] = Field(default_factory=lambda: list(SCENARIOS), min_length=1)
    unshared_producer_devices: list[str] | None = Field(
        None, description="verifier device of each unshared pair; default: producer.device"
    )
    warmup_steps: int = Field(2, ge=1, description="first steps per consumer left out")
    telemetry_interval_s: float = Field(0.5, gt=0, description="sampler interval (s)")
    scenario_timeout_s: float = Field(900.0, gt=0, description="kill a scenario after (s)")
    threads_per_role: int | None = Field(
        None, ge=1, description="OMP/torch threads per role process; None: library default"
    )
    trainer_heartbeat_s: float = Field(2.0, gt=0, description="trainer heartbeat interval (s)")
    database: str | None = Field(
        None,
        description="coordinator database: None = SQLite in each run dir; a "
        "postgresql://user@host/db URL (no ?schema=) = PostgreSQL, a new schema per run dir",
    )

    @field_validator("database")
    @classmethod
    def _postgres_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not is_url(v):
            raise ValueError(f"expected a postgresql:// URL (or null for SQLite), got {v!r}")
        if any(k == "schema" for k, _ in parse_qsl(v.partition("?")[2])):
            raise ValueError("leave out ?schema=: the harness gives each run dir its own schema")
        return v

    def model_post_init(self, _ctx: Any) -> None:
        ids = [c.id for c in self.consumers]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"bench config: consumer ids must be unique, got {ids}")
        devs = self.unshared_producer_devices
        if devs is not None and len(devs) != len(self.consumers):
            raise ConfigError(
                f"bench config: unshared_producer_devices has {len(devs)} entries "
                f"for {len(self.consumers)} consumers"
            )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> BenchConfig:
        from pydantic import ValidationError

        try:
            return cls.model_validate_json(Path(path).read_text())
        except ValidationError as e:
            errs = "; ".join(
                f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()
            )
            raise ConfigError(f"{path}: {errs}") from e
        except OSError as e:
            raise ConfigError(f"{path}: {e}") from e


# PostgreSQL's limit on fanout's schema names (fanout.coord.postgresdb checks it).
_SCHEMA_CHARS = 51


def schema_name(bench: str, scenario: str, index: int, token: str) -> str:
    """The PostgreSQL schema of a bench run dir: `<bench>_<scenario>_<index>_<token>`,
    lower-case letters, digits and _ (the bench name shortened to fit)."""
    tail = f"_{scenario}_{index}_{token}"
    head = re.sub(r"[^a-z0-9_]+", "_", bench.lower()).strip("_") or "bench"
    if not head[0].isalpha():
        head = "b_" + head
    return head[: _SCHEMA_CHARS - len(tail)] + tail


def run_dir_database(cfg: BenchConfig, scenario: str, index: int, token: str) -> str | None:
    """`--db-path` of a run dir: None (SQLite in the run dir) or cfg.database with a
    schema of its own."""
    if cfg.database is None:
        return None
    sep = "&" if "?" in cfg.database else "?"
    return f"{cfg.database}{sep}schema={schema_name(cfg.name, scenario, index, token)}"
