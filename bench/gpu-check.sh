#!/usr/bin/env bash
# The prepared GPU check: every CUDA path of the project on one GPU, results under OUTDIR.
#
#   bench/gpu-check.sh OUTDIR
#   bench/gpu-check.sh --dry-run OUTDIR    every step on this CPU, with stand-ins of tiny sizes
#
# 1. the tests marked cuda, the engine's single-process tests on the device among them (MOE_TEST_DEVICE=cuda
#    marks every test taking the device fixture). The multi-process gloo tests are CPU tests and stay in CI;
# 2. the micro-benchmarks on the GPU (pytest-benchmark JSON with the derived ratios);
# 3. the `gpu` scenario suite through moe-bench (result documents under OUTDIR/results);
# 4. the device's measured profile (moe-bench profile-device --quick, peaks and network from h200-sxm
#    unless GPU_CHECK_BASE names another profile) and the gpu suite projected op by op on it, to compare
#    with 3. Without the measured profile (step 4 failed) the projection runs on the GPU_CHECK_BASE
#    profile and says so (project.log, device_fallback in each document, the last lines here).
# A failing step is recorded and the next one still runs. Exit status: 0 only if every step passed,
# 1 if one failed (the last line names them), 2 if the check cannot start.
#
# Budget on one H200, by arithmetic until a GPU run measures it (each step's limit below; 14.75
# minutes in all, steps.txt records the measured seconds):
#   tests-cuda  420 s: the selection is 363 tests (pytest --collect-only -m cuda under MOE_TEST_DEVICE=cuda, all
#                      skipped on a CPU); they compile Triton kernels after CUDA start-up (about 15 s): about 30
#                      distinct quantizer and GEMM specialisations, and the fused-op tests on the order of
#                      100 more (their cases' sizes and dtypes; the engine itself launches 73 at the
#                      reference models' sizes, counted by python -m bench.validate.kernel_compile, the
#                      MXFP8 GEMM's 8 among them: it is tuned over 4 configs, each compiled on an sm90's
#                      first call per (N, K, experts)), so some 10 GEMM shapes of the tests compile 4
#                      times each (estimate), and the MXFP8 weight gradients' two kernels some 6 more (their
#                      dtypes and accumulate-or-not): about 166 compiles at 0.2-2.3 s each on a 2-core host,
#                      385 s at the upper end.
#   micro-cuda  150 s: 4 benchmarks of 7 calls each (pedantic: 2 warm-up, 5 rounds) of one layer's
#                      forward and backward on 4,096 tokens, at most 0.31 TFLOP a call (0.3 ms at the
#                      989 TFLOP/s bf16 peak, 3 ms at 10%): under 0.1 s in all; and each fused op
#                      against its eager composition (bench/micro/test_fused_ops.py, 14 benchmarks of 7
#                      calls): the loss pair does 13.5 TFLOP a call (0.14 s at 10% of the peak, 2 s for
#                      its 14 calls), the rest move under 2 GB a call (under 1 ms at 4.8 TB/s). The rest
#                      is pytest and CUDA start-up (about 15 s) and the first call of each kernel (about
#                      13 Triton kernels at up to 3 s each). The grouped weight-gradient pair
#                      (bench/micro/test_grouped_wgrad.py: the GEMM adding into fp32 against the GEMM and
#                      an add, 4 benchmarks of 5 calls at 0.82 TFLOP each, under 10 ms a call at 10% of
#                      the peak) compiles the Triton GEMM once (one config per dtype; up to 3 s,
#                      estimate). The dense pair (bench/micro/test_wgrad.py: cuBLAS adding into fp32
#                      against mm and an add, 4 benchmarks of 7 calls at up to 0.96 TFLOP each) takes
#                      under 10 ms a call at 10% of the peak. The MXFP8 weight-gradient pair
#                      (bench/micro/test_mxfp8_wgrad.py: the operands' quantization and the block-scaled
#                      GEMM against the bf16 one, 4 benchmarks of 7 calls at 0.82 TFLOP each) is as quick;
#                      it compiles two Triton kernels once (up to 3 s each, estimate).
#   suite-gpu   210 s: see the arithmetic in scenarios/suites.yaml (gpu suite). On one GPU the node
#                      scenarios (gpu/node, 2-8 GPUs) are recorded skipped without starting; a host with
#                      more GPUs runs those that fit and the limit grows by 75 s for each (same arithmetic).
#                      Two GPUs run the overlapped data-parallel step (node2-e8-ddp-ep2-bf16, overlap auto)
#                      beside the plain one (node2-e8-ddp-ep2-no-overlap-bf16): suites.yaml's microbatch-overlap.
#   profile      45 s: the quick CUDA sweep (cuda_quick_sweep in bench/run/profile/sweep.py) times 365
#                      points, 8.0 s by estimate_seconds: each call at the H200's peaks (estimates: 989
#                      TFLOP/s bf16; 67 fp32, TF32 being off as in the engine; 4.8 TB/s), 3 calls of
#                      warm-up and sizing, repeats of batches of 1 ms or more (3 to 10, 20 ms if they
#                      fit), 10 ms making its operands. Twice that for kernels below peak (16 s), CUDA
#                      start-up (about 15 s) and the first use of cuBLAS, the attention and grouped GEMM
#                      kernels (about 5 s): 36 s.
#                      (tests/integration/workers/test_gpu_check.py recomputes the count and the estimate.)
#   project      60 s: the three one-GPU scenarios (scenarios/gpu/*.yaml, not gpu/node) traced at full
#                      size under fake tensors and priced: 30 s of CPU time on a 2-core CPU machine
#                      (about 10 s a scenario), doubled for a slower host core.
#
# --dry-run exercises the plumbing (steps, limits, files, the profile handed to the projection,
# steps.txt, the summary, the exit status) with about a minute of CPU time on a 2-core CPU machine: a
# few CPU tests, the micro-benchmarks at tiny sizes, a tiny execute scenario for the suite, tiny_sweep
# for the profile (network from GPU_CHECK_BASE, default cpu-2core) and the projection of the
# scenario's bf16 twin on that profile.
set -uo pipefail

