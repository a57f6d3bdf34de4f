// Host side shared by the GEMM1 + SwiGLU entry points (A from a dispatched pool by TMA, or gathered
// from the token rows): the w13 check, the w13 / h / z tensor maps and the launch.
#pragma once

#include "kernels/grouped_gemm/epilogue_swiglu.cuh"
#include "kernels/grouped_gemm/launch.cuh"

namespace megamoe::grouped_gemm {

// w13 is addressed as one [E_local * 2I, H] matrix with 32-bit TMA row coordinates.
inline int check_w13_rows(const std::string& fn, int32_t num_local_experts, int32_t intermediate) {
  if (int64_t(num_local_experts) * 2 * intermediate > std::numeric_limits<int32_t>::max()) {
    return invalid_argument(fn + "num_local_experts * 2 * intermediate exceeds the 32-bit row range of w13");
  }
  return MEGAMOE_OK;
}

// H (and z when KeepZ) = SwiGLU(A · w13[e]ᵀ) over the pool's live blocks; A's source is A's policy.
template <bool KeepZ, class A>
int launch_swiglu(const typename A::Params& a, const void* w13, void* h, void* z, const int32_t* block_expert,
                  const int32_t* num_blocks, int64_t max_blocks, int32_t intermediate, int32_t hidden,
                  int32_t num_local_experts, void* stream, const std::string& fn) {
  using Epi = SwigluEpilogue<KeepZ>;
  const uint64_t rows = uint64_t(max_blocks) * kBlockM;
  CUtensorMap map_b;
  typename Epi::Params epi{};
  epi.intermediate = intermediate;
  if (int s = make_tensor_map(&map_b, w13, uint64_t(num_local_experts) * 2 * intermediate, uint64_t(hidden),
                              Epi::Cfg::kBBoxRows, fn, "w13");
      s != MEGAMOE_OK) {
    return s;
  }
  if (int s = make_tensor_map(&epi.h, h, rows, uint64_t(intermediate), kWarpgroupRows, fn, "h"); s != MEGAMOE_OK) {
    return s;
  }
  if constexpr (KeepZ) {
    if (int s = make_tensor_map(&epi.z, z, rows, 2 * uint64_t(intermediate), kWarpgroupRows, fn, "z");
        s != MEGAMOE_OK) {
      return s;
    }
  }
  // Box 0 = gate rows [128 t, +128), box 1 = up rows [I + 128 t, +128) of the expert's 2I rows.
  const BRows b_rows{2 * intermediate, intermediate};
  return launch_pool<Epi, A>(a, map_b, epi, block_expert, num_blocks, max_blocks, intermediate / Epi::kHCols, b_rows,
                             hidden, stream);
}

}  // namespace megamoe::grouped_gemm
