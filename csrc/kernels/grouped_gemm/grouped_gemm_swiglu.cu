// megamoe_grouped_gemm_swiglu_bf16: GEMM1 of the expert MLP with SwiGLU in the epilogue
// (kernel.cuh with epilogue_swiglu.cuh; each stage's B tile = 128 gate rows + the 128 matching up rows),
// optionally also storing z = gate | up for the backward.
#include "kernels/grouped_gemm/epilogue_swiglu.cuh"
#include "kernels/grouped_gemm/launch.cuh"

using namespace megamoe;
using namespace megamoe::grouped_gemm;

namespace {

template <bool KeepZ>
int launch_swiglu(const CUtensorMap& map_a, const CUtensorMap& map_b, const CUtensorMap& map_h, const CUtensorMap& map_z,
                  const int32_t* block_expert, const int32_t* num_blocks, int64_t max_blocks, int32_t intermediate,
                  int32_t hidden, void* stream) {
  using Epi = SwigluEpilogue<KeepZ>;
  const typename Epi::Params epi{map_h, map_z, intermediate};
  // Box 0 = gate rows [128 t, +128), box 1 = up rows [I + 128 t, +128) of the expert's 2I rows.
  const BRows b_rows{2 * intermediate, intermediate};
  return launch_pool<Epi>(map_a, map_b, epi, block_expert, num_blocks, max_blocks, intermediate / Epi::kHCols, b_rows,
                          hidden, stream);
}

}  // namespace

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
  if (int64_t(num_local_experts) * 2 * intermediate > std::numeric_limits<int32_t>::max()) {
    return invalid_argument(fn + "num_local_experts * 2 * intermediate exceeds the 32-bit row range of w13");
  }
  if (max_blocks == 0) return MEGAMOE_OK;  // an empty pool: nothing to compute or store

  const uint64_t rows = uint64_t(max_blocks) * kBlockM;
  using Cfg = SwigluEpilogue<false>::Cfg;
  CUtensorMap map_a, map_b, map_h, map_z{};
  if (int s = make_tensor_map(&map_a, a, rows, uint64_t(hidden), kBlockM, fn, "a"); s != MEGAMOE_OK) return s;
  if (int s = make_tensor_map(&map_b, w13, uint64_t(num_local_experts) * 2 * intermediate, uint64_t(hidden),
                              Cfg::kBBoxRows, fn, "w13");
      s != MEGAMOE_OK) {
    return s;
  }
  if (int s = make_tensor_map(&map_h, h, rows, uint64_t(intermediate), kWarpRows, fn, "h"); s != MEGAMOE_OK) {
    return s;
  }
  if (z == nullptr) {
    return launch_swiglu<false>(map_a, map_b, map_h, map_z, block_expert, num_blocks, max_blocks, intermediate, hidden,
                                stream);
  }
  if (int s = make_tensor_map(&map_z, z, rows, 2 * uint64_t(intermediate), kWarpRows, fn, "z"); s != MEGAMOE_OK) {
    return s;
  }
  return launch_swiglu<true>(map_a, map_b, map_h, map_z, block_expert, num_blocks, max_blocks, intermediate, hidden,
                             stream);
}
