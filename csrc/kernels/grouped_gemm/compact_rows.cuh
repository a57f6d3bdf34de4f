// z's rows. GEMM1 keeps z = gate | up compact: one row per route of the plan's local experts,
// expert by expert, without the padding rows that round each expert up to 128 in the pool
// (megamoe.h). So the backward keeps T·K rows, not the pool's worst case of T·K + 127 per expert.
// A pool block's rows are z's rows shifted by one offset, and its expert's z rows end where the next
// expert's begin; past that end the block holds padding, which z leaves out.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "megamoe/megamoe.h"
#include "routing/routing.h"

namespace megamoe::grouped_gemm {

struct CompactRows {
  const int32_t* block_expert;
  const int32_t* expert_offsets;
  const int32_t* compact_offsets;

  // Whether the plan has the arrays (fn, "megamoe_...: ", prefixes the message).
  static int check(const std::string& fn, const megamoe_routing_plan& plan) {
    if (plan.expert_offsets == nullptr || plan.compact_offsets == nullptr) {
      return invalid_argument(fn + "the plan's expert_offsets and compact_offsets must be non-null (z is compact)");
    }
    return MEGAMOE_OK;
  }
  static CompactRows of(const megamoe_routing_plan& plan) {
    return {plan.block_expert, plan.expert_offsets, plan.compact_offsets};
  }
  // z's rows for its TMA maps: T·K, or one for a plan without routes (no tile reads or writes z then,
  // but a map needs a row).
  static uint64_t rows(const megamoe_routing_plan& plan) {
    const int64_t routes = routing::num_routes(plan.shape);
    return uint64_t(routes > 0 ? routes : 1);
  }

  struct Block {
    int shift;  // z row = pool row - shift
    int end;    // the first z row past the block's expert
  };
  __device__ Block block(int b) const {
    const int e = __ldg(block_expert + b);
    const int first = __ldg(compact_offsets + e);
    return {__ldg(expert_offsets + e) - first, __ldg(compact_offsets + e + 1)};
  }
};

}  // namespace megamoe::grouped_gemm
