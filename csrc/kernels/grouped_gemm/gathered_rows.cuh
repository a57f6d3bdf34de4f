// Pool GEMMs (bf16) one of whose operands is gathered from token rows instead of read from a
// dispatched pool: pool row r holds token row slot_to_route[r] / top_k of `rows` [T, row_elems], or
// zeros for a padding row. Used where experts get few rows (small batches): the token rows stay in L2
// while the weights stream past, where a pool is K-fold larger, mostly padding, written by a dispatch
// and read back from DRAM.
//   Gathered::kA  GEMM1: A [pool rows, K] K-major, a stage's 128 pool rows x 64 columns of K;
//   Gathered::kB  dW13 = dzᵀ·x: B [pool rows, N] MN-major, a stage's 64 pool rows (its k-block) x
//                 BLOCK_N columns of N, in BLOCK_N / 64 boxes.
//
// The whole producer warpgroup loads: thread 0 arms each stage's full barrier with the other
// operand's bytes and issues its TMA boxes (as mainloop.cuh's produce_operands does); every thread
// then copies 16-byte chunks of the gathered rows by cp.async into the same 128B-swizzled tile TMA
// would write (operand.cuh: a tile row's 16-byte chunk c lands at chunk c ^ (row % 8)), and the stage
// completes when the copies of all 128 threads have landed (cp.async.mbarrier.arrive.noinc: the full
// barrier counts 1 + 128 arrivals).
#pragma once

#include <cuda.h>

#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include <cstdint>
#include <string>

#include "common/status.h"
#include "kernels/grouped_gemm/config.cuh"
#include "kernels/grouped_gemm/operand.cuh"
#include "kernels/grouped_gemm/pipeline.cuh"
#include "kernels/grouped_gemm/scheduler.cuh"

namespace megamoe::grouped_gemm {

constexpr int kGatherThreads = 128;                              // the producer warpgroup
constexpr int kChunksPerRow = kSwizzleBytes / 16;                // 16-byte chunks of a 128-byte tile row: 8
constexpr int kGatherRowStep = kGatherThreads / kChunksPerRow;  // tile rows one pass of the warpgroup covers: 16

// The bf16 Config (Base) with one operand gathered (kernel.cuh picks the producer by kGathered).
template <class Base, Gathered Which>
struct GatheredConfig : Base {
  static_assert(!Base::kFp8, "gathered rows are bf16");
  static constexpr Gathered kGathered = Which;
  // Each producer thread holds its rows' token indices beside the tile's coordinates.
  static constexpr int kProducerRegs = 56;
  static constexpr int kMathRegs = 224;
  static_assert(128 * kProducerRegs + 256 * kMathRegs <= kThreads * 168, "setmaxnreg.inc would wait forever");
  struct MainloopParams {
    const uint16_t* rows;          // [T, row_elems] bf16 token rows
    const int32_t* slot_to_route;  // the plan's: route of each pool row, -1 for padding rows
    int32_t top_k;
    int32_t row_elems;  // a multiple of 8: a 16-byte chunk is all inside a row or all past it
  };
  // Host side: the parameters for token rows [T, row_elems] gathered through the plan's
  // slot_to_route; `flag` names the argument that asked for them.
  static int token_rows(const std::string& fn, const char* flag, const megamoe_routing_plan& plan, const void* rows,
                        int32_t row_elems, MainloopParams* params) {
    if (plan.slot_to_route == nullptr) {
      return invalid_argument(fn + flag + " needs the plan's slot_to_route (device pointer)");
    }
    *params = {static_cast<const uint16_t*>(rows), plan.slot_to_route, plan.shape.top_k, row_elems};
    return MEGAMOE_OK;
  }
};
template <int BlockN, int BBoxes>
using GatheredAConfig = GatheredConfig<Config<BlockN, BBoxes>, Gathered::kA>;
template <int BlockN>
using GatheredBConfig = GatheredConfig<Config<BlockN, 1, Major::MN, Major::MN>, Gathered::kB>;

// Arrivals that complete a stage's full barrier: the TMA thread's arrive_and_expect_tx, and with an
// operand gathered each producer thread's cp.async arrival.
template <class Cfg>
constexpr int full_arrivals() {
  return Cfg::kGathered == Gathered::kNone ? 1 : 1 + kGatherThreads;
}

// 16 bytes from global to shared memory, or 16 zero bytes when !real (src is then not read).
__device__ __forceinline__ void copy_chunk_or_zeros(uint32_t dst, const void* src, bool real) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(real ? 16 : 0));
}

// The token row of pool row `slot`, -1 for a padding row.
template <class Params>
__device__ __forceinline__ int32_t token_of(const Params& m, int slot) {
  const int32_t route = m.slot_to_route[slot];
  return route < 0 ? -1 : route / m.top_k;
}

