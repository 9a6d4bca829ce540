"""Every config field of every subcommand is reachable, declared once, and reaches its component.

.venv/bin/pytest tests/test_config_fields.py -q

For `fanout prepare | produce | train | eval | status | sweep | demo`, each field of
the command's config (its own and those it inherits from component configs:
ChatFormat, DataOptions, VerifierOptions, RunOptions, ConsumerOptions, RunDirOptions)
is given a non-default value and must
arrive in the built config (a) through its generated flag, (b) through a `--config`
JSON file, with (c) a flag overriding the file. Parsing uses the real `fanout` parser
(cli.build_parser) and the module's own `config_from_args`; no command runs.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import logging
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, get_args, get_origin

import pytest
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from fanout import cli
from fanout.bench import demo as demo_mod
from fanout.bench.demo import DemoConfig
from fanout.coord.heartbeat import HeartbeatOptions
from fanout.coord.retention import RunConfig, RunOptions
from fanout.data import prepare as prepare_mod
from fanout.data.chat import ChatFormat, ReadOptions
from fanout.data.prepare import DataOptions, PrepareConfig
from fanout.decode import eval as eval_mod
from fanout.decode.config import EvalConfig
from fanout.errors import ConfigError
from fanout.families.registry import FAMILIES
from fanout.flags import (
    configure_logging,
    declared_in,
    field_flag,
    flag_kind,
    model_from_args,
    switch_off,
    to_flags,
)
from fanout.model.capture_layers import CaptureLayers
from fanout.model.draft_config import DraftConfig, DraftRecipe
from fanout.model.verifier import VerifierConfig, VerifierOptions
from fanout.produce import producer as produce_mod
from fanout.produce.config import ProducerConfig
from fanout.regen import regenerate as regen_mod
from fanout.regen.engine import RegenOptions
from fanout.regen.regenerate import RegenerateConfig
from fanout.status import commands as status_mod
from fanout.status.commands import DetachConfig, RunDirOptions, StatusConfig, SweepConfig
from fanout.train import trainer as train_mod
from fanout.train.config import TrainConfig
from fanout.train.consumer import ConsumerConfig, ConsumerOptions

COMMANDS: dict[str, tuple[ModuleType, type[BaseModel]]] = {
    "prepare": (prepare_mod, PrepareConfig),
    "regenerate": (regen_mod, RegenerateConfig),
    "produce": (produce_mod, ProducerConfig),
    "train": (train_mod, TrainConfig),
    "eval": (eval_mod, EvalConfig),
    "status": (status_mod, StatusConfig),
    "sweep": (status_mod, SweepConfig),
    "detach": (status_mod, DetachConfig),
    "demo": (demo_mod, DemoConfig),
}
# Modules serving several commands take the command's name: config_from_args(args, name).
SHARED_MODULE = ("status", "sweep", "detach")

# The component configs each command config is composed of (inherits).
COMPONENTS: dict[type[BaseModel], tuple[type[BaseModel], ...]] = {
    PrepareConfig: (ChatFormat, ReadOptions, DataOptions),
    ProducerConfig: (
        ChatFormat,
        ReadOptions,
        DataOptions,
        VerifierOptions,
        CaptureLayers,
        RunOptions,
        RegenOptions,
        HeartbeatOptions,
    ),
    RegenerateConfig: (ChatFormat, ReadOptions, RegenOptions),
    TrainConfig: (ConsumerOptions, DraftRecipe, HeartbeatOptions),
    EvalConfig: (ChatFormat,),
    StatusConfig: (RunDirOptions,),
    SweepConfig: (RunDirOptions,),
    DetachConfig: (RunDirOptions,),
}

# (command config, component config) pairs that share fields by name, and the fields
# each command declares itself on purpose: the comment above its declaration says why
# ("# Not <Component>'s: ..."; test_shared_fields_are_declared_once checks it is there).
PAIRS: dict[tuple[type[BaseModel], type[BaseModel]], set[str]] = {
    (ProducerConfig, PrepareConfig): {"tokenizer", "seq_len", "seed"},
    (ProducerConfig, VerifierConfig): set(),
    (ProducerConfig, RunConfig): set(),
    (TrainConfig, ConsumerConfig): set(),
    # the producer writes the run (dir, database) the trainer reads and may override; its
    # --takeover takes the producer role, the trainer's a consumer id. --heartbeat-s is
    # shared; layers are named apart (--capture-layer-ids / --draft-layer-ids).
    (ProducerConfig, ConsumerOptions): {"run_dir", "db_path", "takeover"},
    # the trainer's mask id is a choice (None: the verifier's last id), the draft's the id
    # it resolved to
    (TrainConfig, DraftConfig): {"mask_token_id"},
    (EvalConfig, ChatFormat): set(),
    (PrepareConfig, ChatFormat): set(),
    # regenerate reads chat data but does not pack it; its device/dtype run only the hf engine
    (RegenerateConfig, DataOptions): {"data"},
    (RegenerateConfig, VerifierOptions): {"device", "dtype"},
    (RegenerateConfig, ProducerConfig): {
        "data",
        "device",
        "dtype",
        "verifier_name_or_path",
        "tokenizer",
        "seed",
    },
    # --json prints a different thing for each (a snapshot / what was removed)
    (StatusConfig, SweepConfig): {"as_json"},
}


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, str]:
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    g = tmp_path / "other.jsonl"
    g.write_text(f.read_text())
    return {"file": str(f), "file2": str(g), "dir": str(tmp_path)}


def _base(command: str, p: dict[str, str]) -> dict[str, Any]:
    """Values for the required fields."""
    bases: dict[str, dict[str, Any]] = {
        "prepare": {"data": [p["file"]], "tokenizer": p["dir"]},
        "regenerate": {"data": [p["file"]], "out": "o"},
        "produce": {"run_dir": "r", "verifier_name_or_path": p["dir"], "data": [p["file"]]},
        "train": {
            "run_dir": "r",
            "consumer_id": "c",
            "verifier_name_or_path": "v",
            "save_path": "s",
        },
        "eval": {"verifier_name_or_path": p["dir"], "data": p["file"], "tokenizer": p["dir"]},
        "detach": {"consumer_id": "c"},
    }
    return bases.get(command, {})  # status, sweep, demo: no required fields


# Fields that are valid only together with another one.
# Values: a key of the `paths` fixture, or a literal value.
COMPANIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("train", "eval_every"): {"eval_data": "file"},
    # a replica rank is below --replicas (fanout.produce.replicas.ReplicaOptions)
    ("produce", "replica_rank"): {"replicas": 8},
    # a family's own options are valid only with that family chosen
    **{("train", k): {"draft_family": f.name} for f in FAMILIES.values() for k in f.options()},
}


def _candidates(field: FieldInfo, p: dict[str, str]) -> list[Any]:
    """Values of the field's type to try, in order (the first valid non-default wins)."""
    kind = flag_kind(field)
    types = {field.annotation, *get_args(field.annotation)}  # T or T | None
    d = field.get_default(call_default_factory=True)
    if kind == "bool":
        return [d is not True, d is True]
    if kind == "choice":
        (choices,) = (get_args(t) for t in types if get_args(t))
        return list(choices)
    if kind == "dict":
        return [{"bot": "assistant", "human": "user"}, {}]
    if kind == "tuple":
        return [("q", "a"), ("user", "bot")]
    if kind == "list":
        # a list of choices (--capture-for): its first choice, then all of them
        items = [get_args(a) for t in types for a in get_args(t) if get_origin(a) is Literal]
        if items:
            return [[items[0][0]], list(items[0])]
        return [[p["file"]], [p["file"], p["file2"]], [3, 1], [2], ["all"], ["x", "y"]]
    if int in types:
        n = d if isinstance(d, int) else 0
        return [n + 1, n + 7, 1, 2, 3, 64]  # 64: above a default it must not be below
    if float in types:
        x = d if isinstance(d, float) else 0.0
        return [x + 1, x / 2, 0.25, 0.75, 7.0]
    json_obj = '{"enable_thinking": false}'  # --chat-template-kwargs
    return ["x-value", "y-value", p["file"], p["file2"], p["dir"], "cuda:1", "cpu", json_obj]


