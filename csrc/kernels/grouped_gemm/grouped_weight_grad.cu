// megamoe_grouped_weight_grad_bf16: out[e] = A[rows of e]ᵀ · B[rows of e] for every local expert,
// K running over the expert's routed pool rows (kernel.cuh with scheduler_expert.cuh and
// epilogue_weight_grad.cuh; both operands token-major, i.e. MN-major).
#include "kernels/grouped_gemm/epilogue_weight_grad.cuh"
#include "kernels/grouped_gemm/launch.cuh"

using namespace megamoe;
using namespace megamoe::grouped_gemm;

namespace {

template <int BlockN, bool Fp32>
int weight_grad(const CUtensorMap& map_a, const CUtensorMap& map_b, void* out, const int32_t* expert_offsets,
                const int32_t* expert_counts, int64_t pool_rows, int32_t num_local_experts, int32_t m, int32_t n,
                int accumulate, void* stream, const std::string& fn) {
  using Epi = WeightGradEpilogue<BlockN, Fp32>;
  typename Epi::Params epi{};
  if constexpr (!Fp32) {
    if (int s = make_tensor_map(&epi.c, out, uint64_t(num_local_experts) * m, uint64_t(n), kWarpRows, fn, "out");
        s != MEGAMOE_OK) {
      return s;
    }
  }
  epi.out = static_cast<float*>(out);
  epi.m = m;
  epi.n = n;
  epi.accumulate = accumulate;
  const ExpertScheduler::Params sched{expert_offsets, expert_counts, num_local_experts, m / kBlockM, n / BlockN,
                                      int(pool_rows)};
  const int64_t tiles = int64_t(num_local_experts) * (m / kBlockM) * (n / BlockN);
  return launch<Epi, ExpertScheduler>(map_a, map_b, epi, sched, tiles, stream);
}

}  // namespace

extern "C" int megamoe_grouped_weight_grad_bf16(const void* a_pool, const void* b_pool, void* out,
                                                const int32_t* expert_offsets, const int32_t* expert_counts,
                                                int64_t max_blocks, int32_t num_local_experts, int32_t m, int32_t n,
                                                int32_t out_fp32, int32_t accumulate, void* stream) {
  constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
  const std::string fn = "megamoe_grouped_weight_grad_bf16: ";
  if (a_pool == nullptr || b_pool == nullptr || out == nullptr || expert_offsets == nullptr ||
      expert_counts == nullptr) {
    return invalid_argument(fn + "a_pool, b_pool, out, expert_offsets and expert_counts must be non-null");
  }
  if (m <= 0 || m % 128 != 0) return invalid_argument(fn + "m must be a positive multiple of 128, got " + std::to_string(m));
  if (n <= 0 || n % 128 != 0) return invalid_argument(fn + "n must be a positive multiple of 128, got " + std::to_string(n));
  if (num_local_experts < 1) {
    return invalid_argument(fn + "num_local_experts must be >= 1, got " + std::to_string(num_local_experts));
  }
  if (max_blocks < 0) return invalid_argument(fn + "max_blocks must be >= 0, got " + std::to_string(max_blocks));
  if (max_blocks * kBlockM > kIntMax) {
    return invalid_argument(fn + "max_blocks = " + std::to_string(max_blocks) + " exceeds the 32-bit row range");
  }
  if (int64_t(num_local_experts) * m > kIntMax || int64_t(num_local_experts) * (m / 128) * (n / 128) > kIntMax) {
    return invalid_argument(fn + "num_local_experts * m exceeds the 32-bit row range of out");
  }
  if (out_fp32 != 0 && out_fp32 != 1) return invalid_argument(fn + "out_fp32 must be 0 or 1");
  if (accumulate != 0 && accumulate != 1) return invalid_argument(fn + "accumulate must be 0 or 1");
  if (accumulate && !out_fp32) {
    return invalid_argument(fn + "accumulate = 1 needs out_fp32 = 1 (accumulation into a bf16 gradient is not supported)");
  }
  if (!aligned16(a_pool) || !aligned16(b_pool) || !aligned16(out)) {
    return invalid_argument(fn + "a_pool, b_pool and out must be 16-byte aligned");
  }

  // With no pool rows every expert is empty: the kernel still writes (or adds) zeros, and never
  // loads, so the maps only need a valid shape.
  const int64_t pool_rows = max_blocks * kBlockM;
  const uint64_t map_rows = uint64_t(pool_rows > 0 ? pool_rows : kBlockM);
  CUtensorMap map_a, map_b;
  if (int s = make_tensor_map(&map_a, a_pool, map_rows, uint64_t(m), kBlockK, fn, "a_pool"); s != MEGAMOE_OK) {
    return s;
  }
  if (int s = make_tensor_map(&map_b, b_pool, map_rows, uint64_t(n), kBlockK, fn, "b_pool"); s != MEGAMOE_OK) {
    return s;
  }
  const bool wide = choose_block_n(n) == 256;
  if (out_fp32) {
    return wide ? weight_grad<256, true>(map_a, map_b, out, expert_offsets, expert_counts, pool_rows, num_local_experts,
                                         m, n, accumulate, stream, fn)
                : weight_grad<128, true>(map_a, map_b, out, expert_offsets, expert_counts, pool_rows, num_local_experts,
                                         m, n, accumulate, stream, fn);
  }
  return wide ? weight_grad<256, false>(map_a, map_b, out, expert_offsets, expert_counts, pool_rows, num_local_experts,
                                        m, n, 0, stream, fn)
              : weight_grad<128, false>(map_a, map_b, out, expert_offsets, expert_counts, pool_rows, num_local_experts,
                                        m, n, 0, stream, fn);
}
