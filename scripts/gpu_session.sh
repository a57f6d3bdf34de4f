#!/usr/bin/env bash
# One call on the GPU machine: machine facts, the README's test command (GPU tests included) and
# the benchmarks, with logs and JSON under $OUT. Stages: env tests sanitize gemm bench (default:
# all); after a failed `tests` stage the later stages are skipped.
#   device run: MEGAMOE_COMMIT=<sha> bash scripts/gpu_session.sh [stage ...]
# (carry .whl for nvidia-cutlass offline; MEGAMOE_COMMIT names the commit, the copy has no .git)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/megamoe-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1

# Wheels carried from a machine with internet (e.g. nvidia-cutlass for the CUTLASS headers).
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

status=0
for stage in ${@:-env tests sanitize gemm bench}; do
  case "$stage" in
    env)
      { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv
        python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
        nvcc --version | tail -1; cmake --version | head -1
        ls -d /usr/include/gtest /usr/src/googletest 2>&1; } 2>&1 | tee "$out/env.txt" ;;
    tests)
      bash tests/run.sh -q 2>&1 | tee "$out/tests.log" || { echo "tests failed: stopping"; exit 1; } ;;
    sanitize)
      # Small shapes only: the kernels' memory accesses and shared-memory races, not their speed.
      for tool in memcheck racecheck; do
        compute-sanitizer --tool "$tool" --error-exitcode 1 build/megamoe_tests --gtest_brief=1 \
          --gtest_filter='*small*:*DispatchCombine*:Routings/*' 2>&1 | tail -5 | tee -a "$out/sanitize.log" || status=1
      done ;;
    gemm)
      MEGAMOE_LIBRARY=$PWD/build/libmegamoe.so PYTHONPATH=$PWD/python:${PYTHONPATH:-} \
        python3 -m megamoe.bench.gemm --out "$out/bench" 2>&1 | tee "$out/gemm.log" || status=1 ;;
    bench)
      MEGAMOE_LIBRARY=$PWD/build/libmegamoe.so PYTHONPATH=$PWD/python:${PYTHONPATH:-} \
        python3 -m megamoe.bench --out "$out/bench" --plot ${MEGAMOE_BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" || status=1 ;;
    *)
      echo "unknown stage $stage (env, tests, sanitize, gemm, bench)"; status=2 ;;
  esac
done
exit $status
