// Block-FP8 main loop of one math warpgroup: rows [64 wg, 64 wg + 64) x BLOCK_N columns of the tile.
//
// Per 128-deep k-block: 4 wgmma m64n128k32 (e4m3 x e4m3 -> fp32) into a fresh fragment, then
//   acc[row, col] += part[row, col] * a_scale[row, kb] * b_scale[kb]
// (fp32, in k-block order). A's scales come with the stage (config_fp8.cuh); B's one scale per
// k-block of each 128-column block is read from global memory when the k-block is issued.
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>

#include <type_traits>

#include "kernels/grouped_gemm/config_fp8.cuh"
#include "kernels/grouped_gemm/mainloop.cuh"

namespace megamoe::grouped_gemm {

using Fp8Wgmma = gmma::MMA_64x128x32_F32E4M3E4M3_SS_TN<>;
using Fp8Layout = OperandLayout<Major::K>;

// The 4 wgmma m64n128k32 of a 128-deep k-block into a fresh fragment; desc_b: the 128 B rows.
template <int N>
__device__ __forceinline__ void issue_fp8_k_block(float (&part)[N], uint64_t desc_a, uint64_t desc_b) {
  issue_k_block<Fp8Wgmma, kFp8BlockK / 32, Fp8Layout, Fp8Layout>(part, desc_a, desc_b, false);
}

// acc[offset + i] (=, or += with Accumulate) part[i] scaled by its row's scale (scale_lo for the
// fragment's first row, scale_hi for row + 8).
template <bool Accumulate, int M, int N>
__device__ __forceinline__ void add_scaled(float (&acc)[M], int offset, const float (&part)[N], float scale_lo,
                                           float scale_hi) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float scaled = part[i] * ((i % 4) < 2 ? scale_lo : scale_hi);
    if constexpr (Accumulate) {
      acc[offset + i] += scaled;
    } else {
      acc[offset + i] = scaled;
    }
  }
}

// BLOCK_N 128: two fragments alternate, k-block kb + 1's wgmmas in flight while kb's are scaled and
// added, so the warpgroup's tensor work does not pause for the scaling.
template <class Cfg, class Smem, class UnderFirstBatch>
__device__ void mma_tile_fp8_alternating(float (&acc)[Cfg::kAccumulators], const Smem& smem,
                                         PipelineState<Cfg::kStages>& state, int k_blocks, int warpgroup,
                                         const float* b_scales, UnderFirstBatch&& under_first_batch) {
  constexpr int N = Cfg::kAccumulators;
  const bool signals = threadIdx.x % 32 == 0;
  const uint32_t a_offset = Fp8Layout::mn_offset(warpgroup * kWarpgroupRows);
  const int row = fragment_row(warpgroup);
  PipelineState<Cfg::kStages> done = state;  // the oldest k-block in flight
  // Waits for the next k-block's stage and issues its wgmmas into part; returns its B scale.
  const auto issue = [&](float (&part)[N], int kb) {
    const float b_scale = __ldg(b_scales + kb);
    Barrier::wait(smem.full(state.stage), state.phase);
    issue_fp8_k_block(part, Fp8Layout::descriptor(smem.a(state.stage) + a_offset),
                      Fp8Layout::descriptor(smem.b(state.stage)));
    state.advance();
    return b_scale;
  };
  // The oldest k-block's wgmmas have completed: scale part into acc and release its stage.
  const auto retire = [&](float (&part)[N], float b_scale) {
    fence_accumulators(part);
    const float* a_scales = smem.a_scales(done.stage);
    const float scale_lo = a_scales[row] * b_scale, scale_hi = a_scales[row + 8] * b_scale;
    __syncwarp();  // every lane has read its scales before the warp releases the stage
    if (signals) Barrier::arrive(smem.empty(done.stage));
    done.advance();
    add_scaled<true>(acc, 0, part, scale_lo, scale_hi);
  };
  float part0[N], part1[N];
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i] = 0.f;
  float scale0 = issue(part0, 0), scale1;
  under_first_batch();
  // part0 holds k-block kb in flight at the top of each pass; the waits are static, so ptxas can
  // see that each retire reads a completed fragment.
  int kb = 0;
  for (; kb + 2 < k_blocks; kb += 2) {
    scale1 = issue(part1, kb + 1);
    cute::warpgroup_wait<1>();
    retire(part0, scale0);
    scale0 = issue(part0, kb + 2);
    cute::warpgroup_wait<1>();
    retire(part1, scale1);
  }
  if (kb + 1 < k_blocks) {
    scale1 = issue(part1, kb + 1);
    cute::warpgroup_wait<1>();
    retire(part0, scale0);
    cute::warpgroup_wait<0>();
    retire(part1, scale1);
  } else {
    cute::warpgroup_wait<0>();
    retire(part0, scale0);
  }
}

