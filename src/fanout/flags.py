"""Command-line flags generated from a component's pydantic config.

    p = FlagParser(prog="fanout produce"); add_model_flags(p, ProducerConfig)
    cfg = model_from_args(ProducerConfig, p.parse_args())   # --config FILE + flags

One field, one flag (`max_live_windows` → `--max-live-windows`), help text from
the field's description, so flags, config files and Python calls cannot drift
apart. A `--config FILE` (JSON object of field names) supplies defaults that
explicit flags override. Validation errors name the field and where its value
came from.

Field types and their flags:
- `bool`: `--x` / `--no-x` (a field whose flag is already `--no-x`: `--no-x` / `--x`);
  `Literal[...]`: a choice;  `int | None`: 'none' for None;
  an optional "stop after N" limit (at least 1, None = no limit): `limit_flag(help)`;
- `list[T]`: `--x A B` (a repeatable field, `flag_options(repeatable=True)`, also
  takes `--x A --x B`);
- `tuple[str, ...]`: `--x a,b` or `--x a b`;
- `dict[str, str]`: `--x k=v,k2=v2` (or `--x k=v k2=v2`; a bare `--x` is the empty map).

A field whose flag differs from its name says so with
`Field(..., json_schema_extra=flag_options(flag="--json", metavar="OUT"))`; a renamed
flag keeps its old name working with `flag_options(aliases=("--old-name",))`.
A command whose flags are one config's gives fanout.cli its `add_arguments` /
`config_from_args` through `CommandFlags`. The commands parse with `FlagParser`: a
flag argparse refuses (unknown, a value of the wrong type, a choice not offered) is
a `FlagError`, one line and exit 1 as every other bad input, not argparse's usage
block and exit 2.
The commands' shared flags live here too: `--log-level` (`add_log_level_flag`,
`configure_logging`), and what every log line says about the process that wrote it:
its role and torchrun rank (`[produce r1]`, `set_log_role`), and whether it draws a
progress bar (`draws_progress`: rank 0 only, as torchrun's ranks share one stderr).
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, get_args, get_origin

from pydantic import AliasChoices, BaseModel, Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from fanout.errors import ConfigError, FlagError

M = TypeVar("M", bound=BaseModel)

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s [%(role)s] %(name)s %(message)s"


def makeup(model: type[BaseModel]) -> str:
    """What a command config is composed of, from its bases (README and
    docs/architecture.md print it: scripts/docs.py), e.g. "`PrepareConfig` = `DataOptions`
    (with `ChatFormat`) + its own"."""

    def name(c: type) -> str:
        inner = parts_of(c)
        shown = f"`{c.__name__}`"
        return f"{shown} (with {', '.join(name(b) for b in inner)})" if inner else shown

    def parts_of(c: type) -> list[type]:  # a base with no fields (a family without options)
        return [b for b in c.__bases__ if issubclass(b, BaseModel) and b is not BaseModel
                and b.model_fields]  # fmt: skip

    bases = parts_of(model)
    own = [f for f in model.model_fields if declared_in(model, f) is model]
    parts = [name(b) for b in bases] + (["its own"] if own else [])
    return f"`{model.__name__}` = {' + '.join(parts)}"


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def flag_options(
    *,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    metavar: str | None = None,
    repeatable: bool = False,
    choices_checked_by_config: bool = False,
) -> dict[str, Any]:
    """`json_schema_extra` for a field whose flag is not the default one:
    `flag` replaces `--field-name`, `aliases` are older flag names still accepted
    (--help lists them; `to_flags` writes only `flag`), `metavar` names the value in
    --help, `repeatable` lets a list flag be given several times (values add up),
    `choices_checked_by_config` leaves a choice flag's check to the config (a bad name is
    the config's message, as any bad value; --help still lists the choices)."""
    out: dict[str, Any] = {}
    if flag is not None:
        out["flag"] = flag
    if aliases:
        out["aliases"] = list(aliases)
    if metavar is not None:
        out["metavar"] = metavar
    if repeatable:
        out["repeatable"] = True
    if choices_checked_by_config:
        out["choices_checked_by_config"] = True
    return out


def limit_flag(description: str) -> Any:
    """The field of an optional "stop after N" limit, the one rule every such flag
    follows: at least 1, None (the default; `--x none`) = no limit, e.g.

        max_steps: int | None = limit_flag("stop after this many optimizer steps")
    """
    return Field(None, ge=1, description=description)


def _extra(field: FieldInfo) -> dict[str, Any]:
    extra = field.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def field_flag(name: str, field: FieldInfo) -> str:
    """The flag that sets field `name` (`--name-with-dashes` unless the field says)."""
    return str(_extra(field).get("flag") or flag_name(name))


