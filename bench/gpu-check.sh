#!/usr/bin/env bash
# The prepared GPU check: every CUDA path of the project on one GPU, results under OUTDIR.
#
#   bench/gpu-check.sh OUTDIR
#
# 1. the test suite on the GPU (CUDA-marked tests plus the device-parametrised ones, MOE_TEST_DEVICE=cuda);
# 2. the micro-benchmarks on the GPU (pytest-benchmark JSON with the derived ratios);
# 3. the `gpu` scenario suite through moe-bench (result documents under OUTDIR/results).
# Each step has its own time limit so that the whole check stays under 9 minutes on one H200; a
# failing step is recorded and the next one still runs. Exit status: 0 only if every step passed.
set -uo pipefail

out=${1:?usage: bench/gpu-check.sh OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
python=${PYTHON:-python}

if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu-check: no CUDA device visible to torch; nothing to check" >&2
    exit 2
fi

{ nvidia-smi || true; "$python" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"; } \
    >"$out/environment.txt" 2>&1

status=0
run_step() {  # name, time limit in seconds, command...
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    echo "== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - started))" | tee -a "$out/steps.txt"
    tail -n 5 "$out/$name.log"
    [ $rc -eq 0 ] || status=1
}

run_step tests-cuda 150 env MOE_TEST_DEVICE=cuda "$python" -m pytest tests -m "cuda or not slow" -q \
    --junitxml="$out/tests-cuda.xml" -p no:cacheprovider
run_step micro-cuda 120 env MOE_BENCH_DEVICE=cuda "$python" -m pytest bench/micro -q --benchmark-enable \
    --benchmark-json="$out/micro-cuda.json" -p no:cacheprovider
run_step suite-gpu 240 "$python" -m bench.cli run --suite gpu --device cuda --out "$out/results" --no-plots

echo "gpu-check: results in $out (status $status)"
exit $status
