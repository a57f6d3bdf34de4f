// A 128-column block of a math warpgroup's 64 rows, staged in shared memory as two bf16 chunks of 64
// columns (epilogue.cuh's swizzled chunk layout), quantised to e4m3 with one scale per row: the
// block-FP8 recipe of kernels/fp8/e4m3.cuh applied to the staged bf16 values, so the bytes and
// scales are those megamoe_quantize_rows_fp8 makes of the same rows. The caller gives each thread's
// amax over its values of the block, taken in fp32 before they were rounded to bf16: rounding is
// monotonic, so the bf16 rounding of that amax is the amax of the bf16 values. The e4m3 block lands
// in the swizzle of a 128-byte-wide TMA box; it may overwrite the first chunk, since each warp reads
// all of its 16 rows of that chunk before it writes them (and touches no other warp's rows).
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

// Returns the scales of the thread's two fragment rows (row half 0, row half 8); every lane of a
// row's quad gets them.
__device__ __forceinline__ float2 quantize_block_e4m3(uint8_t* first, uint8_t* second, uint8_t* out, RowAmax part) {
  constexpr int kPairs = kEpiCols / 16;
  float scale[2], inverse[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float amax = __bfloat162float(__float2bfloat16_rn(part.of_row(h)));  // the amax of the staged bf16 values
    scale[h] = fp8::block_scale(amax);
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

}  // namespace megamoe::grouped_gemm