def field_aliases(field: FieldInfo) -> list[str]:
    """The other flags that also set a field (`flag_options(aliases=...)`): old names."""
    return [str(a) for a in _extra(field).get("aliases", ())]


def field_keys(name: str, field: FieldInfo) -> list[str]:
    """The config-file keys that set field `name`: its name and its older names
    (`validation_alias=AliasChoices(...)`), the name first."""
    keys = [name]
    alias = field.validation_alias
    for choice in alias.choices if isinstance(alias, AliasChoices) else [alias]:
        if isinstance(choice, str) and choice not in keys:
            keys.append(choice)
    return keys


def _alias_dest(name: str, alias: str) -> str:
    # An older flag parses into its own destination, so that giving both names is seen
    # (one destination would let the later silently win) and refused by model_from_args.
    return f"{name}@{alias}"


def declared_in(model: type[BaseModel], name: str) -> type:
    """The class that declares field `name` of `model`: the model itself or the component
    config it inherits the field from."""
    for cls in model.__mro__:
        if name in inspect.get_annotations(cls):
            return cls
    raise KeyError(f"{model.__name__} has no field {name!r}")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _parse_none(conv: Any) -> Any:
    def parse(s: str) -> Any:
        return None if s.lower() in ("none", "null") else conv(s)

    # argparse names the type in its refusal: "invalid int value: 'abc'"
    parse.__name__ = getattr(conv, "__name__", "parse")
    return parse


def switch_off(flag: str) -> str:
    """The flag that sets a bool field False: `--x` → `--no-x`; `--no-x` → `--x` (a
    field named for the negative, `no_cache`, never gets a double negative)."""
    return "--" + flag[5:] if flag.startswith("--no-") else "--no-" + flag[2:]


class _Switch(argparse.BooleanOptionalAction):
    """`--x` / `--no-x`, or for a field whose flag is `--no-x` (`no_cache` → `--no-cache`),
    `--no-x` (True) / `--x` (False): switch_off's pairs, not argparse's `--no-no-x`."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        # argparse added `--no-` + each flag; the parser registers these strings after
        self._negative = {switch_off(s) for s in option_strings if s.startswith("--")}
        self.option_strings = [*option_strings, *sorted(self._negative)]

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if option_string in self.option_strings:
            setattr(namespace, self.dest, option_string not in self._negative)


def flag_kind(field: FieldInfo) -> str:
    """How a field's flag is parsed: bool | choice | list | tuple | dict | scalar."""
    tp, _ = _unwrap_optional(field.annotation)
    origin = get_origin(tp)
    if tp is bool:
        return "bool"
    if origin is Literal:
        return "choice"
    if origin is dict:
        return "dict"
    if origin is tuple:
        return "tuple"
    if origin is list:
        return "list"
    return "scalar"


def _shown(default: Any) -> str:
    if isinstance(default, dict):
        return ",".join(f"{k}={v}" for k, v in default.items()) or "{}"
    if isinstance(default, tuple):
        return ",".join(map(str, default))
    return str(default)


