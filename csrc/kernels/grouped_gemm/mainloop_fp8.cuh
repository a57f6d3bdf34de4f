// Block-FP8 main loop of one math warpgroup: rows [64 wg, 64 wg + 64) x 128 columns of the tile.
//
// Per 128-deep k-block: 4 wgmma m64n128k32 (e4m3 x e4m3 -> fp32) into a fresh fragment, then
//   acc[row, col] += part[row, col] * a_scale[row, kb] * b_scale[kb]
// (fp32, in k-block order). A's scales come with the stage (config_fp8.cuh); B's one scale per
// k-block of this 128-column block is read from global memory before the stage's wait. The
// warpgroup waits for its own batch before scaling it, so its tensor work pauses for the scaling;
// the other math warpgroup's wgmmas fill that gap.
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>

#include "kernels/grouped_gemm/config_fp8.cuh"
#include "kernels/grouped_gemm/mainloop.cuh"

namespace megamoe::grouped_gemm {

template <class Cfg, class Smem, class UnderFirstBatch>
__device__ void mma_tile_fp8(float (&acc)[Cfg::kAccumulators], const Smem& smem, PipelineState<Cfg::kStages>& state,
                             int k_blocks, int warpgroup, const float* b_scales, UnderFirstBatch&& under_first_batch) {
  using L = OperandLayout<Major::K>;
  using Op = gmma::MMA_64x128x32_F32E4M3E4M3_SS_TN<>;
  const bool signals = threadIdx.x % 32 == 0;
  const uint32_t a_offset = L::mn_offset(warpgroup * kWarpgroupRows);
  // The fragment's rows of this thread: row and row + 8 (epilogue.cuh has the layout).
  const int row = warpgroup * kWarpgroupRows + ((threadIdx.x / 32) % 4) * kWarpRows + (threadIdx.x % 32) / 4;
  float part[Cfg::kAccumulators];
#pragma unroll
  for (int i = 0; i < Cfg::kAccumulators; ++i) acc[i] = 0.f;
  for (int kb = 0; kb < k_blocks; ++kb) {
    const float b_scale = __ldg(b_scales + kb);
    Barrier::wait(smem.full(state.stage), state.phase);
    const uint64_t desc_a = L::descriptor(smem.a(state.stage) + a_offset);
    const uint64_t desc_b = L::descriptor(smem.b(state.stage));
    fence_accumulators(part);
    cute::warpgroup_arrive();
#pragma unroll
    for (int k = 0; k < Cfg::kKBlock / 32; ++k) {
      wgmma<Op>(advance_descriptor(desc_a, k * L::kKStepBytes), advance_descriptor(desc_b, k * L::kKStepBytes), part,
                k > 0 ? gmma::ScaleOut::One : gmma::ScaleOut::Zero);
    }
    cute::warpgroup_commit_batch();
    if (kb == 0) under_first_batch();
    cute::warpgroup_wait<0>();
    fence_accumulators(part);
    const float* a_scales = smem.a_scales(state.stage);
    const float scale_lo = a_scales[row] * b_scale, scale_hi = a_scales[row + 8] * b_scale;
    __syncwarp();  // every lane has read its scales before the warp releases the stage
    if (signals) Barrier::arrive(smem.empty(state.stage));
#pragma unroll
    for (int i = 0; i < Cfg::kAccumulators; ++i) acc[i] += part[i] * ((i % 4) < 2 ? scale_lo : scale_hi);
    state.advance();
  }
}

}  // namespace megamoe::grouped_gemm
