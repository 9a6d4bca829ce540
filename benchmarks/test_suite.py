"""The default test run (`./dev.sh test`: pytest -m "not slow") as a record: how long it took.

    python benchmarks/test_suite.py --json benchmarks/results/test_suite.json   # ≈ 15 min
    python benchmarks/test_suite.py --loaded --json OUT    # beside one busy loop per core

Runs `python -m pytest -m "not slow" -n 2 --dist loadfile -q --durations=15` (dev.sh's
two pytest-xdist workers) in a fresh process (a private
`--basetemp`, so another pytest session's clean-up cannot remove its temp files) and
records its wall time against the goal (under 15 minutes on the 2-core development VM),
the counts pytest reported (passed, failed, skipped), the load and the 15 slowest tests.
`--loaded` starts one busy-looping process per core beside it first, as `./dev.sh test
--loaded` does. Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

from record import REPO, Recorder, Row

GOAL_S = 15 * 60


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--loaded", action="store_true", help="beside one busy loop per core")
    ap.add_argument("--json", help="write the record here")
    a = ap.parse_args(argv)
    rec = Recorder("test_suite", argv)
    hogs = []
    if a.loaded:
        for _ in range(os.cpu_count() or 1):
            hogs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
    try:
        with tempfile.TemporaryDirectory(prefix="fanout-suite-") as tmp:
            cmd = [sys.executable, "-m", "pytest", "-m", "not slow", "-n", "2", "--dist",
                   "loadfile", "-q", "--durations=15", "-p", "no:cacheprovider",
                   f"--basetemp={tmp}/pt"]  # fmt: skip
            t0 = time.monotonic()
            r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            wall = time.monotonic() - t0
    finally:
        for h in hogs:
            h.kill()
    out = r.stdout + r.stderr
    sys.stdout.write(out[-6000:])
    tail = out.strip().splitlines()[-1] if out.strip() else ""
    counts = {
        k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|error)", tail)
    }
    slowest = re.findall(r"^(\d+\.\d+)s (call|setup|teardown)\s+(\S+)$", out, re.M)
    loaded = "; beside one busy loop per core (--loaded)" if a.loaded else ""
    # xdist's workers deselect on their own and its summary does not count them
    deselected = (
        f"{counts['deselected']} slow deselected" if "deselected" in counts else "slow deselected"
    )
    rows = [
        Row(stage="tests", name="default_run_s" + ("_loaded" if a.loaded else ""),
            what="the default test run (`./dev.sh test`: not slow), wall time" + loaded,
            result=round(wall), unit="s", goal=f"< {GOAL_S} s (15 min)",
            met=wall < GOAL_S and r.returncode == 0,
            conditions=f"{counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, "
            f"{counts.get('skipped', 0)} skipped, {deselected}; 2 xdist workers; pytest "
            f"said: {tail.strip('= ')}"),
    ]  # fmt: skip
    rec.write(a.json, rows, raw={"returncode": r.returncode, "counts": counts,
                                 "slowest": [list(s) for s in slowest], "wall_s": wall})  # fmt: skip
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
