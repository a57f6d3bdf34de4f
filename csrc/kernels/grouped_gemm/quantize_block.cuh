// A 128-column block of a math warpgroup's 64 rows, staged in shared memory as two bf16 chunks of 64
// columns (epilogue.cuh's swizzled chunk layout), quantised to e4m3 with one scale per row: the
// block-FP8 recipe of kernels/fp8/e4m3.cuh applied to the staged bf16 values, so the bytes and
// scales are those megamoe_quantize_rows_fp8 makes of the same rows. The caller gives each thread's
// amax over the packed bf16 pairs it staged (RowAmaxBf16). The e4m3 block lands in the swizzle of a
// 128-byte-wide TMA box; it may overwrite the first chunk, since each warp reads all of its 16 rows
// of that chunk before it writes them (and touches no other warp's rows).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/fp8/e4m3.cuh"
#include "kernels/grouped_gemm/epilogue.cuh"

namespace megamoe::grouped_gemm {

// The thread's share of a block row's amax over its values (fp32; NaN once one of them is).
struct RowAmax {
  float amax[2] = {0.f, 0.f};  // per row half (fragment rows r and r + 8)
  __device__ void add(int half, float v) { amax[half] = fp8::max_nan(amax[half], fabsf(v)); }
  // The amax of the thread's fragment row `half` over the 4 lanes of its quad, which hold the row.
  __device__ float of_row(int half) const { return fp8::lanes_max_nan<4>(amax[half]); }
};

// The same over bf16 pairs as they are staged, one instruction per pair (fp8::abs_max_nan_bf16x2):
// the amax of the bf16 values, which is the bf16 rounding of their fp32 amax (rounding is monotonic).
struct RowAmaxBf16 {
  uint32_t pairs[2] = {0u, 0u};  // per row half, both halves of each pair running
  __device__ void add(int half, uint32_t packed) { pairs[half] = fp8::abs_max_nan_bf16x2(pairs[half], packed); }
  __device__ float of_thread(int half) const {
    const float2 both = fp8::abs_halves(pairs[half]);
    return fp8::max_nan(both.x, both.y);
  }
  __device__ float of_row(int half) const { return fp8::lanes_max_nan<4>(of_thread(half)); }
  __device__ float of_thread() const { return fp8::max_nan(of_thread(0), of_thread(1)); }
};

// Returns the scales of the thread's two fragment rows (row half 0, row half 8); every lane of a
// row's quad gets them.
__device__ __forceinline__ float2 quantize_block_e4m3(uint8_t* first, uint8_t* second, uint8_t* out,
                                                      RowAmaxBf16 part) {
  constexpr int kPairs = kEpiCols / 16;
  float scale[2], inverse[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    scale[h] = fp8::block_scale(part.of_row(h));
    inverse[h] = fp8::inverse(scale[h]);
  }
  // The first chunk's values, all read before any of its rows is written.
  uint32_t held[kPairs][4];
#pragma unroll
  for (int pair = 0; pair < kPairs; ++pair) load_packed_pair(held[pair], first, pair);
  __syncwarp();
  const int lane = int(threadIdx.x % 32);
  const int row = int((threadIdx.x / 32) % 4) * kWarpRows + lane / 4;  // row half 0 of the thread
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int pair = 0; pair < kPairs; ++pair) {
      uint32_t v[4];
      if (c == 0) {
#pragma unroll
        for (int q = 0; q < 4; ++q) v[q] = held[pair][q];
      } else {
        load_packed_pair(v, second, pair);
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // q = 2 g + h: 8-column group 2 pair + g, row half h
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v[q]));
        const int col = c * kEpiCols + 8 * (2 * pair + q / 2) + 2 * (lane % 4);
        store_shared_u16(swizzled_byte(out, row + 8 * (q % 2), col), fp8::to_e4m3x2(f.x, f.y, inverse[q % 2]));
      }
    }
  }
  return make_float2(scale[0], scale[1]);
}

