// megamoe_grouped_gemm_scatter_bf16: GEMM2 of the expert MLP, each pool row written straight into
// its (token, k) combine slot (kernel.cuh with epilogue_scatter.cuh).
#include "kernels/grouped_gemm/epilogue_scatter.cuh"
#include "kernels/grouped_gemm/launch.cuh"

using namespace megamoe;
using namespace megamoe::grouped_gemm;

namespace {

template <int BlockN>
int scatter(const CUtensorMap& map_a, const void* w2, void* out_rows, const int32_t* slot_to_route,
            const int32_t* block_expert, const int32_t* num_blocks, int64_t max_blocks, int32_t n, int32_t k,
            int32_t num_local_experts, int64_t num_out_rows, void* stream, const std::string& fn) {
  using Epi = ScatterEpilogue<BlockN>;
  CUtensorMap map_b;
  if (int s = make_tensor_map(&map_b, w2, uint64_t(num_local_experts) * n, uint64_t(k), BlockN, fn, "w2");
      s != MEGAMOE_OK) {
    return s;
  }
  const typename Epi::Params epi{static_cast<__nv_bfloat16*>(out_rows), slot_to_route, num_out_rows, n};
  return launch<Epi>(map_a, map_b, epi, block_expert, num_blocks, max_blocks, n / BlockN, BRows{n, 0}, k, stream);
}

}  // namespace

extern "C" int megamoe_grouped_gemm_scatter_bf16(const void* h, const void* w2, void* out_rows,
                                                 const int32_t* slot_to_route, const int32_t* block_expert,
                                                 const int32_t* num_blocks, int64_t max_blocks, int32_t n, int32_t k,
                                                 int32_t num_local_experts, int64_t num_out_rows, void* stream) {
  const std::string fn = "megamoe_grouped_gemm_scatter_bf16: ";
  if (h == nullptr || w2 == nullptr || out_rows == nullptr || slot_to_route == nullptr) {
    return invalid_argument(fn + "h, w2, out_rows and slot_to_route must be non-null");
  }
  if (int s = validate_pool_gemm(fn, block_expert, num_blocks, max_blocks, n, "n", k, "k", num_local_experts);
      s != MEGAMOE_OK) {
    return s;
  }
  if (num_out_rows < 0) return invalid_argument(fn + "num_out_rows must be >= 0, got " + std::to_string(num_out_rows));
  // TMA needs 16-byte aligned operands; the epilogue's 16-byte stores need an aligned out_rows.
  if (!aligned16(h) || !aligned16(w2) || !aligned16(out_rows)) {
    return invalid_argument(fn + "h, w2 and out_rows must be 16-byte aligned");
  }
  if (int64_t(num_local_experts) * n > std::numeric_limits<int32_t>::max()) {
    return invalid_argument(fn + "num_local_experts * n exceeds the 32-bit row range of w2");
  }
  if (max_blocks == 0 || num_out_rows == 0) return MEGAMOE_OK;  // nothing can be written

  CUtensorMap map_a;
  if (int s = make_tensor_map(&map_a, h, uint64_t(max_blocks) * kBlockM, uint64_t(k), kBlockM, fn, "h");
      s != MEGAMOE_OK) {
    return s;
  }
  return choose_block_n(n) == 256
             ? scatter<256>(map_a, w2, out_rows, slot_to_route, block_expert, num_blocks, max_blocks, n, k,
                            num_local_experts, num_out_rows, stream, fn)
             : scatter<128>(map_a, w2, out_rows, slot_to_route, block_expert, num_blocks, max_blocks, n, k,
                            num_local_experts, num_out_rows, stream, fn);
}