// BLOCK_N 256: the sum holds 128 registers, so each k-block runs as two halves of 4 wgmma
// m64n128k32 into one fragment (B rows [0, 128) then [128, 256) of the stage), each scaled and added
// to its 64 registers of the sum before the next half is issued. The tile stages half as many A
// bytes per FLOP as at BLOCK_N 128 (shared memory and L2), for a wait per half.
template <class Cfg, class Smem, class UnderFirstBatch>
__device__ void mma_tile_fp8_halves(float (&acc)[Cfg::kAccumulators], const Smem& smem,
                                    PipelineState<Cfg::kStages>& state, int k_blocks, int warpgroup,
                                    const float* b_scales, int second_half, UnderFirstBatch&& under_first_batch) {
  constexpr int N = Cfg::kAccumulators / 2;
  constexpr uint32_t kHalfBBytes = 128 * kFp8BlockK;
  const bool signals = threadIdx.x % 32 == 0;
  const uint32_t a_offset = Fp8Layout::mn_offset(warpgroup * kWarpgroupRows);
  const int row = fragment_row(warpgroup);
  float part[N];
  // The first k-block sets the sum instead of adding to it, so the sum's registers are not live
  // while the previous tile's deferred store (under_first_batch) still holds its packed values.
  const auto k_block = [&](int kb, auto first) {
    const float b_scale[2] = {__ldg(b_scales + kb), __ldg(b_scales + second_half + kb)};
    Barrier::wait(smem.full(state.stage), state.phase);
    const float* a_scales = smem.a_scales(state.stage);
    const float a_lo = a_scales[row], a_hi = a_scales[row + 8];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      issue_fp8_k_block(part, Fp8Layout::descriptor(smem.a(state.stage) + a_offset),
                        Fp8Layout::descriptor(smem.b(state.stage) + half * kHalfBBytes));
      if constexpr (decltype(first)::value) {
        if (half == 0) under_first_batch();
      }
      cute::warpgroup_wait<0>();
      fence_accumulators(part);
      if (half == 1) {
        __syncwarp();  // every lane has read its scales before the warp releases the stage
        if (signals) Barrier::arrive(smem.empty(state.stage));
      }
      add_scaled<!decltype(first)::value>(acc, half * N, part, a_lo * b_scale[half], a_hi * b_scale[half]);
    }
    state.advance();
  };
  k_block(0, std::true_type{});
  for (int kb = 1; kb < k_blocks; ++kb) k_block(kb, std::false_type{});
}

// b_scales: this tile's first 128-column block's scales, one per k-block; second_half: how far
// on those of its second 128-column half start (BLOCK_N 256).
template <class Cfg, class Smem, class UnderFirstBatch>
__device__ __forceinline__ void mma_tile_fp8(float (&acc)[Cfg::kAccumulators], const Smem& smem,
                                             PipelineState<Cfg::kStages>& state, int k_blocks, int warpgroup,
                                             const float* b_scales, int second_half,
                                             UnderFirstBatch&& under_first_batch) {
  if constexpr (Cfg::kBlockN == 128) {
    mma_tile_fp8_alternating<Cfg>(acc, smem, state, k_blocks, warpgroup, b_scales, under_first_batch);
  } else {
    mma_tile_fp8_halves<Cfg>(acc, smem, state, k_blocks, warpgroup, b_scales, second_half, under_first_batch);
  }
}

}  // namespace megamoe::grouped_gemm