def _validated(model: type[BaseModel], values: dict[str, Any], name: str) -> Any | None:
    try:
        return getattr(model.model_validate(values), name)
    except ValidationError:
        return None


def _pick(model: type[BaseModel], base: dict[str, Any], name: str, p: dict[str, str],
          avoid: list[Any]) -> Any:  # fmt: skip
    field = model.model_fields[name]
    for v in _candidates(field, p):
        got = _validated(model, base | {name: v}, name)
        if got is not None and all(got != a for a in avoid):
            return v
    raise AssertionError(f"{model.__name__}.{name}: no valid value other than {avoid}")


def _argv(name: str, field: FieldInfo, value: Any) -> list[str]:
    """The flag (as a user writes it) that sets `name` to `value`."""
    flag, kind = field_flag(name, field), flag_kind(field)
    if value is None:
        return [flag, "none"]
    if kind == "bool":
        return [flag if value else switch_off(flag)]  # --no-cache / --cache
    if kind == "dict":
        return [flag, ",".join(f"{k}={v}" for k, v in value.items())] if value else [flag]
    if kind == "tuple":
        return [flag, ",".join(value)]
    if kind == "list":
        return [flag, *map(str, value)]
    return [flag, str(value)]


def _build(command: str, argv: list[str]) -> BaseModel:
    module, model = COMMANDS[command]
    args = cli.build_parser([command]).parse_args([command, *argv])
    name = [command] if command in SHARED_MODULE else []
    cfg: BaseModel = module.config_from_args(args, *name)
    assert type(cfg) is model
    return cfg


