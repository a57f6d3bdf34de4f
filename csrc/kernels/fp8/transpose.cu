// Batched transpose of one-byte (e4m3) matrices, [batches, rows, cols] -> [batches, cols, rows]: the
// backward's K-major copies of the FP8 weights (megamoe.fp8.QuantizedWeight.transposed). One CTA per
// 128 x 128 tile: coalesced 16-byte loads into shared memory, then each thread gathers the bytes of
// half an output row from there and writes them as four 16-byte stores.
#include <algorithm>
#include <cstdint>
#include <string>

#include "common/status.h"

namespace megamoe {
namespace {

constexpr int kTile = 128;
constexpr int kThreads = 256;
constexpr int kPitch = kTile + 16;  // bytes per shared row: 16-byte aligned, rows start on different banks

__global__ void __launch_bounds__(kThreads)
transpose_tiles(const uint8_t* __restrict__ in, uint8_t* __restrict__ out, int32_t rows, int32_t cols) {
  __shared__ __align__(16) uint8_t tile[kTile * kPitch];
  const int tiles_c = cols / kTile;
  const int64_t tiles_per_batch = int64_t(rows / kTile) * tiles_c;
  const int64_t batch = blockIdx.x / tiles_per_batch;
  const int64_t t = blockIdx.x % tiles_per_batch;
  const int64_t row0 = (t / tiles_c) * kTile, col0 = (t % tiles_c) * kTile;
  const uint8_t* src = in + batch * int64_t(rows) * cols;
  uint8_t* dst = out + batch * int64_t(rows) * cols;
  constexpr int kVecsPerRow = kTile / 16;
#pragma unroll
  for (int i = 0; i < kTile * kVecsPerRow / kThreads; ++i) {
    const int v = i * kThreads + int(threadIdx.x);
    const int r = v / kVecsPerRow, c = (v % kVecsPerRow) * 16;
    *reinterpret_cast<uint4*>(tile + r * kPitch + c) =
        *reinterpret_cast<const uint4*>(src + (row0 + r) * cols + col0 + c);
  }
  __syncthreads();
  const int out_row = int(threadIdx.x) / 2;          // a column of the input tile
  const int first = (int(threadIdx.x) % 2) * (kTile / 2);  // the half of its 128 bytes this thread writes
#pragma unroll
  for (int v = 0; v < kTile / 2 / 16; ++v) {
    uint32_t words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      uint32_t word = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        word |= uint32_t(tile[(first + v * 16 + w * 4 + b) * kPitch + out_row]) << (8 * b);
      }
      words[w] = word;
    }
    *reinterpret_cast<uint4*>(dst + (col0 + out_row) * rows + row0 + first + v * 16) =
        make_uint4(words[0], words[1], words[2], words[3]);
  }
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
  transpose_tiles<<<unsigned(tiles), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint8_t*>(a.in), static_cast<uint8_t*>(a.out), a.rows, a.cols);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}
