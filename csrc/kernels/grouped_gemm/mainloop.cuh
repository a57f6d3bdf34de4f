// Main loop: the TMA producer and the wgmma consumers of one 128 x BLOCK_N tile.
//
// Operand tiles are 128B-swizzled, K-major or MN-major (operand.cuh: TMA boxes, descriptors, the
// k-step); the wgmma op carries the majorness of each operand. The scheduler policy
// (scheduler.cuh, scheduler_expert.cuh) says which tiles, where their operands start and how many
// k-blocks (Cfg::kKBlock deep: 64 bf16, 128 e4m3) each has. The producer serves both precisions;
// mainloop_fp8.cuh has the block-FP8 consumer.
#pragma once

#include <cuda.h>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include <utility>

#include "kernels/grouped_gemm/config.cuh"
#include "kernels/grouped_gemm/epilogue.cuh"
#include "kernels/grouped_gemm/operand.cuh"
#include "kernels/grouped_gemm/pipeline.cuh"
#include "kernels/grouped_gemm/scheduler.cuh"

namespace megamoe::grouped_gemm {

template <int BlockN, gmma::Major A, gmma::Major B>
struct WgmmaOp;
template <gmma::Major A, gmma::Major B>
struct WgmmaOp<128, A, B> {
  using type = gmma::MMA_64x128x16_F32BF16BF16_SS<A, B>;
};
template <gmma::Major A, gmma::Major B>
struct WgmmaOp<256, A, B> {
  using type = gmma::MMA_64x256x16_F32BF16BF16_SS<A, B>;
};

// Descriptors hold the start address in 16-byte units in their low bits; shared addresses are
// below 2^18, so adding a byte offset / 16 never carries out of the 14-bit field.
__device__ inline uint64_t advance_descriptor(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

template <class Op, int N, size_t... I>
__device__ __forceinline__ void wgmma_impl(uint64_t desc_a, uint64_t desc_b, float (&acc)[N],
                                           gmma::ScaleOut scale_d, std::index_sequence<I...>) {
  Op::fma(desc_a, desc_b, acc[I]..., scale_d);
}

template <class Op, int N>
__device__ __forceinline__ void wgmma(uint64_t desc_a, uint64_t desc_b, float (&acc)[N],
                                      gmma::ScaleOut scale_d) {
  wgmma_impl<Op>(desc_a, desc_b, acc, scale_d, std::make_index_sequence<N>{});
}

template <int N>
__device__ __forceinline__ void fence_accumulators(float (&acc)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) cute::warpgroup_fence_operand(acc[i]);
}

// One k-block's wgmmas (Steps k steps) into acc, committed as one batch. The first k step overwrites
// acc unless `accumulate` (so a tile's first k-block needs no zeroing of the accumulators).
template <class Op, int Steps, class LA, class LB, int N>
__device__ __forceinline__ void issue_k_block(float (&acc)[N], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  fence_accumulators(acc);
  cute::warpgroup_arrive();
#pragma unroll
  for (int k = 0; k < Steps; ++k) {
    wgmma<Op>(advance_descriptor(desc_a, k * LA::kKStepBytes), advance_descriptor(desc_b, k * LB::kKStepBytes), acc,
              (accumulate || k > 0) ? gmma::ScaleOut::One : gmma::ScaleOut::Zero);
  }
  cute::warpgroup_commit_batch();
}

// One thread streams every tile's A and B k-blocks (block FP8: with A's scales) into the ring, then
// the stages its epilogue reads through the ring, if any (epilogue.cuh, RingChunks).
template <class Cfg, class Epi, class Sched, class Smem>
__device__ void produce_operands(const CUtensorMap* tma_a, const CUtensorMap* tma_b,
                                 const typename Cfg::MainloopParams& mainloop, const typename Epi::Params& epi,
                                 const Smem& smem, Sched sched) {
  using LA = OperandLayout<Cfg::kAMajor>;
  using LB = OperandLayout<Cfg::kBMajor>;
  PipelineState<Cfg::kStages> state;
  for (; sched.valid(); sched.advance()) {
    const auto tile = sched.tile();
    const TileOrigin o = sched.template origin<Cfg>(tile);
    for (int kb = 0; kb < tile.k_blocks; ++kb) {
      Barrier::wait(smem.empty(state.stage), state.phase ^ 1u);
      uint64_t* full = smem.full(state.stage);
      Barrier::arrive_and_expect_tx(full, Cfg::kStageBytes);  // A, every B box, A's scales
      LA::template load<kBlockM, 1>(tma_a, full, smem.a(state.stage), o.a_mn, o.a_k + kb * Cfg::kKBlock, 0);
      LB::template load<Cfg::kBlockN, Cfg::kBBoxes>(tma_b, full, smem.b(state.stage), o.b_mn,
                                                    o.b_k + kb * Cfg::kKBlock, o.b_box_stride);
      if constexpr (Cfg::kFp8) {
        cute::SM90_TMA_LOAD_2D::copy(&mainloop.a_scales, full, kTmaCacheHint, smem.a_scales(state.stage), o.a_mn,
                                     o.a_k / Cfg::kKBlock + kb);
      }
      state.advance();
    }
    if constexpr (RingChunks<Epi>::value > 0) Epi::load_ring(epi, tile, smem, state);
  }
}

// One math warpgroup's share of a tile (k_blocks >= 1): rows [64 wg, 64 wg + 64) x all BLOCK_N columns, fp32.
// The batch of 4 wgmmas for k-block kb stays in flight while we wait for kb - 1's batch, so the
// tensor cores never drain between k-blocks; kb - 1's stage is released as soon as it completes.
// under_first_batch() runs while the tile's first batch is in flight (it must not touch acc): the
// deferred epilogues store the previous tile there, under tensor-core work.
template <class Cfg, class Smem, class UnderFirstBatch>
__device__ void mma_tile(float (&acc)[Cfg::kAccumulators], const Smem& smem, PipelineState<Cfg::kStages>& state,
                         int k_blocks, int warpgroup, UnderFirstBatch&& under_first_batch) {
  using LA = OperandLayout<Cfg::kAMajor>;
  using LB = OperandLayout<Cfg::kBMajor>;
  using Op = typename WgmmaOp<Cfg::kBlockN, LA::kGmma, LB::kGmma>::type;
  const bool signals = threadIdx.x % 32 == 0;  // one empty-barrier arrive per warp
  const uint32_t a_offset = LA::mn_offset(warpgroup * kWarpgroupRows);
  int previous_stage = -1;
  for (int kb = 0; kb < k_blocks; ++kb) {
    Barrier::wait(smem.full(state.stage), state.phase);
    const uint64_t desc_a = LA::descriptor(smem.a(state.stage) + a_offset);
    const uint64_t desc_b = LB::descriptor(smem.b(state.stage));
    issue_k_block<Op, kBlockK / 16, LA, LB>(acc, desc_a, desc_b, kb > 0);
    if (kb == 0) under_first_batch();
    cute::warpgroup_wait<1>();
    fence_accumulators(acc);
    if (previous_stage >= 0 && signals) Barrier::arrive(smem.empty(previous_stage));
    previous_stage = state.stage;
    state.advance();
  }
  cute::warpgroup_wait<0>();
  fence_accumulators(acc);
  if (signals) Barrier::arrive(smem.empty(previous_stage));
}

}  // namespace megamoe::grouped_gemm
