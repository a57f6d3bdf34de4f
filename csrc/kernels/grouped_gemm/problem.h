// What the host side of a pool GEMM knows of its problem: the routing plan's pool, the GEMM's N and
// K, and the API function's name for messages. Each policy builds its device parameters from it
// (to_params) and says whether it can run it (can_implement); launch.cuh puts them together.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>

#include "common/status.h"
#include "megamoe/megamoe.h"
#include "routing/routing.h"

namespace megamoe::grouped_gemm {

struct PoolProblem {
  std::string fn;  // "megamoe_...: ", prefixes every message
  const megamoe_routing_plan* plan;
  int64_t max_blocks;  // pool blocks the plan can hold
  uint64_t rows;       // pool rows: max_blocks * 128
  int32_t n, k;        // the GEMM's N (columns of the output tile rows) and K
  int32_t num_local_experts;
};

struct NamedPointer {
  const void* ptr;
  const char* name;
};

// Each pointer non-null and 16-byte aligned (TMA, and the epilogues' 16-byte stores).
inline int check_pointers(const std::string& fn, std::initializer_list<NamedPointer> pointers) {
  for (const NamedPointer& p : pointers) {
    if (p.ptr == nullptr) return invalid_argument(fn + p.name + " must be non-null");
    if (!aligned16(p.ptr)) return invalid_argument(fn + p.name + " must be 16-byte aligned (TMA)");
  }
  return MEGAMOE_OK;
}

// `rows` rows (e.g. E_local * N of a K-major B) must fit TMA's 32-bit coordinates.
inline int check_row_range(const std::string& fn, int64_t rows, const char* what) {
  if (rows > std::numeric_limits<int32_t>::max()) {
    return invalid_argument(fn + what + " = " + std::to_string(rows) + " exceeds the 32-bit row range of TMA");
  }
  return MEGAMOE_OK;
}

// N and K of a bf16 GEMM: rows of 16 bytes (TMA's stride unit); the tiles past N or K are cut off
// (TMA fills what it loads past them with zeros and stores nothing there). Block FP8: whole 128-wide
// scale blocks.
constexpr int32_t kBf16SizeMultiple = 8;
constexpr int32_t kFp8SizeMultiple = 128;

// Checks the plan and the sizes every pool GEMM shares (n_name / k_name: the caller's names for N
// and K; both multiples of `multiple`); fills `out`.
inline int make_pool_problem(const std::string& fn, const megamoe_routing_plan* plan, int32_t n, const char* n_name,
                             int32_t k, const char* k_name, int32_t multiple, PoolProblem* out) {
  MEGAMOE_RETURN_IF_ERROR(routing::check_plan(fn, plan));
  if (plan->block_expert == nullptr || plan->num_blocks == nullptr) {
    return invalid_argument(fn + "the plan's block_expert and num_blocks must be non-null (device pointers)");
  }
  const std::string why = multiple == kFp8SizeMultiple ? " (block-FP8 scale blocks)" : " (16-byte bf16 rows)";
  if (n <= 0 || n % multiple != 0) {
    return invalid_argument(fn + n_name + " must be a positive multiple of " + std::to_string(multiple) + why +
                            ", got " + std::to_string(n));
  }
  if (k <= 0 || k % multiple != 0) {
    return invalid_argument(fn + k_name + " must be a positive multiple of " + std::to_string(multiple) + why +
                            ", got " + std::to_string(k));
  }
  const int64_t max_blocks = routing::max_blocks(*plan);
  // TMA coordinates and the tile counter are 32-bit.
  MEGAMOE_RETURN_IF_ERROR(check_row_range(fn, max_blocks * MEGAMOE_BLOCK_M, "the plan's pool rows"));
  MEGAMOE_RETURN_IF_ERROR(check_row_range(fn, max_blocks * ((n + 127) / 128), "the plan's blocks x n-tiles"));
  *out = PoolProblem{fn, plan, max_blocks, uint64_t(max_blocks) * MEGAMOE_BLOCK_M, n, k,
                     plan->shape.num_local_experts};
  return MEGAMOE_OK;
}

}  // namespace megamoe::grouped_gemm