def _fields(command: str) -> list[tuple[str, str]]:
    return [(command, name) for name in COMMANDS[command][1].model_fields]


ALL_FIELDS = [cf for c in COMMANDS for cf in _fields(c)]


@pytest.mark.parametrize(("command", "name"), ALL_FIELDS, ids=[f"{c}.{n}" for c, n in ALL_FIELDS])
def test_field_reachable_by_flag_and_config_file(
    command: str, name: str, paths: dict[str, str], tmp_path: Path
) -> None:
    model = COMMANDS[command][1]
    field = model.model_fields[name]
    base = _base(command, paths) | {
        k: paths.get(v, v) for k, v in COMPANIONS.get((command, name), {}).items()
    }
    default = None if field.is_required() else field.get_default(call_default_factory=True)
    avoid = [base[name]] if name in base else [default]
    value = _pick(model, base, name, paths, avoid)
    want = _validated(model, base | {name: value}, name)
    base_argv = [
        a for k, v in base.items() if k != name for a in _argv(k, model.model_fields[k], v)
    ]

    # (a) the generated flag
    got = getattr(_build(command, [*base_argv, *_argv(name, field, value)]), name)
    assert got == want and got not in avoid, (name, got, want)

    # (b) a --config file
    conf = tmp_path / "c.json"
    conf.write_text(json.dumps(base | {name: value}))
    assert getattr(_build(command, ["--config", str(conf)]), name) == want

    # (c) a flag overrides the file: back to the default where a flag can say it
    # a flag can give the default back unless it is None of a switch or an empty list
    sayable = default != [] and (default is not None or flag_kind(field) in ("scalar", "list"))
    if not field.is_required() and sayable:
        other = default
    else:
        other = _pick(model, base, name, paths, [want])
    want_other = _validated(model, base | {name: other}, name)
    got = getattr(_build(command, ["--config", str(conf), *_argv(name, field, other)]), name)
    assert got == want_other != want, (name, got, want_other)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_bad_flag_value_names_the_flag(command: str, paths: dict[str, str]) -> None:
    from fanout.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--config .*no such file"):
        _build(command, ["--config", paths["dir"] + "/nope.json"])
    model = COMMANDS[command][1]
    # a config file with a field the command does not have names it (as its flag)
    conf = Path(paths["dir"]) / "extra.json"
    conf.write_text(json.dumps(_base(command, paths) | {"no_such_field": 1}))
    with pytest.raises(ConfigError, match=rf"{model.__name__} .*--no-such-field: Extra inputs"):
        _build(command, ["--config", str(conf)])
    if "role_map" in model.model_fields:
        base = _base(command, paths)
        argv = [a for k, v in base.items() for a in _argv(k, model.model_fields[k], v)]
        with pytest.raises(ConfigError, match="--role-map: expected KEY=VALUE"):
            _build(command, [*argv, "--role-map", "bot"])
        with pytest.raises(ConfigError, match=r"--role-map.*must be one of"):
            _build(command, [*argv, "--role-map", "bot=narrator"])