// Copies RowsPerThread tile rows of 128 bytes, this thread's chunk of each: tile row first_row + 16 i
// from token row token[i], element col onwards (zeros past row_elems or for a padding row).
template <int RowsPerThread, class Params>
__device__ __forceinline__ void copy_rows(uint32_t tile, const int32_t (&token)[RowsPerThread], const Params& m,
                                          int first_row, int col) {
  const int chunk = int(threadIdx.x) % kChunksPerRow;
  // r % 8 is the same for all of this thread's rows (16 i is a multiple of 8).
  const uint32_t dst = tile + uint32_t(first_row) * kSwizzleBytes + uint32_t((chunk ^ (first_row % 8)) * 16);
#pragma unroll
  for (int i = 0; i < RowsPerThread; ++i) {
    const bool real = token[i] >= 0 && col < m.row_elems;
    copy_chunk_or_zeros(dst + uint32_t(i * kGatherRowStep * kSwizzleBytes),
                        real ? m.rows + int64_t(token[i]) * m.row_elems + col : m.rows, real);
  }
}

// Every producer thread runs this: the TMA operand from thread 0, the gathered one from all.
template <class Cfg, class Sched, class Smem>
__device__ void produce_gathered_operands(const CUtensorMap* tma_a, const CUtensorMap* tma_b,
                                          const typename Cfg::MainloopParams& m, const Smem& smem, Sched sched) {
  using LA = OperandLayout<Cfg::kAMajor>;
  using LB = OperandLayout<Cfg::kBMajor>;
  const int thread = int(threadIdx.x);
  const int chunk = thread % kChunksPerRow;
  const int first_row = thread / kChunksPerRow;
  PipelineState<Cfg::kStages> state;
  for (; sched.valid(); sched.advance()) {
    const auto tile = sched.tile();
    const TileOrigin o = sched.template origin<Cfg>(tile);
    if constexpr (Cfg::kGathered == Gathered::kA) {
      // The tile's 128 pool rows are its M: the same rows in every k-block.
      static_assert(Cfg::kAMajor == Major::K);
      constexpr int kRows = kBlockM / kGatherRowStep;  // 8
      int32_t token[kRows];
#pragma unroll
      for (int i = 0; i < kRows; ++i) token[i] = token_of(m, o.a_mn + first_row + i * kGatherRowStep);
      for (int kb = 0; kb < tile.k_blocks; ++kb) {
        Barrier::wait(smem.empty(state.stage), state.phase ^ 1u);
        uint64_t* full = smem.full(state.stage);
        if (thread == 0) {
          Barrier::arrive_and_expect_tx(full, Cfg::kBBytes);
          LB::template load<Cfg::kBlockN, Cfg::kBBoxes>(tma_b, full, smem.b(state.stage), o.b_mn,
                                                        o.b_k + kb * Cfg::kKBlock, o.b_box_stride);
        }
        copy_rows(cute::cast_smem_ptr_to_uint(smem.a(state.stage)), token, m, first_row,
                  o.a_k + kb * Cfg::kKBlock + chunk * 8);
        cutlass::arch::cpasync_barrier_arrive_noinc(full);
        state.advance();
      }
    } else {
      // Each k-block's 64 pool rows are its K, and the tile's BLOCK_N columns are 64-column boxes.
      static_assert(Cfg::kBMajor == Major::MN);
      constexpr int kRows = kBlockK / kGatherRowStep;  // 4
      for (int kb = 0; kb < tile.k_blocks; ++kb) {
        const int first_slot = o.b_k + kb * Cfg::kKBlock + first_row;
        int32_t token[kRows];
#pragma unroll
        for (int i = 0; i < kRows; ++i) token[i] = token_of(m, first_slot + i * kGatherRowStep);
        Barrier::wait(smem.empty(state.stage), state.phase ^ 1u);
        uint64_t* full = smem.full(state.stage);
        if (thread == 0) {
          Barrier::arrive_and_expect_tx(full, Cfg::kABytes);
          LA::template load<kBlockM, 1>(tma_a, full, smem.a(state.stage), o.a_mn, o.a_k + kb * Cfg::kKBlock, 0);
        }
        const uint32_t b_tile = cute::cast_smem_ptr_to_uint(smem.b(state.stage));
#pragma unroll
        for (int box = 0; box < Cfg::kBlockN / kMnBoxCols; ++box) {
          copy_rows(b_tile + uint32_t(box * kMnBoxBytes), token, m, first_row, o.b_mn + box * kMnBoxCols + chunk * 8);
        }
        cutlass::arch::cpasync_barrier_arrive_noinc(full);
        state.advance();
      }
    }
  }
  cute::cp_async_wait<0>();  // no copy outlives its thread
}

}  // namespace megamoe::grouped_gemm
