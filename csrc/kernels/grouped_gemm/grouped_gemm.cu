// megamoe_grouped_gemm_bf16: the plain grouped GEMM, C = A · B[e]ᵀ per pool block (kernel.cuh with
// the TMA-store epilogue).
#include "kernels/grouped_gemm/epilogue.cuh"
#include "kernels/grouped_gemm/launch.cuh"

using namespace megamoe;
using namespace megamoe::grouped_gemm;

extern "C" int megamoe_grouped_gemm_bf16(const void* a, const void* b, void* c, const int32_t* block_expert,
                                         const int32_t* num_blocks, int64_t max_blocks, int32_t n, int32_t k,
                                         int32_t num_local_experts, void* stream) {
  const std::string fn = "megamoe_grouped_gemm_bf16: ";
  if (a == nullptr || b == nullptr || c == nullptr) return invalid_argument(fn + "a, b and c must be non-null");
  if (int s = validate_pool_gemm(fn, block_expert, num_blocks, max_blocks, n, "n", k, "k", num_local_experts);
      s != MEGAMOE_OK) {
    return s;
  }
  if (!aligned16(a) || !aligned16(b) || !aligned16(c)) {
    return invalid_argument(fn + "a, b and c must be 16-byte aligned (TMA)");
  }
  if (int64_t(num_local_experts) * n > std::numeric_limits<int32_t>::max()) {
    return invalid_argument(fn + "num_local_experts * n exceeds the 32-bit row range of B");
  }
  if (max_blocks == 0) return MEGAMOE_OK;  // an empty pool: nothing to compute or store

  const int block_n = choose_block_n(n);
  const uint64_t rows = uint64_t(max_blocks) * kBlockM;
  CUtensorMap map_a, map_b;
  if (int s = make_tensor_map(&map_a, a, rows, uint64_t(k), kBlockM, fn, "A"); s != MEGAMOE_OK) return s;
  if (int s = make_tensor_map(&map_b, b, uint64_t(num_local_experts) * n, uint64_t(k), uint32_t(block_n), fn, "B");
      s != MEGAMOE_OK) {
    return s;
  }
  const BRows b_rows{n, 0};
  if (block_n == 256) {
    PlainEpilogue<256>::Params epi;
    if (int s = make_tensor_map(&epi.c, c, rows, uint64_t(n), kWarpRows, fn, "C"); s != MEGAMOE_OK) return s;
    return launch_pool<PlainEpilogue<256>>(map_a, map_b, epi, block_expert, num_blocks, max_blocks, n / 256, b_rows, k,
                                      stream);
  }
  PlainEpilogue<128>::Params epi;
  if (int s = make_tensor_map(&epi.c, c, rows, uint64_t(n), kWarpRows, fn, "C"); s != MEGAMOE_OK) return s;
  return launch_pool<PlainEpilogue<128>>(map_a, map_b, epi, block_expert, num_blocks, max_blocks, n / 128, b_rows, k,
                                    stream);
}
