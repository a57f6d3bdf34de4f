// Dispatch (one rank): copy each routed token row into its slot of the expert-major pool.
// One warp per pool row; the row's 16-byte chunks are spread over the lanes, and each lane keeps
// all its loads in flight before the first store. Padding rows of live blocks are zeroed so the
// GEMMs never read stale data; rows past the live blocks are not touched.
#include <algorithm>

#include "common/status.h"
#include "common/vec16.cuh"

namespace megamoe {
namespace {

constexpr int kWarpsPerCta = 8;
constexpr int kMaxVecsPerLane = 16;  // H up to 32 lanes * 16 * 8 = 4096 bf16 kept in registers

template <int kVecsPerLane>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
dispatch_rows(const Bf16x8* __restrict__ x, Bf16x8* __restrict__ pool,
              const int32_t* __restrict__ slot_to_route, const int32_t* __restrict__ num_blocks,
              int64_t max_rows, int32_t top_k, int32_t vecs_per_row) {
  const int lane = threadIdx.x % 32;
  const int64_t blocks_rows = int64_t(*num_blocks) * MEGAMOE_BLOCK_M;
  const int64_t live_rows = blocks_rows < max_rows ? blocks_rows : max_rows;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerCta;
  for (int64_t row = int64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32; row < live_rows;
       row += warps) {
    const int32_t route = slot_to_route[row];
    Bf16x8 v[kVecsPerLane];
#pragma unroll
    for (int i = 0; i < kVecsPerLane; ++i) {
      const int c = i * 32 + lane;
      v[i] = Bf16x8{};
      if (route >= 0 && c < vecs_per_row) v[i] = x[int64_t(route / top_k) * vecs_per_row + c];
    }
#pragma unroll
    for (int i = 0; i < kVecsPerLane; ++i) {
      const int c = i * 32 + lane;
      if (c < vecs_per_row) pool[row * vecs_per_row + c] = v[i];
    }
  }
}

template <int kVecsPerLane>
void launch(const void* x, void* pool, const int32_t* slot_to_route, const int32_t* num_blocks,
            int64_t max_rows, int32_t top_k, int32_t hidden, int grid, cudaStream_t stream) {
  dispatch_rows<kVecsPerLane><<<grid, kWarpsPerCta * 32, 0, stream>>>(
      static_cast<const Bf16x8*>(x), static_cast<Bf16x8*>(pool), slot_to_route, num_blocks,
      max_rows, top_k, hidden / kBf16PerVec);
}

}  // namespace
}  // namespace megamoe

extern "C" int megamoe_dispatch_bf16(const void* x, void* pool, const int32_t* slot_to_route,
                                     const int32_t* num_blocks, int64_t max_blocks, int32_t top_k,
                                     int32_t hidden, void* stream_handle) {
  using namespace megamoe;
  if (!x || !pool || !slot_to_route || !num_blocks) return invalid_argument("dispatch: null pointer");
  if (top_k < 1 || max_blocks < 0) return invalid_argument("dispatch: top_k must be >= 1, max_blocks >= 0");
  if (hidden <= 0 || hidden % kBf16PerVec || hidden > 32 * kMaxVecsPerLane * kBf16PerVec) {
    return invalid_argument("dispatch: hidden size " + std::to_string(hidden) +
                            " must be a positive multiple of 8 and at most 4096");
  }
  if ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(pool)) % 16) {
    return invalid_argument("dispatch: x and pool must be 16-byte aligned");
  }
  const int64_t max_rows = max_blocks * MEGAMOE_BLOCK_M;
  if (max_rows == 0) return MEGAMOE_OK;
  int device = 0, sms = 0;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int grid = int(std::min<int64_t>(int64_t(sms) * 8, (max_rows + kWarpsPerCta - 1) / kWarpsPerCta));
  auto stream = static_cast<cudaStream_t>(stream_handle);
  const int vecs_per_lane = (hidden / kBf16PerVec + 31) / 32;
  if (vecs_per_lane <= 4) {
    launch<4>(x, pool, slot_to_route, num_blocks, max_rows, top_k, hidden, grid, stream);
  } else if (vecs_per_lane <= 8) {
    launch<8>(x, pool, slot_to_route, num_blocks, max_rows, top_k, hidden, grid, stream);
  } else {
    launch<kMaxVecsPerLane>(x, pool, slot_to_route, num_blocks, max_rows, top_k, hidden, grid, stream);
  }
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}