def add_model_flags(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    *,
    exclude: tuple[str, ...] = (),
    config_flag: bool = True,
) -> None:
    """Add one flag per field of `model` (defaults SUPPRESSed: unset flags stay unset).

    --help lists required fields first, then the command's own, then those of each
    component config it inherits. Required fields are not required by argparse: a
    --config file may give them (the model names what is missing)."""
    if config_flag:
        parser.add_argument(
            "--config",
            metavar="FILE",
            default=None,
            help="JSON file of field values (flag names with underscores); flags override it",
        )
    mro = model.__mro__
    fields = sorted(
        model.model_fields.items(),
        key=lambda kv: (not kv[1].is_required(), mro.index(declared_in(model, kv[0]))),
    )
    for name, field in fields:
        if name in exclude:
            continue
        tp, optional = _unwrap_optional(field.annotation)
        extra = _extra(field)
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
        default = field.default if field.default is not PydanticUndefined else None
        if field.default_factory is not None:
            default = field.default_factory()  # type: ignore[call-arg]
        required = field.is_required()
        help_text = (field.description or "").rstrip(".")
        # a field a before-validator fills from another flag (the model's
        # `required_unless`, e.g. produce's --data from --follow) is not required then
        unless = getattr(model, "required_unless", {}).get(name)
        if required:
            help_text += f" (required unless {unless})" if unless else " (required)"
        else:
            help_text += f" (default: {_shown(default)})"
        kind = flag_kind(field)
        if kind == "bool":
            kwargs["action"] = _Switch
        elif kind == "choice":
            if extra.get("choices_checked_by_config"):
                kwargs["metavar"] = "{" + ",".join(map(str, get_args(tp))) + "}"
            else:
                kwargs["choices"] = list(get_args(tp))
        elif kind == "dict":
            kwargs["nargs"] = "*"
            kwargs["metavar"] = "KEY=VALUE"
            help_text += "; KEY=VALUE pairs, comma- or space-separated"
        elif kind == "tuple":
            kwargs["nargs"] = "+"
            help_text += "; comma- or space-separated"
        elif kind == "list":
            inner = get_args(tp)[0]
            kwargs["nargs"] = "+"
            kwargs["type"] = inner if inner in (int, float) else str
            if optional:
                help_text += "; 'none' for the default rule"
                kwargs["type"] = _parse_none(kwargs["type"])
            if extra.get("repeatable"):
                kwargs["action"] = "extend"
                help_text += "; repeatable"
        elif tp in (int, float, str):
            kwargs["type"] = _parse_none(tp) if optional else tp
        else:
            kwargs["type"] = str
        if "metavar" in extra:
            kwargs["metavar"] = extra["metavar"]
        flag = field_flag(name, field)
        parser.add_argument(flag, help=help_text.replace("%", "%%"), **kwargs)
        for alias in field_aliases(field):
            kwargs["dest"] = _alias_dest(name, alias)
            if kind not in ("bool", "choice"):  # shown as the field's value, not its dest
                kwargs.setdefault("metavar", name.upper())
            parser.add_argument(alias, help=f"older name of {flag}", **kwargs)


def _from_flag(flag: str, kind: str, v: Any) -> Any:
    """A flag's parsed strings → the value the model validates (tuples, maps, None)."""
    if kind == "list" and v == [None]:  # nargs="+" with a single 'none' means None
        return None
    if kind == "tuple":
        return tuple(p for item in v for p in item.split(",") if p)
    if kind == "dict":
        out: dict[str, str] = {}
        for item in (p for s in v for p in s.split(",") if p):
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise ConfigError(f"{flag}: expected KEY=VALUE pairs (a=b,c=d), got {item!r}")
            out[key] = value
        return out
    return v


def model_from_args(model: type[M], args: argparse.Namespace, **fixed: Any) -> M:
    """Build `model` from `--config FILE` (if any), then explicit flags, then `fixed`."""
    values: dict[str, Any] = {}
    source = "flags"
    config = getattr(args, "config", None)
    if config:
        path = Path(config)
        try:
            loaded = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"--config {path}: no such file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"--config {path}: line {e.lineno}: invalid JSON: {e.msg}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {path}: expected a JSON object")
        values.update(loaded)
        source = f"--config {path} and flags"
        for name, field in model.model_fields.items():
            keys = [k for k in field_keys(name, field) if k in loaded]
            if len(keys) > 1:
                raise ConfigError(
                    f"--config {path}: keys {' and '.join(map(repr, keys))} both set "
                    f"{field_flag(name, field)}; keep one"
                )
    given = vars(args)
    for name, field in model.model_fields.items():
        flag = field_flag(name, field)
        names = [(flag, name), *((a, _alias_dest(name, a)) for a in field_aliases(field))]
        used = [(f, dest) for f, dest in names if dest in given]
        if len(used) > 1:
            raise ConfigError(
                f"{' and '.join(f for f, _ in used)} set the same field ({used[0][0]}"
                f" is the current name); give one"
            )
        if used:
            for key in field_keys(name, field):  # a flag overrides the file, by any name
                values.pop(key, None)
            values[name] = _from_flag(used[0][0], flag_kind(field), given[used[0][1]])
    values.update(fixed)
    try:
        return model.model_validate(values)
    except ValidationError as e:
        raise ConfigError(f"invalid {model.__name__} from {source}: {problems(e, model)}") from None


class CommandFlags(Generic[M]):
    """The flags of a command that are one config's fields (`fanout eval`: EvalConfig's):
    the `add_arguments` / `config_from_args` pair a command module gives fanout.cli (and
    the tests), written once:

        _FLAGS = CommandFlags(EvalConfig)
        add_arguments, config_from_args = _FLAGS.add_arguments, _FLAGS.config_from_args
    """

    def __init__(self, model: type[M]) -> None:
        self.model = model

    def add_arguments(self, parser: argparse.ArgumentParser, name: str = "") -> None:
        """One flag per field of the config, and `--config FILE` (`add_model_flags`);
        `name` is the command's (fanout.cli passes it)."""
        add_model_flags(parser, self.model)

    def config_from_args(self, args: argparse.Namespace) -> M:
        """The config from `--config FILE` and flags (flags win)."""
        return model_from_args(self.model, args)


