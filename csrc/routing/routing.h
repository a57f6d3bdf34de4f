// Routing internals shared by the host reference and the CUDA implementation.
#pragma once

#include <cstdint>
#include <string>

#include "megamoe/megamoe.h"

#ifdef __CUDACC__
#define MEGAMOE_HOST_DEVICE __host__ __device__
#else
#define MEGAMOE_HOST_DEVICE
#endif

namespace megamoe::routing {

constexpr int kBlockM = MEGAMOE_BLOCK_M;
// Routes one warp scans in the CUDA plan; each chunk keeps its own per-expert counters so that the
// slot order inside an expert follows route order without a global sort.
constexpr int kRoutesPerChunk = 512;

MEGAMOE_HOST_DEVICE inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

MEGAMOE_HOST_DEVICE inline int64_t num_routes(const megamoe_routing_shape& s) { return s.num_tokens * s.top_k; }

MEGAMOE_HOST_DEVICE inline int64_t num_chunks(const megamoe_routing_shape& s) {
  return ceil_div(num_routes(s), kRoutesPerChunk);
}

// Small plans (up to 8192 routes and 1024 local experts) are built by one launch of a cluster of up
// to 8 CTAs, a thread per route, whose counters stay in shared memory (read across the cluster):
// no workspace, and none of the three launches' waits between passes on the critical path.
constexpr int64_t kClusterRoutesPerCta = 1024;
constexpr int64_t kClusterMaxCtas = 8;
constexpr int32_t kClusterMaxExperts = 1024;

MEGAMOE_HOST_DEVICE inline int64_t chunk_counter_bytes(const megamoe_routing_shape& s) {
  return num_chunks(s) * (int64_t(s.num_local_experts) + 1) * int64_t(sizeof(int32_t));
}

MEGAMOE_HOST_DEVICE inline bool builds_in_one_cluster(const megamoe_routing_shape& s) {
  return num_routes(s) <= kClusterRoutesPerCta * kClusterMaxCtas && s.num_local_experts <= kClusterMaxExperts;
}

// Local expert of a global id, or -1 for masked, out-of-range or other ranks' experts.
MEGAMOE_HOST_DEVICE inline int32_t local_expert(int32_t id, const megamoe_routing_shape& s) {
  const int32_t local = id - s.expert_begin;
  return (local >= 0 && local < s.num_local_experts) ? local : -1;
}

MEGAMOE_HOST_DEVICE inline bool is_invalid_id(int32_t id, const megamoe_routing_shape& s) {
  return id < -1 || id >= s.num_experts;
}

// A route's id as the plan reads it, from int32 or int64 ids: an int64 id outside [-1, E) becomes
// -2 or E, so one past int32's range is counted as invalid instead of wrapping onto an expert.
MEGAMOE_HOST_DEVICE inline int32_t plan_id(int32_t id, const megamoe_routing_shape&) { return id; }
MEGAMOE_HOST_DEVICE inline int32_t plan_id(int64_t id, const megamoe_routing_shape& s) {
  return id < -1 ? -2 : (id >= s.num_experts ? s.num_experts : int32_t(id));
}

// Checks the ids a plan is built from: their element size, 4 (int32) or 8 (int64), and a pointer
// wherever there are routes; returns MEGAMOE_OK or sets the last error.
int check_ids(const void* topk_ids, int32_t id_bytes, const megamoe_routing_shape& s);

// Checks a plan before it is built: its shape and its output pointers; returns MEGAMOE_OK or sets
// the last error.
int validate(const megamoe_routing_plan* plan, bool needs_workspace);

// Checks a plan handed to a consumer (dispatch, combine, the pool GEMMs): non-null, with a valid
// shape. `fn` ("megamoe_...: ") prefixes the message. The consumer checks the arrays it reads.
int check_plan(const std::string& fn, const megamoe_routing_plan* plan);

inline int64_t max_blocks(const megamoe_routing_plan& plan) { return megamoe_routing_max_blocks(&plan.shape); }
inline int64_t pool_rows(const megamoe_routing_plan& plan) { return megamoe_routing_capacity(&plan.shape); }

}  // namespace megamoe::routing
