"""`python -m fanout.chaos`: a kill -9 chaos run (or the soak) with a printed verdict.

    python -m fanout.chaos --work-dir runs/chaos --kills 30 --conversations 700
    python -m fanout.chaos --work-dir runs/soak --minutes 10 --conversations 700 --epochs 2

Runs rounds (fanout.chaos.soak) until `--kills` kills or `--minutes` of killing: a
stream that ends first is followed by another. Prints one summary line and every
broken promise (by round); exit status 1 if there was one.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from fanout.chaos.driver import ChaosConfig
from fanout.chaos.soak import run_rounds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fanout.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", required=True, help="directory for assets, run, drafts, logs")
    p.add_argument("--consumers", type=int, default=3, help="trainers (default: 3)")
    p.add_argument("--kills", type=int, default=30, help="kills before letting the run finish")
    p.add_argument("--minutes", type=float, default=None, help="kill for this long instead (soak)")
    p.add_argument("--conversations", type=int, default=60, help="chat rows (stream length)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the data")
    p.add_argument("--launcher", choices=["fork", "exec"], default="fork", help="role start-up")
    p.add_argument("--seed", type=int, default=0, help="kill schedule seed")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="fail after this long (s)")
    p.add_argument("--json", default=None, help="write the report here")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = ChaosConfig(
        work_dir=a.work_dir,
        consumers=a.consumers,
        kills=a.kills,
        minutes=a.minutes,
        conversations=a.conversations,
        epochs=a.epochs,
        launcher=a.launcher,
        seed=a.seed,
        timeout_s=a.timeout_s,
    )
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