@pytest.mark.parametrize(
    ("command", "argv", "want"),
    [
        ("status", [], {"run_dir": ".", "db_path": None, "allow_network_fs": False,
                        "as_json": False}),
        ("status", ["--run-dir", "r", "--db-path", "d.sqlite3", "--allow-network-fs", "--json"],
         {"run_dir": "r", "db_path": "d.sqlite3", "allow_network_fs": True, "as_json": True}),
        ("sweep", [], {"run_dir": ".", "db_path": None, "allow_network_fs": False,
                       "as_json": False}),
        ("sweep", ["--run-dir", "r", "--json"], {"run_dir": "r", "as_json": True}),
        ("demo", [], {"minutes": 2.0, "run_dir": "runs/demo"}),
        ("demo", ["--minutes", "0.5", "--run-dir", "/tmp/d"], {"minutes": 0.5, "run_dir": "/tmp/d"}),
    ],
)  # fmt: skip
def test_status_sweep_demo_keep_their_flags_and_defaults(
    command: str, argv: list[str], want: dict[str, Any]
) -> None:
    cfg = _build(command, argv)
    assert {k: getattr(cfg, k) for k in want} == want


# ---- one definition per field ------------------------------------------------------------


@pytest.mark.parametrize(("command", "component"), list(PAIRS), ids=lambda c: c.__name__)
def test_shared_fields_are_declared_once(
    command: type[BaseModel], component: type[BaseModel]
) -> None:
    """A field both configs have comes from one declaration (a common base), unless the
    command declares its own on purpose (PAIRS, with the reason beside the field)."""
    deliberate = PAIRS[(command, component)]
    shared = set(command.model_fields) & set(component.model_fields)
    copied = {
        f for f in shared - deliberate if declared_in(command, f) is not declared_in(component, f)
    }
    assert copied == set(), f"{command.__name__} re-declares {component.__name__}'s {copied}"
    for f in deliberate:
        assert f in shared and declared_in(command, f) is not declared_in(component, f), f
        assert declared_in(command, f) in command.__mro__, f
        # the reason is written where the command declares it, as a comment above it
        lines = inspect.getsource(declared_in(command, f)).splitlines()
        at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{f}:"))
        above = [x.strip() for x in lines[:at]][::-1]
        comment = " ".join(reversed(list(itertools.takewhile(lambda x: x.startswith("#"), above))))
        assert comment.startswith("# Not "), (
            f"{declared_in(command, f).__name__}.{f} is declared apart from "
            f"{component.__name__}'s: say why in a '# Not ...' comment above it"
        )


@pytest.mark.parametrize("command", list(COMPONENTS), ids=lambda c: c.__name__)
def test_commands_inherit_their_components(command: type[BaseModel]) -> None:
    for component in COMPONENTS[command]:
        assert issubclass(command, component), (command.__name__, component.__name__)
        assert set(component.model_fields) <= set(command.model_fields)


# ---- the command's fields reach the component configs it builds ----------------------------


def _nondefault(model: type[BaseModel], base: dict[str, Any], p: dict[str, str]) -> dict[str, Any]:
    out = {}
    for name, field in model.model_fields.items():
        if name in base:
            continue
        default = field.get_default(call_default_factory=True)
        out[name] = _pick(model, base, name, p, [default])
    return out


def test_producer_options_reach_prepare_verifier_and_run_configs(paths: dict[str, str]) -> None:
    base = _base("produce", paths)
    for name in [
        *DataOptions.model_fields,
        *VerifierOptions.model_fields,
        *RunOptions.model_fields,
    ]:
        if name in base:
            continue
        # data fields: a value the data stage accepts too (PrepareConfig checks paths)
        model, mbase = (
            (PrepareConfig, _base("prepare", paths))
            if name in DataOptions.model_fields
            else (ProducerConfig, base)
        )
        v = _pick(model, mbase, name, paths, [ProducerConfig.model_fields[name].default])
        cfg = ProducerConfig.model_validate(base | {name: v})
        if name in DataOptions.model_fields:
            got = getattr(cfg.prepare_config("default-cache"), name)
        elif name in VerifierOptions.model_fields:
            got = cfg.verifier_options()[name]
            VerifierConfig(path="v", **cfg.verifier_options())  # load_verifier accepts them
        else:
            got = getattr(cfg.run_config(total_windows=7), name)
        assert got == getattr(cfg, name), name
    cfg = ProducerConfig.model_validate(base | {"tokenizer": None, "seq_len": 64})
    prep = cfg.prepare_config("default-cache")
    assert (prep.tokenizer, prep.seq_len, prep.cache_dir) == (paths["dir"], 64, "default-cache")


