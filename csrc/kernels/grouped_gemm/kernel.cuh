// Persistent, warp-specialised grouped GEMM over a routing plan's expert-major pool (sm_90a), BF16
// or block FP8 (the epilogue's Cfg: config.cuh, config_fp8.cuh), templated on its epilogue policy
// (epilogue.cuh: plain store, epilogue_gated.cuh, epilogue_scatter.cuh,
// epilogue_gated_backward.cuh, epilogue_weight_grad.cuh) and its scheduler policy (scheduler.cuh:
// pool blocks x n-tiles; scheduler_expert.cuh: K-grouped weight gradients).
//
// One CTA per SM, 384 threads:
//   warpgroup 0  producer: one thread issues the TMA loads of every tile's A and B k-blocks into a
//                multi-stage ring (or, gathered_rows.cuh, all 128 threads copy one operand's rows
//                from token rows beside the other's TMA); the warpgroup gives most of its
//                registers back (setmaxnreg).
//   warpgroups 1-2  math: each owns 64 rows of the 128 x BLOCK_N tile, issues wgmma from shared
//                memory, then runs the epilogue on its rows while the producer is already filling
//                the ring with the next tile.
// See config.cuh (tile shape and shared memory), pipeline.cuh (barriers), scheduler.cuh (tile
// order), operand.cuh (operand layouts), mainloop.cuh (TMA + wgmma), mainloop_fp8.cuh (block FP8).
#pragma once

#include <cuda.h>

#include <cstdint>

#include <cutlass/arch/reg_reconfig.h>

#include "kernels/grouped_gemm/config.cuh"
#include "kernels/grouped_gemm/gathered_rows.cuh"
#include "kernels/grouped_gemm/mainloop.cuh"
#include "kernels/grouped_gemm/mainloop_fp8.cuh"
#include "kernels/grouped_gemm/pipeline.cuh"
#include "kernels/grouped_gemm/scheduler.cuh"
#include "kernels/grouped_gemm/scheduler_expert.cuh"

// Without the sm_90a feature set the CuTe wrappers compile to traps and setmaxnreg to nothing;
// fail the build instead of shipping a kernel that cannot run.
#if defined(__CUDA_ARCH__) && \
    !(defined(CUTE_ARCH_MMA_SM90A_ENABLED) && defined(CUTE_ARCH_TMA_SM90_ENABLED) && \
      defined(CUTE_ARCH_STSM_SM90_ENABLED) && defined(CUDA_CTA_RECONFIG_ACTIVATED))
#error "megamoe grouped GEMM needs sm_90a (wgmma, TMA, stmatrix, setmaxnreg)"
#endif

