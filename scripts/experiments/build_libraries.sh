# Builds library versions side by side for an A/B on a GPU machine: each scratch/<name>.tgz (from
# `git archive <rev> CMakeLists.txt cmake csrc python | gzip > scratch/<name>.tgz`) is unpacked into
# /tmp/src_<name> and built into /tmp/b_<name>/libmegamoe.so, all in parallel; returns when all are
# built. A build already in /tmp/b_<name> is kept while scratch/<name>.tgz is unchanged (its checksum
# is kept beside it), and a scratch/<name>.so (built elsewhere from the same revision, with the same
# CUDA) is used as it is, with no build here.
# MEGAMOE_WHEELS: a folder of wheels to install offline first (default .whl, if it exists), e.g. the
# nvidia-cutlass wheel for the CUDA headers.
# Run it in the background to overlap the builds with the tests, then `wait` before benchmarking:
#   bash scripts/experiments/build_libraries.sh main my-branch & bash scripts/gpu_session.sh tests; wait
set -u
wheels=${MEGAMOE_WHEELS:-.whl}
compgen -G "$wheels/*.whl" >/dev/null &&
  python3 -m pip install -q --no-index --no-deps --target /tmp/megamoe-site "$wheels"/*.whl
for n in "$@"; do
  sum=$(cat scratch/$n.tgz scratch/$n.so 2>/dev/null | md5sum | cut -d' ' -f1)
  [ -f /tmp/b_$n/libmegamoe.so ] && [ "$(cat /tmp/b_$n/source.md5 2>/dev/null)" = "$sum" ] && continue
  rm -rf /tmp/src_$n /tmp/b_$n
  mkdir -p /tmp/src_$n /tmp/b_$n && tar -xzf scratch/$n.tgz -C /tmp/src_$n
  if [ -f scratch/$n.so ]; then
    cp scratch/$n.so /tmp/b_$n/libmegamoe.so && echo "$sum" > /tmp/b_$n/source.md5 && continue
  fi
  (PYTHONPATH=/tmp/megamoe-site cmake -S /tmp/src_$n -B /tmp/b_$n -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_BUILD_TESTS=OFF >/dev/null &&
   cmake --build /tmp/b_$n -j 8 --target megamoe 2>&1 | grep -E "rror"
   [ -f /tmp/b_$n/libmegamoe.so ] && echo "$sum" > /tmp/b_$n/source.md5) &
done
wait
