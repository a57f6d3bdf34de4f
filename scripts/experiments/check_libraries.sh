# Correctness of library versions on a GPU machine, before ab_libraries.sh times them.
# For each <name>, build_libraries.sh unpacks scratch/<name>.tgz (`git archive <rev> CMakeLists.txt
# cmake csrc python tests pyproject.toml`) into /tmp/src_<name> and stages its library in /tmp/b_<name>;
# scratch/tests_<name>/ holds that revision's megamoe_tests with its libmegamoe.so, built beforehand
# (e.g. on another machine with the same CUDA). Runs the GoogleTests, compute-sanitizer memcheck on
# the small ones, and the revision's own pytest files given after `--` (default: the fused and
# expert-parallel tests). MEGAMOE_WHEELS: a folder of wheels to install offline (build_libraries.sh).
#   bash scripts/experiments/check_libraries.sh <name> ... [-- <pytest files>]
set -uo pipefail
names=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do names+=("$1"); shift; done; [ $# -gt 0 ] && shift
files=${*:-"tests/python/test_backends.py tests/python/test_expert_parallel.py"}
bash "$(dirname "$0")/build_libraries.sh" "${names[@]}"
status=0
for n in "${names[@]}"; do
  echo "== $n"
  tests=scratch/tests_$n
  LD_LIBRARY_PATH=$tests timeout 300 $tests/megamoe_tests --gtest_brief=1 2>&1 | tail -3 || status=1
  LD_LIBRARY_PATH=$tests timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 $tests/megamoe_tests \
    --gtest_brief=1 --gtest_filter='*small*:*DispatchCombine*' 2>&1 | tail -2 || status=1
  (cd /tmp/src_$n && MEGAMOE_LIBRARY=/tmp/b_$n/libmegamoe.so PYTHONPATH=/tmp/megamoe-site timeout 400 \
    python3 -m pytest -q -x -p no:cacheprovider $files 2>&1 | tail -2) || status=1
done
exit $status
