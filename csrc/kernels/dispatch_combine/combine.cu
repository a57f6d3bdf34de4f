// Combine (one rank): y[t] = Σ_k p[t, k] · routed[t*K + k], summed in ascending k in fp32 and
// rounded once. Deterministic, no atomics. Routes without a slot (masked) are skipped, so their
// rows of `routed`, never written, are never read.
#include <algorithm>

#include "common/status.h"
#include "common/vec16.cuh"

namespace megamoe {
namespace {

constexpr int kWarpsPerCta = 8;

__global__ void __launch_bounds__(kWarpsPerCta * 32)
combine_rows(const Bf16x8* __restrict__ routed, const float* __restrict__ topk_weights,
             const int32_t* __restrict__ route_to_slot, Bf16x8* __restrict__ y, int64_t num_tokens,
             int32_t top_k, int32_t vecs_per_row) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerCta;
  for (int64_t t = int64_t(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32; t < num_tokens; t += warps) {
    for (int c = lane; c < vecs_per_row; c += 32) {
      float acc[kBf16PerVec] = {};
      for (int k = 0; k < top_k; ++k) {
        const int64_t route = t * top_k + k;
        if (route_to_slot[route] < 0) continue;
        add_scaled(acc, routed[route * vecs_per_row + c], topk_weights[route]);
      }
      y[t * vecs_per_row + c] = round_to_bf16(acc);
    }
  }
}

}  // namespace
}  // namespace megamoe

extern "C" int megamoe_combine_bf16(const void* routed, const float* topk_weights,
                                    const int32_t* route_to_slot, void* y, int64_t num_tokens,
                                    int32_t top_k, int32_t hidden, void* stream_handle) {
  using namespace megamoe;
  if (num_tokens < 0 || top_k < 1) return invalid_argument("combine: need num_tokens >= 0 and top_k >= 1");
  if (num_tokens == 0) return MEGAMOE_OK;
  if (!routed || !topk_weights || !route_to_slot || !y) return invalid_argument("combine: null pointer");
  if (hidden <= 0 || hidden % kBf16PerVec) {
    return invalid_argument("combine: hidden size " + std::to_string(hidden) + " must be a positive multiple of 8");
  }
  if ((reinterpret_cast<uintptr_t>(routed) | reinterpret_cast<uintptr_t>(y)) % 16) {
    return invalid_argument("combine: routed and y must be 16-byte aligned");
  }
  int device = 0, sms = 0;
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int grid = int(std::min<int64_t>(int64_t(sms) * 8, (num_tokens + kWarpsPerCta - 1) / kWarpsPerCta));
  combine_rows<<<grid, kWarpsPerCta * 32, 0, static_cast<cudaStream_t>(stream_handle)>>>(
      static_cast<const Bf16x8*>(routed), topk_weights, route_to_slot, static_cast<Bf16x8*>(y),
      num_tokens, top_k, hidden / kBf16PerVec);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}
