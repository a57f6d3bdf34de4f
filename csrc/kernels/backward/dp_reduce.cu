// dp reduce: dp[route] = Σ_t dp_partial[slot, t] over the dh epilogue's per-n-tile partial sums
// (kernels/grouped_gemm/epilogue_gated_backward.cuh), t ascending, fp32. Deterministic, no atomics. Routes without a
// slot (masked, non-local) or with a slot outside the pool get 0.
#include <algorithm>
#include <string>

#include "common/device.h"
#include "common/status.h"
#include "routing/routing.h"

namespace megamoe {
namespace {

constexpr int kThreadsPerCta = 256;

__global__ void __launch_bounds__(kThreadsPerCta)
dp_reduce_routes(const float* __restrict__ dp_partial, const int32_t* __restrict__ route_to_slot,
                 float* __restrict__ dp, int64_t num_routes, int32_t cols, int64_t pool_rows) {
  const int64_t stride = int64_t(gridDim.x) * kThreadsPerCta;
  for (int64_t route = int64_t(blockIdx.x) * kThreadsPerCta + threadIdx.x; route < num_routes; route += stride) {
    const int32_t slot = route_to_slot[route];
    float sum = 0.f;
    if (slot >= 0 && slot < pool_rows) {
      const float* row = dp_partial + int64_t(slot) * cols;
      for (int t = 0; t < cols; ++t) sum += row[t];
    }
    dp[route] = sum;
  }
}

}  // namespace
}  // namespace megamoe

extern "C" int megamoe_dp_reduce(const megamoe_routing_plan* plan, const megamoe_dp_reduce_args* args,
                                 void* stream) {
  using namespace megamoe;
  const std::string fn = "megamoe_dp_reduce: ";
  MEGAMOE_RETURN_IF_ERROR(routing::check_plan(fn, plan));
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  const megamoe_dp_reduce_args& a = *args;
  if (a.intermediate <= 0 || a.intermediate % 8 != 0) {
    return invalid_argument(fn + "intermediate must be a positive multiple of 8, got " +
                            std::to_string(a.intermediate));
  }
  const int64_t num_routes = routing::num_routes(plan->shape);
  if (num_routes == 0) return MEGAMOE_OK;
  if (a.dp_partial == nullptr || plan->route_to_slot == nullptr || a.dp == nullptr) {
    return invalid_argument(fn + "dp_partial, dp and the plan's route_to_slot must be non-null");
  }
  int sms = 0;
  MEGAMOE_RETURN_IF_ERROR(current_sm_count(&sms));
  const int grid = int(std::min<int64_t>(int64_t(sms) * 8, (num_routes + kThreadsPerCta - 1) / kThreadsPerCta));
  dp_reduce_routes<<<grid, kThreadsPerCta, 0, static_cast<cudaStream_t>(stream)>>>(
      a.dp_partial, plan->route_to_slot, a.dp, num_routes, MEGAMOE_DP_PARTIAL_COLS(a.intermediate),
      routing::pool_rows(*plan));
  MEGAMOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return MEGAMOE_OK;
}
