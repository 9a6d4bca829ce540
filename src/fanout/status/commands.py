"""`fanout status`, `sweep`, `detach`: look at a run directory, clean it up, release a consumer.

    fanout status --run-dir runs/demo            # compact table (fanout.status.table)
    fanout status --run-dir runs/demo --json     # machine-readable (fanout.status.schema)
    fanout status --run-dir runs/demo --watch    # the table, redrawn (fanout.status.watch)
    fanout status --run-dir runs/demo --serve 9464   # /metrics, / (fanout.status.serve)
    fanout sweep --run-dir runs/demo             # remove temp debris and orphan files
    fanout detach --run-dir runs/demo --consumer-id b8:dp0   # release a stopped consumer

Every view of `status` shows one snapshot (fanout.status.snapshot), which only reads
the database. `detach` releases a stopped or lost consumer
(Coordinator.detach_consumer). `sweep` finishes interrupted evictions, then removes
tmp/ debris and window files no ready or capturing row names (Store.sweep with
Coordinator.wants_file); it is safe while a producer and consumers run.

Their flags are generated from StatusConfig / SweepConfig / DetachConfig
(fanout.flags), so each takes `--config FILE` too. This package stays free of torch:
`fanout status` is the command people run in a loop.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fanout.coord.coordinator import Coordinator
from fanout.errors import ConfigError, CoordinatorBusy, NoCoordinator
from fanout.flags import add_model_flags, flag_options, model_from_args
from fanout.status.snapshot import STALLED_AFTER_S, snapshot
from fanout.status.table import format_table


class RunDirOptions(BaseModel):
    """Which run directory `fanout status` / `fanout sweep` open, and how."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_dir: str = Field(".", min_length=1, description="Run directory.")
    db_path: str | None = Field(
        None,
        description="Coordinator database (a path or a postgresql:// URL) if not the one "
        "recorded in the run dir at create; None = the recorded one.",
    )
    allow_network_fs: bool = Field(
        False,
        description="Open a database on a network filesystem anyway (unsafe with WAL; "
        "tests/experts).",
    )


class StatusConfig(RunDirOptions):
    """`fanout status`: show the state of a run directory."""

    # Not SweepConfig's: --json prints a snapshot here, what was removed there.
    as_json: bool = Field(
        False,
        description="Print the whole snapshot as JSON instead of a table (its schema: "
        "fanout.status.schema, docs/operations.md).",
        json_schema_extra=flag_options(flag="--json"),
    )
    watch: bool = Field(
        False,
        description="Redraw the table in place every --interval-s seconds until Ctrl-C "
        "(exit 0); needs a terminal.",
    )
    serve: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Serve Prometheus metrics at /metrics, the snapshot at /status.json and "
        "a page that refreshes itself at / on this TCP port until Ctrl-C (0: any free "
        "port, printed); none = do not serve.",
        json_schema_extra=flag_options(metavar="PORT"),
    )
    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Address --serve binds: loopback by default; 0.0.0.0 = every interface.",
    )
    interval_s: float = Field(
        2.0,
        gt=0,
        description="Seconds between --watch redraws, and between --serve's samples "
        "(its page's plot) and page refreshes.",
    )
    wait_s: float = Field(
        600.0,
        ge=0,
        description="--serve and --watch started before a producer created the run wait "
        "this long for it, saying so every 10 s (0: refuse at once, as a one-shot status "
        "does)",
    )
    stalled_after_s: float = Field(
        STALLED_AFTER_S,
        gt=0,
        description="Show the run as STALLED (and /metrics fanout_stalled 1) once a ready "
        "window has waited this long with no trainer reading past it: nothing trained.",
    )

    @model_validator(mode="after")
    def _one_view(self) -> StatusConfig:
        views = [f for f, on in (("--json", self.as_json), ("--watch", self.watch),
                                 ("--serve", self.serve is not None)) if on]  # fmt: skip
        if len(views) > 1:
            raise ValueError(f"{' and '.join(views)}: pick one view")
        return self


class SweepConfig(RunDirOptions):
    """`fanout sweep`: remove temp debris and orphan window files from a run directory."""

    as_json: bool = Field(
        False,
        description="Print what was removed and kept as JSON instead of a line.",
        json_schema_extra=flag_options(flag="--json"),
    )


