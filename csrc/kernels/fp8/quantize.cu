// Block-FP8 quantisation of activation rows (DeepSeek-V3 recipe, as megamoe.fp8.quantize_rows): one
// scale per row and 128 columns, rounded as e4m3.cuh says.
// One warp per row (quantize_row.cuh): 16-byte loads, all of a pass in flight at once, 8-byte stores.
// Dequantisation: one warp per (row, 128-column block), 4 columns per lane.
// The weights' 128 x 128 recipe (as megamoe.fp8.quantize_blocks): one CTA per block, 64 values per
// thread in registers, so the block is read once; written as it is, or staged in shared memory and
// stored transposed (the backward's K-major copy, transpose_tile.cuh).
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/device.h"
#include "common/status.h"
#include "common/vec16.cuh"
#include "kernels/fp8/quantize_row.cuh"
#include "kernels/fp8/transpose_tile.cuh"

namespace megamoe {
namespace {

constexpr int kBlock = 128;
constexpr int kWarpsPerCta = 8;

struct Bf16x4 {
  __nv_bfloat162 lo, hi;
};

__global__ void __launch_bounds__(kWarpsPerCta * 32)
quantize_rows(const Bf16x8* __restrict__ a, uint2* __restrict__ q, float* __restrict__ scales, int64_t rows,
              int32_t vecs_per_row, int32_t scales_ld) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerCta;
  for (int64_t row = int64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32; row < rows; row += warps) {
    for (int pass = 0; pass < vecs_per_row; pass += 32 * fp8::kRowChunksPerLane) {
      const fp8::RowPass quantised = fp8::quantize_row_pass(a + row * vecs_per_row, vecs_per_row, pass);
#pragma unroll
      for (int i = 0; i < fp8::kRowChunksPerLane; ++i) {
        const int c = pass + 32 * i + lane;
        if (c >= vecs_per_row) break;
        q[row * vecs_per_row + c] = quantised.q[i];
        if (lane % 16 == 0) {
          const int block = c / 16;
          scales[scales_ld > 0 ? row * scales_ld + block : int64_t(block) * rows + row] = quantised.scale[i];
        }
      }
    }
  }
}

// One CTA per 128 x 128 block of a [rows, k] matrix: thread t reads 8 columns (one 16-byte load) of
// rows t / 16 + 16 i, i < 8, and writes their 8 e4m3 bytes: to q [rows, k] with scales [rows / 128,
// k / 128], or Transposed, for rows = batches * n (blocks_n = n / 128), to q [batches, k, n] with
// scales [batches, k / 128, n / 128].
constexpr int kBlockThreads = 256;
constexpr int kRowsPerPass = kBlockThreads / 16;
static_assert(kBlock == fp8::kTile && kBlockThreads == fp8::kTileThreads, "a block is one transposed tile");

template <bool Transposed>
__global__ void __launch_bounds__(kBlockThreads)
quantize_blocks(const uint4* __restrict__ b, uint8_t* __restrict__ q, float* __restrict__ scales, int32_t blocks_k,
                int32_t blocks_n) {
  const int64_t block = blockIdx.x;
  const int64_t row_block = block / blocks_k, k_block = block % blocks_k;
  const int64_t row0 = row_block * kBlock + threadIdx.x / 16;
  const int64_t vecs_per_row = int64_t(blocks_k) * kBlock / 8;
  const int64_t col_vec = k_block * (kBlock / 8) + threadIdx.x % 16;
  float x[kBlock / kRowsPerPass][8];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kBlock / kRowsPerPass; ++i) {
    const uint4 v = b[(row0 + i * kRowsPerPass) * vecs_per_row + col_vec];
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(pairs[j]);
      x[i][2 * j] = f.x;
      x[i][2 * j + 1] = f.y;
      amax = fp8::max_nan(amax, fp8::max_nan(fabsf(f.x), fabsf(f.y)));
    }
  }
  const float scale = fp8::cta_block_scale<kBlockThreads>(amax);
  const float inverse = fp8::inverse(scale);
  const auto packed = [&](int i) {
    return make_uint2(fp8::to_e4m3x4(x[i][0], x[i][1], x[i][2], x[i][3], inverse),
                      fp8::to_e4m3x4(x[i][4], x[i][5], x[i][6], x[i][7], inverse));
  };
  if constexpr (!Transposed) {
    if (threadIdx.x == 0) scales[block] = scale;
#pragma unroll
    for (int i = 0; i < kBlock / kRowsPerPass; ++i) {
      reinterpret_cast<uint2*>(q)[(row0 + i * kRowsPerPass) * vecs_per_row + col_vec] = packed(i);
    }
  } else {
    __shared__ __align__(16) uint8_t tile[kBlock * fp8::kTilePitch];
    const int64_t batch = row_block / blocks_n, n_block = row_block % blocks_n;
    if (threadIdx.x == 0) scales[(batch * blocks_k + k_block) * blocks_n + n_block] = scale;
#pragma unroll
    for (int i = 0; i < kBlock / kRowsPerPass; ++i) {
      const int r = int(threadIdx.x) / 16 + i * kRowsPerPass;
      *reinterpret_cast<uint2*>(tile + r * fp8::kTilePitch + (threadIdx.x % 16) * 8) = packed(i);
    }
    __syncthreads();
    const int64_t n = int64_t(blocks_n) * kBlock, k = int64_t(blocks_k) * kBlock;
    fp8::store_tile_transposed(tile, q + batch * n * k + k_block * kBlock * n + n_block * kBlock, n);
  }
}

