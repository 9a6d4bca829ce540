"""Flags generated from pydantic configs: one flag per field, --config FILE, typed errors.

.venv/bin/pytest tests/test_flags.py -x -q
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

from fanout.errors import ConfigError
from fanout.flags import add_model_flags, field_flag, flag_name, model_from_args
from fanout.produce.config import ProducerConfig
from fanout.produce.producer import add_arguments as producer_arguments
from fanout.train.config import TrainConfig
from fanout.train.consumer import ConsumerConfig
from fanout.train.trainer import add_arguments as train_arguments


def _parser(add: object) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t")
    add(p)  # type: ignore[operator]
    return p


def _option_strings(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


@pytest.mark.parametrize(
    ("model", "add"),
    [(TrainConfig, train_arguments), (ProducerConfig, producer_arguments)],
    ids=["train", "produce"],
)
def test_every_field_has_a_flag_with_help(model: type[BaseModel], add: object) -> None:
    p = _parser(add)
    opts = _option_strings(p)
    missing = [f for f, fld in model.model_fields.items() if field_flag(f, fld) not in opts]
    assert missing == []
    helps = {s: a.help for a in p._actions for s in a.option_strings}
    for name, field in model.model_fields.items():
        h = helps[field_flag(name, field)] or ""  # an older name's help points at this one
        assert field.description and field.description.rstrip(".") in h, name
        # "(required unless --follow)": a field a before-validator fills (#52)
        assert "(required" in h if field.is_required() else "(default:" in h, name
    assert "--config" in opts


def test_consumer_config_fields_are_reachable_from_train_flags() -> None:
    # ConsumerConfig has no CLI of its own; the trainer maps its flags onto it.
    # Every consumer field other than the prefetch/max-windows internals must be a train flag.
    # seed / epochs / torchrun's WORLD_SIZE drive these:
    internal = {"row_shuffle_seed", "prefetch", "max_windows", "dp_world_size"}
    train = set(TrainConfig.model_fields)
    assert set(ConsumerConfig.model_fields) - internal <= train


def test_flags_parse_to_the_right_types() -> None:
    p = _parser(producer_arguments)
    args = p.parse_args(
        [
            "--run-dir", "r", "--verifier-name-or-path", "v", "--data", "a.json", "b.jsonl",
            "--window-rows", "8", "--capture-layer-ids", "1", "3", "--no-progress",
            "--lag-policy", "recapture", "--max-windows", "none", "--ttl-s", "2.5",
        ]
    )  # fmt: skip
    cfg = model_from_args(ProducerConfig, args)
    assert cfg.data == ["a.json", "b.jsonl"]
    assert cfg.window_rows == 8 and cfg.capture_layer_ids == [1, 3]
    assert cfg.progress is False and cfg.lag_policy == "recapture"
    assert cfg.max_windows is None and cfg.ttl_s == 2.5
    # unset flags keep the model's defaults
    assert cfg.seq_len == ProducerConfig.model_fields["seq_len"].default
    none = model_from_args(
        ProducerConfig,
        p.parse_args(["--run-dir", "r", "--verifier-name-or-path", "v", "--data", "x",
                      "--capture-layer-ids", "none"]),
    )  # fmt: skip
    assert none.capture_layer_ids is None


# command -> (its arguments, its config, its required flags)
COMMANDS: dict[str, tuple[Any, type[BaseModel], list[str]]] = {
    "produce": (producer_arguments, ProducerConfig,
                ["--run-dir", "r", "--verifier-name-or-path", "v", "--data", "x"]),
    "train": (train_arguments, TrainConfig, ["--run-dir", "r", "--consumer-id", "c",
                                             "--verifier-name-or-path", "v", "--save-path", "s"]),
}  # fmt: skip


@pytest.mark.parametrize(
    ("command", "flag", "value"),
    [
        ("produce", "--max-live-windows", "0"), ("produce", "--window-rows", "0"),
        ("produce", "--seq-len", "4"), ("produce", "--ttl-s", "0"),
        ("produce", "--capture-batch-rows", "-3"),
        ("train", "--lr", "-1"), ("train", "--block-size", "1"), ("train", "--warmup-ratio", "1.5"),
        ("train", "--dpace-alpha", "2"), ("train", "--rows-per-step", "0"),
        ("train", "--max-grad-norm", "0"),
    ],
)  # fmt: skip
def test_a_bad_value_names_its_flag(command: str, flag: str, value: str) -> None:
    arguments, config, required = COMMANDS[command]
    args = _parser(arguments).parse_args([*required, flag, value])
    with pytest.raises(ConfigError, match=flag):
        model_from_args(config, args)


def test_missing_required_flag_is_named() -> None:
    p = _parser(train_arguments)
    args = p.parse_args(["--run-dir", "r", "--verifier-name-or-path", "v", "--save-path", "s"])
    with pytest.raises(ConfigError, match="--consumer-id"):
        model_from_args(TrainConfig, args)


def test_choices_and_types_are_enforced_by_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    p = _parser(train_arguments)
    for bad in (["--scheduler-type", "bogus"], ["--lr", "fast"]):
        with pytest.raises(SystemExit) as e:
            p.parse_args(["--run-dir", "r", *bad])
        assert e.value.code == 2
        assert bad[0] in capsys.readouterr().err


def test_config_file_then_flags_override(tmp_path: Path) -> None:
    cfg_file = tmp_path / "train.json"
    cfg_file.write_text(
        json.dumps(
            {
                "run_dir": "runs/a",
                "consumer_id": "b4",
                "verifier_name_or_path": "v",
                "save_path": "s",
                "block_size": 4,
                "lr": 0.5,
                "target_layer_ids": [1, 2],
            }
        )
    )
    p = _parser(train_arguments)
    cfg = model_from_args(TrainConfig, p.parse_args(["--config", str(cfg_file), "--lr", "0.1"]))
    assert cfg.lr == 0.1  # flag wins
    # from the file, under the older key of --draft-layer-ids
    assert cfg.block_size == 4 and cfg.draft_layer_ids == [1, 2]
    assert cfg.consumer_id == "b4"


def test_config_file_errors_name_file_line_and_field(tmp_path: Path) -> None:
    p = _parser(train_arguments)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{\n  "lr": 0.1,\n  oops\n}\n')
    with pytest.raises(ConfigError, match=r"bad\.json: line 3"):
        model_from_args(TrainConfig, p.parse_args(["--config", str(bad_json)]))
    with pytest.raises(ConfigError, match="no such file"):
        model_from_args(TrainConfig, p.parse_args(["--config", str(tmp_path / "nope.json")]))
    not_obj = tmp_path / "list.json"
    not_obj.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        model_from_args(TrainConfig, p.parse_args(["--config", str(not_obj)]))
    unknown = tmp_path / "unknown.json"
    base = {"run_dir": "r", "consumer_id": "c", "verifier_name_or_path": "v", "save_path": "s"}
    unknown.write_text(json.dumps(base | {"learning_rate": 1e-3}))
    with pytest.raises(ConfigError, match="--learning-rate") as e:
        model_from_args(TrainConfig, p.parse_args(["--config", str(unknown)]))
    assert "unknown.json" in str(e.value)
    bad_value = tmp_path / "bad_value.json"
    bad_value.write_text(json.dumps(base | {"lr": -2}))
    with pytest.raises(ConfigError, match="--lr"):
        model_from_args(TrainConfig, p.parse_args(["--config", str(bad_value)]))


class _Toy(BaseModel):
    """A model exercising every field kind add_model_flags maps."""

    name: str = Field(description="required string")
    count: int = Field(3, ge=0, description="an int")
    ratio: float | None = Field(None, description="optional float")
    ids: list[int] | None = Field(None, description="optional int list")
    mode: Literal["a", "b"] = Field("a", description="a choice")
    on: bool = Field(True, description="a switch")


@pytest.mark.parametrize(
    "values",
    [
        {"name": "x"},
        {"name": "y", "count": 0, "ratio": 0.25, "ids": [4, 5, 6], "mode": "b", "on": False},
        {"name": "z", "ratio": None, "ids": None, "on": True},
    ],
)
def test_round_trip_model_to_flags_to_model(values: dict[str, object]) -> None:
    want = _Toy.model_validate(values)
    argv: list[str] = []
    for k, v in want.model_dump().items():
        f = flag_name(k)
        if isinstance(v, bool):
            argv.append(f if v else "--no-" + f[2:])
        elif isinstance(v, list):
            argv += [f, *map(str, v)]
        else:
            argv += [f, "none" if v is None else str(v)]
    p = argparse.ArgumentParser()
    add_model_flags(p, _Toy)
    assert model_from_args(_Toy, p.parse_args(argv)) == want


def test_a_field_named_for_the_negative_gets_no_double_negative() -> None:
    """`no_cache` → `--no-cache` (True) / `--cache` (False), never `--no-no-cache` (#32)."""
    from fanout.data.prepare import PrepareConfig
    from fanout.data.prepare import add_arguments as prepare_arguments
    from fanout.flags import to_flags

    p = _parser(prepare_arguments)
    assert "--no-no-cache" not in p.format_help()
    assert {"--no-cache", "--cache", "--progress", "--no-progress"} <= _option_strings(p)
    base = ["--data", __file__, "--tokenizer", "tok"]

    def parsed(*argv: str) -> PrepareConfig:
        return model_from_args(PrepareConfig, p.parse_args([*base, *argv]))

    assert parsed("--no-cache").no_cache is True
    assert parsed("--no-cache", "--cache").no_cache is False  # the last one wins
    assert parsed().no_cache is False and parsed("--no-progress").progress is False
    # to_flags writes what the parser reads back
    for v in (True, False):
        assert parsed(*to_flags(PrepareConfig, {"no_cache": v})).no_cache is v
    assert to_flags(PrepareConfig, {"no_cache": False, "progress": False}) == [
        "--cache",
        "--no-progress",
    ]


# --------------------------------------------------------------------------- log role


def test_log_lines_carry_role_and_torchrun_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun the ranks share one stderr: each line names its role and rank."""
    import logging

    from fanout.flags import LOG_FORMAT, RoleFormatter, log_role, set_log_role

    before = log_role()
    try:
        monkeypatch.delenv("RANK", raising=False)
        assert set_log_role("produce") == "produce"
        monkeypatch.setenv("RANK", "1")
        assert set_log_role("produce") == "produce r1"
        assert set_log_role("train", "b16:dp1") == "train b16:dp1"
        rec = logging.LogRecord("fanout.x", logging.INFO, __file__, 1, "hello", None, None)
        assert "[train b16:dp1] fanout.x hello" in RoleFormatter(LOG_FORMAT).format(rec)
    finally:
        set_log_role(before)


@pytest.mark.parametrize(("rank", "draws"), [(None, True), ("0", True), ("1", False)])
def test_only_rank_0_draws_a_progress_bar(
    monkeypatch: pytest.MonkeyPatch, rank: str | None, draws: bool
) -> None:
    from fanout.flags import draws_progress

    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    assert draws_progress() is draws


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_command_under_torchrun_tags_its_log_lines(rank: str) -> None:
    """The command's own logging set-up (no test runner's handlers): the tag on stderr."""
    import os
    import subprocess
    import sys

    code = (
        "import logging; from fanout import cli; from fanout.flags import configure_logging\n"
        "configure_logging(cli.build_parser(['status']).parse_args(['status']))\n"
        "logging.getLogger('fanout.t').warning('hello')\n"
    )
    env = {**os.environ, "RANK": rank, "WORLD_SIZE": "2"}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert f"[status r{rank}] fanout.t hello" in p.stderr


# Every "stop after N" limit the commands have (issue #54: one place for the rule).
_LIMITS = [
    ("fanout.train.config", "TrainConfig", "max_steps"),
    ("fanout.train.consumer", "ConsumerConfig", "max_windows"),
    ("fanout.produce.config", "ProducerConfig", "max_windows"),
    ("fanout.regen.regenerate", "RegenerateConfig", "max_records"),
    ("fanout.bench.config", "AssetsSpec", "conversations"),
    ("fanout.coord.retention", "RunConfig", "total_windows"),
]


@pytest.mark.parametrize(("module", "config", "field"), _LIMITS)
def test_every_stop_after_n_limit_is_limit_flags_rule(module: str, config: str, field: str) -> None:
    """At least 1, None (the default) = no limit: each field's schema is limit_flag's
    with its own help, so a bound or a default written by hand (gt=0, 0 = off) fails."""
    import importlib

    from pydantic import create_model

    from fanout.flags import limit_flag

    model = getattr(importlib.import_module(module), config)
    info = model.model_fields[field]
    fields: dict[str, Any] = {field: (int | None, limit_flag(info.description or ""))}
    probe = create_model("Probe", **fields)
    got = model.model_json_schema()["properties"][field]
    assert got == probe.model_json_schema()["properties"][field]


def test_a_limit_flag_takes_none_and_refuses_0_naming_the_flag() -> None:
    from fanout.flags import limit_flag

    class Cfg(BaseModel):
        max_things: int | None = limit_flag("stop after this many things")

    p = argparse.ArgumentParser(prog="t")
    add_model_flags(p, Cfg)
    assert "stop after this many things" in p.format_help()
    assert model_from_args(Cfg, p.parse_args([])).max_things is None
    assert model_from_args(Cfg, p.parse_args(["--max-things", "none"])).max_things is None
    assert model_from_args(Cfg, p.parse_args(["--max-things", "3"])).max_things == 3
    with pytest.raises(
        ConfigError, match="--max-things: Input should be greater than or equal to 1"
    ):
        model_from_args(Cfg, p.parse_args(["--max-things", "0"]))