def to_flags(config: type[BaseModel], values: Mapping[str, Any]) -> list[str]:
    """The flags that set `values` (field name → value) of a command's config, written
    as `model_from_args` parses them back: `--x` / `--no-x`, `--x a b`, `--x none`,
    `--x k=v`. The bench harness and the tests build their subcommand argv with it."""
    out: list[str] = []
    for name, v in values.items():
        field = config.model_fields[name]
        flag, kind = field_flag(name, field), flag_kind(field)
        if kind == "bool":
            out.append(flag if v else switch_off(flag))
        elif v is None:
            out += [flag, "none"]
        elif kind == "dict":
            out += [flag, *(f"{k}={x}" for k, x in v.items())]
        elif kind in ("list", "tuple"):
            out += [flag, *map(str, v)]
        else:
            out += [flag, str(v)]
    return out


def problems(e: ValidationError, model: type[BaseModel] | None = None) -> str:
    """A pydantic error on one line, each problem named by its flag: `--lr: Input ...`."""
    fields = model.model_fields if model is not None else {}

    def where(loc: tuple[int | str, ...]) -> str:
        name = str(loc[0])
        return field_flag(name, fields[name]) if name in fields else flag_name(name)

    def one(err: Any) -> str:  # a whole-model check names its flags in its own words
        if not err["loc"]:
            return str(err["msg"]).removeprefix("Value error, ")
        return f"{where(err['loc'])}: {err['msg']}"

    return "; ".join(one(err) for err in e.errors())


class FlagParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors raise FlagError instead of printing the usage
    block and exiting 2: the command prints it as its one line and exits 1 (fanout.cli;
    under torchrun also in the file the agent reads). Subparsers are FlagParsers too
    (argparse makes them of the parent's class)."""

    def error(self, message: str) -> typing.NoReturn:
        raise FlagError(self.prog, message)


# --------------------------------------------------------------------------- logging


def add_log_level_flag(parser: argparse.ArgumentParser, default: str = "warning") -> None:
    """`--log-level {debug,info,warning,error}`: how much the command logs on stderr."""
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=None,
        help=f"log messages of this level and above on stderr (default: {default})",
    )
    parser.set_defaults(log_level_default=default)


def torchrun_rank() -> int | None:
    """This process's rank in a torchrun group (its RANK), None outside one."""
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None and rank.strip().isdigit() else None


def draws_progress() -> bool:
    """Whether this process may draw a progress bar: outside torchrun, or as its rank 0
    (the ranks share one stderr, where two bars would glue together)."""
    return torchrun_rank() in (None, 0)


_role = "fanout"  # what log lines name the process by; set_log_role


def log_role() -> str:
    """The tag this process's log lines carry, e.g. `produce r1` or `train b16:dp1`."""
    return _role


def set_log_role(command: str, rank: int | str | None = None) -> str:
    """Tag this process's log lines `[COMMAND rRANK]` (`rank` an int) or
    `[COMMAND RANK]` (a string, e.g. `b16:dp1`); without a rank, torchrun's RANK when
    there is one. `configure_logging` sets it from the command; a command that learns
    its rank later (a producer's replica rank, a trainer's draft and DP rank) sets it
    again. Returns the tag."""
    global _role
    rank = torchrun_rank() if rank is None else rank
    if rank is None:
        _role = command
    else:
        _role = f"{command} r{rank}" if isinstance(rank, int) else f"{command} {rank}"
    return _role


class RoleFormatter(logging.Formatter):
    """LOG_FORMAT with the process's role and rank (`%(role)s`: log_role())."""

    def format(self, record: logging.LogRecord) -> str:
        record.role = _role
        return super().format(record)


def configure_logging(args: argparse.Namespace, role: str | None = None) -> None:
    """Set up logging from `--log-level` (or the command's default level); each line
    carries the process's role (`role`, else the subcommand's name) and its torchrun
    rank, e.g. `[produce r1]` (set_log_role).

    A process that already has log handlers (a test runner, an embedding program)
    keeps them; an explicit --log-level still sets the level."""
    given: str | None = getattr(args, "log_level", None)
    name: str = given or getattr(args, "log_level_default", None) or "warning"
    level = getattr(logging, name.upper())
    set_log_role(role or getattr(args, "command", None) or "fanout")
    handler = logging.StreamHandler()
    handler.setFormatter(RoleFormatter(LOG_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
    if given:
        logging.getLogger().setLevel(level)
