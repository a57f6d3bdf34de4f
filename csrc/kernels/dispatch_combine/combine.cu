// Combine (one rank): y[t] = Σ_k p[t, k] · routed[t*K + k] (p = 1 without topk_weights), summed in
// ascending k in fp32 and rounded once. Deterministic, no atomics. Routes without a slot (masked) are
// skipped, so their rows of `routed`, never written, are never read.
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

extern "C" int megamoe_combine_bf16(const megamoe_routing_plan* plan, const megamoe_combine_args* args,
                                    void* stream_handle) {
  using namespace megamoe;
  const std::string fn = "megamoe_combine_bf16: ";
  MEGAMOE_RETURN_IF_ERROR(routing::check_plan(fn, plan));
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  const megamoe_combine_args& a = *args;
  const int64_t num_tokens = plan->shape.num_tokens;
  if (num_tokens == 0) return MEGAMOE_OK;
  if (!a.routed || !plan->route_to_slot || !a.y) {
    return invalid_argument(fn + "routed, y and the plan's route_to_slot must be non-null");
  }
  if (a.hidden <= 0 || a.hidden % kBf16PerVec) {
    return invalid_argument(fn + "hidden size " + std::to_string(a.hidden) + " must be a positive multiple of 8");
  }
  if (!aligned16(a.routed) || !aligned16(a.y)) return invalid_argument(fn + "routed and y must be 16-byte aligned");
  int grid = 0;
  MEGAMOE_RETURN_IF_ERROR(warp_grid(num_tokens, &grid));
  combine_rows<<<grid, kWarpsPerCta * 32, 0, static_cast<cudaStream_t>(stream_handle)>>>(
      static_cast<const Bf16x8*>(a.routed), a.topk_weights, plan->route_to_slot, static_cast<Bf16x8*>(a.y),
      num_tokens, plan->shape.top_k, a.hidden / kBf16PerVec);
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}
