#!/usr/bin/env python
"""The fan-out benchmark (1p1c / 1p3c / unshared) — same as `fanout bench`.

    python scripts/benchmark_fanout.py benchmarks/fanout/cpu-tiny.json --json out.json
    python scripts/benchmark_fanout.py benchmarks/fanout/qwen3-8b-1p3c.json --out runs/bench-8b

Prints a table (hardware, sizes, versions, per-scenario numbers), writes report.json,
report.md and PNG plots under --out, and copies report.json to --json. Exit 1 if the
run is invalid (see docs/benchmarks.md for the validity rules).
"""

import argparse
import sys

from fanout.bench.bench import add_arguments, run
from fanout.errors import FanoutError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmark_fanout.py", description=__doc__.split("\n")[0])
    add_arguments(p)
    try:
        return run(p.parse_args(argv))
    except FanoutError as e:
        print(f"benchmark_fanout: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