__global__ void __launch_bounds__(kWarpsPerCta * 32)
dequantize_rows(const uint32_t* __restrict__ q, const float* __restrict__ scales, Bf16x4* __restrict__ a,
                int64_t rows, int32_t blocks) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerCta;
  for (int64_t w = int64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32; w < rows * blocks; w += warps) {
    const int64_t i = w * 32 + lane;
    const float scale = scales[int64_t(w % blocks) * rows + w / blocks];
    const uint32_t packed = q[i];
    a[i] = {fp8::dequantize_e4m3x2(uint16_t(packed), scale), fp8::dequantize_e4m3x2(uint16_t(packed >> 16), scale)};
  }
}

// Checks the row kernels' arguments (a: bf16 rows, q: e4m3 rows, each aligned as its kernel loads and
// stores it) and sizes the grid for `warps` warps, at most 16 CTAs per SM (the warps then stride).
int row_grid(const std::string& fn, const void* a, int a_alignment, const void* q, int q_alignment,
             const float* scales, int64_t rows, int32_t k, int64_t warps, int* grid) {
  if (a == nullptr || q == nullptr || scales == nullptr) return invalid_argument(fn + "null pointer");
  if (rows < 0 || k <= 0 || k % kBlock != 0) {
    return invalid_argument(fn + "need rows >= 0 and k a positive multiple of 128, got rows " + std::to_string(rows) +
                            ", k " + std::to_string(k));
  }
  if (reinterpret_cast<uintptr_t>(a) % a_alignment || reinterpret_cast<uintptr_t>(q) % q_alignment) {
    return invalid_argument(fn + "the bf16 rows must be " + std::to_string(a_alignment) + "-byte and the e4m3 rows " +
                            std::to_string(q_alignment) + "-byte aligned");
  }
  int sms = 0;
  MEGAMOE_RETURN_IF_ERROR(current_sm_count(&sms));
  *grid = int(std::max<int64_t>(1, std::min<int64_t>(int64_t(sms) * 16, (warps + kWarpsPerCta - 1) / kWarpsPerCta)));
  return MEGAMOE_OK;
}

}  // namespace
}  // namespace megamoe

extern "C" int megamoe_quantize_rows_fp8(const megamoe_quantize_fp8_args* args, void* stream) {
  using namespace megamoe;
  const std::string fn = "megamoe_quantize_rows_fp8: ";
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  const megamoe_quantize_fp8_args& a = *args;
  if (a.scales_ld != 0 && a.scales_ld < a.k / kBlock) {
    return invalid_argument(fn + "scales_ld must be 0 (k-block major) or at least k / 128, got " +
                            std::to_string(a.scales_ld));
  }
  if (a.rows == 0) return MEGAMOE_OK;
  int grid = 0;
  MEGAMOE_RETURN_IF_ERROR(row_grid(fn, a.a, 16, a.q, 8, a.scales, a.rows, a.k, a.rows, &grid));
  quantize_rows<<<grid, kWarpsPerCta * 32, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const Bf16x8*>(a.a), static_cast<uint2*>(a.q), a.scales, a.rows, a.k / kBf16PerVec, a.scales_ld);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}