dry_run=0
if [ "${1:-}" = --dry-run ]; then
    dry_run=1
    shift
fi
out=${1:?usage: bench/gpu-check.sh [--dry-run] OUTDIR}
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
root=$(pwd -P)
python=${PYTHON:-python}

# Worker processes start in a directory of their own, so the project must import from anywhere, and
# from this checkout: an editable install of it.
where=$(cd / && "$python" -c "
import os, bench, moe_engine
print(*(os.path.dirname(os.path.dirname(os.path.realpath(m.__file__))) for m in (bench, moe_engine)))" 2>/dev/null)
if [ "$where" != "$root $root" ]; then
    echo "gpu-check: bench and moe_engine do not import from $root outside it (found: ${where:-an import error}); run pip install -e . there" >&2
    exit 2
fi
cli=$(cd / && PYTHONVERBOSE=1 moe-bench --help 2>&1 >/dev/null | grep -o "/[^ ']*/bench/cli\.py" | head -n 1)
if [ "$cli" != "$root/bench/cli.py" ]; then
    echo "gpu-check: moe-bench ($(command -v moe-bench || echo not on PATH)) does not run $root/bench/cli.py${cli:+ but $cli}; run pip install -e . there" >&2
    exit 2
fi

if [ $dry_run = 1 ]; then
    base=${GPU_CHECK_BASE:-cpu-2core}
    "$python" -c "import torch, triton; print('dry run on the CPU: torch', torch.__version__, 'triton', triton.__version__)" \
        >"$out/environment.txt" 2>&1
    tests=(env -u MOE_TEST_DEVICE "$python" -m pytest tests/unit/moe_engine/test_cuda.py tests/unit/moe_engine/moe/test_grouped_gemm.py)
    # The micro-benchmarks' own module at tiny sizes, so that pytest-benchmark still writes its JSON.
    micro=(env MOE_BENCH_DEVICE=cpu MOE_BENCH_PROFILE="$base" "$python" -c "
import sys, pytest, bench.micro.test_moe_layer as micro
micro.TOKENS, micro.D_MODEL, micro.EXPERT_HIDDEN = 64, 32, 16
sys.exit(pytest.main(sys.argv[1:]))")
    # Run in fp32: the runner first measures the CPU's peak in the scenario's dtype, which takes minutes
    # in bf16 on a CPU without bf16 units.
    cat >"$out/dry-run-fp32.yaml" <<'EOF'
schema_version: 1
description: bench/gpu-check.sh --dry-run's stand-in for the gpu suite, a second of steps on a CPU.
mode: execute
model:
  vocab_size: 256
  d_model: 64
  n_layers: 1
  n_heads: 2
  n_kv_heads: 2
  seq_len: 64
  moe: {num_experts: 4, top_k: 2, expert_hidden: 32}
routing: {mode: random, seed: 0}
precision: fp32
run: {warmup_steps: 1, steps: 2, tokens_per_step: 128, timeout_s: 120}
EOF
    # Projected in bf16, as the gpu suite runs: the trace's fake grouped GEMM (torch's meta kernel)
    # takes bf16 operands only.
    sed 's/^precision: fp32$/precision: bf16/' "$out/dry-run-fp32.yaml" >"$out/dry-run-bf16.yaml"
    suite=("$python" -m bench.cli run "$out/dry-run-fp32.yaml" --device cpu)
    profile=("$python" -m bench.cli profile-device --device cpu --tiny --ranks 1 --name dry-run-cpu)
    projected=("$out/dry-run-bf16.yaml")
else
    base=${GPU_CHECK_BASE:-h200-sxm}
    if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu-check: no CUDA device visible to torch; nothing to check (bench/gpu-check.sh --dry-run OUTDIR runs the steps on a CPU)" >&2
        exit 2
    fi
    { nvidia-smi || true; "$python" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"; } \
        >"$out/environment.txt" 2>&1
    # The tests marked cuda: by hand where only a GPU runs them, and by tests/conftest.py for every test
    # taking the device fixture under MOE_TEST_DEVICE=cuda (tests/README.md).
    tests=(env MOE_TEST_DEVICE=cuda "$python" -m pytest -m cuda tests)
    # Each fused op against its eager composition, its bytes/s set against the base profile's memory rate.
    micro=(env MOE_BENCH_DEVICE=cuda MOE_BENCH_PROFILE="$base" "$python" -m pytest)
    suite=("$python" -m bench.cli run --suite gpu --device cuda)
    profile=("$python" -m bench.cli profile-device --device cuda --quick --name measured-gpu)
    projected=(scenarios/gpu/*.yaml)
fi

: >"$out/steps.txt"
failed=()
run_step() {  # name, time limit in seconds, command...
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    echo "== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc seconds=$((SECONDS - started)) limit=$limit" | tee -a "$out/steps.txt"
    tail -n 5 "$out/$name.log"
    [ $rc -eq 0 ] || failed+=("$name")
}

run_step tests-cuda 420 "${tests[@]}" -q --junitxml="$out/tests-cuda.xml" -p no:cacheprovider
run_step micro-cuda 150 "${micro[@]}" bench/micro -q --benchmark-enable --benchmark-json="$out/micro-cuda.json" \
    -p no:cacheprovider
# The node scenarios this host has the GPUs for (1 < dp * pp <= GPUs): 75 s each on top of the one-GPU set.
node_scenarios=$("$python" -c "
import torch
from bench.run.suites import load_all, suite_files
gpus = torch.cuda.device_count()
print(sum(1 < s.world_size <= gpus for s in load_all(suite_files('gpu', torch.device('cuda')))))") || {
    # Without the count the suite step would get the one-GPU limit and time out on a node: stop here.
    echo "gpu-check: could not count the gpu suite's node scenarios" >&2
    exit 2
}
run_step suite-gpu $((210 + 75 * ${node_scenarios:-0})) "${suite[@]}" --out "$out/results" --no-plots
run_step profile 45 "${profile[@]}" --base "$base" --out "$out/device-profile.yaml"
run_step project 60 "$python" -m bench.cli project "${projected[@]}" --device "$out/device-profile.yaml" \
    --fallback-device "$base" --out "$out/projections"

grep -h -m 1 "no such profile file; projected on" "$out/project.log" | sed 's/^moe-bench: warning: /gpu-check: /'
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu-check: FAILED: ${failed[*]} (of 5 steps; logs and results in $out)"
    exit 1
fi
echo "gpu-check: all 5 steps passed; results in $out"
