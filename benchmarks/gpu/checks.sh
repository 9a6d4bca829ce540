#!/usr/bin/env bash
# The CUDA-only checks, as one script for a lent GPU machine (see docs/benchmarks.md).
#
#   bash benchmarks/gpu/checks.sh prepare   # here, no GPU needed: wheels + bench data
#   bash benchmarks/gpu/checks.sh run       # there: $OUT receives logs and JSON
#
# `prepare` downloads the wheels the GPU image lacks (pydantic and its three
# dependencies, for its Python 3.12) into .whl/ and copies the Qwen3 tokenizer and
# a chat file from ../shared/data into .benchdata/ (both git-ignored; carry both).
# `run` installs the wheels into /tmp/site, then runs tests/test_gpu.py (fused ops, bf16
# capture, every draft family's bf16 step against its fp32 CPU loss, NVML), the
# producer benchmark at the README's size (H 1024 × 24 layers, vocab 151,669,
# T 2048, R 8) over 16 and 48 windows, one profiled producer run, the same at
# --tp 2 under torchrun when the device has two GPUs or more, and `fanout eval`
# in bf16 of the demo's trained drafts (one per family) (prepare trains them if runs/demo has none),
# greedy and at T = 1, and the draft cache against the uncached loop and a free draft
# at a 1.5k-token context; then every zoo verifier's capture and long rows on CUDA
# (benchmarks/verifiers.py), packed hybrids (with flash-linear-attention where its wheels
# are there), and every family's train step at DFlash's recipe shape,
# dense vs block-sparse draft attention vs speculators (benchmarks/draft_attention.py),
# and at the CPU step comparison's config against speculators, time and peak CUDA memory
# (benchmarks/families.py --only step --device cuda; issue #56's goal: <= 0.8x, <= 1.0x).
# The copy there has no .git: give the commit it is of, FANOUT_COMMIT=$(git rev-parse HEAD)
# (run here), so the JSONs (benchmarks/record.py) name it; copy the producer JSONs into
# benchmarks/results/ (e.g. producer-h200-16.json) and run `python benchmarks/report.py`.
set -uo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-run}
OUT=${OUT:-/tmp/fanout-gpu-out}
mkdir -p "$OUT"

if [ "$mode" = prepare ]; then
  set -e
  py=.venv/bin/python
  [ -x "$py" ] || py=python3
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  # transformers' tensor parallelism (the --tp check) needs accelerate (the `tp` extra)
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl accelerate==1.15.0 psutil==7.2.2
  # the `hybrid` extra (flash-linear-attention's varlen gated delta rule) and its einops,
  # for the packed-hybrid check; installed with --no-deps apart, so that a failure to
  # import it leaves the other checks on the torch path
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform any --platform manylinux_2_28_x86_64 -d .whl/hybrid \
    flash-linear-attention==0.5.2 fla-core==0.5.2 einops==0.8.1 || echo "hybrid wheels: none"
  # speculators 0.9.0 and what its models import (scripts/install_speculators.sh's pins),
  # for the draft-attention step comparison; installed with --no-deps like there
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl/speculators \
    speculators==0.9.0 hs-connectors==0.9.0 openai==3.57.0 sniffio==1.3.1 datasets==5.1.0 \
    multiprocess==0.70.19 dill==0.4.1 pandas==3.1.1 loguru==0.7.3
  mkdir -p .benchdata
  cp -r ../shared/data/tokenizers/qwen3 .benchdata/tokenizer
  cp ../shared/data/chat/fastchat/dummy_conversation.json .benchdata/chat.json
  # trained demo drafts + their tiny assets for the bf16 `fanout eval` check (a few MB)
  if ! ls runs/demo/last/1p3c/drafts/eagle3/checkpoint-*/COMMITTED >/dev/null 2>&1; then
    "$py" -m fanout.cli demo --minutes 1 --run-dir runs/demo >/dev/null
  fi
  rm -rf .benchdata/demo && mkdir -p .benchdata/demo/last/1p3c
  cp -r runs/demo/assets .benchdata/demo/assets
  cp -r runs/demo/last/1p3c/drafts .benchdata/demo/last/1p3c/drafts
  du -sh .whl .benchdata
  exit 0
