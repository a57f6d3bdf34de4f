# Nsight Compute's view of chosen kernels inside the fused layer's forward + backward, on a GPU
# machine: SM clock under load, SM / L2 / DRAM throughput, the tensor pipe's active cycles, warp stall
# reasons. Clocks are left as they are (--clock-control none): an H200 runs these GEMMs at 1.46-1.55 GHz
# (power limit).
#   bash scripts/experiments/ncu_kernels.sh <kernel name regex> <preset> [launches, default 2] [precision]
#        [tokens, default 16384]
#   e.g. ... WeightGrad qwen3-235b-a22b      (the two weight-gradient launches of the first iteration)
#        ... "WeightGrad|GatedBackward|GatedFp8" qwen3-30b-a3b 4 fp8
#        NCU_SOURCE=dh.csv ... GatedBackward qwen3-30b-a3b 1 fp8   (one kernel, line by line)
# The regex matches the demangled name (template arguments included: the epilogue policy names the GEMM).
# Uses the library of the build directory, or MEGAMOE_LIBRARY with the matching PYTHONPATH.
# With NCU_SOURCE=<file.csv> it samples the warps' states per instruction instead (SourceCounters, the
# CUDA source read from where the library was built), writes them per source line to that CSV and
# prints ncu_source_lines.py's summary of it: which lines the kernel's time goes to.
set -u
regex=$1 preset=$2 count=${3:-2} precision=${4:-bf16} tokens=${5:-16384}
bench=(python3 -m megamoe.bench --preset "$preset" --tokens "$tokens" --backends fused --precision "$precision"
       --modes fwdbwd --warmup 1 --repeat 3 --budget 0 --out /tmp/ncu_bench)
if [ -n "${NCU_SOURCE:-}" ]; then
  ncu --clock-control none --kernel-name-base demangled -k "regex:$regex" -c "$count" --section SourceCounters \
    --section SpeedOfLight --import-source yes -o /tmp/ncu_source -f "${bench[@]}"
  ncu -i /tmp/ncu_source.ncu-rep --page source --csv --print-source cuda,sass > "$NCU_SOURCE"
  python3 "$(dirname "$0")/ncu_source_lines.py" "$NCU_SOURCE"
  exit
fi
ncu --clock-control none --kernel-name-base demangled -k "regex:$regex" -c "$count" --section SpeedOfLight --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis \
  --metrics sm__cycles_elapsed.avg.per_second,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,smsp__inst_executed.sum,\
sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,\
"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
  "${bench[@]}"
