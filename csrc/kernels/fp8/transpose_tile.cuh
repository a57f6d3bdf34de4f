// A 128 x 128 tile of one-byte values staged in shared memory (rows kTilePitch bytes apart), stored
// transposed: each of 256 threads gathers the bytes of half an output row (a column of the tile)
// and writes them as four 16-byte stores. The weights' K-major e4m3 copies are written this way,
// transposed from e4m3 (transpose.cu) or as they are quantised (quantize.cu).
#pragma once

#include <cstdint>

namespace megamoe::fp8 {

constexpr int kTile = 128;
constexpr int kTileThreads = 256;
constexpr int kTilePitch = kTile + 16;  // bytes per shared row: 16-byte aligned, rows start on different banks

// out_rows: the row length of the transposed matrix (the input's rows); out points at the tile's
// first output row and column.
__device__ inline void store_tile_transposed(const uint8_t* tile, uint8_t* out, int64_t out_rows) {
  const int out_row = int(threadIdx.x) / 2;                // a column of the staged tile
  const int first = (int(threadIdx.x) % 2) * (kTile / 2);  // the half of its 128 bytes this thread writes
#pragma unroll
  for (int v = 0; v < kTile / 2 / 16; ++v) {
    uint32_t words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      uint32_t word = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        word |= uint32_t(tile[(first + v * 16 + w * 4 + b) * kTilePitch + out_row]) << (8 * b);
      }
      words[w] = word;
    }
    *reinterpret_cast<uint4*>(out + out_row * out_rows + first + v * 16) =
        make_uint4(words[0], words[1], words[2], words[3]);
  }
}

}  // namespace megamoe::fp8
