#!/usr/bin/env bash
# The test command: builds the C++/CUDA core and its GoogleTests for sm_90a, runs them, then the
# Python tests against that build. GPU tests skip without a GPU; the same command runs them on one.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=$(realpath -m "${MEGAMOE_BUILD_DIR:-build}")
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release \
  ${CUTLASS_INCLUDE_DIR:+-DCUTLASS_INCLUDE_DIR="$CUTLASS_INCLUDE_DIR"}
cmake --build "$build_dir" -j "$(nproc)"
ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)"
MEGAMOE_LIBRARY="$build_dir/libmegamoe.so" python3 -m pytest "$@"
