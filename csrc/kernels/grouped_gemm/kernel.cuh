// Persistent, warp-specialised BF16 grouped GEMM over a routing plan's expert-major pool (sm_90a),
// templated on its epilogue policy (epilogue.cuh: plain store, epilogue_swiglu.cuh, epilogue_scatter.cuh).
//
// One CTA per SM, 384 threads:
//   warpgroup 0  producer: one thread issues the TMA loads of every tile's A and B k-blocks into a
//                multi-stage ring; the warpgroup gives most of its registers back (setmaxnreg).
//   warpgroups 1-2  math: each owns 64 rows of the 128 x BLOCK_N tile, issues wgmma from shared
//                memory, then runs the epilogue on its rows while the producer is already filling
//                the ring with the next tile.
// See config.cuh (tile shape and shared memory), pipeline.cuh (barriers), scheduler.cuh (tile
// order), mainloop.cuh (TMA + wgmma).
#pragma once

#include <cuda.h>

#include <cstdint>

#include <cutlass/arch/reg_reconfig.h>

#include "kernels/grouped_gemm/config.cuh"
#include "kernels/grouped_gemm/mainloop.cuh"
#include "kernels/grouped_gemm/pipeline.cuh"
#include "kernels/grouped_gemm/scheduler.cuh"

// Without the sm_90a feature set the CuTe wrappers compile to traps and setmaxnreg to nothing;
// fail the build instead of shipping a kernel that cannot run.
#if defined(__CUDA_ARCH__) && \
    !(defined(CUTE_ARCH_MMA_SM90A_ENABLED) && defined(CUTE_ARCH_TMA_SM90_ENABLED) && \
      defined(CUTE_ARCH_STSM_SM90_ENABLED) && defined(CUDA_CTA_RECONFIG_ACTIVATED))
#error "megamoe grouped GEMM needs sm_90a (wgmma, TMA, stmatrix, setmaxnreg)"
#endif

namespace megamoe::grouped_gemm {

// n_tiles: tiles per pool block; b_rows: where each tile's B boxes are (mainloop.cuh).
template <class Epi>
__global__ void __launch_bounds__(kThreads, 1)
grouped_gemm_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,
                    const __grid_constant__ typename Epi::Params epi, const int32_t* __restrict__ block_expert,
                    const int32_t* __restrict__ num_blocks, int max_blocks, int n_tiles, BRows b_rows, int k) {
  using Cfg = typename Epi::Cfg;
  extern __shared__ uint8_t smem_raw[];
  const SharedStorage<Cfg> smem(smem_raw);
  const int warpgroup = int(threadIdx.x / 128);

  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(&tma_a);
    cute::prefetch_tma_descriptor(&tma_b);
    Epi::prefetch(epi);
    init_pipeline_barriers<SharedStorage<Cfg>, Cfg::kStages>(smem, kMathWarps);
  }
  __syncthreads();

  const TileScheduler sched(num_blocks, max_blocks, n_tiles);
  const int k_blocks = k / kBlockK;

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    if (threadIdx.x == 0) produce_operands<Cfg>(&tma_a, &tma_b, smem, sched, block_expert, b_rows, k_blocks);
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<kMathRegisters>();
  const int math_wg = warpgroup - 1;
  PipelineState<Cfg::kStages> state;
  float acc[Cfg::kAccumulators];
  for (TileScheduler tiles = sched; tiles.valid(); tiles.advance()) {
    const auto rows = Epi::prepare(epi, tiles.block(), math_wg);  // loads in flight during the main loop
    mma_tile<Cfg>(acc, smem, state, k_blocks, math_wg);
    Epi::store(acc, epi, smem, math_wg, tiles.block(), tiles.n_tile(), rows);
  }
  Epi::drain();
}

}  // namespace megamoe::grouped_gemm