def test_train_options_reach_the_consumer_config(paths: dict[str, str]) -> None:
    base = _base("train", paths)
    cfg = TrainConfig.model_validate(
        base | _nondefault(ConsumerOptions, {k: base[k] for k in ("run_dir", "consumer_id")}, paths)
    )
    ccfg = cfg.consumer_config(dp_rank=cfg.dp_rank, dp_world_size=cfg.dp_rank + 1, max_windows=3)
    for name in ConsumerOptions.model_fields:
        assert getattr(ccfg, name) == getattr(cfg, name), name
    assert (ccfg.row_shuffle_seed, ccfg.max_windows) == (cfg.seed, 3)


def test_train_recipe_reaches_the_draft_config(paths: dict[str, str]) -> None:
    """Each DraftRecipe field the trainer is given arrives in the draft's DraftConfig,
    and the model and the trainer have one default: the real-verifier recipe."""
    base = _base("train", paths)
    chosen = {"num_layers": 2, "block_size": 8, "max_anchors": 7, "draft_vocab_size": 100,
              "gamma": 2.5, "loss_weighting": "dpace", "dpace_alpha": 0.25,
              "label_source": "input_ids", "loss_type": "ce"}  # fmt: skip
    assert set(chosen) == set(DraftRecipe.model_fields)
    shape = dict(hidden_size=8, intermediate_size=8, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=4, vocab_size=256, mask_token_id=255)  # fmt: skip
    # dpace needs ce: loss_type's other value goes with the default weighting
    for over in ({}, {"loss_type": "kl", "loss_weighting": "exp"}):
        want = chosen | over
        dcfg = DraftConfig(**TrainConfig.model_validate(base | want).draft_recipe(),
                            **shape, target_layer_ids=[1])  # fmt: skip
        assert {k: getattr(dcfg, k) for k in want} == want
    for name, v in (chosen | {"loss_type": "kl"}).items():  # each tried off its default
        assert v != DraftRecipe.model_fields[name].default, name
    defaults = TrainConfig.model_validate(base)
    model = DraftConfig(**shape, target_layer_ids=[1])
    assert defaults.draft_recipe() == {k: getattr(model, k) for k in chosen}
    assert (model.num_layers, model.block_size, model.max_anchors) == (5, 16, 512)


@pytest.mark.parametrize(
    ("command", "field", "names", "value", "argv_value"),
    [
        ("train", "loss_weighting", ("per_position_loss_weight", "loss_weighting"), "dpace",
         ["dpace"]),
        ("train", "draft_layer_ids", ("draft_layer_ids", "target_layer_ids"), [1, 3], ["3", "1"]),
        ("produce", "capture_layer_ids", ("capture_layer_ids", "target_layer_ids"), [3, 1],
         ["3", "1"]),
        ("produce", "capture_layer_ids", ("capture_layer_ids", "target_layer_ids"), ["all"],
         ["all"]),
    ],
)  # fmt: skip
def test_renamed_flag_keeps_its_old_name(
    paths: dict[str, str],
    command: str,
    field: str,
    names: tuple[str, str],
    value: Any,
    argv_value: list[str],
) -> None:
    """A field's flag and its older name (--per-position-loss-weight, speculators' name,
    and --loss-weighting; --draft-layer-ids and --target-layer-ids; --capture-layer-ids
    and --target-layer-ids) set the same field, from flags and from --config keys;
    to_flags writes the first; --help shows both. Both flags on one command line, or
    both keys in one file, are refused with one line; a flag overrides the file's key
    by either name."""
    model = COMMANDS[command][1]
    base = _base(command, paths)
    argv = [a for k, v in base.items() for a in _argv(k, model.model_fields[k], v)]
    flags = ["--" + n.replace("_", "-") for n in names]
    for flag in flags:
        cfg = _build(command, [*argv, flag, *argv_value])
        assert isinstance(cfg, model) and getattr(cfg, field) == value
    for key in names:
        assert getattr(model.model_validate(base | {key: value}), field) == value
        conf = Path(paths["dir"]) / f"{key}.json"
        conf.write_text(json.dumps(base | {key: value}))
        assert getattr(_build(command, ["--config", str(conf)]), field) == value
    assert to_flags(model, {field: value})[0] == flags[0]
    help_text = _subparser(command).format_help()
    assert all(f in help_text for f in flags)
    with pytest.raises(ConfigError, match=f"{flags[0]} and {flags[1]} set the same field"):
        _build(command, [*argv, flags[0], *argv_value, flags[1], *argv_value])
    both = Path(paths["dir"]) / "both.json"
    both.write_text(json.dumps(base | {names[0]: value, names[1]: value}))
    with pytest.raises(ConfigError, match=rf"--config {both}: keys .* both set {flags[0]}"):
        _build(command, ["--config", str(both)])
    default = model.model_fields[field].default
    for key in names:  # the file says the default under either name; the flag wins
        conf = Path(paths["dir"]) / f"{key}-default.json"
        conf.write_text(json.dumps(base | {key: default}))
        for flag in flags:
            got = _build(command, ["--config", str(conf), flag, *argv_value])
            assert getattr(got, field) == value, (key, flag)


