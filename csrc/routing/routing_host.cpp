// Host reference for the routing plan: the plain definition the CUDA plan is tested against.
#include <algorithm>
#include <string>
#include <vector>

#include "common/status.h"
#include "routing/routing.h"

namespace megamoe::routing {

namespace {

int check_shape(const std::string& fn, const megamoe_routing_shape& s) {
  if (s.num_tokens < 0) return invalid_argument(fn + "num_tokens must be >= 0");
  if (s.top_k < 1) return invalid_argument(fn + "top_k must be >= 1");
  if (s.num_experts < 1) return invalid_argument(fn + "num_experts must be >= 1");
  if (s.num_local_experts < 1 || s.expert_begin < 0 ||
      int64_t(s.expert_begin) + s.num_local_experts > s.num_experts) {
    return invalid_argument(fn + "local experts [" + std::to_string(s.expert_begin) + ", " +
                            std::to_string(int64_t(s.expert_begin) + s.num_local_experts) +
                            ") must lie inside [0, " + std::to_string(s.num_experts) + ")");
  }
  if (num_routes(s) > INT32_MAX / 2) {
    return invalid_argument(fn + "T * K = " + std::to_string(num_routes(s)) +
                            " routes exceeds the 32-bit slot index range");
  }
  return MEGAMOE_OK;
}

// The plan as the C API defines it, for int32 or int64 ids.
template <typename Id>
void build_host(const Id* topk_ids, const megamoe_routing_plan* plan) {
  const auto& s = plan->shape;
  const int64_t routes = num_routes(s);
  std::vector<int32_t> counts(s.num_local_experts, 0);
  int32_t invalid = 0;
  for (int64_t r = 0; r < routes; ++r) {
    const int32_t id = plan_id(topk_ids[r], s);
    invalid += is_invalid_id(id, s);
    const int32_t e = local_expert(id, s);
    if (e >= 0) ++counts[e];
  }

  int32_t blocks = 0, routed = 0;
  for (int32_t e = 0; e < s.num_local_experts; ++e) {
    plan->expert_counts[e] = counts[e];
    plan->expert_offsets[e] = blocks * kBlockM;
    plan->compact_offsets[e] = routed;
    routed += counts[e];
    const int32_t expert_blocks = int32_t(ceil_div(counts[e], kBlockM));
    for (int32_t b = 0; b < expert_blocks; ++b) plan->block_expert[blocks + b] = e;
    blocks += expert_blocks;
  }
  plan->expert_offsets[s.num_local_experts] = blocks * kBlockM;
  plan->compact_offsets[s.num_local_experts] = routed;
  std::fill(plan->block_expert + blocks, plan->block_expert + megamoe_routing_max_blocks(&s), -1);
  std::fill(plan->slot_to_route, plan->slot_to_route + megamoe_routing_capacity(&s), -1);
  *plan->num_blocks = blocks;
  *plan->num_invalid = invalid;
  if (plan->num_invalid_host != nullptr) *plan->num_invalid_host = invalid;

  std::vector<int32_t> next(plan->expert_offsets, plan->expert_offsets + s.num_local_experts);
  for (int64_t r = 0; r < routes; ++r) {
    const int32_t e = local_expert(plan_id(topk_ids[r], s), s);
    const int32_t slot = e >= 0 ? next[e]++ : -1;
    plan->route_to_slot[r] = slot;
    if (slot >= 0) plan->slot_to_route[slot] = int32_t(r);
  }
}

}  // namespace

int check_plan(const std::string& fn, const megamoe_routing_plan* plan) {
  if (plan == nullptr) return invalid_argument(fn + "plan must be non-null (a routing plan)");
  return check_shape(fn + "plan.shape: ", plan->shape);
}

int check_ids(const void* topk_ids, int32_t id_bytes, const megamoe_routing_shape& s) {
  if (id_bytes != 4 && id_bytes != 8) {
    return invalid_argument("routing: id_bytes must be 4 (int32 topk_ids) or 8 (int64), got " +
                            std::to_string(id_bytes));
  }
  if (num_routes(s) > 0 && topk_ids == nullptr) return invalid_argument("routing: topk_ids is null");
  return MEGAMOE_OK;
}

int validate(const megamoe_routing_plan* plan, bool needs_workspace) {
  if (plan == nullptr) return invalid_argument("routing: null plan");
  MEGAMOE_RETURN_IF_ERROR(check_shape("routing: ", plan->shape));
  const auto& s = plan->shape;
  if (!plan->expert_counts || !plan->expert_offsets || !plan->compact_offsets || !plan->slot_to_route ||
      !plan->block_expert || !plan->num_blocks || !plan->num_invalid ||
      (num_routes(s) > 0 && !plan->route_to_slot) || (needs_workspace && !plan->workspace)) {
    return invalid_argument("routing: a plan output pointer is null");
  }
  return MEGAMOE_OK;
}

}  // namespace megamoe::routing

using namespace megamoe::routing;

extern "C" int64_t megamoe_routing_capacity(const megamoe_routing_shape* shape) {
  return ceil_div(num_routes(*shape), kBlockM) * kBlockM + int64_t(shape->num_local_experts) * kBlockM;
}

extern "C" int64_t megamoe_routing_max_blocks(const megamoe_routing_shape* shape) {
  return megamoe_routing_capacity(shape) / kBlockM;
}

extern "C" int megamoe_build_routing_host(const void* topk_ids, int32_t id_bytes, const megamoe_routing_plan* plan) {
  MEGAMOE_RETURN_IF_ERROR(validate(plan, false));
  MEGAMOE_RETURN_IF_ERROR(check_ids(topk_ids, id_bytes, plan->shape));
  if (id_bytes == 8) {
    build_host(static_cast<const int64_t*>(topk_ids), plan);
  } else {
    build_host(static_cast<const int32_t*>(topk_ids), plan);
  }
  return MEGAMOE_OK;
}

extern "C" size_t megamoe_routing_workspace_bytes(const megamoe_routing_shape* shape) {
  // Per-chunk, per-expert counters (then the chunk's running base) and per-chunk invalid-id counts
  // for the CUDA plan; none where one cluster holds its counters in shared memory.
  return builds_in_one_cluster(*shape) ? 0 : size_t(chunk_counter_bytes(*shape));
}