namespace megamoe::grouped_gemm {

// One math warpgroup's main loop of a tile: bf16 (mainloop.cuh) or block FP8 (mainloop_fp8.cuh,
// with the tile's B scales, which the scheduler finds: fp8_b_scales).
template <class Cfg, class Sched, class Smem, class Tile, class UnderFirstBatch>
__device__ __forceinline__ void main_loop(float (&acc)[Cfg::kAccumulators], const Smem& smem,
                                          PipelineState<Cfg::kStages>& state, const Sched& sched, const Tile& tile,
                                          int warpgroup, const typename Cfg::MainloopParams& mainloop,
                                          UnderFirstBatch&& under_first_batch) {
  if constexpr (Cfg::kFp8) {
    const Fp8TileScales b_scales = sched.template fp8_b_scales<Cfg>(tile, mainloop);
    mma_tile_fp8<Cfg>(acc, smem, state, tile.k_blocks, warpgroup, b_scales.first, b_scales.second_half,
                      under_first_batch);
  } else {
    mma_tile<Cfg>(acc, smem, state, tile.k_blocks, warpgroup, under_first_batch);
  }
}

template <class Epi, class Sched>
__global__ void __launch_bounds__(kThreads, 1)
grouped_gemm_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,
                    const __grid_constant__ typename Epi::Cfg::MainloopParams mainloop,
                    const __grid_constant__ typename Epi::Params epi,
                    const __grid_constant__ typename Sched::Params sched_params) {
  using Cfg = typename Epi::Cfg;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const SharedStorage<Cfg> smem(smem_raw);
  const int warpgroup = int(threadIdx.x / 128);

  if (threadIdx.x == 0) {
    if (cute::cast_smem_ptr_to_uint(smem_raw) % 1024 != 0) __trap();  // the swizzled tiles would misplace rows
    if constexpr (Cfg::kGathered != Gathered::kA) cute::prefetch_tma_descriptor(&tma_a);
    if constexpr (Cfg::kGathered != Gathered::kB) cute::prefetch_tma_descriptor(&tma_b);
    if constexpr (Cfg::kFp8) cute::prefetch_tma_descriptor(&mainloop.a_scales);
    Epi::prefetch(epi);
    init_pipeline_barriers<SharedStorage<Cfg>, Cfg::kStages>(smem, full_arrivals<Cfg>(), kMathWarps);
  }
  __syncthreads();

  // Each warpgroup builds its own scheduler from sched_params: nothing stays live across the register
  // split (a value that did spilled in the math warpgroups).
  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if constexpr (Cfg::kGathered != Gathered::kNone) {
      produce_gathered_operands<Cfg, Epi>(&tma_a, &tma_b, mainloop, epi, smem, Sched(sched_params));
    } else if (threadIdx.x == 0) {
      produce_operands<Cfg, Epi>(&tma_a, &tma_b, mainloop, epi, smem, Sched(sched_params));
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<Cfg::kMathRegs>();
  const int math_wg = warpgroup - 1;
  PipelineState<Cfg::kStages> state;
  float acc[Cfg::kAccumulators];
  if constexpr (Deferred<Epi>::value) {
    // The tile's result waits in registers (bf16) and is stored under the next tile's first batch.
    typename Epi::Pending pending;
    bool has_pending = false;
    const auto store_pending = [&] {
      if (has_pending) Epi::store(pending, epi, smem, math_wg);
    };
    for (Sched tiles(sched_params); tiles.valid(); tiles.advance()) {
      const auto tile = tiles.tile();
      const auto rows = Epi::prepare(epi, tile, math_wg);
      if (!Sched::kMayBeEmpty || tile.k_blocks > 0) {
        main_loop<Cfg>(acc, smem, state, tiles, tile, math_wg, mainloop, store_pending);
        pending = Epi::retire(acc, epi, smem, math_wg, tile, rows);
      } else {
        // No main loop to hide the store under, and the tile's result is zeros: retired from a zero
        // fragment rather than acc, so acc is not live from one tile to the next (which leaves the
        // FP8 main loop room for the pending tile beside its fragment).
        store_pending();
        const float zeros[Cfg::kAccumulators] = {};
        pending = Epi::retire(zeros, epi, smem, math_wg, tile, rows);
      }
      has_pending = true;
    }
    store_pending();
  } else {
    const auto store = [&](const float(&values)[Cfg::kAccumulators], const auto& tile, const auto& rows) {
      if constexpr (RingChunks<Epi>::value > 0) {
        Epi::store(values, epi, smem, math_wg, tile, rows, state);  // reads its stages from the ring
      } else {
        Epi::store(values, epi, smem, math_wg, tile, rows);
      }
    };
    for (Sched tiles(sched_params); tiles.valid(); tiles.advance()) {
      const auto tile = tiles.tile();
      const auto rows = Epi::prepare(epi, tile, math_wg);  // loads in flight during the main loop
      if (!Sched::kMayBeEmpty || tile.k_blocks > 0) {
        main_loop<Cfg>(acc, smem, state, tiles, tile, math_wg, mainloop, [] {});
        store(acc, tile, rows);
      } else {  // K-grouped, an expert without rows: its tile is zeros (as in the deferred path)
        const float zeros[Cfg::kAccumulators] = {};
        store(zeros, tile, rows);
      }
    }
  }
  Epi::drain();
}

}  // namespace megamoe::grouped_gemm
