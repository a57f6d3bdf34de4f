// Epilogue building blocks and the plain GEMM's epilogue: fp32 accumulators -> bf16 (one rounding)
// -> swizzled shared chunk -> TMA store.
//
// A math warpgroup owns 64 rows of the tile and writes them in 64-column chunks through two chunk
// buffers; it never waits for its stores to reach global memory, only (before reusing a buffer) for
// the store issued two chunks earlier to have finished reading shared memory. Deferred epilogues
// keep the tile packed in registers and stage it while the next tile's first wgmma batch runs, so
// the tensor cores are busy during the stores too.
//
// wgmma's accumulator fragment: in warp w of the warpgroup, lane l holds for each 8-column group j
// acc[4j + 0..1] = row 16w + l/4, columns 8j + 2(l%4) + {0,1}, and acc[4j + 2..3] = row + 8.
// That is exactly stmatrix's per-lane fragment of an 8x8 matrix, so one stmatrix.x4 stores the
// 16 x 16 block of groups j, j+1: matrices (rows 0-7, j), (rows 8-15, j), (rows 0-7, j+1),
// (rows 8-15, j+1); lane l supplies the address of row l % 8 of matrix l / 8.
//
// Epilogue policies (this file's PlainEpilogue, epilogue_gated.cuh, epilogue_scatter.cuh, ...) give
// the host: Arguments (the caller's pointers), can_implement(problem, args) and to_params(problem,
// args, &params), and kTileN (columns of the problem's N per tile); and the kernel:
//   Cfg, Params (a kernel parameter), prefetch(params), prepare(params, tile, warpgroup) -> Rows
//   (per-tile values loaded before the main loop, to hide their latency), then either store(acc, ...)
//   or, with kDeferred, retire(...) -> Pending and store(pending, ...) (below); and drain(). The
//   tile is the scheduler's (PoolTile: block, n_tile; ExpertTile: expert, m_tile, n_tile).
// An epilogue that reads a tile-shaped input (epilogue_gated_backward.cuh: z) also declares
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
#include "kernels/grouped_gemm/problem.h"
#include "kernels/grouped_gemm/scheduler.cuh"
#include "kernels/grouped_gemm/tensor_map.h"

namespace megamoe::grouped_gemm {

// Epi::kRingChunks, or 0 for the epilogues that read nothing through the operand ring.
template <class Epi, class = void>
struct RingChunks : std::integral_constant<int, 0> {};
template <class Epi>
struct RingChunks<Epi, std::void_t<decltype(Epi::kRingChunks)>> : std::integral_constant<int, Epi::kRingChunks> {};

// Epi::kDeferred: retire(acc, params, smem, warpgroup, tile, rows) -> Pending right after the main loop
// (the tile's values packed to bf16, and whatever cannot wait), store(pending, params, smem,
// warpgroup) under the next tile's first wgmma batch (kernel.cuh).
template <class Epi, class = void>
struct Deferred : std::false_type {};
template <class Epi>
struct Deferred<Epi, std::void_t<decltype(Epi::kDeferred)>> : std::integral_constant<bool, Epi::kDeferred> {};

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // lo -> low half = lower column
  return *reinterpret_cast<const uint32_t*>(&v);
}

// ld.shared.v4 (a plain dereference of the carved pointer compiles to a generic LD).
__device__ __forceinline__ uint4 load_shared_16(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(cute::cast_smem_ptr_to_uint(p)));
  return v;
}

__device__ __forceinline__ uint32_t load_shared_u32(uint32_t address) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(address));
  return v;
}

__device__ __forceinline__ void store_shared_u32(uint32_t address, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(address), "r"(v));
}

// bar.sync on named barrier `id` (1..15; 0 is __syncthreads) for `threads` threads, whole warps; the
// memory clobber keeps the compiler's loads and stores on their side of it.
__device__ __forceinline__ void sync_threads(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void store_shared_u16(uint8_t* p, uint16_t v) {
  asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(cute::cast_smem_ptr_to_uint(p)), "h"(v));
}

