"""Command-line flags generated from a component's pydantic config.

    p = argparse.ArgumentParser(); add_model_flags(p, ProducerConfig)
    cfg = model_from_args(ProducerConfig, p.parse_args())   # --config FILE + flags

One field, one flag (`max_live_windows` → `--max-live-windows`), help text from
the field's description, so flags, config files and Python calls cannot drift
apart. A `--config FILE` (JSON object of field names) supplies defaults that
explicit flags override. Validation errors name the field and where its value
came from.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from fanout.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


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

    return parse


def add_model_flags(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    *,
    exclude: tuple[str, ...] = (),
    config_flag: bool = True,
) -> None:
    """Add one flag per field of `model` (defaults SUPPRESSed: unset flags stay unset)."""
    if config_flag:
        parser.add_argument(
            "--config",
            metavar="FILE",
            default=None,
            help="JSON file of field values (flag names with underscores); flags override it",
        )
    for name, field in model.model_fields.items():
        if name in exclude:
            continue
        tp, optional = _unwrap_optional(field.annotation)
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
        default = field.default if field.default is not PydanticUndefined else None
        if field.default_factory is not None:
            default = field.default_factory()  # type: ignore[call-arg]
        required = field.is_required()
        help_text = (field.description or "").rstrip(".")
        help_text += " (required)" if required else f" (default: {default})"
        origin = get_origin(tp)
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif origin is Literal:
            kwargs["choices"] = list(get_args(tp))
        elif origin in (list, tuple):
            inner = get_args(tp)[0]
            kwargs["nargs"] = "+"
            kwargs["type"] = inner if inner in (int, float) else str
            if optional:
                help_text += "; 'none' for the default rule"
                kwargs["type"] = _parse_none(kwargs["type"])
        elif tp in (int, float, str):
            kwargs["type"] = _parse_none(tp) if optional else tp
        else:
            kwargs["type"] = str
        parser.add_argument(flag_name(name), help=help_text.replace("%", "%%"), **kwargs)


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
    for name in model.model_fields:
        if name in vars(args):
            v = getattr(args, name)
            # nargs="+" with a single 'none' means None
            if isinstance(v, list) and v == [None]:
                v = None
            values[name] = v
    values.update(fixed)
    try:
        return model.model_validate(values)
    except ValidationError as e:
        raise ConfigError(f"invalid {model.__name__} from {source}: {problems(e)}") from None


def problems(e: ValidationError) -> str:
    """A pydantic error on one line, each problem named by its flag: `--lr: Input ...`."""
    return "; ".join(
        f"{flag_name(str(err['loc'][0])) if err['loc'] else '?'}: {err['msg']}"
        for err in e.errors()
    )
