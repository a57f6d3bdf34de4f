# Builds each scratch/<name>.tgz (from `git archive <rev> CMakeLists.txt csrc python | gzip >
# scratch/<name>.tgz`) into /tmp/b_<name>/libmegamoe.so, in parallel, and returns when all are built
# (a build already there is kept while the machine stays warm). A scratch/<name>.so built on the
# development machine (with its nvcc, from the same revision) is used as it is, with no build here.
# Run it in the background to overlap
# the builds with the tests, then `wait` before benchmarking:
#   bash scripts/experiments/build_libraries.sh main my-branch & MEGAMOE_COMMIT=<sha> bash scripts/gpu_session.sh tests; wait
set -u
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
for n in "$@"; do
  [ -f /tmp/b_$n/libmegamoe.so ] && continue
  mkdir -p /tmp/src_$n && tar -xzf scratch/$n.tgz -C /tmp/src_$n
  if [ -f scratch/$n.so ]; then mkdir -p /tmp/b_$n && cp scratch/$n.so /tmp/b_$n/libmegamoe.so && continue; fi
  (PYTHONPATH=/tmp/site cmake -S /tmp/src_$n -B /tmp/b_$n -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_BUILD_TESTS=OFF >/dev/null &&
   cmake --build /tmp/b_$n -j 8 --target megamoe 2>&1 | grep -E "rror") &
done
wait
