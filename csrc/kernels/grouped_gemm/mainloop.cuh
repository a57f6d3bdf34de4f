// Main loop: the TMA producer and the wgmma consumers of one 128 x BLOCK_N tile.
//
// Shared-memory operand tiles are K-major with the 128-byte swizzle, as TMA's SWIZZLE_128B writes
// them: row r of a tile sits at r * 128 bytes, its 16-byte chunks permuted by r % 8. wgmma reads
// the same bytes through a descriptor with layout type SWIZZLE_128B, 8-row groups 1024 bytes apart
// (SBO), and a start address that advances 32 bytes per 16-deep K step inside the 128-byte row;
// the swizzle is applied to absolute address bits, which is why every tile is 1024-aligned.
#pragma once

#include <cuda.h>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include <utility>

#include "kernels/grouped_gemm/config.cuh"
#include "kernels/grouped_gemm/pipeline.cuh"
#include "kernels/grouped_gemm/scheduler.cuh"

namespace megamoe::grouped_gemm {

namespace gmma = cute::SM90::GMMA;

template <int BlockN>
struct WgmmaOp;
template <>
struct WgmmaOp<128> {
  using type = gmma::MMA_64x128x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>;
};
template <>
struct WgmmaOp<256> {
  using type = gmma::MMA_64x256x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>;
};

// Descriptor of a K-major, 128B-swizzled operand tile starting at `tile` (1024-aligned).
__device__ inline uint64_t swizzled_tile_descriptor(const void* tile) {
  cute::GmmaDescriptor desc;
  desc.bitfield.start_address_ = uint16_t(cute::cast_smem_ptr_to_uint(tile) >> 4);
  desc.bitfield.leading_byte_offset_ = 1;                   // unused by swizzled K-major layouts
  desc.bitfield.stride_byte_offset_ = (8 * kSwizzleBytes) >> 4;  // next group of 8 rows
  desc.bitfield.base_offset_ = 0;                           // tiles start on a 1024-byte boundary
  desc.bitfield.layout_type_ = uint8_t(gmma::LayoutType::B128);
  return desc.desc_;
}

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

// Where a tile's B rows are: B is addressed as one [E_local * rows_per_expert, K] matrix, so one
// descriptor serves all experts. Box i of n-tile t of expert e starts at row
// e * rows_per_expert + i * box_stride + t * kBBoxRows (box_stride is unused with one box).
struct BRows {
  int rows_per_expert;
  int box_stride;
};

// One thread streams every tile's A and B k-blocks into the ring. An expert id outside
// [0, E_local) would read out of bounds, which TMA fills with zeros.
template <class Cfg, class Smem>
__device__ void produce_operands(const CUtensorMap* tma_a, const CUtensorMap* tma_b, const Smem& smem,
                                 TileScheduler sched, const int32_t* __restrict__ block_expert, BRows b_rows,
                                 int k_blocks) {
  constexpr uint64_t kCacheHint = uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL);
  PipelineState<Cfg::kStages> state;
  for (; sched.valid(); sched.advance()) {
    const int block = sched.block();
    const int a_row = block * kBlockM;
    const int b_row = block_expert[block] * b_rows.rows_per_expert + sched.n_tile() * Cfg::kBBoxRows;
    for (int kb = 0; kb < k_blocks; ++kb) {
      Barrier::wait(smem.empty(state.stage), state.phase ^ 1u);
      uint64_t* full = smem.full(state.stage);
      Barrier::arrive_and_expect_tx(full, Cfg::kStageBytes);  // A and every B box
      cute::SM90_TMA_LOAD_2D::copy(tma_a, full, kCacheHint, smem.a(state.stage), kb * kBlockK, a_row);
#pragma unroll
      for (int box = 0; box < Cfg::kBBoxes; ++box) {
        cute::SM90_TMA_LOAD_2D::copy(tma_b, full, kCacheHint, smem.b(state.stage) + box * Cfg::kBBoxBytes,
                                     kb * kBlockK, b_row + box * b_rows.box_stride);
      }
      state.advance();
    }
  }
}

// One math warpgroup's share of a tile: rows [64 wg, 64 wg + 64) x all BLOCK_N columns, fp32.
// The batch of 4 wgmmas for k-block kb stays in flight while we wait for kb - 1's batch, so the
// tensor cores never drain between k-blocks; kb - 1's stage is released as soon as it completes.
template <class Cfg, class Smem>
__device__ void mma_tile(float (&acc)[Cfg::kAccumulators], const Smem& smem,
                         PipelineState<Cfg::kStages>& state, int k_blocks, int warpgroup) {
  using Op = typename WgmmaOp<Cfg::kBlockN>::type;
  const bool signals = threadIdx.x % 32 == 0;  // one empty-barrier arrive per warp
  const uint32_t a_offset = uint32_t(warpgroup * kWarpgroupRows * kSwizzleBytes);
  int previous_stage = -1;
  for (int kb = 0; kb < k_blocks; ++kb) {
    Barrier::wait(smem.full(state.stage), state.phase);
    const uint64_t desc_a = swizzled_tile_descriptor(smem.a(state.stage) + a_offset);
    const uint64_t desc_b = swizzled_tile_descriptor(smem.b(state.stage));
    fence_accumulators(acc);
    cute::warpgroup_arrive();
#pragma unroll
    for (int k = 0; k < kBlockK / 16; ++k) {
      // The first wgmma of a tile overwrites the accumulators instead of clearing them first.
      const auto scale_d = (kb > 0 || k > 0) ? gmma::ScaleOut::One : gmma::ScaleOut::Zero;
      wgmma<Op>(advance_descriptor(desc_a, k * 32), advance_descriptor(desc_b, k * 32), acc, scale_d);
    }
    cute::warpgroup_commit_batch();
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
