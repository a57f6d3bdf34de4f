// Combine (one rank): y[t] = Σ_k p[t, k] · routed[t*K + k], summed in ascending k in fp32 and
// rounded once. Deterministic, no atomics. Routes without a slot (masked) are skipped, so their
// rows of `routed`, never written, are never read.
#include "kernels/dispatch_combine/warp_rows.cuh"

namespace megamoe {
namespace {

__global__ void __launch_bounds__(kWarpsPerCta * 32)
combine_rows(const Bf16x8* __restrict__ routed, const float* __restrict__ topk_weights,
             const int32_t* __restrict__ route_to_slot, Bf16x8* __restrict__ y, int64_t num_tokens,
             int32_t top_k, int32_t vecs_per_row) {
  const auto route_row = [&](int64_t route) -> const Bf16x8* {
    return route_to_slot[route] < 0 ? nullptr : routed + route * vecs_per_row;
  };
  combine_tokens(route_row, topk_weights, y, num_tokens, top_k, vecs_per_row);
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
  if (!aligned16(routed) || !aligned16(y)) return invalid_argument("combine: routed and y must be 16-byte aligned");
  int grid = 0;
  if (int s = warp_grid(num_tokens, &grid); s != MEGAMOE_OK) return s;
  combine_rows<<<grid, kWarpsPerCta * 32, 0, static_cast<cudaStream_t>(stream_handle)>>>(
      static_cast<const Bf16x8*>(routed), topk_weights, route_to_slot, static_cast<Bf16x8*>(y),
      num_tokens, top_k, hidden / kBf16PerVec);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}
