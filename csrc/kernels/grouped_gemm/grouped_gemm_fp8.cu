// megamoe_grouped_gemm_fp8: the plain grouped GEMM in block FP8 (kernel.cuh with the FP8 main loop,
// mainloop_fp8.cuh, and the plain TMA-store epilogue).
#include "kernels/grouped_gemm/config_fp8.cuh"
#include "kernels/grouped_gemm/epilogue.cuh"
#include "kernels/grouped_gemm/launch.cuh"

using namespace megamoe;
using namespace megamoe::grouped_gemm;

template <int BlockN>
static int launch_fp8(const void* a, const float* a_scales, const void* b, const float* b_scales, void* c,
                      const int32_t* block_expert, const int32_t* num_blocks, int64_t max_blocks, int32_t n,
                      int32_t k, int32_t num_local_experts, void* stream, const std::string& fn) {
  using Epi = PlainEpilogue<BlockN, Fp8Config<BlockN>>;
  const uint64_t rows = uint64_t(max_blocks) * kBlockM;
  CUtensorMap map_a, map_b;
  typename Fp8Config<BlockN>::MainloopParams mainloop{};
  mainloop.b_scales = b_scales;
  mainloop.n_blocks = n / 128;
  if (int s = encode_tensor_map(&map_a, a, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, rows, uint64_t(k), kFp8BlockK, kBlockM,
                                CU_TENSOR_MAP_SWIZZLE_128B, fn, "A");
      s != MEGAMOE_OK) {
    return s;
  }
  if (int s = encode_tensor_map(&map_b, b, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, uint64_t(num_local_experts) * n,
                                uint64_t(k), kFp8BlockK, BlockN, CU_TENSOR_MAP_SWIZZLE_128B, fn, "B");
      s != MEGAMOE_OK) {
    return s;
  }
  if (int s = encode_tensor_map(&mainloop.a_scales, a_scales, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4,
                                uint64_t(k / kFp8BlockK), rows, kBlockM, 1, CU_TENSOR_MAP_SWIZZLE_NONE, fn,
                                "a_scales");
      s != MEGAMOE_OK) {
    return s;
  }
  typename Epi::Params epi;
  if (int s = make_tensor_map(&epi.c, c, rows, uint64_t(n), kWarpRows, fn, "C"); s != MEGAMOE_OK) return s;
  return launch_pool<Epi>(map_a, map_b, epi, block_expert, num_blocks, max_blocks, n / BlockN, BRows{n, 0}, k, stream,
                          mainloop);
}

extern "C" int megamoe_grouped_gemm_fp8(const void* a, const float* a_scales, const void* b, const float* b_scales,
                                        void* c, const int32_t* block_expert, const int32_t* num_blocks,
                                        int64_t max_blocks, int32_t n, int32_t k, int32_t num_local_experts,
                                        void* stream) {
  const std::string fn = "megamoe_grouped_gemm_fp8: ";
  if (a == nullptr || a_scales == nullptr || b == nullptr || b_scales == nullptr || c == nullptr) {
    return invalid_argument(fn + "a, a_scales, b, b_scales and c must be non-null");
  }
  if (int s = validate_pool_gemm(fn, block_expert, num_blocks, max_blocks, n, "n", k, "k", num_local_experts);
      s != MEGAMOE_OK) {
    return s;
  }
  if (!aligned16(a) || !aligned16(a_scales) || !aligned16(b) || !aligned16(c)) {
    return invalid_argument(fn + "a, a_scales, b and c must be 16-byte aligned (TMA)");
  }
  if (int64_t(num_local_experts) * n > std::numeric_limits<int32_t>::max()) {
    return invalid_argument(fn + "num_local_experts * n exceeds the 32-bit row range of B");
  }
  if (max_blocks == 0) return MEGAMOE_OK;

  const int block_n = choose_block_n(n);
  return block_n == 256 ? launch_fp8<256>(a, a_scales, b, b_scales, c, block_expert, num_blocks, max_blocks, n, k,
                                          num_local_experts, stream, fn)
                        : launch_fp8<128>(a, a_scales, b, b_scales, c, block_expert, num_blocks, max_blocks, n, k,
                                          num_local_experts, stream, fn);
}
