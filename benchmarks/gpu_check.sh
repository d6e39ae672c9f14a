#!/usr/bin/env bash
# One lent GPU's checks in one command: the GPU tests, then the GPU benchmark.
# Usage (on the device machine, in the repo root):
#   bash benchmarks/gpu_check.sh OUTDIR [BENCH_SECONDS] [gpu.py options, e.g. --only PATTERN]
#   FZERO_BENCH=offload bash benchmarks/gpu_check.sh OUTDIR [BENCH_SECONDS] [offload_gpu.py options]
# FZERO_TEST_S (default 240) limits the GPU tests. Every row of gpu.py takes about 20 s (a fresh process each): all of them need ~400 s.
# FZERO_BENCH=offload runs benchmarks/offload_gpu.py (issue 49) instead, into RESULTS-offload.md.
# Writes OUTDIR/{machine.txt,gpu-tests.log,RESULTS-gpu.md,gpu-bench.log}. optree travels as a
# wheel in .whl/ (the device has no package index): see the device tool's notes.
set -u
out=${1:?an output folder}; bench_s=${2:-330}; shift 2 || shift $#
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
{ date -u; git rev-parse --short HEAD 2>/dev/null; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, optree; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'optree', optree.__version__)"; } > "$out/machine.txt" 2>&1
timeout "${FZERO_TEST_S:-240}" python3 -m pytest -q -p no:cacheprovider tests/e2e/test_gpu.py 2>&1 | tee "$out/gpu-tests.log" | tail -5
if [ "${FZERO_BENCH:-gpu}" = offload ]; then
  timeout "$bench_s" python3 benchmarks/offload_gpu.py --out "$out/RESULTS-offload.md" "$@" > "$out/gpu-bench.log" 2>&1
else
  timeout "$bench_s" python3 benchmarks/gpu.py --steps 30 --ws2-steps 0 --out "$out/RESULTS-gpu.md" "$@" > "$out/gpu-bench.log" 2>&1
fi
echo "benchmark exit $?"; tail -3 "$out/gpu-bench.log"
