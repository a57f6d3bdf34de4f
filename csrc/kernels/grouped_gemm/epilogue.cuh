// Epilogue building blocks and the plain GEMM's epilogue: fp32 accumulators -> bf16 (one rounding)
// -> swizzled shared chunk -> TMA store.
//
// A math warpgroup owns 64 rows of the tile and writes them in 64-column chunks through two chunk
// buffers; it never waits for its stores to reach global memory, only (before reusing a buffer) for
// the store issued two chunks earlier to have finished reading shared memory. The next tile's main
// loop therefore overlaps the tail of this tile's stores.
//
// wgmma's accumulator fragment: in warp w of the warpgroup, lane l holds for each 8-column group j
// acc[4j + 0..1] = row 16w + l/4, columns 8j + 2(l%4) + {0,1}, and acc[4j + 2..3] = row + 8.
// That is exactly stmatrix's per-lane fragment of an 8x8 matrix, so one stmatrix.x4 stores the
// 16 x 16 block of groups j, j+1: matrices (rows 0-7, j), (rows 8-15, j), (rows 0-7, j+1),
// (rows 8-15, j+1); lane l supplies the address of row l % 8 of matrix l / 8.
//
// Epilogue policies (this file's PlainEpilogue, SwigluEpilogue, ScatterEpilogue) give the kernel:
//   Cfg, Params (a kernel parameter), prefetch(params), prepare(params, tile, warpgroup) -> Rows
//   (per-tile values loaded before the main loop, to hide their latency), store(...), drain(); the
//   tile is the scheduler's (PoolTile: block, n_tile; ExpertTile: expert, m_tile, n_tile).
// An epilogue that reads a tile-shaped input (epilogue_swiglu_backward.cuh: z) also declares
// kRingChunks > 0 and load_ring(params, tile, smem, state): the producer loads that many stages of
// it through the operand ring after the tile's k-blocks, and store(..., state) consumes them.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm90.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include <type_traits>

#include "kernels/grouped_gemm/config.cuh"
#include "kernels/grouped_gemm/scheduler.cuh"

