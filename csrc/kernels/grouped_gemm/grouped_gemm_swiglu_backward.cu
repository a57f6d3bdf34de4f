// megamoe_grouped_gemm_swiglu_backward_bf16: dh = dy_pool · w2[e] with the SwiGLU backward, the
// p-weighting and the dp partial sums in the epilogue (kernel.cuh with epilogue_swiglu_backward.cuh;
// w2 [E, H, I] is read as it is: B[e] = [K = H, N = I], MN-major).
#include "kernels/grouped_gemm/epilogue_swiglu_backward.cuh"
#include "kernels/grouped_gemm/launch.cuh"

using namespace megamoe;
using namespace megamoe::grouped_gemm;

extern "C" int megamoe_grouped_gemm_swiglu_backward_bf16(const void* dy_pool, const void* w2, const void* z_pool,
                                                         const float* p_pool, void* dz, void* hp, float* dp_partial,
                                                         const int32_t* block_expert, const int32_t* num_blocks,
                                                         int64_t max_blocks, int32_t intermediate, int32_t hidden,
                                                         int32_t num_local_experts, void* stream) {
  const std::string fn = "megamoe_grouped_gemm_swiglu_backward_bf16: ";
  if (dy_pool == nullptr || w2 == nullptr || z_pool == nullptr || p_pool == nullptr || dz == nullptr ||
      hp == nullptr || dp_partial == nullptr) {
    return invalid_argument(fn + "dy_pool, w2, z_pool, p_pool, dz, hp and dp_partial must be non-null");
  }
  if (int s = validate_pool_gemm(fn, block_expert, num_blocks, max_blocks, intermediate, "intermediate", hidden,
                                 "hidden", num_local_experts);
      s != MEGAMOE_OK) {
    return s;
  }
  if (!aligned16(dy_pool) || !aligned16(w2) || !aligned16(z_pool) || !aligned16(dz) || !aligned16(hp) ||
      !aligned16(p_pool) || !aligned16(dp_partial)) {
    return invalid_argument(fn + "dy_pool, w2, z_pool, p_pool, dz, hp and dp_partial must be 16-byte aligned");
  }
  if (int64_t(num_local_experts) * hidden > std::numeric_limits<int32_t>::max()) {
    return invalid_argument(fn + "num_local_experts * hidden exceeds the 32-bit row range of w2");
  }
  if (max_blocks == 0) return MEGAMOE_OK;  // an empty pool: nothing to compute or store

  const uint64_t rows = uint64_t(max_blocks) * kBlockM;
  CUtensorMap map_a, map_b;
  SwigluBackwardParams epi;
  if (int s = make_tensor_map(&map_a, dy_pool, rows, uint64_t(hidden), kBlockM, fn, "dy_pool"); s != MEGAMOE_OK) {
    return s;
  }
  // w2 as [E * H, I]: rows are K, columns N; 64 x 64 boxes (operand.cuh, MN-major).
  if (int s = make_tensor_map(&map_b, w2, uint64_t(num_local_experts) * hidden, uint64_t(intermediate), kBlockK, fn,
                              "w2");
      s != MEGAMOE_OK) {
    return s;
  }
  if (int s = make_tensor_map(&epi.dz, dz, rows, 2 * uint64_t(intermediate), kWarpgroupRows, fn, "dz");
      s != MEGAMOE_OK) {
    return s;
  }
  if (int s = make_tensor_map(&epi.hp, hp, rows, uint64_t(intermediate), kWarpgroupRows, fn, "hp"); s != MEGAMOE_OK) {
    return s;
  }
  if (int s = make_tensor_map(&epi.z, z_pool, rows, 2 * uint64_t(intermediate), kBlockM, fn, "z_pool");
      s != MEGAMOE_OK) {
    return s;
  }
  epi.p = p_pool;
  epi.dp_partial = dp_partial;
  epi.intermediate = intermediate;
  const BRows b_rows{hidden, 0};
  if (choose_block_n(intermediate) == 256) {
    return launch_pool<SwigluBackwardEpilogue<256>>(map_a, map_b, epi, block_expert, num_blocks, max_blocks,
                                                    intermediate / 256, b_rows, hidden, stream);
  }
  return launch_pool<SwigluBackwardEpilogue<128>>(map_a, map_b, epi, block_expert, num_blocks, max_blocks,
                                                  intermediate / 128, b_rows, hidden, stream);
}
