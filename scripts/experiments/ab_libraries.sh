# A/B of library versions on a GPU machine. Each scratch/<name>.tgz (from
# `git archive <rev> CMakeLists.txt cmake csrc python | gzip > scratch/<name>.tgz`) is built into
# /tmp/b_<name> by build_libraries.sh (kept for later calls) and benchmarked with its own Python
# package, in the order given, twice (ABAB), so drift shows. Results go to $MEGAMOE_OUT/<name>-<round>
# (default runs/ab); MEGAMOE_WHEELS is a folder of wheels to install offline (build_libraries.sh).
#   bash scripts/experiments/ab_libraries.sh <name>[:<args>] ... [-- <megamoe.bench args>]
# A name may be followed by arguments of its own after a colon, commas for spaces, added to that run's (e.g.
# `main:--backends,fused-recompute-gather` beside `main`: one library timed with two options; with
# AB_MODULE=time_moe, `main:--recompute,gather`).
# AB_MODULE=megamoe.bench.profile compares kernel by kernel instead (args: that module's, e.g.
# -- --preset qwen3-30b-a3b --mode fwdbwd --iterations 10); it prints each profile's head.
# AB_MODULE=time_moe times each revision's megamoe.moe with this tree's timing (time_moe.py; args:
# its --preset / --tokens and the timing options), for revisions whose own benchmark predates the sustained defaults.
set -u
module=${AB_MODULE:-megamoe.bench}
out=${MEGAMOE_OUT:-runs/ab}
names=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do names+=("$1"); shift; done; [ $# -gt 0 ] && shift
default_args="--preset qwen3-30b-a3b qwen3-235b-a22b --tokens 16384 --backends fused --modes fwd fwdbwd"
[ "$module" = megamoe.bench ] || default_args=""
bench_args=${*:-$default_args}
libraries=(); for n in "${names[@]}"; do libraries+=("${n%%:*}"); done
bash "$(dirname "$0")/build_libraries.sh" $(printf '%s\n' "${libraries[@]}" | sort -u)
for round in 1 2; do
  for name in "${names[@]}"; do
    n=${name%%:*}; own_args=""; [ "$name" != "$n" ] && own_args=$(echo "${name#*:}" | tr , ' ')
    label=$(echo "$name" | tr -c 'A-Za-z0-9_.\n-' _)
    echo "== $name (round $round)"
    case "$module" in
      time_moe) runner=(python3 "$(dirname "$0")/time_moe.py" --label "$label") ;;
      *) runner=(python3 -m "$module") ;;
    esac
    MEGAMOE_LIBRARY=/tmp/b_$n/libmegamoe.so PYTHONPATH=/tmp/megamoe-site:/tmp/src_$n/python MEGAMOE_COMMIT=$n \
      timeout 200 "${runner[@]}" $bench_args $own_args --out "$out/$label-$round" 2>&1 |
      case "$module" in
        megamoe.bench) grep -E "│|Error|error:|Traceback" ;;
        time_moe) grep -E "^{|Error|error:|Traceback" ;;
        *) head -12 ;;
      esac
  done
done