namespace megamoe::grouped_gemm {

// Epi::kRingChunks, or 0 for the epilogues that read nothing through the operand ring.
template <class Epi, class = void>
struct RingChunks : std::integral_constant<int, 0> {};
template <class Epi>
struct RingChunks<Epi, std::void_t<decltype(Epi::kRingChunks)>> : std::integral_constant<int, Epi::kRingChunks> {};

// Epi::kDeferred: pack(acc, tile, rows) -> Pending after the main loop, store(pending, ...) under
// the next tile's first wgmma batch (kernel.cuh).
template <class Epi, class = void>
struct Deferred : std::false_type {};
template <class Epi>
struct Deferred<Epi, std::void_t<decltype(Epi::kDeferred)>> : std::integral_constant<bool, Epi::kDeferred> {};

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // lo -> low half = lower column
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Named barrier over one math warpgroup (id 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_sync(int warpgroup) {
  cutlass::arch::NamedBarrier::sync(128, uint32_t(1 + warpgroup));
}

// Writes fragment columns [64 c, 64 c + 64) of the warpgroup's 64 rows, as bf16, into a chunk
// buffer: row r at r * 128 bytes, its 16-byte groups permuted by r % 8 (128B swizzle).
// c must be a compile-time constant after unrolling (it indexes registers).
// zero: stage zeros instead (a K-grouped tile without k-blocks); a constant false folds away.
template <int N>
__device__ __forceinline__ void stage_chunk(const float (&acc)[N], int c, uint8_t* chunk, bool zero = false) {
  const int lane = threadIdx.x % 32;
  const int warp = (threadIdx.x / 32) % 4;
  const int matrix = lane / 8;
  const int row = warp * 16 + (matrix % 2) * 8 + lane % 8;  // row inside the warpgroup's 64
#pragma unroll
  for (int p = 0; p < kEpiCols / 16; ++p) {
    const int j = c * (kEpiCols / 8) + 2 * p;  // first 8-column group of this 16 x 16 block
    const int group = 2 * p + matrix / 2;      // 16-byte chunk of the 128-byte row, unswizzled
    auto* dst = chunk + row * kSwizzleBytes + ((group ^ (row % 8)) * 16);
    const uint32_t keep = zero ? 0u : ~0u;
    cute::SM90_U32x4_STSM_N::copy(pack_bf16x2(acc[4 * j + 0], acc[4 * j + 1]) & keep,
                                  pack_bf16x2(acc[4 * j + 2], acc[4 * j + 3]) & keep,
                                  pack_bf16x2(acc[4 * j + 4], acc[4 * j + 5]) & keep,
                                  pack_bf16x2(acc[4 * j + 6], acc[4 * j + 7]) & keep,
                                  *reinterpret_cast<cute::uint128_t*>(dst));
  }
}

// Stores fragment columns [0, 64 Chunks) of the warpgroup's rows to C[row0.., col0..] by TMA, each
// warp its own 16 rows (tma_c has 16-row boxes): stage_chunk writes only the warp's rows of the
// chunk buffer, so a warp needs no other warp before it stages or issues its store.
template <int Chunks, int N, class Smem>
__device__ __forceinline__ void tma_store_chunks(const float (&acc)[N], const CUtensorMap* tma_c, const Smem& smem,
                                                 int warpgroup, int row0, int col0, bool zero = false) {
  static_assert(Chunks % kEpiBuffers == 0, "chunk buffers must line up with tiles");
  static_assert(Chunks * kEpiCols * kWarpgroupRows <= N * 128, "more columns than the fragment holds");
  const int warp = (threadIdx.x / 32) % 4;
  const bool leader = threadIdx.x % 32 == 0;  // issues and tracks this warp's TMA stores
#pragma unroll
  for (int c = 0; c < Chunks; ++c) {
    uint8_t* chunk = smem.epi(warpgroup, c % kEpiBuffers);
    // The store that last read this warp's rows of the buffer was issued kEpiBuffers chunks ago
    // (possibly in the previous tile: Chunks is a multiple of kEpiBuffers, so buffer c % 2 is the same one).
    if (leader) cute::tma_store_wait<kEpiBuffers - 1>();
    __syncwarp();
    stage_chunk(acc, c, chunk, zero);
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> visible to TMA
    __syncwarp();
    if (leader) {
      cute::SM90_TMA_STORE_2D::copy(tma_c, chunk + warp * kWarpRows * kSwizzleBytes, col0 + c * kEpiCols,
                                    row0 + warp * kWarpRows);
      cute::tma_store_arrive();
    }
  }
}

// Packed bf16 pairs, 16 columns at a time: v[q] (q = 2 g + h) is the thread's pair of 8-column
// group 2 p + g, row half h (h = 1: row + 8) of a 64 x 64 swizzled chunk, i.e. pack_bf16x2 of the
// matching fragment entries. One stmatrix / ldmatrix .x4 moves the warp's 16 rows x 16 columns.
__device__ __forceinline__ uint8_t* packed_pair_address(uint8_t* chunk, int p) {
  const int lane = threadIdx.x % 32;
  const int warp = (threadIdx.x / 32) % 4;
  const int matrix = lane / 8;
  const int row = warp * 16 + (matrix % 2) * 8 + lane % 8;
  const int group = 2 * p + matrix / 2;
  return chunk + row * kSwizzleBytes + ((group ^ (row % 8)) * 16);
}

__device__ __forceinline__ void stage_packed_pair(const uint32_t (&v)[4], uint8_t* chunk, int p) {
  cute::SM90_U32x4_STSM_N::copy(v[0], v[1], v[2], v[3],
                                *reinterpret_cast<cute::uint128_t*>(packed_pair_address(chunk, p)));
}

// A TMA box of a row-major bf16 matrix (64 columns, 128B swizzle) lands in exactly this layout, so
// this reads such a box straight into fragment order.
__device__ __forceinline__ void load_packed_pair(uint32_t (&v)[4], uint8_t* chunk, int p) {
  cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(packed_pair_address(chunk, p)), v[0], v[1],
                                v[2], v[3]);
}

// Before the CTA exits, its last stores must have finished reading shared memory (every thread
// that issued stores waits for its own).
__device__ __forceinline__ void drain_stores() {
  if (threadIdx.x % 32 == 0) cute::tma_store_wait<0>();
}

// C[128 b.., n-tile..] = the tile, through a TMA map of C with 16-row x 64-column boxes.
template <int BlockN>
struct PlainEpilogue {
  using Cfg = Config<BlockN>;
  struct Params {
    CUtensorMap c;
  };
  struct Rows {};

  __device__ static void prefetch(const Params& p) { cute::prefetch_tma_descriptor(&p.c); }
  __device__ static Rows prepare(const Params&, const PoolTile&, int) { return {}; }
  __device__ static void store(const float (&acc)[Cfg::kAccumulators], const Params& p,
                               const SharedStorage<Cfg>& smem, int warpgroup, const PoolTile& t, Rows) {
    tma_store_chunks<BlockN / kEpiCols>(acc, &p.c, smem, warpgroup, t.block * kBlockM + warpgroup * kWarpgroupRows,
                                        t.n_tile * BlockN);
  }
  __device__ static void drain() { drain_stores(); }
};

}  // namespace megamoe::grouped_gemm
