// A pool GEMM whose A rows are gathered from token rows instead of read from a dispatched pool
// (bf16 only): pool row r of block b holds token row slot_to_route[r] / top_k of `rows` [T, K], or
// zeros for a padding row. Used where experts get few rows (GEMM1 at small batches): the token rows
// (T x K x 2 bytes) stay in L2 while the weights stream past, where a pool is K-fold larger, half
// padding, written by a dispatch and read back from DRAM.
//
// The whole producer warpgroup loads: thread 0 arms each stage's full barrier with B's bytes and
// issues B's TMA boxes (as mainloop.cuh's produce_operands does); every thread then copies 16-byte
// chunks of A's rows by cp.async into the same 128B-swizzled K-major tile TMA would write
// (operand.cuh), and the stage completes when the copies of all 128 threads have landed
// (cp.async.mbarrier.arrive.noinc: the full barrier counts 1 + 128 arrivals, full_arrivals).
#pragma once

#include <cuda.h>

#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include <cstdint>

#include "kernels/grouped_gemm/config.cuh"
#include "kernels/grouped_gemm/operand.cuh"
#include "kernels/grouped_gemm/pipeline.cuh"
#include "kernels/grouped_gemm/scheduler.cuh"

namespace megamoe::grouped_gemm {

constexpr int kGatherThreads = 128;                           // the producer warpgroup
constexpr int kChunksPerRow = kBlockK * 2 / 16;              // 16-byte chunks of a row's k-block: 8
constexpr int kGatherRowStep = kGatherThreads / kChunksPerRow;  // rows one pass of the warpgroup covers: 16
constexpr int kGatherRowsPerThread = kBlockM / kGatherRowStep;  // 8

// The bf16 Config with A gathered (kernel.cuh picks the producer by kGatherA).
template <int BlockN, int BBoxes>
struct GatheredConfig : Config<BlockN, BBoxes> {
  static constexpr bool kGatherA = true;
  // Each producer thread holds its 8 rows' token indices beside the tile's coordinates.
  static constexpr int kProducerRegs = 56;
  static constexpr int kMathRegs = 224;
  static_assert(128 * kProducerRegs + 256 * kMathRegs <= kThreads * 168, "setmaxnreg.inc would wait forever");
  struct MainloopParams {
    const uint16_t* rows;          // [T, k] bf16 token rows
    const int32_t* slot_to_route;  // the plan's: route of each pool row, -1 for padding rows
    int32_t top_k;
    int32_t k;                     // a multiple of 8: a 16-byte chunk is all inside K or all past it
  };
};

// Arrivals that complete a stage's full barrier: the TMA thread's arrive_and_expect_tx, and with A
// gathered each producer thread's cp.async arrival.
template <class Cfg>
constexpr int full_arrivals() {
  return Cfg::kGatherA ? 1 + kGatherThreads : 1;
}

// 16 bytes from global to shared memory, or 16 zero bytes when !real (src is then not read).
__device__ __forceinline__ void copy_chunk_or_zeros(uint32_t dst, const void* src, bool real) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(real ? 16 : 0));
}

// Every producer thread runs this: B by TMA from thread 0, A's rows by cp.async from all.
template <class Cfg, class Sched, class Smem>
__device__ void produce_gathered_operands(const CUtensorMap* tma_b, const typename Cfg::MainloopParams& m,
                                          const Smem& smem, Sched sched) {
  using LB = OperandLayout<Cfg::kBMajor>;
  static_assert(Cfg::kAMajor == Major::K && !Cfg::kFp8, "gathered rows are bf16 K-major A");
  const int thread = int(threadIdx.x);
  const int chunk = thread % kChunksPerRow;
  const int first_row = thread / kChunksPerRow;  // this thread's rows: first_row + 16 i
  // The 128B swizzle moves chunk c of tile row r to chunk c ^ (r % 8); r % 8 is the same for all of
  // this thread's rows (16 i is a multiple of 8).
  const uint32_t row_offset = uint32_t(first_row) * kSwizzleBytes + uint32_t((chunk ^ (first_row % 8)) * 16);
  PipelineState<Cfg::kStages> state;
  for (; sched.valid(); sched.advance()) {
    const auto tile = sched.tile();
    const TileOrigin o = sched.template origin<Cfg>(tile);
    int32_t token[kGatherRowsPerThread];  // -1: a padding row
#pragma unroll
    for (int i = 0; i < kGatherRowsPerThread; ++i) {
      const int32_t route = m.slot_to_route[o.a_mn + first_row + i * kGatherRowStep];
      token[i] = route < 0 ? -1 : route / m.top_k;
    }
    for (int kb = 0; kb < tile.k_blocks; ++kb) {
      Barrier::wait(smem.empty(state.stage), state.phase ^ 1u);
      uint64_t* full = smem.full(state.stage);
      if (thread == 0) {
        Barrier::arrive_and_expect_tx(full, Cfg::kBBytes);
        LB::template load<Cfg::kBlockN, Cfg::kBBoxes>(tma_b, full, smem.b(state.stage), o.b_mn,
                                                      o.b_k + kb * Cfg::kKBlock, o.b_box_stride);
      }
      const int col = o.a_k + kb * Cfg::kKBlock + chunk * 8;
      const uint32_t dst = cute::cast_smem_ptr_to_uint(smem.a(state.stage)) + row_offset;
#pragma unroll
      for (int i = 0; i < kGatherRowsPerThread; ++i) {
        const bool real = token[i] >= 0 && col < m.k;
        copy_chunk_or_zeros(dst + uint32_t(i * kGatherRowStep * kSwizzleBytes),
                            real ? m.rows + int64_t(token[i]) * m.k + col : m.rows, real);
      }
      cutlass::arch::cpasync_barrier_arrive_noinc(full);
      state.advance();
    }
  }
  cute::cp_async_wait<0>();  // no copy outlives its thread
}

}  // namespace megamoe::grouped_gemm
