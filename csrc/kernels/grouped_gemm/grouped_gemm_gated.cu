// megamoe_grouped_gemm_gated_bf16 / _fp8: GEMM1 of the expert MLP with the gated activation in the
// epilogue (kernel.cuh with epilogue_gated.cuh, or epilogue_gated_fp8.cuh quantising h; each stage's
// B tile = 128 gate rows + the 128 matching up rows), optionally also storing z = gate | up for the
// backward; in bf16 A is the pool or, gathered_rows.cuh, the token rows.
#include "kernels/grouped_gemm/epilogue_gated.cuh"
#include "kernels/grouped_gemm/epilogue_gated_fp8.cuh"
#include "kernels/grouped_gemm/launch.cuh"

using namespace megamoe;
using namespace megamoe::grouped_gemm;

namespace {

template <class Epi>
int run_gated(const PoolProblem& p, const megamoe_gated_gemm_args& args, void* stream) {
  const PoolOperands operands{args.a, "a", args.w13, "w13", Epi::b_rows(p)};
  typename Epi::Cfg::MainloopParams mainloop{};
  if constexpr (Epi::Cfg::kGathered == Gathered::kA) {
    MEGAMOE_RETURN_IF_ERROR(Epi::Cfg::token_rows(p.fn, "gather_a", *p.plan, args.a, p.k, &mainloop));
  }
  return run_pool_gemm<Epi>(p, operands, {args.h, args.z, args.activation_limit}, stream, mainloop);
}

template <class Act, class Cfg>
int run_gated_keep_z_or_not(const PoolProblem& p, const megamoe_gated_gemm_args& args, void* stream) {
  return args.z == nullptr ? run_gated<GatedEpilogue<Act, false, Cfg>>(p, args, stream)
                           : run_gated<GatedEpilogue<Act, true, Cfg>>(p, args, stream);
}

}  // namespace

extern "C" int megamoe_grouped_gemm_gated_bf16(const megamoe_routing_plan* plan, const megamoe_gated_gemm_args* args,
                                               void* stream) {
  const std::string fn = "megamoe_grouped_gemm_gated_bf16: ";
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  PoolProblem p;
  MEGAMOE_RETURN_IF_ERROR(
      make_pool_problem(fn, plan, args->intermediate, "intermediate", args->hidden, "hidden", kBf16SizeMultiple, &p));
  MEGAMOE_RETURN_IF_ERROR(check_gather_flag(fn, args->gather_a, "gather_a", "a"));
  return with_activation(fn, args->activation, args->activation_limit, [&](auto act) {
    using Act = decltype(act);
    return args->gather_a ? run_gated_keep_z_or_not<Act, GatheredAConfig<256, 2>>(p, *args, stream)
                          : run_gated_keep_z_or_not<Act, Config<256, 2>>(p, *args, stream);
  });
}

extern "C" int megamoe_grouped_gemm_gated_fp8(const megamoe_routing_plan* plan, const megamoe_gated_gemm_fp8_args* args,
                                              void* stream) {
  const std::string fn = "megamoe_grouped_gemm_gated_fp8: ";
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  PoolProblem p;
  MEGAMOE_RETURN_IF_ERROR(
      make_pool_problem(fn, plan, args->intermediate, "intermediate", args->hidden, "hidden", kFp8SizeMultiple, &p));
  const Fp8Scales scales{args->a_scales, args->w13_scales};
  return with_activation(fn, args->activation, args->activation_limit, [&](auto act) {
    using Act = decltype(act);
    const auto run = [&](auto epilogue) {
      using Epi = decltype(epilogue);
      const PoolOperands operands{args->a, "a", args->w13, "w13", Epi::b_rows(p)};
      return run_pool_gemm_fp8<Epi>(p, operands, {args->h, args->h_scales, args->z, args->activation_limit}, scales,
                                     stream);
    };
    return args->z == nullptr ? run(GatedFp8Epilogue<Act, false>{}) : run(GatedFp8Epilogue<Act, true>{});
  });
}