fi

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site-spec .whl/speculators/*.whl || echo "speculators wheels: not installed"
export PYTHONPATH=/tmp/site:/tmp/site-spec:$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -x 2>&1 | tee "$OUT/test_gpu.log"
bench=(python3 benchmarks/producer.py --hidden 1024 --layers 24 --num-draft-layers 5
  --seq-len 2048 --window-rows 8 --data .benchdata/chat.json --tokenizer .benchdata/tokenizer)
for w in 16 48; do
  "${bench[@]}" --windows "$w" --json "$OUT/producer-$w.json" 2>&1 | grep -v "it/s\]" \
    | tee "$OUT/producer-$w.log"
done
"${bench[@]}" --windows 16 --storage-dtype float8_e4m3fn --json "$OUT/producer-fp8.json" 2>&1 \
  | grep -v "it/s\]" | tee "$OUT/producer-fp8.log"
"${bench[@]}" --windows 8 --profile "$OUT/profile" 2>&1 | grep -v "it/s\]" > "$OUT/profile.log"
# tensor-parallel capture (fanout.produce.tp_capture, NCCL): TP 2 vs 1 on the same windows, which
# must match; needs two GPUs
ngpu=$(nvidia-smi --list-gpus | wc -l)
if [ "$ngpu" -ge 2 ]; then
  python3 -m torch.distributed.run --standalone --nproc-per-node 2 "${bench[@]:1}" --tp 2 \
    --windows 16 --workdir /tmp --json "$OUT/producer-tp2.json" 2>&1 | grep -v "it/s\]" \
    | tee "$OUT/producer-tp2.log"
else
  echo "tp check skipped: this device has $ngpu GPU; --tp 2 needs 2 or more" \
    | tee "$OUT/producer-tp2.log"
fi
# fanout eval in bf16 on CUDA: the demo's trained drafts, real speculative decoding
python3 benchmarks/eval.py --demo-dir .benchdata/demo --device cuda --dtype bfloat16 \
  --num-prompts 16 --max-new-tokens 96 --json "$OUT/eval-bf16.json" 2>&1 \
  | grep -v "Loading weights" | tee "$OUT/eval-bf16.log"
# the same at serving temperatures: sampled speculative decoding on CUDA (T = 0 and 1)
python3 benchmarks/eval.py --demo-dir .benchdata/demo --device cuda --dtype bfloat16 \
  --num-prompts 16 --max-new-tokens 96 --temperature 0 1 --top-k 50 \
  --json "$OUT/eval-bf16-t1.json" 2>&1 | grep -v "Loading weights" | tee "$OUT/eval-bf16-t1.log"
# the draft cache's buffers on CUDA at a long context, against the uncached loop and the
# free-draft ceiling (same tokens in all three arms; ratios: docs/eval.md)
python3 benchmarks/eval.py --demo-dir .benchdata/demo --device cuda --dtype bfloat16 \
  --num-prompts 1 --max-new-tokens 256 --ignore-eos --compare-uncached --rounds 2 --turns 30 \
  --json "$OUT/eval-bf16-cache.json" 2>&1 | grep -v "Loading weights" | tee "$OUT/eval-bf16-cache.log"
# every verifier architecture of the zoo (tests/verifier_zoo.py): packed capture vs each
# document alone on CUDA, and long rows (T 4k/16k/32k) with no T x T mask vs the dense
# mask forced, at a verifier-like width (issue #43)
python3 benchmarks/verifiers.py --device cuda --hidden 1024 --layers 8 --vocab 32000 \
  --rows 4 --seq-len 4096 --hybrid-archs "" --json "$OUT/verifiers-gpu.json" 2>&1 \
  | grep -v "it/s\]" | tee "$OUT/verifiers-gpu.log"
# packed hybrids (issue #53): Qwen3.5 / Qwen3-Next (gated delta rule), LFM2 (short
# convolutions), Nemotron-H and Falcon-H1 (Mamba-2) at a verifier-like width, packed rows with per-document resets vs fanout's
# per-document path vs each document alone; with flash-linear-attention's varlen kernel
# where its wheels installed (first its exactness against the torch path), else the torch path;
# causal-conv1d / mamba-ssm (fanout[mamba]) have only sdists that build CUDA extensions:
# not shipped, their -m gpu test runs only where the machine already has them
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site-hybrid .whl/hybrid/*.whl 2>/dev/null || echo "hybrid wheels: not installed"
PYTHONPATH=/tmp/site-hybrid:$PYTHONPATH python3 -c "import fla.ops.gated_delta_rule" \
  2>&1 | tail -1 | tee "$OUT/hybrid-fla.txt"
PYTHONPATH=/tmp/site-hybrid:$PYTHONPATH python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_varlen_scan.py 2>&1 | tee "$OUT/test_varlen_gpu.log"
PYTHONPATH=/tmp/site-hybrid:$PYTHONPATH python3 benchmarks/verifiers.py --device cuda \
  --archs '' --lengths '' --sliding-archs '' --hidden 1024 --vocab 32000 --hybrid-rows 8 \
  --json "$OUT/verifiers-hybrid-gpu.json" 2>&1 | grep -v "it/s\]" \
  | tee "$OUT/verifiers-hybrid-gpu.log"
# every family's train step at DFlash's recipe shape (T 3072, 512 anchors, block 16, 5
# layers) at a Qwen3-8B width: dense masked vs block-sparse draft attention vs speculators
# 0.9.0's (its simple_flex_attention), time and peak CUDA memory (issue #44)
python3 benchmarks/draft_attention.py --device cuda --hidden 4096 --heads 32 --kv-heads 8 \
  --head-dim 128 --intermediate 12288 --vocab 32000 --draft-layers 5 --threads 8 \
  --out /tmp/draft_attention --json "$OUT/draft_attention-gpu.json" 2>&1 \
  | tee "$OUT/draft_attention-gpu.log"
# every family's train step against speculators 0.9.0's model on the same config and rows
# as the CPU record (benchmarks/results/families-step-*.json), on CUDA: time (each part
# synchronized) and peak CUDA memory, 9 interleaved rounds (issue #56)
python3 benchmarks/families.py --only step --device cuda --out /tmp/families \
  --json "$OUT/families-step-gpu.json" 2>&1 | grep -v "Loading weights\|Writing model" \
  | tee "$OUT/families-step-gpu.log"
ls -la "$OUT"
