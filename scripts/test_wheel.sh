#!/usr/bin/env bash
# The wheel as a user gets it: builds it (scripts/build_wheel.sh), installs it into a fresh virtual
# environment with the CUDA toolkit off the PATH (no compiler is needed to install it), and runs the
# Python tests that need no GPU against the installed package (GPU tests skip without one; with one
# they run too). The environment reuses this Python's installed PyTorch (--system-site-packages);
# the test checks that megamoe and its core come from the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=$(bash scripts/build_wheel.sh | tail -1)
venv=$(mktemp -d)/venv
python3 -m venv --system-site-packages "$venv"
# Every PATH folder that holds nvcc (the toolkit's, and links to it) is left out.
no_toolkit=$(tr ':' '\n' <<<"$PATH" | while read -r dir; do [ -x "$dir/nvcc" ] || echo "$dir"; done | paste -sd:)
PATH=$no_toolkit bash -c '! command -v nvcc >/dev/null || { echo "nvcc still on the PATH"; exit 1; }
           "$0"/bin/python -m pip install -q --no-deps --no-index --ignore-installed "$1"' "$venv" "$wheel"
cd tests/python  # not the repository root: the source tree's python/ stays off sys.path
env -u MEGAMOE_LIBRARY "$venv/bin/python" - <<'PY'
import megamoe, megamoe._native as native, sys
lib = native.library()._name
assert megamoe.__file__.startswith(sys.prefix), megamoe.__file__
assert lib.startswith(sys.prefix), lib
print(f"megamoe {megamoe.__version__} from {megamoe.__file__}, core {lib}")
PY
env -u MEGAMOE_LIBRARY "$venv/bin/python" -m pytest -q -p no:cacheprovider -c /dev/null --rootdir . -o pythonpath=. .