// The same block quantised along its columns instead, stored transposed (megamoe_transpose_quantize_fp8's
// blocks: 1 x 128 along the rows, one scale per column over the block's 128 rows, both math
// warpgroups' 64; or one per 128 x 128 block). A warp takes 8 bf16 column pairs (words [word0,
// word0 + 8) of a 128-byte staged row) of its warpgroup's 64 rows: lane l the pair word0 + l / 4 in
// the 16-row group l % 4, so the 4 lanes of a quad hold a column's 64 rows and store them as 64
// contiguous bytes (a warp's 16-byte stores touch 8 lines, not 32). Lane l reads the rows of its
// group in the order r ^ 2 (l % 4): the swizzle XORs a row's 16-byte chunks with row % 8, so the
// warp's 32 loads of a step fall in 32 banks. The e4m3 bytes are put back in row order to be stored.
struct StagedColumnGroup {
  uint32_t row_address[8];  // step r < 8 reads row r ^ order of the group; step r + 8 the row 8 below
  uint32_t order;           // 2 (lane % 4)

  // Row r ^ order of the group starts at row * 128 and holds the word in 16-byte unit (word / 4) ^ row:
  // for rows and units below 8 that offset is (row * 144) ^ ((word / 4) * 16), bits 4-9, which the
  // chunk's 1024-aligned address with the group's 16 rows and the word's 4 bytes leaves clear, so each
  // row's address is one xor: (base | (order * 144) ^ ((word / 4) * 16)) ^ (r * 144).
  __device__ StagedColumnGroup(const uint8_t* chunk_rows, int word0) {
    const int lane = int(threadIdx.x % 32), group = lane % 4, word = word0 + lane / 4;
    order = 2 * group;
    const uint32_t base = cute::cast_smem_ptr_to_uint(chunk_rows) + group * 16 * kSwizzleBytes + (word % 4) * 4;
    const uint32_t first_row = base | ((order * 144u) ^ uint32_t(word / 4) * 16u);
#pragma unroll
    for (int r = 0; r < 8; ++r) row_address[r] = first_row ^ uint32_t(r * 144);
  }
  __device__ uint32_t at(int step) const {  // step < 16 a constant after unrolling
    return load_shared_u32(row_address[step % 8] + (step / 8) * 8 * kSwizzleBytes);
  }

  // Both columns' amax over the 64 rows as a bf16 pair (fp8::abs_halves reads it); every lane of the
  // quad gets it. Every lane of the warp calls it.
  __device__ uint32_t amax() const {
    uint32_t amax[2] = {0u, 0u};  // two chains
#pragma unroll
    for (int step = 0; step < 16; ++step) amax[step % 2] = fp8::abs_max_nan_bf16x2(amax[step % 2], at(step));
    uint32_t quad = fp8::abs_max_nan_bf16x2(amax[0], amax[1]);
#pragma unroll
    for (int offset = 1; offset < 4; offset *= 2) {
      quad = fp8::abs_max_nan_bf16x2(quad, __shfl_xor_sync(0xffffffffu, quad, offset));
    }
    return quad;
  }

  // The group's 16 rows of each column in e4m3, in row order, to column0 and column1 (the columns'
  // first row of the warpgroup's 64).
  __device__ void store_e4m3(float inverse_lo, float inverse_hi, uint8_t* column0, uint8_t* column1) const {
    uint32_t lo[4], hi[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      float a[4], b[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const uint32_t v = at(4 * w + r);
        a[r] = __uint_as_float(v << 16);
        b[r] = __uint_as_float(v & 0xffff0000u);
      }
      lo[w] = fp8::to_e4m3x4(a[0], a[1], a[2], a[3], inverse_lo);
      hi[w] = fp8::to_e4m3x4(b[0], b[1], b[2], b[3], inverse_hi);
    }
    const int offset = int(order) * 8;  // 16 group bytes
    *reinterpret_cast<uint4*>(column0 + offset) = in_row_order(lo);
    *reinterpret_cast<uint4*>(column1 + offset) = in_row_order(hi);
  }

  // Byte p of the result is byte p ^ order of v (step p ^ order held row p).
  __device__ uint4 in_row_order(uint32_t (&v)[4]) const {
    const uint32_t halves = (order & 2) ? 0x1032u : 0x3210u;  // p ^ 2: the two 16-bit halves of a word
#pragma unroll
    for (int w = 0; w < 4; ++w) v[w] = __byte_perm(v[w], 0, halves);
    return (order & 4) ? make_uint4(v[1], v[0], v[3], v[2]) : make_uint4(v[0], v[1], v[2], v[3]);  // p ^ 4
  }
};

}  // namespace megamoe::grouped_gemm
