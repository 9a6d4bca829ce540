"""The `fanout` command: `fanout prepare | regenerate | produce | train | eval | promote |
status | detach | sweep | bench | demo | upgrade-checkpoint` (every name in COMMANDS;
tests/test_docs_match_code.py checks).

    fanout --help
    fanout status --run-dir runs/demo --json

Each subcommand lives in the module that owns it; this file only maps names to
`add_arguments(parser)` / `run(args) -> int` pairs, imported lazily so that
`fanout status` never pays for importing torch. Every subcommand takes
`--log-level {debug,info,warning,error}` (default: info for the long-running
`produce` and `train`, warning for the rest); a subcommand with a config also takes
`--config FILE` (fanout.flags).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from fanout.errors import FanoutError, FlagError
from fanout.flags import (
    FlagParser,
    add_log_level_flag,
    add_model_flags,
    configure_logging,
    model_from_args,
)
from fanout.train.dplaunch import failed

# name -> (module, one-line help). Each module defines add_arguments(p) and run(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {}
# Commands whose progress log is their record (the rest log warnings and errors only).
INFO_LOGGING = ("produce", "train")
# name -> light component configs ("module:Class", no torch in their imports) whose
# flag-only rules (their validators) are checked before the command's module, and torch
# with it, is imported: such an error comes back in well under a second
# (benchmarks/startup.py measures it). The command's own config checks them again.
EARLY: dict[str, tuple[str, ...]] = {
    "produce": ("fanout.produce.replicas:ReplicaOptions",),
    # the family, its own options and the shared recipe: the registry and every
    # family's config load without torch (Family.model_ref: models on first use)
    "train": ("fanout.families.registry:FamilyOptions", "fanout.model.draft_config:DraftRecipe"),
    "eval": ("fanout.decode.config:EvalConfig",),
    "promote": ("fanout.decode.config:PromoteConfig",),
}
# flags that put a command in a mode needing less than its whole config (the command
# checks that mode itself): no early check then
EARLY_UNLESS: dict[str, tuple[str, ...]] = {"promote": ("--rollback",)}


class _Quiet(argparse.ArgumentParser):
    """A parser that raises instead of printing a usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def command_of(argv: list[str]) -> str | None:
    """The command `argv` names: its first word that is not a flag."""
    return next((a for a in argv if not a.startswith("-")), None)


def early_check(argv: list[str]) -> None:
    """Raise ConfigError if `argv`'s command breaks a flag-only rule of its EARLY
    components; anything else (help, a flag the full parser rejects) is left to it."""
    command = command_of(argv)
    if command not in EARLY or {"-h", "--help", *EARLY_UNLESS.get(command, ())} & set(argv):
        return
    rest = argv[argv.index(command) + 1 :]
    for ref in EARLY[command]:
        module, cls = ref.split(":")
        model = getattr(importlib.import_module(module), cls)
        parser = _Quiet(add_help=False, allow_abbrev=False)
        add_model_flags(parser, model)
        try:
            args, _ = parser.parse_known_args(rest)
        except ValueError:
            return
        model_from_args(model, args)


def _register(name: str, module: str, help_text: str) -> None:
    COMMANDS[name] = (module, help_text)


_register(
    "status",
    "fanout.status.commands",
    "show the state of a run directory (windows, consumers, leases)",
)
_register(
    "sweep",
    "fanout.status.commands",
    "remove temp debris and orphan window files from a run directory",
)
_register(
    "detach",
    "fanout.status.commands",
    "release a stopped or lost consumer so it no longer holds the producer back",
)
_register(
    "produce", "fanout.produce.producer", "run the verifier over packed rows and publish windows"
)
_register("train", "fanout.train.trainer", "train one draft (any family) as a consumer of a run")
_register("prepare", "fanout.data.prepare", "chat data → packed, loss-masked token rows (cached)")
_register(
    "regenerate",
    "fanout.regen.regenerate",
    "chat data → the same conversations with the verifier's own answers (on-policy data)",
)
_register(
    "eval",
    "fanout.decode.eval",
    "speculative decoding with trained drafts: lossless check, τ, speedup",
)
_register(
    "promote",
    "fanout.decode.promote",
    "serve a better draft: evaluate each new checkpoint against the served one, flip a link",
)
_register(
    "upgrade-checkpoint",
    "fanout.checkpoints.upgrade",
    "rewrite draft checkpoints this fanout refuses: format 1 -> 2, unsorted layers -> "
    "ascending (fc columns permuted)",
)
_register(
    "bench", "fanout.bench.bench", "1p1c / 1p3c / unshared benchmark → report.json, .md, plots"
)
_register(
    "demo",
    "fanout.bench.demo",
    # the families are the registry's (fanout.bench.demo.DEMO_FAMILIES), not counted
    # here: the CLI's module must not load them to print its help
    "one producer, one draft of each registered family on CPU for a few minutes; prints a report",
)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    # the docstring's first paragraph (its first line alone stops mid-list)
    about = " ".join(__doc__.split("\n\n", 1)[0].split())
    parser = FlagParser(prog="fanout", description=about)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = command_of(argv)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_log_level_flag(p, "info" if name in INFO_LOGGING else "warning")
        # Only import the module whose flags we need (keeps `fanout status` light).
        if name == wanted:
            importlib.import_module(module).add_arguments(p, name)
    return parser


def _failed(command: str, e: FanoutError) -> int:
    """A command's one-line error, on stderr and, under torchrun, in the file its agent
    reads the rank's failure from (fanout.train.dplaunch names it in its own line)."""
    return failed(f"fanout {command}", e)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        early_check(argv)
    except FanoutError as e:
        return _failed(str(command_of(argv)), e)
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except FlagError as e:
        # argparse refuses a command's unknown flags in the top parser: name the command
        command = command_of(argv)
        if e.prog == "fanout" and command in COMMANDS:
            e = FlagError(f"fanout {command}", e.message)
        return failed(e.prog, e)
    if args.command is None:
        parser.print_help()
        return 2
    configure_logging(args)
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args, args.command) or 0)
    except FanoutError as e:
        return _failed(args.command, e)
    except KeyboardInterrupt:
        print(f"fanout {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `fanout status | head`: the reader left; nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
