#!/usr/bin/env bash
# One call on the GPU machine: machine facts, the README's test command (GPU tests included) and
# the benchmarks. Everything it writes is packed into $OUT/results.tar.gz (the device tool returns
# at most 8 files). Stages: env tests sanitize gemm profile bench train parity (default: all but
# profile and parity);
# after a failed `tests` stage the later stages are skipped.
#   device run: MEGAMOE_COMMIT=<sha> bash scripts/gpu_session.sh [stage ...]
# Carry .whl (the nvidia-cutlass wheel) for the headers; MEGAMOE_COMMIT names the commit, since the
# copy there has no .git. The build lives outside the carried tree, so a warm machine reuses it.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/megamoe-out}
work=$(mktemp -d)
mkdir -p "$out" "$work/bench"
trap 'tar -czf "$out/results.tar.gz" -C "$work" .' EXIT
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export MEGAMOE_BUILD_DIR=${MEGAMOE_BUILD_DIR:-/tmp/megamoe-build}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
build() {  # what tests/run.sh builds, for the stages that skip `tests` on a fresh machine
  cmake -S . -B "$MEGAMOE_BUILD_DIR" -DCMAKE_BUILD_TYPE=Release >/dev/null &&
    cmake --build "$MEGAMOE_BUILD_DIR" -j "$(nproc)" 2>&1 | grep -E "error|serialised" || true
}
run_python() {  # the package from this tree, the library from the build (built first if missing)
  [[ -f "$MEGAMOE_BUILD_DIR/libmegamoe.so" ]] || build
  MEGAMOE_LIBRARY="$MEGAMOE_BUILD_DIR/libmegamoe.so" PYTHONPATH="$PWD/python:${PYTHONPATH:-}" python3 "$@"
}

status=0
for stage in ${@:-env tests sanitize gemm bench train}; do
  case "$stage" in
    env)
      { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv
        python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
        nvcc --version | tail -1; cmake --version | head -1; } 2>&1 | tee "$work/env.txt" ;;
    tests)
      bash tests/run.sh -q 2>&1 | tee "$work/tests.log" || { echo "tests failed: stopping"; exit 1; } ;;
    sanitize)
      # Small shapes only: the kernels' memory accesses and shared-memory races, not their speed.
      for tool in memcheck racecheck; do
        compute-sanitizer --tool "$tool" --error-exitcode 1 "$MEGAMOE_BUILD_DIR/megamoe_tests" --gtest_brief=1 \
          --gtest_filter='*small*:*DispatchCombine*:Routings/*' 2>&1 | tail -5 | tee -a "$work/sanitize.log" || status=1
      done ;;
    gemm)
      run_python -m megamoe.bench.gemm --out "$work/bench" 2>&1 | tee "$work/gemm.log" || status=1 ;;
    profile)
      # Kernel-by-kernel breakdown of one backend (MEGAMOE_PROFILE_ARGS, default: fused fwd+bwd).
      run_python -m megamoe.bench.profile --out "$work/bench" ${MEGAMOE_PROFILE_ARGS:-} 2>&1 \
        | tee -a "$work/profile.log" || status=1 ;;
    bench)
      run_python -m megamoe.bench --out "$work/bench" --plot ${MEGAMOE_BENCH_ARGS:-} 2>&1 \
        | grep -v "megamoe.bench: " | tee "$work/bench.log" || status=1 ;;
    train)
      run_python -m megamoe.train.bench --out "$work/bench" 2>&1 | grep -v "it/s\]" | tee "$work/train.log" || status=1 ;;
    parity)
      run_python -m megamoe.train.parity --out "$work/bench" 2>&1 | grep -v "it/s\]" | tee "$work/parity.log" || status=1 ;;
    *)
      echo "unknown stage $stage (env, tests, sanitize, gemm, profile, bench, train, parity)"; status=2 ;;
  esac
done
exit $status