class DetachConfig(RunDirOptions):
    """`fanout detach`: release a stopped or lost consumer so it no longer holds the
    producer back (it may register again later, e.g. with --resume)."""

    consumer_id: str = Field(
        min_length=1,
        description="Consumer to detach: name:dp<rank>, or a name (every rank of it).",
    )
    force: bool = Field(
        False,
        description="Detach it even while it is active (it is fenced off and exits 3).",
    )


CONFIGS: dict[str, type[StatusConfig] | type[SweepConfig] | type[DetachConfig]] = {
    "status": StatusConfig,
    "sweep": SweepConfig,
    "detach": DetachConfig,
}


def add_arguments(parser: argparse.ArgumentParser, name: str = "status") -> None:
    add_model_flags(parser, CONFIGS[name])


def config_from_args(
    args: argparse.Namespace, name: str = "status"
) -> StatusConfig | SweepConfig | DetachConfig:
    """StatusConfig (SweepConfig, DetachConfig for `name` "sweep", "detach") from
    `--config FILE` and flags."""
    return model_from_args(CONFIGS[name], args)


def run(args: argparse.Namespace, name: str = "status") -> int:
    cfg = config_from_args(args, name)
    if isinstance(cfg, StatusConfig) and cfg.watch and not sys.stdout.isatty():
        raise ConfigError(
            "--watch redraws a terminal, and stdout is not one; use --json (in a loop) or "
            "--serve PORT for a dashboard"
        )
    if isinstance(cfg, StatusConfig) and (cfg.serve is not None or cfg.watch):
        _wait_for_run(cfg)  # a monitor started before the producer waits, as trainers do
    with Coordinator.open(
        cfg.run_dir, db_path=cfg.db_path, allow_network_fs=cfg.allow_network_fs
    ) as co:
        if isinstance(cfg, DetachConfig):
            for line in co.detach_consumer(cfg.consumer_id, force=cfg.force):
                print(line)
            return 0
        if name == "sweep":
            report = co.sweep()
            if cfg.as_json:
                print(json.dumps({"tmp_removed": report.tmp_removed,
                                  "orphans_removed": report.orphans_removed,
                                  "kept": report.kept}))  # fmt: skip
            else:
                print(
                    f"sweep {co.root}: {report.removed} removed "
                    f"({len(report.tmp_removed)} temp, {len(report.orphans_removed)} orphan), "
                    f"{report.kept} live kept"
                )
            return 0
        if isinstance(cfg, StatusConfig) and cfg.serve is not None:
            from fanout.status.serve import StatusServer

            server = StatusServer(co, cfg.host, cfg.serve, cfg.interval_s, cfg.stalled_after_s)
            print(f"fanout status: serving {server.url} (metrics at {server.url}metrics); "
                  "Ctrl-C to stop", flush=True)  # fmt: skip
            return server.run()
        if isinstance(cfg, StatusConfig) and cfg.watch:
            from fanout.status.watch import watch

            return watch(lambda: format_table(snapshot(co, cfg.stalled_after_s)), cfg.interval_s)
        s = snapshot(co, getattr(cfg, "stalled_after_s", STALLED_AFTER_S))
        print(json.dumps(s, indent=2) if cfg.as_json else format_table(s))
    return 0


def _wait_for_run(cfg: StatusConfig, say_every_s: float = 10.0) -> None:
    """Until a producer has created the run (Coordinator.open_when_created, the wait
    trainers use too), at most --wait-s: a line on stderr at once and every
    `say_every_s`. Anything else that stops the open, and a run still missing after
    --wait-s, is raised by the open that follows (one line)."""
    start = time.monotonic()
    said = [-say_every_s]

    def say(e: NoCoordinator | CoordinatorBusy) -> None:
        waited = time.monotonic() - start
        if waited - said[0] >= say_every_s:
            said[0] = waited
            print(f"fanout status: waiting for a producer to create the run "
                  f"({waited:.0f} s): {e}", file=sys.stderr, flush=True)  # fmt: skip

    with contextlib.suppress(NoCoordinator, CoordinatorBusy):
        Coordinator.open_when_created(
            cfg.run_dir, cfg.wait_s, db_path=cfg.db_path,
            allow_network_fs=cfg.allow_network_fs, on_wait=say,
        ).close()  # fmt: skip
