#!/usr/bin/env bash
# Build, test and benchmark on a GPU machine, and gather everything into one results folder: machine
# facts (env.txt), the test command's log (GPU tests included), compute-sanitizer on the small
# GoogleTests, and the benchmarks' logs and JSON (bench/ inside the folder).
#   bash scripts/gpu_session.sh [stage ...]
# Stages: env tests gpu-tests sanitize gemm profile bench classes train parity torchtitan (default:
# all but gpu-tests, profile, classes, parity and torchtitan);
# after a failed `tests` or `gpu-tests` stage the later stages are skipped.
# Settings (environment variables):
#   MEGAMOE_OUT        the results folder (default: runs/gpu-<date>-<time> in this tree; runs/ is ignored by git)
#   MEGAMOE_TAR        also pack the folder into this .tar.gz (e.g. to copy it off the machine in one file)
#   MEGAMOE_BUILD_DIR  where the core is built (default /tmp/megamoe-build, kept between calls)
#   MEGAMOE_WHEELS     a folder of wheels to install offline first (default .whl, if it exists), e.g. the
#                      nvidia-cutlass wheel for the CUDA headers on a machine without internet access
#   MEGAMOE_COMMIT     the commit being measured, for the records, when the tree has no .git
#   MEGAMOE_BENCH_ARGS, MEGAMOE_PROFILE_ARGS, MEGAMOE_TRAIN_ARGS, MEGAMOE_TORCHTITAN_ARGS  extra arguments
#                      of those stages
set -uo pipefail
out=${MEGAMOE_OUT:+$(realpath -m "$MEGAMOE_OUT")} tarball=${MEGAMOE_TAR:+$(realpath -m "$MEGAMOE_TAR")}
cd "$(dirname "$0")/.."
out=${out:-$PWD/runs/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out/bench"
[[ -n "$tarball" ]] && trap 'tar -czf "$tarball" -C "$out" .' EXIT
echo "results: $out"
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export MEGAMOE_BUILD_DIR=${MEGAMOE_BUILD_DIR:-/tmp/megamoe-build}
wheels=${MEGAMOE_WHEELS:-.whl}
if compgen -G "$wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/megamoe-site "$wheels"/*.whl
  export PYTHONPATH=/tmp/megamoe-site${PYTHONPATH:+:$PYTHONPATH}
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
        nvcc --version | tail -1; cmake --version | head -1; } 2>&1 | tee "$out/env.txt" ;;
    tests)
      bash tests/run.sh -q 2>&1 | tee "$out/tests.log" || { echo "tests failed: stopping"; exit 1; } ;;
    gpu-tests)
      # The suite's GPU side in a fraction of `tests`' time: the GoogleTests in parallel, then one pytest
      # per file, six at a time, largest first, without the CPU-device cases (CI runs those); a log
      # per file in pytest/ (a file still running after 6 minutes is stopped and counts as failed; the
      # EP group file, with its torch.compile cases, needs more than 4 beside five others).
      build
      ctest --test-dir "$MEGAMOE_BUILD_DIR" -j 8 --output-on-failure >"$out/ctest.log" 2>&1
      failed=$?
      tail -3 "$out/ctest.log"
      mkdir -p "$out/pytest"
      ( export MEGAMOE_LIBRARY="$MEGAMOE_BUILD_DIR/libmegamoe.so" PYTHONPATH="$PWD/python:${PYTHONPATH:-}" \
          OUT_DIR="$out/pytest" OMP_NUM_THREADS=2
        ls -S tests/python/test_*.py | xargs -P 6 -I{} bash -c 'name=$(basename {} .py)
          timeout 360 python3 -m pytest -q -rfE -p no:cacheprovider -k "not cpu" {} > "$OUT_DIR/$name.log" 2>&1
          rc=$?; [[ $rc == 0 || $rc == 5 ]] || echo "FAILED: $name (rc $rc)"
          tail -1 "$OUT_DIR/$name.log" | sed "s/^/$name: /"' ) | tee "$out/gpu-tests.log"
      if (( failed )) || grep -q "^FAILED" "$out/gpu-tests.log"; then echo "tests failed: stopping"; exit 1; fi ;;
    sanitize)
      # Small shapes only: the kernels' memory accesses and shared-memory races, not their speed.
      for tool in memcheck racecheck; do
        compute-sanitizer --tool "$tool" --error-exitcode 1 "$MEGAMOE_BUILD_DIR/megamoe_tests" --gtest_brief=1 \
          --gtest_filter='*small*:*DispatchCombine*:Routings/*' 2>&1 | tail -5 | tee -a "$out/sanitize.log" || status=1
      done ;;
    gemm)
      run_python -m megamoe.bench.gemm --out "$out/bench" 2>&1 | tee "$out/gemm.log" || status=1 ;;
    profile)
      # Kernel-by-kernel breakdown of one backend (MEGAMOE_PROFILE_ARGS, default: fused fwd+bwd).
      run_python -m megamoe.bench.profile --out "$out/bench" ${MEGAMOE_PROFILE_ARGS:-} 2>&1 \
        | tee -a "$out/profile.log" || status=1 ;;
    bench)
      run_python -m megamoe.bench --out "$out/bench" --plot ${MEGAMOE_BENCH_ARGS:-} 2>&1 \
        | grep -v "megamoe.bench: " | tee "$out/bench.log" || status=1 ;;
    classes)
      # The model classes beyond Qwen3 at 16384 tokens, then Qwen3-30B-A3B at a small batch.
      for run in "classes --preset kimi-k2-ep8 mixtral-8x22b gpt-oss-20b qwen3-next-80b-a3b --tokens 16384 --backends fused grouped" \
                 "small_batch --preset qwen3-30b-a3b --tokens 1024 --backends fused fused-graphed fused-step-graphed grouped --precision bf16 fp8 fp8_bwd"; do
        set -- $run
        name=$1; shift
        run_python -m megamoe.bench --out "$out/bench/$name" "$@" --skewed-tokens \
          --modes fwd fwdbwd 2>&1 | grep -v "megamoe.bench: " | tee -a "$out/classes.log" || status=1
      done ;;
    train)
      run_python -m megamoe.train.bench --out "$out/bench" ${MEGAMOE_TRAIN_ARGS:-} 2>&1 | grep -v "it/s\]" \
        | tee "$out/train.log" || status=1 ;;
    parity)
      run_python -m megamoe.train.parity --out "$out/bench" 2>&1 | grep -v "it/s\]" | tee "$out/parity.log" || status=1 ;;
    torchtitan)
      # TorchTitan's models with its experts and megamoe's (torchtitan 0.2 among the wheels): the
      # reference-setting step bench, then the loss parity.
      for mode in bench parity; do
        run_python -m megamoe.train.torchtitan "$mode" --out "$out/bench" ${MEGAMOE_TORCHTITAN_ARGS:-} 2>&1 \
          | tee -a "$out/torchtitan.log" || status=1
      done ;;
    *)
      echo "unknown stage $stage (env, tests, sanitize, gemm, profile, bench, classes, train, parity, torchtitan)"
      status=2 ;;
  esac
done
exit $status
