#!/usr/bin/env bash
# Installs speculators 0.9.0 (vllm-project/speculators, Apache-2.0) into fanout's venv:
# the oracle of tests/test_speculators.py (skipped without it). fanout itself never
# imports it. Run by ./dev.sh in CI (CI=true) or with FANOUT_SPECULATORS=1, after the
# `.[dev]` install; by hand: scripts/install_speculators.sh [VENV] (default .venv).
#
# Always --no-deps: speculators' metadata requires torch, torchvision and torchaudio, and
# a resolve would replace the CPU torch with a multi-GB CUDA build (and pull CLI,
# data-generation and docs dependencies the test never imports). Pinned below is what
# `import speculators.models.dflash` and its checkpoint loader need beyond `.[dev]`;
# each was checked necessary by importing with it removed:
#   hs-connectors      speculators pins it (==0.9.0); imported by speculators.train.data,
#                      which speculators/__init__ imports through models.eagle3
#   openai, sniffio    imported by speculators.train.data (openai imports sniffio)
#   datasets           imported by speculators.train.data; 5.1.0 = speculators' cap
#   multiprocess, dill, pandas   imported by datasets
#   loguru             speculators.utils.loading: the loader of the verifier's weights
# The rest they import (pyarrow >= 24, fsspec, huggingface-hub, httpx2, anyio,
# python-dateutil, pyyaml, xxhash, filelock, tqdm, packaging) comes with `.[dev]`.
# Known metadata gaps `pip check` lists, none on the path the test uses: openai's jiter
# (imported lazily, by streaming only), datasets 5.1.0's fsspec<=2026.7.0 (the newer one
# fanout's resolve picks imports fine), speculators' aiohttp/click/httpx/protobuf/psutil/
# pydantic-settings/rich/typer/torchvision/torchaudio (CLI, data generation), and its
# transformers<=5.19.0 cap (the 5.x fanout resolves, 5.25 at this writing, loads and
# runs its models: tests/test_speculators.py is the check).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${FANOUT_VENV:-.venv}}
if ! "$VENV/bin/python" -c "import torch, transformers" 2>/dev/null; then
  echo "install_speculators: $VENV has no torch/transformers; run ./dev.sh first" >&2
  exit 1
fi
if ! "$VENV/bin/python" -c "import sys; sys.exit(sys.version_info < (3, 11))"; then
  echo "install_speculators: speculators 0.9.0 needs Python >= 3.11; skipped" \
    "(tests/test_speculators.py will skip)" >&2
  exit 0
fi
"$VENV/bin/pip" install -q --no-deps \
  "speculators==0.9.0" "hs-connectors==0.9.0" \
  "openai==3.57.0" "sniffio==1.3.1" \
  "datasets==5.1.0" "multiprocess==0.70.19" "dill==0.4.1" "pandas==3.1.1" \
  "loguru==0.7.3"
"$VENV/bin/python" -c "import speculators.models.dflash, speculators.utils.loading" \
  2>/dev/null || {
  echo "install_speculators: speculators installed but does not import:" >&2
  "$VENV/bin/python" -c "import speculators.models.dflash, speculators.utils.loading"
}
