// Pool GEMMs (bf16) one of whose operands is gathered from token rows instead of read from a
// dispatched pool: pool row r holds token row slot_to_route[r] / top_k of `rows` [T, row_elems], or
// zeros for a padding row. Used where experts get few rows (small batches): the token rows stay in L2
// while the weights stream past, where a pool is K-fold larger, mostly padding, written by a dispatch
// and read back from DRAM. The gathered operand's major decides which pool rows a stage holds:
//   K-major  (GEMM1's A = x, dh's A = dy): a stage's 128 pool rows (the tile's M) x 64 columns of K,
//            the same rows in every k-block;
//   MN-major (the weight gradients: dW13's B = x, dW2's A = dy): a stage's 64 pool rows (its k-block)
//            x the tile's 128 or BLOCK_N columns of M or N, in 64-column boxes.
//
// The whole producer warpgroup loads: thread 0 arms each stage's full barrier with the other
// operand's bytes and issues its TMA boxes (as mainloop.cuh's produce_operands does); every thread
// then copies 16-byte chunks of the gathered rows by cp.async into the same 128B-swizzled tile TMA
// would write (operand.cuh: a tile row's 16-byte chunk c lands at chunk c ^ (row % 8)), and the stage
// completes when the copies of all 128 threads have landed (cp.async.mbarrier.arrive.noinc: the full
// barrier counts 1 + 128 arrivals). An epilogue's ring stages (dh's z chunks) are loaded by thread 0
// as produce_operands loads them, and every thread arrives on them once, so they count the same.
#pragma once

#include <cuda.h>

#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include <cstdint>
#include <string>

#include "common/status.h"
#include "kernels/grouped_gemm/config.cuh"
#include "kernels/grouped_gemm/epilogue.cuh"
#include "kernels/grouped_gemm/operand.cuh"
#include "kernels/grouped_gemm/pipeline.cuh"
#include "kernels/grouped_gemm/scheduler.cuh"

