# Correctness of library builds in one call on the GPU machine, before ab_libraries.sh times them.
# For each <name>: scratch/<name>.tgz (`git archive <rev> CMakeLists.txt csrc python tests
# pyproject.toml`) is unpacked into /tmp/src_<name>; scratch/tests_<name>/ holds that revision's
# megamoe_tests with its libmegamoe.so, both built on the development machine. Runs the GoogleTests,
# compute-sanitizer memcheck on the small ones, and the revision's own pytest files given after `--`
# (default: the fused and expert-parallel tests) against scratch/<name>.so. Carry .whl and scratch.
#   bash scripts/experiments/check_libraries.sh <name> ... [-- <pytest files>]
set -uo pipefail
names=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do names+=("$1"); shift; done; [ $# -gt 0 ] && shift
files=${*:-"tests/python/test_backends.py tests/python/test_expert_parallel.py"}
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
status=0
for n in "${names[@]}"; do
  echo "== $n"
  mkdir -p /tmp/src_$n && tar -xzf scratch/$n.tgz -C /tmp/src_$n
  tests=scratch/tests_$n
  LD_LIBRARY_PATH=$tests timeout 300 $tests/megamoe_tests --gtest_brief=1 2>&1 | tail -3 || status=1
  LD_LIBRARY_PATH=$tests timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 $tests/megamoe_tests \
    --gtest_brief=1 --gtest_filter='*small*:*DispatchCombine*' 2>&1 | tail -2 || status=1
  (cd /tmp/src_$n && MEGAMOE_LIBRARY=$OLDPWD/scratch/$n.so PYTHONPATH=/tmp/site timeout 400 \
    python3 -m pytest -q -x -p no:cacheprovider $files 2>&1 | tail -2) || status=1
done
exit $status
