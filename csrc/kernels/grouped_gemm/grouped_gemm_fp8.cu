// megamoe_grouped_gemm_fp8: the plain grouped GEMM in block FP8 (kernel.cuh with the FP8 main loop,
// mainloop_fp8.cuh, and the plain TMA-store epilogue).
#include "kernels/grouped_gemm/config_fp8.cuh"
#include "kernels/grouped_gemm/epilogue.cuh"
#include "kernels/grouped_gemm/launch.cuh"

using namespace megamoe;
using namespace megamoe::grouped_gemm;

namespace {

template <int BlockN>
int run_fp8(const PoolProblem& p, const megamoe_gemm_fp8_args& args, void* stream) {
  using Cfg = Fp8Config<BlockN>;
  using Epi = PlainEpilogue<BlockN, Cfg>;
  const PoolOperands operands{args.a, "a", args.b, "b", BRows{p.n, 0}};
  MEGAMOE_RETURN_IF_ERROR(check_pool_gemm<Epi>(p, operands, {args.c}));  // before the scales' map (CUDA)
  typename Cfg::MainloopParams mainloop;
  MEGAMOE_RETURN_IF_ERROR(Cfg::to_params(p, {args.a_scales, args.b_scales}, &mainloop));
  return run_pool_gemm<Epi>(p, operands, {args.c}, stream, mainloop);
}

}  // namespace

extern "C" int megamoe_grouped_gemm_fp8(const megamoe_routing_plan* plan, const megamoe_gemm_fp8_args* args,
                                        void* stream) {
  const std::string fn = "megamoe_grouped_gemm_fp8: ";
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  PoolProblem p;
  MEGAMOE_RETURN_IF_ERROR(make_pool_problem(fn, plan, args->n, "n", args->k, "k", &p));
  return wide_tiles(p.n) ? run_fp8<256>(p, *args, stream) : run_fp8<128>(p, *args, stream);
}
