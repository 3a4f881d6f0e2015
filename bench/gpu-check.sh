#!/usr/bin/env bash
# The prepared GPU check: every CUDA path of the project on one GPU, results under OUTDIR.
#
#   bench/gpu-check.sh OUTDIR
#
# 1. the tests that touch CUDA: the CUDA-marked ones and the single-process engine tests on the device
#    (MOE_TEST_DEVICE=cuda). The multi-process gloo tests are CPU tests and stay in CI;
# 2. the micro-benchmarks on the GPU (pytest-benchmark JSON with the derived ratios);
# 3. the `gpu` scenario suite through moe-bench (result documents under OUTDIR/results);
# 4. the device's measured profile (moe-bench profile-device, peaks and network from h200-sxm unless
#    GPU_CHECK_BASE names another profile) and the gpu suite projected op by op on it, to compare with 3.
# A failing step is recorded and the next one still runs. Exit status: 0 only if every step passed.
#
# Budget on one H200, by arithmetic until a GPU run measures it (each step's limit below; 9.25
# minutes in all, steps.txt records the measured seconds):
#   tests-cuda  180 s: the same selection takes 16 s on a 2-core CPU machine with its 39 CUDA tests
#                      skipped; those compile Triton kernels (about 30 distinct quantizer and GEMM
#                      specialisations at up to 3 s each: 90 s) after CUDA start-up (about 15 s).
#   micro-cuda   90 s: 4 benchmarks at pytest-benchmark's 1 s measuring time each, plus warm-up,
#                      Triton compilation and start-up.
#   suite-gpu   210 s: see the arithmetic in scenarios/suites.yaml (gpu suite). On one GPU the node
#                      scenarios (gpu/node, 2-8 GPUs) are recorded skipped without starting; a host with
#                      more GPUs runs those that fit and the limit grows by 75 s for each (same arithmetic).
#   profile      45 s: the quick CUDA sweep (bench/run/profile_device.py, about 250 points at 20 ms each).
#   project      30 s: the three one-GPU scenarios (scenarios/gpu/*.yaml, not gpu/node) traced under fake
#                      tensors (about 5 s each on a CPU) and priced.
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

cuda_tests=(tests/test_cuda.py tests/test_model.py tests/moe/test_grouped_gemm.py tests/moe/test_host_sync.py
            tests/moe/test_mxfp8_experts.py tests/moe/test_layer.py tests/moe/test_router.py tests/precision)
run_step tests-cuda 180 env MOE_TEST_DEVICE=cuda "$python" -m pytest "${cuda_tests[@]}" -q \
    --junitxml="$out/tests-cuda.xml" -p no:cacheprovider
run_step micro-cuda 90 env MOE_BENCH_DEVICE=cuda "$python" -m pytest bench/micro -q --benchmark-enable \
    --benchmark-json="$out/micro-cuda.json" -p no:cacheprovider
# The node scenarios this host has the GPUs for (1 < dp * pp <= GPUs): 75 s each on top of the one-GPU set.
node_scenarios=$("$python" -c "
import torch
from bench.run.runner import load_all, suite_files
gpus = torch.cuda.device_count()
print(sum(1 < s.world_size <= gpus for s in load_all(suite_files('gpu', torch.device('cuda')))))")
run_step suite-gpu $((210 + 75 * ${node_scenarios:-0})) "$python" -m bench.cli run --suite gpu --device cuda \
    --out "$out/results" --no-plots
run_step profile 45 "$python" -m bench.cli profile-device --device cuda --quick --base "${GPU_CHECK_BASE:-h200-sxm}" \
    --name measured-gpu --out "$out/device-profile.yaml"
run_step project 30 "$python" -m bench.cli project scenarios/gpu/*.yaml --device "$out/device-profile.yaml" \
    --out "$out/projections"

echo "gpu-check: results in $out (status $status)"
exit $status