// Byte column `col` of row `row` of a 128-byte-wide box (e4m3) in the 128B swizzle.
__device__ __forceinline__ uint8_t* swizzled_byte(uint8_t* box, int row, int col) {
  return box + row * kSwizzleBytes + (((col / 16) ^ (row % 8)) * 16) + col % 16;
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

// Packed fragment columns [64 c, 64 c + 64) of the warpgroup's 64 rows into a chunk buffer: row r
// at r * 128 bytes, its 16-byte groups permuted by r % 8 (128B swizzle). c must be a compile-time
// constant after unrolling (it indexes registers).
template <int M>
__device__ __forceinline__ void stage_packed_chunk(const uint32_t (&packed)[M], int c, uint8_t* chunk) {
#pragma unroll
  for (int p = 0; p < kEpiCols / 16; ++p) {
    const int i = (c * (kEpiCols / 16) + p) * 4;
    const uint32_t v[4] = {packed[i], packed[i + 1], packed[i + 2], packed[i + 3]};
    stage_packed_pair(v, chunk, p);
  }
}

// Fragment entries 2i and 2i + 1 as one bf16 pair: packed[i]. In the fragment's order, packed
// [4 (4 c + p), + 4) are the stmatrix operands of 16 x 16 block p of 64-column chunk c.
template <int N>
__device__ __forceinline__ void pack_fragment(const float (&acc)[N], uint32_t (&packed)[N / 2]) {
#pragma unroll
  for (int i = 0; i < N / 2; ++i) packed[i] = pack_bf16x2(acc[2 * i], acc[2 * i + 1]);
}

// Where a TMA store of a box at (column, row) goes, for the maps of tensor_map.h: a matrix, one
// plane of a tensor of planes (coordinates (column, row, plane)), or one half of a gated tensor
// (coordinates (column, half, row)).
struct InMatrix {
  __device__ void store(const CUtensorMap* map, void* box, int col, int row) const {
    cute::SM90_TMA_STORE_2D::copy(map, box, col, row);
  }
};
struct InPlane {
  int plane;
  __device__ void store(const CUtensorMap* map, void* box, int col, int row) const {
    cute::SM90_TMA_STORE_3D::copy(map, box, col, row, plane);
  }
};
struct InHalf {
  int half;
  __device__ void store(const CUtensorMap* map, void* box, int col, int row) const {
    cute::SM90_TMA_STORE_3D::copy(map, box, col, half, row);
  }
};

// Which of a warp's 16 rows tma_store_chunks stores: all of them, or (RowsBefore) those before
// `end`, a warp whose rows cross it storing them one by one through `row_map`, a map of the same
// tensor with one-row boxes. The 128B swizzle follows the shared-memory address, so row r of the
// staged box, at r * 128 bytes, is exactly what a one-row box there holds.
struct AllRows {
  template <class Where>
  __device__ void store(const CUtensorMap* map, uint8_t* box, int col, int row, Where where) const {
    where.store(map, box, col, row);
  }
};
struct RowsBefore {
  const CUtensorMap* row_map;
  int end;
  template <class Where>
  __device__ void store(const CUtensorMap* map, uint8_t* box, int col, int row, Where where) const {
    if (row + kWarpRows <= end) {
      where.store(map, box, col, row);
      return;
    }
#pragma unroll 1
    for (int r = 0; r < end - row; ++r) where.store(row_map, box + r * kSwizzleBytes, col, row + r);
  }
};

// Stores packed fragment columns [0, 64 Chunks) of the warpgroup's rows to C[row0.., col0..] by
// TMA (where: InMatrix, InPlane or InHalf; rows: AllRows or RowsBefore), each warp its own 16 rows
// (tma_c has 16-row boxes): a warp stages only its rows of the chunk buffer, so it needs no other
// warp before it stages or issues its store.
template <int Chunks, int M, class Smem, class Where = InMatrix, class Rows = AllRows>
__device__ __forceinline__ void tma_store_chunks(const uint32_t (&packed)[M], const CUtensorMap* tma_c,
                                                 const Smem& smem, int warpgroup, int row0, int col0,
                                                 Where where = {}, Rows rows = {}) {
  static_assert(Chunks % kEpiBuffers == 0, "chunk buffers must line up with tiles");
  static_assert(Chunks * kEpiCols * kWarpgroupRows <= M * 256, "more columns than the fragment holds");
  const int warp = (threadIdx.x / 32) % 4;
  const bool leader = threadIdx.x % 32 == 0;  // issues and tracks this warp's TMA stores
#pragma unroll
  for (int c = 0; c < Chunks; ++c) {
    uint8_t* chunk = smem.epi(warpgroup, c % kEpiBuffers);
    // The store that last read this warp's rows of the buffer was issued kEpiBuffers chunks ago
    // (possibly in the previous tile: Chunks is a multiple of kEpiBuffers, so buffer c % 2 is the same one).
    if (leader) cute::tma_store_wait<kEpiBuffers - 1>();
    __syncwarp();
    stage_packed_chunk(packed, c, chunk);
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> visible to TMA
    __syncwarp();
    if (leader) {
      rows.store(tma_c, chunk + warp_box_offset(), col0 + c * kEpiCols, row0 + warp * kWarpRows, where);
      cute::tma_store_arrive();
    }
  }
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

// C[128 b.., n-tile..] = the tile, through a TMA map of C with 16-row x 64-column boxes; deferred
// (kernel.cuh): retire() packs the tile to bf16 after its main loop, store() writes it while the
// next tile's first wgmma batch runs.
template <int BlockN, class C = Config<BlockN>>
struct PlainEpilogue {
  using Cfg = C;
  static constexpr bool kDeferred = true;
  static constexpr int kTileN = BlockN;
  struct Arguments {
    void* c;  // [pool rows, N] bf16
  };
  struct Params {
    CUtensorMap c;
  };

  static int can_implement(const PoolProblem& p, const Arguments& args) {
    return check_pointers(p.fn, {{args.c, "c"}});
  }
  static int to_params(const PoolProblem& p, const Arguments& args, Params* params) {
    return make_tensor_map(&params->c, args.c, p.rows, uint64_t(p.n), kWarpRows, p.fn, "c");
  }
  struct Rows {};
  struct Pending {
    uint32_t packed[Cfg::kAccumulators / 2];
    int row0, col0;
  };

  __device__ static void prefetch(const Params& p) { cute::prefetch_tma_descriptor(&p.c); }
  __device__ static Rows prepare(const Params&, const PoolTile&, int) { return {}; }
  __device__ static Pending retire(const float (&acc)[Cfg::kAccumulators], const Params&, const SharedStorage<Cfg>&,
                                   int warpgroup, const PoolTile& t, Rows) {
    Pending pending;
    pack_fragment(acc, pending.packed);
    pending.row0 = t.block * kBlockM + warpgroup * kWarpgroupRows;
    pending.col0 = t.n_tile * BlockN;
    return pending;
  }
  __device__ static void store(const Pending& pending, const Params& p, const SharedStorage<Cfg>& smem,
                               int warpgroup) {
    tma_store_chunks<BlockN / kEpiCols>(pending.packed, &p.c, smem, warpgroup, pending.row0, pending.col0);
  }
  __device__ static void drain() { drain_stores(); }
};

}  // namespace megamoe::grouped_gemm
