// megamoe_grouped_gemm_scatter_bf16 / _fp8: each pool row of A · B[e] written straight into its
// (token, k) slot (kernel.cuh with epilogue_scatter.cuh). The forward's GEMM2 reads w2 [E, N, K]
// (K-major B); the backward's dx per route reads w13 [E, K = 2I, N = H] as it is (MN-major B) in
// bf16, or a transposed FP8 copy [E, N, K] in block FP8.
#include "kernels/grouped_gemm/config_fp8.cuh"
#include "kernels/grouped_gemm/epilogue_scatter.cuh"
#include "kernels/grouped_gemm/launch.cuh"

using namespace megamoe;
using namespace megamoe::grouped_gemm;

namespace {

template <int BlockN, Major BMajor>
int run_scatter(const PoolProblem& p, const megamoe_scatter_gemm_args& args, void* stream) {
  // K-major: B as [E * N, K]; MN-major: B as [E * K, N].
  const PoolOperands operands{args.a, "a", args.b, "b", BRows{BMajor == Major::K ? p.n : p.k, 0}};
  return run_pool_gemm<ScatterEpilogue<BlockN, BMajor>>(
      p, operands, {args.out_rows, args.row_of_slot, args.num_out_rows}, stream);
}

template <Major BMajor>
int run_scatter(const PoolProblem& p, const megamoe_scatter_gemm_args& args, void* stream) {
  return wide_tiles(p.n) ? run_scatter<256, BMajor>(p, args, stream) : run_scatter<128, BMajor>(p, args, stream);
}

}  // namespace

extern "C" int megamoe_grouped_gemm_scatter_bf16(const megamoe_routing_plan* plan,
                                                 const megamoe_scatter_gemm_args* args, void* stream) {
  const std::string fn = "megamoe_grouped_gemm_scatter_bf16: ";
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  PoolProblem p;
  MEGAMOE_RETURN_IF_ERROR(make_pool_problem(fn, plan, args->n, "n", args->k, "k", kBf16SizeMultiple, &p));
  if (args->num_out_rows == 0) return MEGAMOE_OK;  // nothing can be written
  switch (args->b_layout) {
    case MEGAMOE_B_N_BY_K:
      return run_scatter<Major::K>(p, *args, stream);
    case MEGAMOE_B_K_BY_N:
      return run_scatter<Major::MN>(p, *args, stream);
    default:
      return invalid_argument(fn + "b_layout must be MEGAMOE_B_N_BY_K or MEGAMOE_B_K_BY_N, got " +
                              std::to_string(args->b_layout));
  }
}

extern "C" int megamoe_grouped_gemm_scatter_fp8(const megamoe_routing_plan* plan,
                                                const megamoe_scatter_gemm_fp8_args* args, void* stream) {
  const std::string fn = "megamoe_grouped_gemm_scatter_fp8: ";
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  PoolProblem p;
  MEGAMOE_RETURN_IF_ERROR(make_pool_problem(fn, plan, args->n, "n", args->k, "k", kFp8SizeMultiple, &p));
  if (args->num_out_rows == 0) return MEGAMOE_OK;  // nothing can be written
  const PoolOperands operands{args->a, "a", args->b, "b", BRows{p.n, 0}};
  const ScatterArguments out{args->out_rows, args->row_of_slot, args->num_out_rows};
  const Fp8Scales scales{args->a_scales, args->b_scales};
  if (wide_tiles(p.n)) {
    return run_pool_gemm_fp8<ScatterEpilogue<256, Major::K, Fp8Config<256>>>(p, operands, out, scales, stream);
  }
  return run_pool_gemm_fp8<ScatterEpilogue<128, Major::K, Fp8Config<128>>>(p, operands, out, scales, stream);
}
