// megamoe_grouped_gemm_swiglu_bf16: GEMM1 of the expert MLP with SwiGLU in the epilogue
// (kernel.cuh with epilogue_swiglu.cuh; each stage's B tile = 128 gate rows + the 128 matching up rows),
// optionally also storing z = gate | up for the backward.
#include "kernels/grouped_gemm/swiglu_launch.cuh"

using namespace megamoe;
using namespace megamoe::grouped_gemm;

extern "C" int megamoe_grouped_gemm_swiglu_bf16(const void* a, const void* w13, void* h, void* z,
                                                const int32_t* block_expert, const int32_t* num_blocks,
                                                int64_t max_blocks, int32_t intermediate, int32_t hidden,
                                                int32_t num_local_experts, void* stream) {
  const std::string fn = "megamoe_grouped_gemm_swiglu_bf16: ";
  if (a == nullptr || w13 == nullptr || h == nullptr) return invalid_argument(fn + "a, w13 and h must be non-null");
  if (int s = validate_pool_gemm(fn, block_expert, num_blocks, max_blocks, intermediate, "intermediate", hidden,
                                 "hidden", num_local_experts);
      s != MEGAMOE_OK) {
    return s;
  }
  if (!aligned16(a) || !aligned16(w13) || !aligned16(h) || !aligned16(z)) {
    return invalid_argument(fn + "a, w13, h and z must be 16-byte aligned (TMA)");
  }
  if (int s = check_w13_rows(fn, num_local_experts, intermediate); s != MEGAMOE_OK) return s;
  if (max_blocks == 0) return MEGAMOE_OK;  // an empty pool: nothing to compute or store

  CUtensorMap map_a;
  if (int s = make_tensor_map(&map_a, a, uint64_t(max_blocks) * kBlockM, uint64_t(hidden), kBlockM, fn, "a");
      s != MEGAMOE_OK) {
    return s;
  }
  return z == nullptr ? launch_swiglu<false, TmaLoadedA>(map_a, w13, h, z, block_expert, num_blocks, max_blocks,
                                                         intermediate, hidden, num_local_experts, stream, fn)
                      : launch_swiglu<true, TmaLoadedA>(map_a, w13, h, z, block_expert, num_blocks, max_blocks,
                                                        intermediate, hidden, num_local_experts, stream, fn);
}
