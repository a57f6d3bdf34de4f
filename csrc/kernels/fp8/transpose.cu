// Batched transpose of one-byte (e4m3) matrices, [batches, rows, cols] -> [batches, cols, rows]: the
// backward's K-major copies of the FP8 weights made from their forward copies
// (megamoe.fp8.QuantizedWeight.transposed). One CTA per 128 x 128 tile: coalesced 16-byte loads into
// shared memory, then stored transposed (transpose_tile.cuh).
#include <algorithm>
#include <cstdint>
#include <string>

#include "common/status.h"
#include "kernels/fp8/transpose_tile.cuh"

namespace megamoe {
namespace {

using fp8::kTile;
using fp8::kTilePitch;
using fp8::kTileThreads;

__global__ void __launch_bounds__(kTileThreads)
transpose_tiles(const uint8_t* __restrict__ in, uint8_t* __restrict__ out, int32_t rows, int32_t cols) {
  __shared__ __align__(16) uint8_t tile[kTile * kTilePitch];
  const int tiles_c = cols / kTile;
  const int64_t tiles_per_batch = int64_t(rows / kTile) * tiles_c;
  const int64_t batch = blockIdx.x / tiles_per_batch;
  const int64_t t = blockIdx.x % tiles_per_batch;
  const int64_t row0 = (t / tiles_c) * kTile, col0 = (t % tiles_c) * kTile;
  const uint8_t* src = in + batch * int64_t(rows) * cols;
  constexpr int kVecsPerRow = kTile / 16;
#pragma unroll
  for (int i = 0; i < kTile * kVecsPerRow / kTileThreads; ++i) {
    const int v = i * kTileThreads + int(threadIdx.x);
    const int r = v / kVecsPerRow, c = (v % kVecsPerRow) * 16;
    *reinterpret_cast<uint4*>(tile + r * kTilePitch + c) =
        *reinterpret_cast<const uint4*>(src + (row0 + r) * cols + col0 + c);
  }
  __syncthreads();
  fp8::store_tile_transposed(tile, out + batch * int64_t(rows) * cols + col0 * rows + row0, rows);
}

}  // namespace
}  // namespace megamoe

extern "C" int megamoe_transpose_fp8(const megamoe_transpose_fp8_args* args, void* stream) {
  using namespace megamoe;
  const std::string fn = "megamoe_transpose_fp8: ";
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  const megamoe_transpose_fp8_args& a = *args;
  if (a.in == nullptr || a.out == nullptr) return invalid_argument(fn + "null pointer");
  if (a.batches < 0 || a.rows <= 0 || a.rows % kTile || a.cols <= 0 || a.cols % kTile) {
    return invalid_argument(fn + "need batches >= 0 and rows and cols positive multiples of 128, got batches " +
                            std::to_string(a.batches) + ", rows " + std::to_string(a.rows) + ", cols " +
                            std::to_string(a.cols));
  }
  if (reinterpret_cast<uintptr_t>(a.in) % 16 || reinterpret_cast<uintptr_t>(a.out) % 16) {
    return invalid_argument(fn + "in and out must be 16-byte aligned");
  }
  const int64_t tiles = a.batches * (a.rows / kTile) * (a.cols / kTile);
  if (tiles == 0) return MEGAMOE_OK;
  if (tiles > INT32_MAX) return invalid_argument(fn + "more than 2^31 tiles of 128 x 128");
  transpose_tiles<<<unsigned(tiles), kTileThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint8_t*>(a.in), static_cast<uint8_t*>(a.out), a.rows, a.cols);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}
