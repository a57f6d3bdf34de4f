// megamoe_grouped_gemm_fp8: the plain grouped GEMM in block FP8 (kernel.cuh with the FP8 main loop,
// mainloop_fp8.cuh, and the plain TMA-store epilogue).
#include "kernels/grouped_gemm/config_fp8.cuh"
#include "kernels/grouped_gemm/epilogue.cuh"
#include "kernels/grouped_gemm/launch.cuh"

using namespace megamoe;
using namespace megamoe::grouped_gemm;

extern "C" int megamoe_grouped_gemm_fp8(const megamoe_routing_plan* plan, const megamoe_gemm_fp8_args* args,
                                        void* stream) {
  const std::string fn = "megamoe_grouped_gemm_fp8: ";
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  PoolProblem p;
  MEGAMOE_RETURN_IF_ERROR(make_pool_problem(fn, plan, args->n, "n", args->k, "k", kFp8SizeMultiple, &p));
  const PoolOperands operands{args->a, "a", args->b, "b", BRows{p.n, 0}};
  const Fp8Scales scales{args->a_scales, args->b_scales};
  if (wide_tiles(p.n)) {
    return run_pool_gemm_fp8<PlainEpilogue<256, Fp8Config<256>>>(p, operands, {args->c}, scales, stream);
  }
  return run_pool_gemm_fp8<PlainEpilogue<128, Fp8Config<128>>>(p, operands, {args->c}, scales, stream);
}
