// megamoe_grouped_gemm_gated_backward_bf16 / _fp8: dh = dy_pool · w2[e] with the gated activation's
// backward, the p-weighting and the dp partial sums in the epilogue (kernel.cuh with
// epilogue_gated_backward.cuh; in FP8 also dz in e4m3 for dx). BF16 reads w2 [E, H, I] as it is:
// B[e] = [K = H, N = I], MN-major; block FP8 reads its transposed copy [E, I, H] (K-major). In bf16 A is
// the pool of dy or, gathered_rows.cuh, its token rows.
#include "kernels/grouped_gemm/config_fp8.cuh"
#include "kernels/grouped_gemm/epilogue_gated_backward.cuh"
#include "kernels/grouped_gemm/launch.cuh"

using namespace megamoe;
using namespace megamoe::grouped_gemm;

namespace {

template <class Epi>
int run_gated_backward(const PoolProblem& p, const megamoe_gated_backward_args& args, void* stream) {
  const PoolOperands operands{args.dy_pool, "dy_pool", args.w2, "w2", BRows{p.k, 0}};
  typename Epi::Cfg::MainloopParams mainloop{};
  if constexpr (Epi::Cfg::kGathered == Gathered::kA) {
    MEGAMOE_RETURN_IF_ERROR(Epi::Cfg::token_rows(p.fn, "gather_a", *p.plan, args.dy_pool, p.k, &mainloop));
  }
  // The block-FP8 outputs (dz_q, dz_scales, dz_t, dz_t_scales, hp_t, hp_t_scales) stay null.
  const typename Epi::Arguments arguments{args.z,  args.p_pool, args.dz, args.hp, args.dp_partial, nullptr, nullptr,
                                          nullptr, nullptr,     nullptr, nullptr, args.activation_limit};
  return run_pool_gemm<Epi>(p, operands, arguments, stream, mainloop);
}

// BLOCK_N wide tiles over dy's pool or, gathered, its token rows.
template <class Act, int BlockN>
int run_gated_backward(const PoolProblem& p, const megamoe_gated_backward_args& args, void* stream) {
  using Pool = Config<BlockN, 1, Major::K, Major::MN>;
  using GatheredDy = GatheredConfig<Pool, Gathered::kA, 64>;
  return args.gather_a ? run_gated_backward<GatedBackwardEpilogue<Act, BlockN, GatheredDy>>(p, args, stream)
                       : run_gated_backward<GatedBackwardEpilogue<Act, BlockN, Pool>>(p, args, stream);
}

}  // namespace

extern "C" int megamoe_grouped_gemm_gated_backward_bf16(const megamoe_routing_plan* plan,
                                                        const megamoe_gated_backward_args* args, void* stream) {
  const std::string fn = "megamoe_grouped_gemm_gated_backward_bf16: ";
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  PoolProblem p;
  MEGAMOE_RETURN_IF_ERROR(
      make_pool_problem(fn, plan, args->intermediate, "intermediate", args->hidden, "hidden", kBf16SizeMultiple, &p));
  MEGAMOE_RETURN_IF_ERROR(check_gather_flag(fn, args->gather_a, "gather_a", "dy_pool"));
  return with_activation(fn, args->activation, args->activation_limit, [&](auto act) {
    using Act = decltype(act);
    return wide_tiles(p.n) ? run_gated_backward<Act, 256>(p, *args, stream)
                           : run_gated_backward<Act, 128>(p, *args, stream);
  });
}

extern "C" int megamoe_grouped_gemm_gated_backward_fp8(const megamoe_routing_plan* plan,
                                                       const megamoe_gated_backward_fp8_args* args, void* stream) {
  const std::string fn = "megamoe_grouped_gemm_gated_backward_fp8: ";
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  PoolProblem p;
  MEGAMOE_RETURN_IF_ERROR(
      make_pool_problem(fn, plan, args->intermediate, "intermediate", args->hidden, "hidden", kFp8SizeMultiple, &p));
  const PoolOperands operands{args->dy_pool, "dy_pool", args->w2t, "w2t", BRows{p.n, 0}};
  const Fp8Scales scales{args->dy_scales, args->w2t_scales};
  return with_activation(fn, args->activation, args->activation_limit, [&](auto act) {
    using Act = decltype(act);
    const auto run = [&](auto epilogue) {
      using Epi = decltype(epilogue);
      return run_pool_gemm_fp8<Epi>(
          p, operands,
          {args->z, args->p_pool, args->dz, args->hp, args->dp_partial, args->dz_q, args->dz_scales, args->dz_t,
           args->dz_t_scales, args->hp_t, args->hp_t_scales, args->activation_limit},
          scales, stream);
    };
    return wide_tiles(p.n) ? run(GatedBackwardEpilogue<Act, 256, Fp8Config<256>>{})
                           : run(GatedBackwardEpilogue<Act, 128, Fp8Config<128>>{});
  });
}