extern "C" int megamoe_dequantize_rows_fp8(const megamoe_dequantize_fp8_args* args, void* stream) {
  using namespace megamoe;
  const std::string fn = "megamoe_dequantize_rows_fp8: ";
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  const megamoe_dequantize_fp8_args& a = *args;
  if (a.rows == 0) return MEGAMOE_OK;
  int grid = 0;
  MEGAMOE_RETURN_IF_ERROR(row_grid(fn, a.a, 8, a.q, 4, a.scales, a.rows, a.k, a.rows * (a.k / kBlock), &grid));
  dequantize_rows<<<grid, kWarpsPerCta * 32, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint32_t*>(a.q), a.scales, static_cast<Bf16x4*>(a.a), a.rows, a.k / kBlock);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}

extern "C" int megamoe_quantize_blocks_fp8(const megamoe_quantize_fp8_args* args, void* stream) {
  using namespace megamoe;
  const std::string fn = "megamoe_quantize_blocks_fp8: ";
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  const megamoe_quantize_fp8_args& a = *args;
  if (a.a == nullptr || a.q == nullptr || a.scales == nullptr) return invalid_argument(fn + "null pointer");
  if (a.rows < 0 || a.rows % kBlock || a.k <= 0 || a.k % kBlock || a.scales_ld != 0) {
    return invalid_argument(fn + "need rows and k multiples of 128 and scales_ld 0, got rows " +
                            std::to_string(a.rows) + ", k " + std::to_string(a.k) + ", scales_ld " +
                            std::to_string(a.scales_ld));
  }
  if (reinterpret_cast<uintptr_t>(a.a) % 16 || reinterpret_cast<uintptr_t>(a.q) % 8) {
    return invalid_argument(fn + "the bf16 matrix must be 16-byte and the e4m3 one 8-byte aligned");
  }
  const int64_t blocks = (a.rows / kBlock) * (a.k / kBlock);
  if (blocks == 0) return MEGAMOE_OK;
  if (blocks > INT32_MAX) return invalid_argument(fn + "more than 2^31 blocks of 128 x 128");
  quantize_blocks<false><<<unsigned(blocks), kBlockThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint4*>(a.a), static_cast<uint8_t*>(a.q), a.scales, a.k / kBlock, 0);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}

extern "C" int megamoe_quantize_blocks_transposed_fp8(const megamoe_quantize_blocks_transposed_fp8_args* args,
                                                      void* stream) {
  using namespace megamoe;
  const std::string fn = "megamoe_quantize_blocks_transposed_fp8: ";
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  const megamoe_quantize_blocks_transposed_fp8_args& a = *args;
  if (a.w == nullptr || a.q_t == nullptr || a.scales_t == nullptr) return invalid_argument(fn + "null pointer");
  if (a.batches < 0 || a.n <= 0 || a.n % kBlock || a.k <= 0 || a.k % kBlock) {
    return invalid_argument(fn + "need batches >= 0 and n and k positive multiples of 128, got batches " +
                            std::to_string(a.batches) + ", n " + std::to_string(a.n) + ", k " + std::to_string(a.k));
  }
  if (reinterpret_cast<uintptr_t>(a.w) % 16 || reinterpret_cast<uintptr_t>(a.q_t) % 16) {
    return invalid_argument(fn + "w and q_t must be 16-byte aligned");
  }
  const int64_t blocks = a.batches * (a.n / kBlock) * (a.k / kBlock);
  if (blocks == 0) return MEGAMOE_OK;
  if (blocks > INT32_MAX) return invalid_argument(fn + "more than 2^31 blocks of 128 x 128");
  quantize_blocks<true><<<unsigned(blocks), kBlockThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint4*>(a.w), static_cast<uint8_t*>(a.q_t), a.scales_t, a.k / kBlock, a.n / kBlock);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}