namespace megamoe::grouped_gemm {

constexpr int kGatherThreads = 128;                              // the producer warpgroup
constexpr int kChunksPerRow = kSwizzleBytes / 16;                // 16-byte chunks of a 128-byte tile row: 8
constexpr int kGatherRowStep = kGatherThreads / kChunksPerRow;  // tile rows one pass of the warpgroup covers: 16

// Host side: a C API's gather flag, 0 (`operand` is the pool) or 1 (it is the token rows).
inline int check_gather_flag(const std::string& fn, int32_t flag, const char* name, const char* operand) {
  if (flag == 0 || flag == 1) return MEGAMOE_OK;
  return invalid_argument(fn + name + " must be 0 (" + operand + " is the pool) or 1 (the token rows), got " +
                          std::to_string(flag));
}

// The bf16 Config (Base) with one operand gathered (kernel.cuh picks the producer by kGathered).
// ProducerRegs: each producer thread holds its rows' token indices beside the tile's coordinates
// (56; dh's producer, which also loads its epilogue's z chunks, 64); the math warpgroups get the rest.
template <class Base, Gathered Which, int ProducerRegs = 56>
struct GatheredConfig : Base {
  static_assert(!Base::kFp8, "gathered rows are bf16");
  static constexpr Gathered kGathered = Which;
  static constexpr int kProducerRegs = ProducerRegs;
  static constexpr int kMathRegs = (kThreads * 168 - 128 * ProducerRegs) / 256 / 8 * 8;
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
// GEMM1's (A = x, K-major, beside w13's K-major B).
template <int BlockN, int BBoxes>
using GatheredAConfig = GatheredConfig<Config<BlockN, BBoxes>, Gathered::kA>;
// The weight gradients' (both operands MN-major): dW2's A = dy, or dW13's B = x.
template <int BlockN, Gathered Which>
using GatheredWeightGradConfig = GatheredConfig<Config<BlockN, 1, Major::MN, Major::MN>, Which>;

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
template <class Cfg, class Epi, class Sched, class Smem>
__device__ void produce_gathered_operands(const CUtensorMap* tma_a, const CUtensorMap* tma_b,
                                          const typename Cfg::MainloopParams& m, const typename Epi::Params& epi,
                                          const Smem& smem, Sched sched) {
  using LA = OperandLayout<Cfg::kAMajor>;
  using LB = OperandLayout<Cfg::kBMajor>;
  constexpr bool kGatherA = Cfg::kGathered == Gathered::kA;
  constexpr Major kMajor = kGatherA ? Cfg::kAMajor : Cfg::kBMajor;
  static_assert(kGatherA || kMajor == Major::MN, "a gathered B is MN-major (the weight gradients)");
  const int thread = int(threadIdx.x);
  const int chunk = thread % kChunksPerRow;
  const int first_row = thread / kChunksPerRow;
  // Thread 0: the other operand's k-block kb of the tile at o, by TMA.
  const auto load_other = [&](uint64_t* full, int stage, const TileOrigin& o, int kb) {
    if (thread != 0) return;
    if constexpr (kGatherA) {
      Barrier::arrive_and_expect_tx(full, Cfg::kBBytes);
      LB::template load<Cfg::kBlockN, Cfg::kBBoxes>(tma_b, full, smem.b(stage), o.b_mn, o.b_k + kb * Cfg::kKBlock,
                                                    o.b_box_stride);
    } else {
      Barrier::arrive_and_expect_tx(full, Cfg::kABytes);
      LA::template load<kBlockM, 1>(tma_a, full, smem.a(stage), o.a_mn, o.a_k + kb * Cfg::kKBlock, 0);
    }
  };
  PipelineState<Cfg::kStages> state;
  for (; sched.valid(); sched.advance()) {
    const auto tile = sched.tile();
    const TileOrigin o = sched.template origin<Cfg>(tile);
    const int mn = kGatherA ? o.a_mn : o.b_mn;  // the gathered operand's origin
    const int k = kGatherA ? o.a_k : o.b_k;
    if constexpr (kMajor == Major::K) {
      // The tile's 128 pool rows are its M: the same rows in every k-block.
      constexpr int kRows = kBlockM / kGatherRowStep;  // 8
      int32_t token[kRows];
#pragma unroll
      for (int i = 0; i < kRows; ++i) token[i] = token_of(m, mn + first_row + i * kGatherRowStep);
      for (int kb = 0; kb < tile.k_blocks; ++kb) {
        Barrier::wait(smem.empty(state.stage), state.phase ^ 1u);
        uint64_t* full = smem.full(state.stage);
        load_other(full, state.stage, o, kb);
        copy_rows(cute::cast_smem_ptr_to_uint(smem.a(state.stage)), token, m, first_row,
                  k + kb * Cfg::kKBlock + chunk * 8);
        cutlass::arch::cpasync_barrier_arrive_noinc(full);
        state.advance();
      }
    } else {
      // Each k-block's 64 pool rows are its K, and the tile's columns of the operand 64-column boxes.
      constexpr int kRows = kBlockK / kGatherRowStep;  // 4
      constexpr int kCols = kGatherA ? kBlockM : Cfg::kBlockN;
      for (int kb = 0; kb < tile.k_blocks; ++kb) {
        const int first_slot = k + kb * Cfg::kKBlock + first_row;
        int32_t token[kRows];
#pragma unroll
        for (int i = 0; i < kRows; ++i) token[i] = token_of(m, first_slot + i * kGatherRowStep);
        Barrier::wait(smem.empty(state.stage), state.phase ^ 1u);
        uint64_t* full = smem.full(state.stage);
        load_other(full, state.stage, o, kb);
        const uint32_t gathered = cute::cast_smem_ptr_to_uint(kGatherA ? smem.a(state.stage) : smem.b(state.stage));
#pragma unroll
        for (int box = 0; box < kCols / kMnBoxCols; ++box) {
          copy_rows(gathered + uint32_t(box * kMnBoxBytes), token, m, first_row, mn + box * kMnBoxCols + chunk * 8);
        }
        cutlass::arch::cpasync_barrier_arrive_noinc(full);
        state.advance();
      }
    }
    if constexpr (RingChunks<Epi>::value > 0) {
      if (thread == 0) {
        PipelineState<Cfg::kStages> ring = state;
        Epi::load_ring(epi, tile, smem, ring);
      }
      for (int c = 0; c < RingChunks<Epi>::value; ++c) {
        Barrier::wait(smem.empty(state.stage), state.phase ^ 1u);
        Barrier::arrive(smem.full(state.stage));
        state.advance();
      }
    }
  }
  cute::cp_async_wait<0>();  // no copy outlives its thread
}

}  // namespace megamoe::grouped_gemm
