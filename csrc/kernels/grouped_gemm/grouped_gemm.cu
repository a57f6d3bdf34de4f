// megamoe_grouped_gemm_bf16: the plain grouped GEMM, C = A · B[e]ᵀ per pool block (kernel.cuh with
// the TMA-store epilogue).
#include "kernels/grouped_gemm/epilogue.cuh"
#include "kernels/grouped_gemm/launch.cuh"

using namespace megamoe;
using namespace megamoe::grouped_gemm;

extern "C" int megamoe_grouped_gemm_bf16(const megamoe_routing_plan* plan, const megamoe_gemm_args* args,
                                         void* stream) {
  const std::string fn = "megamoe_grouped_gemm_bf16: ";
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  PoolProblem p;
  MEGAMOE_RETURN_IF_ERROR(make_pool_problem(fn, plan, args->n, "n", args->k, "k", kBf16SizeMultiple, &p));
  const PoolOperands operands{args->a, "a", args->b, "b", BRows{p.n, 0}};
  if (wide_tiles(p.n)) return run_pool_gemm<PlainEpilogue<256>>(p, operands, {args->c}, stream);
  return run_pool_gemm<PlainEpilogue<128>>(p, operands, {args->c}, stream);
}