def test_chaos_argv_is_written_by_to_flags_and_parses_back(tmp_path: Path) -> None:
    """The chaos driver's producer and trainer command lines come from the one argv
    writer (flags.to_flags) and parse back, through the real parser, to what it set."""
    from fanout.chaos.driver import ChaosConfig, ChaosRun
    from fanout.chaos.procs import ChaosAssets

    assets = ChaosAssets(tokenizer=tmp_path / "tok", verifier=tmp_path / "ver",
                         data=tmp_path / "chat.jsonl")  # fmt: skip
    run = ChaosRun(ChaosConfig(work_dir=str(tmp_path / "w"), consumers=2,
                               target_layer_ids=(0, 2)), assets)  # fmt: skip
    produce = _build("produce", run.producer_argv()[1:])
    assert isinstance(produce, ProducerConfig)
    assert produce.capture_layer_ids == [0, 2] and produce.data == [str(assets.data)]
    assert produce.progress is False
    assert produce.heartbeat_s == run.cfg.heartbeat_s and produce.db_path is None
    train = _build("train", run.trainer_argv(1)[1:])
    assert isinstance(train, TrainConfig)
    assert (train.consumer_id, train.resume, train.num_layers, train.seed) == ("c1", True, 1, 1)
    assert (train.block_size, train.max_anchors) == (4, 8)


# ---- --log-level and --config on every subcommand --------------------------------------------


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser([name])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    p: argparse.ArgumentParser = sub.choices[name]
    return p


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_every_subcommand_takes_log_level(name: str) -> None:
    opts = {s: a for a in _subparser(name)._actions for s in a.option_strings}
    assert list(opts["--log-level"].choices or ()) == ["debug", "info", "warning", "error"]
    if name in COMMANDS:
        assert "--config" in opts


def test_log_level_sets_the_level() -> None:
    root = logging.getLogger()
    before = root.level
    try:
        args = cli.build_parser(["status"]).parse_args(["status", "--log-level", "debug"])
        configure_logging(args)
        assert root.level == logging.DEBUG
        args = cli.build_parser(["status"]).parse_args(["status", "--log-level", "error"])
        configure_logging(args)
        assert root.level == logging.ERROR
    finally:
        root.setLevel(before)


def test_chaos_flags_are_chaos_config_fields_with_its_defaults(tmp_path: Path) -> None:
    """`python -m fanout.chaos` generates its flags from ChaosConfig like every command:
    one flag per field, the config's defaults when none is given, `--config FILE` too."""
    from fanout.chaos.__main__ import build_parser
    from fanout.chaos.driver import ChaosConfig

    parser = build_parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    assert {field_flag(n, f) for n, f in ChaosConfig.model_fields.items()} <= flags
    cfg = model_from_args(ChaosConfig, parser.parse_args(["--work-dir", str(tmp_path)]))
    assert cfg == ChaosConfig(work_dir=str(tmp_path))
    argv = ["--work-dir", "w", "--kills", "5", "--timeout-s", "60", "--kill-every-s", "0.2,0.4"]
    cfg = model_from_args(ChaosConfig, parser.parse_args(argv))
    assert (cfg.kills, cfg.timeout_s, cfg.kill_every_s) == (5, 60.0, (0.2, 0.4))
    conf = tmp_path / "chaos.json"
    conf.write_text(json.dumps({"work_dir": "w", "consumers": 2, "kills": 7}))
    cfg = model_from_args(ChaosConfig, parser.parse_args(["--config", str(conf), "--kills", "1"]))
    assert (cfg.consumers, cfg.kills) == (2, 1)  # the flag wins over the file
