"""`python -m fanout.chaos`: a kill -9 chaos run (or the soak) with a printed verdict.

    python -m fanout.chaos --work-dir runs/chaos --kills 30 --conversations 700
    python -m fanout.chaos --work-dir runs/soak --minutes 10 --conversations 700 --epochs 2

Runs rounds (fanout.chaos.soak) until `--kills` kills or `--minutes` of killing: a
stream that ends first is followed by another. Prints one summary line and every
broken promise (by round); exit status 1 if there was one. Its flags are generated from
ChaosConfig (fanout.flags), so their defaults are the config's; `--config FILE` takes the
same fields as JSON, flags win.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from fanout.chaos.driver import ChaosConfig
from fanout.chaos.soak import run_rounds
from fanout.errors import ConfigError
from fanout.flags import (
    FlagParser,
    add_log_level_flag,
    add_model_flags,
    configure_logging,
    model_from_args,
)


def build_parser() -> argparse.ArgumentParser:
    """One flag per ChaosConfig field (fanout.flags, as every `fanout` command), `--config
    FILE`, and `--json OUT` (where the report goes: not part of the run)."""
    p = FlagParser(prog="python -m fanout.chaos", description=__doc__.split("\n")[0])
    add_model_flags(p, ChaosConfig)
    p.add_argument("--json", default=None, metavar="OUT", help="write the report here")
    add_log_level_flag(p, default="info")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        a = build_parser().parse_args(argv)
        configure_logging(a, role="chaos")
        cfg = model_from_args(ChaosConfig, a)
    except ConfigError as e:  # FlagError too: one line, exit 1
        print(f"python -m fanout.chaos: error: {e}", file=sys.stderr)
        return 1
    rep = run_rounds(cfg)  # rounds until the kill count or the duration is met
    text = json.dumps({"rounds": [asdict(r) for r in rep.rounds]}, indent=2, default=str)
    if a.json:
        Path(a.json).write_text(text + "\n")
    problems = rep.problems()
    print(f"{rep.summary()}  (K={cfg.max_live_windows})")
    for line in problems:
        print("PROBLEM:", line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
