#!/usr/bin/env bash
# One entry point for a fresh machine: creates .venv on first use, then runs
#   ./dev.sh demo [ARGS]   the main job on embedded defaults (fanout demo)
#   ./dev.sh test [ARGS]   the test suite (pytest, slow soaks excluded); --loaded first: beside CPU hogs
#   ./dev.sh lint          ruff check + ruff format --check + lint-imports (layers) + mypy (src, tests, benchmarks, scripts)
#   ./dev.sh fanout ARGS   any fanout subcommand inside the venv
# FANOUT_SPECULATORS=1 (default in CI) also installs speculators for its conformance test
set -euo pipefail
cd "$(dirname "$0")"
VENV=${FANOUT_VENV:-.venv}
stamp="$VENV/.fanout-installed"
if [ ! -x "$VENV/bin/python" ]; then
  echo "dev.sh: creating $VENV (first use) …" >&2
  python3 -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # said before the long part; pip's own download progress follows (no -q on the installs)
  echo "dev.sh: installing torch (CPU) and fanout with its dev tools into $VENV (a few minutes) …" >&2
  # torch first, pinned, and its CPU build: PyPI's Linux wheel of torch is the CUDA
  # build (GBs of CUDA libraries). A wheel of the pinned version pip can already find
  # without an index (find-links, e.g. PIP_FIND_LINKS on an offline machine) is used as
  # it is; otherwise PyTorch's CPU index is added, whose 2.13.0+cpu outranks PyPI's
  # 2.13.0 (a local version label sorts after the plain one). A torch the user already
  # installed (any >=2.9, e.g. a CUDA build) is kept instead of replaced.
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if "$VENV/bin/pip" install -q --dry-run --no-index --no-deps "torch==2.13.0" >/dev/null 2>&1; then
      "$VENV/bin/pip" install --progress-bar on "torch==2.13.0"
    else
      "$VENV/bin/pip" install --progress-bar on "torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu
    fi
  fi
  "$VENV/bin/pip" install --progress-bar on -e ".[dev]"
  touch "$stamp"
  echo "dev.sh: installed" >&2
fi
# speculators 0.9.0, the oracle of tests/test_speculators.py (which skips without it):
# always in CI (CI=true), else with FANOUT_SPECULATORS=1. Its own script installs it
# with --no-deps (a resolve would pull a CUDA torch); FANOUT_SPECULATORS=0 opts out.
want_spec=${FANOUT_SPECULATORS:-0}
[ "${CI:-}" = true ] && want_spec=${FANOUT_SPECULATORS:-1}
spec_stamp="$VENV/.fanout-speculators"
if [ "$want_spec" = 1 ] && { [ ! -f "$spec_stamp" ] || [ scripts/install_speculators.sh -nt "$spec_stamp" ]; }; then
  bash scripts/install_speculators.sh "$VENV"
  touch "$spec_stamp"
fi
cmd=${1:-help}; shift || true
case "$cmd" in
  demo) exec "$VENV/bin/fanout" demo "$@" ;;
  test)
    # tests/test_hosts.py: a run dir over sshfs needs sshfs and sshd. Best effort, as
    # root with apt only (skipped and said by those tests otherwise).
    if ! { command -v sshfs && [ -x /usr/sbin/sshd ]; } >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
      && command -v apt-get >/dev/null; then
      echo "dev.sh: installing sshfs and openssh-server for tests/test_hosts.py …" >&2
      { DEBIAN_FRONTEND=noninteractive apt-get install -y sshfs openssh-server \
        || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y sshfs openssh-server; }; } \
        >/dev/null 2>&1 || echo "dev.sh: sshfs/sshd not installed: the hosts tests will skip" >&2
    fi
    # Two pytest-xdist workers, a test file to each (module fixtures built once): most
    # tests wait on processes they started, so two overlap well even on 2 cores (16 min
    # against 25 serial). FANOUT_TEST_WORKERS=0 runs in this one process (pdb, -x).
    workers=(-n "${FANOUT_TEST_WORKERS:-2}" --dist loadfile)
    [ "${FANOUT_TEST_WORKERS:-2}" = 0 ] && workers=(-p no:xdist)
    # --loaded: the suite beside one busy-looping process per core, as a shared machine
    # runs it (a test that passes only idle is a bug); the hogs end with the run.
    if [ "${1:-}" = --loaded ]; then
      shift
      hogs=()
      for _ in $(seq "$(nproc)"); do
        "$VENV/bin/python" -c "while True: pass" &
        hogs+=($!)
      done
      trap 'kill "${hogs[@]}" 2>/dev/null || true' EXIT
      "$VENV/bin/python" -m pytest -m "not slow" "${workers[@]}" --durations=15 "$@"
      exit $?
    fi
    exec "$VENV/bin/python" -m pytest -m "not slow" "${workers[@]}" --durations=15 "$@" ;;
  lint) "$VENV/bin/ruff" check . && "$VENV/bin/ruff" format --check . && "$VENV/bin/lint-imports" && exec "$VENV/bin/mypy" ;;
  fanout) exec "$VENV/bin/fanout" "$@" ;;
  *) sed -n '2,7p' "$0"; exit 2 ;;
esac
