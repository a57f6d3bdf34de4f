// megamoe_grouped_gemm_swiglu_gather_bf16: GEMM1 + SwiGLU whose producer gathers the A rows from the
// token rows x itself (operand_gather.cuh), so no dispatched pool of x is written.
#include "kernels/grouped_gemm/operand_gather.cuh"
#include "kernels/grouped_gemm/swiglu_launch.cuh"

using namespace megamoe;
using namespace megamoe::grouped_gemm;

extern "C" int megamoe_grouped_gemm_swiglu_gather_bf16(const void* x, int64_t num_tokens, int32_t top_k,
                                                       const int32_t* slot_to_route, const void* w13, void* h,
                                                       const int32_t* block_expert, const int32_t* num_blocks,
                                                       int64_t max_blocks, int32_t intermediate, int32_t hidden,
                                                       int32_t num_local_experts, void* stream) {
  const std::string fn = "megamoe_grouped_gemm_swiglu_gather_bf16: ";
  if (x == nullptr || slot_to_route == nullptr || w13 == nullptr || h == nullptr) {
    return invalid_argument(fn + "x, slot_to_route, w13 and h must be non-null");
  }
  if (num_tokens < 0) return invalid_argument(fn + "num_tokens must be >= 0, got " + std::to_string(num_tokens));
  if (top_k < 1) return invalid_argument(fn + "top_k must be >= 1, got " + std::to_string(top_k));
  if (num_tokens > std::numeric_limits<int32_t>::max() / top_k) {
    return invalid_argument(fn + "num_tokens * top_k exceeds the 32-bit route range of slot_to_route");
  }
  if (int s = validate_pool_gemm(fn, block_expert, num_blocks, max_blocks, intermediate, "intermediate", hidden,
                                 "hidden", num_local_experts);
      s != MEGAMOE_OK) {
    return s;
  }
  // cp.async copies 16-byte pieces of x's rows (hidden is a multiple of 128: every row stays aligned).
  if (!aligned16(x) || !aligned16(w13) || !aligned16(h)) {
    return invalid_argument(fn + "x, w13 and h must be 16-byte aligned (cp.async, TMA)");
  }
  if (int s = check_w13_rows(fn, num_local_experts, intermediate); s != MEGAMOE_OK) return s;
  if (max_blocks == 0) return MEGAMOE_OK;  // an empty pool: nothing to compute or store

  const GatheredA::Params a{static_cast<const uint8_t*>(x), slot_to_route, uint32_t(hidden) * 2, top_k,
                            int32_t(num_tokens * top_k)};
  return launch_swiglu<false, GatheredA>(a, w13, h, nullptr, block_expert, num_blocks, max_blocks, intermediate,
                                         hidden, num_local_experts, stream, fn);
}
