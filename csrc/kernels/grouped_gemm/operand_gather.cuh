// A policy (mainloop.cuh) of GEMM1 without a dispatched pool: each A tile is gathered straight from
// the token rows x [T, H]. Pool row r of the tile is x[slot_to_route[r] / top_k], or zeros for a
// padding row (route -1) and, defensively, for a route outside [0, T * top_k).
//
// Warp 0 of the producer warpgroup copies each stage's 128 x 64 box with 16-byte cp.async pieces
// and writes exactly the bytes TMA's 128B swizzle would (operand.cuh, K-major: row i at i * 128,
// its 16-byte chunk c at chunk position c ^ (i % 8)), so the wgmma descriptors are unchanged.
// Lane l copies 8 rows, first_row(l) + 16 j, and in each at step m (0..3) x's chunk 2 m + l % 2:
//   - a warp-wide copy reads 16 whole 32-byte sectors (a lane pair per row, x 32-byte aligned);
//   - a quarter warp takes rows {0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14} or {9, 11, 13, 15}
//     (+ 16 j), whose i % 8 / 2 differ, so its 8 chunks land in 8 distinct 16-byte bank groups.
// The lane's 8 token indices are read once per tile (rows()); the route division happens there.
//
// Completion: each lane's cp.async.mbarrier.arrive.noinc on the stage's full barrier fires once its
// copies have landed, so the barrier expects 32 such arrivals besides the arrive_and_expect_tx that
// covers B's TMA bytes. The math warpgroups fence the generic-proxy writes for wgmma (mma_tile).
#pragma once

#include <cute/arch/copy_sm80.hpp>
#include <cutlass/arch/barrier.h>

#include <cstdint>

#include "kernels/grouped_gemm/config.cuh"
#include "kernels/grouped_gemm/scheduler.cuh"

namespace megamoe::grouped_gemm {

struct GatheredA {
  static constexpr int kLanes = 32;
  static constexpr int kPieceBytes = 16;
  static constexpr int kLanesPerRow = 2;                      // one 32-byte sector per lane pair
  static constexpr int kRowsPerCopy = kLanes / kLanesPerRow;  // 16 rows per warp-wide copy
  static constexpr int kRowsPerLane = kBlockM / kRowsPerCopy;  // 8
  static constexpr int kSectorsPerRow = kSwizzleBytes / (kPieceBytes * kLanesPerRow);  // 4
  static_assert(kSectorsPerRow == 4, "the write order below walks the 4 sectors of a 128-byte row");

  struct Params {
    const uint8_t* x;              // [num_tokens, hidden] bf16, 16-byte aligned rows
    const int32_t* slot_to_route;  // [max_blocks * 128], the routing plan's
    uint32_t row_bytes;            // hidden * 2
    int32_t top_k;
    int32_t num_routes;            // num_tokens * top_k
  };
  static constexpr uint32_t kZeroRow = ~0u;
  struct Rows {
    uint32_t token[kRowsPerLane];  // x row of each of the lane's rows, or kZeroRow
  };

  static constexpr int kProducerThreads = kLanes;
  static constexpr int kFullArrivals = 1 + kLanes;  // B's arrive_and_expect_tx + one noinc arrive per lane
  static constexpr int kTmaBytes = 0;
  static constexpr bool kGenericProxyWrites = true;

  __device__ static void prefetch(const Params&) {}

  __device__ static Rows rows(const Params& p, const TileOrigin& o) {
    const int first = o.a_mn + first_row(int(threadIdx.x % kLanes));
    Rows r;
#pragma unroll
    for (int j = 0; j < kRowsPerLane; ++j) {
      const int32_t route = __ldg(p.slot_to_route + first + j * kRowsPerCopy);
      r.token[j] = (route >= 0 && route < p.num_routes) ? uint32_t(route) / uint32_t(p.top_k) : kZeroRow;
    }
    return r;
  }

  template <class Cfg>
  __device__ static void load(const Params& p, const Rows& rows, uint64_t* full, uint8_t* tile, const TileOrigin& o,
                              int kb) {
    static_assert(Cfg::kAMajor == Major::K, "gathered rows are the M of a K-major A");
    const int lane = int(threadIdx.x % kLanes);
    const int row = first_row(lane);
    // Step m copies x's chunk 2 m + lane % 2 (immediate offsets) to chunk position
    // (2 m + lane % 2) ^ (row % 8); rows start 128-byte aligned, so that is the step-0 offset ^ 32 m.
    const uint32_t piece0 = uint32_t(lane % kLanesPerRow) * kPieceBytes;
    const uint32_t dst0 = cute::cast_smem_ptr_to_uint(tile) + uint32_t(row * kSwizzleBytes) +
                          (piece0 ^ uint32_t(row % 8) * kPieceBytes);
    const uint8_t* x_k = p.x + (o.a_k + kb * kBlockK) * 2 + piece0;
#pragma unroll
    for (int j = 0; j < kRowsPerLane; ++j) {
      uint32_t token = rows.token[j];
      // Opaque to the compiler: otherwise it hoists each row's flag and 64-bit offset out of the
      // stage loop, tripling the rows' registers (past the producer's 40: spills).
      asm volatile("" : "+r"(token));
      const bool real = token != kZeroRow;
      const uint8_t* src = x_k + uint64_t(real ? token : 0u) * p.row_bytes;
      const uint32_t dst = dst0 + uint32_t(j * kRowsPerCopy * kSwizzleBytes);
#pragma unroll
      for (uint32_t m = 0; m < kSectorsPerRow; ++m) {
        const uint32_t step = m * kPieceBytes * kLanesPerRow;
        copy_piece(dst ^ step, src + step, real);
      }
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(full);
  }

  // A lane must not exit with copies in flight.
  __device__ static void drain() { cute::cp_async_wait<0>(); }

 private:
  // Lane pairs 4 q .. 4 q + 3 (quarter warp q) take rows 8 (q / 2) + q % 2 + {0, 2, 4, 6}.
  __device__ static int first_row(int lane) {
    const int pair = lane / kLanesPerRow;
    return (pair & 8) | ((pair & 3) << 1) | ((pair >> 2) & 1);
  }

  // 16 bytes global -> shared, bypassing L1; real = false writes 16 zero bytes and reads nothing.
  __device__ static void copy_piece(uint32_t dst, const uint8_t* src, bool real) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(real ? 16 : 0)
                 : "memory");
  }
};

}  // namespace megamoe::grouped_gemm
