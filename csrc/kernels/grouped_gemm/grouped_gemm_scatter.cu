// megamoe_grouped_gemm_scatter_bf16 / _mn_bf16: each pool row of A · B[e] written straight into its
// (token, k) slot (kernel.cuh with epilogue_scatter.cuh). The forward's GEMM2 reads w2 [E, N, K]
// (K-major B); the backward's dx per route reads w13 [E, K = 2I, N = H] as it is (MN-major B).
#include "kernels/grouped_gemm/epilogue_scatter.cuh"
#include "kernels/grouped_gemm/launch.cuh"

using namespace megamoe;
using namespace megamoe::grouped_gemm;

namespace {

template <int BlockN, Major BMajor>
int scatter(const CUtensorMap& map_a, const void* b, void* out_rows, const int32_t* slot_to_route,
            const int32_t* block_expert, const int32_t* num_blocks, int64_t max_blocks, int32_t n, int32_t k,
            int32_t num_local_experts, int64_t num_out_rows, void* stream, const std::string& fn) {
  using Epi = ScatterEpilogue<BlockN, BMajor>;
  CUtensorMap map_b;
  // K-major: B as [E * N, K], BLOCK_N-row boxes. MN-major: B as [E * K, N], 64 x 64 boxes.
  const int s = BMajor == Major::K
                    ? make_tensor_map(&map_b, b, uint64_t(num_local_experts) * n, uint64_t(k), BlockN, fn, "b")
                    : make_tensor_map(&map_b, b, uint64_t(num_local_experts) * k, uint64_t(n), kBlockK, fn, "b");
  if (s != MEGAMOE_OK) return s;
  const typename Epi::Params epi{static_cast<__nv_bfloat16*>(out_rows), slot_to_route, num_out_rows, n};
  const BRows b_rows{BMajor == Major::K ? n : k, 0};
  return launch_pool<Epi>(map_a, map_b, epi, block_expert, num_blocks, max_blocks, n / BlockN, b_rows, k, stream);
}

template <Major BMajor>
int scatter_entry(const std::string& fn, const void* a, const void* b, void* out_rows, const int32_t* slot_to_route,
                  const int32_t* block_expert, const int32_t* num_blocks, int64_t max_blocks, int32_t n, int32_t k,
                  int32_t num_local_experts, int64_t num_out_rows, void* stream) {
  const char* names = BMajor == Major::K ? "h, w2, out_rows and slot_to_route must be non-null"
                                         : "a, b, out_rows and slot_to_route must be non-null";
  if (a == nullptr || b == nullptr || out_rows == nullptr || slot_to_route == nullptr) {
    return invalid_argument(fn + names);
  }
  if (int s = validate_pool_gemm(fn, block_expert, num_blocks, max_blocks, n, "n", k, "k", num_local_experts);
      s != MEGAMOE_OK) {
    return s;
  }
  if (num_out_rows < 0) return invalid_argument(fn + "num_out_rows must be >= 0, got " + std::to_string(num_out_rows));
  // TMA needs 16-byte aligned operands; the epilogue's 16-byte stores need an aligned out_rows.
  if (!aligned16(a) || !aligned16(b) || !aligned16(out_rows)) {
    return invalid_argument(fn + (BMajor == Major::K ? "h, w2 and out_rows must be 16-byte aligned"
                                                     : "a, b and out_rows must be 16-byte aligned"));
  }
  if (BMajor == Major::K && int64_t(num_local_experts) * n > std::numeric_limits<int32_t>::max()) {
    return invalid_argument(fn + "num_local_experts * n exceeds the 32-bit row range of w2");
  }
  if (BMajor == Major::MN && int64_t(num_local_experts) * k > std::numeric_limits<int32_t>::max()) {
    return invalid_argument(fn + "num_local_experts * k exceeds the 32-bit row range of b");
  }
  if (max_blocks == 0 || num_out_rows == 0) return MEGAMOE_OK;  // nothing can be written

  CUtensorMap map_a;
  if (int s = make_tensor_map(&map_a, a, uint64_t(max_blocks) * kBlockM, uint64_t(k), kBlockM, fn,
                              BMajor == Major::K ? "h" : "a");
      s != MEGAMOE_OK) {
    return s;
  }
  return choose_block_n(n) == 256
             ? scatter<256, BMajor>(map_a, b, out_rows, slot_to_route, block_expert, num_blocks, max_blocks, n, k,
                                    num_local_experts, num_out_rows, stream, fn)
             : scatter<128, BMajor>(map_a, b, out_rows, slot_to_route, block_expert, num_blocks, max_blocks, n, k,
                                    num_local_experts, num_out_rows, stream, fn);
}

}  // namespace

extern "C" int megamoe_grouped_gemm_scatter_bf16(const void* h, const void* w2, void* out_rows,
                                                 const int32_t* slot_to_route, const int32_t* block_expert,
                                                 const int32_t* num_blocks, int64_t max_blocks, int32_t n, int32_t k,
                                                 int32_t num_local_experts, int64_t num_out_rows, void* stream) {
  return scatter_entry<Major::K>("megamoe_grouped_gemm_scatter_bf16: ", h, w2, out_rows, slot_to_route,
                                 block_expert, num_blocks, max_blocks, n, k, num_local_experts, num_out_rows, stream);
}

extern "C" int megamoe_grouped_gemm_scatter_mn_bf16(const void* a, const void* b, void* out_rows,
                                                    const int32_t* slot_to_route, const int32_t* block_expert,
                                                    const int32_t* num_blocks, int64_t max_blocks, int32_t n,
                                                    int32_t k, int32_t num_local_experts, int64_t num_out_rows,
                                                    void* stream) {
  return scatter_entry<Major::MN>("megamoe_grouped_gemm_scatter_mn_bf16: ", a, b, out_rows, slot_to_route,
                                  block_expert, num_blocks, max_blocks, n, k, num_local_experts, num_out_rows,
                                  stream);
}
