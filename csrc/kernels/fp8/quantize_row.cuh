// One warp quantises a bf16 row to block FP8 (1 x 128 blocks), shared by the row quantisation and
// the FP8 dispatch. A pass covers kRowChunksPerLane x 32 of the row's 16-byte chunks: lane l holds
// chunk pass + 32 i + l, which lies in the pass's block 2 i + l / 16, and the 16 lanes of a block
// share its amax by shuffles (rounding: e4m3.cuh). A pass's loads are all issued before its first
// shuffle, so a lane keeps that many loads in flight.
#pragma once

#include <cstdint>

#include "common/vec16.cuh"
#include "kernels/fp8/e4m3.cuh"

namespace megamoe::fp8 {

constexpr int kRowChunksPerLane = 8;  // 8 pairs of 128-column blocks: 2048 columns per pass

struct RowPass {
  uint2 q[kRowChunksPerLane];      // the lane's chunks in e4m3, 8 bytes each
  float scale[kRowChunksPerLane];  // the scales of their blocks
};

// vecs_per_row: a multiple of 16 (whole blocks). Entries of chunks past the row are left unset; a
// row of an odd number of blocks ends with a half pair, whose lanes 16-31 only take part in the
// shuffles.
__device__ __forceinline__ RowPass quantize_row_pass(const Bf16x8* __restrict__ row, int vecs_per_row, int pass) {
  const int lane = threadIdx.x % 32;
  Bf16x8 v[kRowChunksPerLane];
#pragma unroll
  for (int i = 0; i < kRowChunksPerLane; ++i) {
    const int c = pass + 32 * i + lane;
    v[i] = c < vecs_per_row ? load_readonly(row + c) : Bf16x8{};
  }
  RowPass out;
#pragma unroll
  for (int i = 0; i < kRowChunksPerLane; ++i) {
    if (pass + 32 * i >= vecs_per_row) break;  // the same for every lane
    float f[kBf16PerVec];
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 pair = __bfloat1622float2(v[i].pairs[j]);
      f[2 * j] = pair.x;
      f[2 * j + 1] = pair.y;
      amax = max_nan(amax, max_nan(fabsf(pair.x), fabsf(pair.y)));
    }
    out.scale[i] = block_scale(lanes_max_nan<16>(amax));
    const float inv = inverse(out.scale[i]);
    out.q[i] = make_uint2(to_e4m3x4(f[0], f[1], f[2], f[3], inv), to_e4m3x4(f[4], f[5], f[6], f[7], inv));
  }
  return out;
}

}  // namespace megamoe::fp8
