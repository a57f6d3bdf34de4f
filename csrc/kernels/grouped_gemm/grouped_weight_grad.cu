// megamoe_grouped_weight_grad_bf16: out[e] = A[rows of e]ᵀ · B[rows of e] for every local expert,
// K running over the expert's routed pool rows (kernel.cuh with scheduler_expert.cuh and
// epilogue_weight_grad.cuh; both operands token-major, i.e. MN-major; each a pool or one of them,
// gathered_rows.cuh, the token rows).
// megamoe_grouped_weight_grad_fp8: the same in block FP8 on the operands given transposed (FP8
// tensor cores read both K-major): Aᵀ with one scale per row and 128 pool rows, Bᵀ with one per
// 128 x 128 block, the FP8 main loop's promotion (mainloop_fp8.cuh).
#include "kernels/grouped_gemm/config_fp8.cuh"
#include "kernels/grouped_gemm/epilogue_weight_grad.cuh"
#include "kernels/grouped_gemm/launch.cuh"

using namespace megamoe;
using namespace megamoe::grouped_gemm;

namespace {

// The epilogue's parameters for out [E_local, m, n] in the given output format.
template <class Epi>
int weight_grad_epilogue(const std::string& fn, const megamoe_routing_plan& plan, void* out, int32_t m, int32_t n,
                         int32_t out_ld, int32_t output, typename Epi::Params* epi) {
  const typename Epi::Arguments args{out, out_ld ? out_ld : n, output == MEGAMOE_GRAD_FP32_ADD};
  MEGAMOE_RETURN_IF_ERROR(Epi::can_implement(fn, args));
  return Epi::to_params(fn, plan, m, n, args, epi);
}

template <int BlockN, bool Fp32, class Cfg>
int run_weight_grad(const std::string& fn, const megamoe_routing_plan& plan, const megamoe_weight_grad_args& args,
                    void* stream) {
  using Epi = WeightGradEpilogue<BlockN, Fp32, Cfg>;
  typename Cfg::MainloopParams mainloop{};
  if constexpr (Cfg::kGathered == Gathered::kA) {
    MEGAMOE_RETURN_IF_ERROR(Cfg::token_rows(fn, "gather_a", plan, args.a_pool, args.m, &mainloop));
  } else if constexpr (Cfg::kGathered == Gathered::kB) {
    MEGAMOE_RETURN_IF_ERROR(Cfg::token_rows(fn, "gather_b", plan, args.b_pool, args.n, &mainloop));
  }
  typename Epi::Params epi;
  MEGAMOE_RETURN_IF_ERROR(
      weight_grad_epilogue<Epi>(fn, plan, args.out, args.m, args.n, args.out_ld, args.output, &epi));
  // The pool's rows are K: 64 x 64 boxes of each token-major operand (operand.cuh, MN-major), or one
  // operand's rows gathered from its token rows by the producer (gathered_rows.cuh): no map of it.
  const uint64_t rows = uint64_t(routing::pool_rows(plan));
  CUtensorMap map_a{}, map_b{};
  if constexpr (Cfg::kGathered != Gathered::kA) {
    MEGAMOE_RETURN_IF_ERROR(make_tensor_map(&map_a, args.a_pool, rows, uint64_t(args.m), kBlockK, fn, "a_pool"));
  }
  if constexpr (Cfg::kGathered != Gathered::kB) {
    MEGAMOE_RETURN_IF_ERROR(make_tensor_map(&map_b, args.b_pool, rows, uint64_t(args.n), kBlockK, fn, "b_pool"));
  }
  return launch<Epi, ExpertScheduler>(map_a, map_b, epi, ExpertScheduler::to_params<Cfg>(plan, args.m, args.n),
                                      stream, mainloop);
}

template <int BlockN, bool Fp32>
int run_weight_grad(const std::string& fn, const megamoe_routing_plan& plan, const megamoe_weight_grad_args& args,
                    void* stream) {
  if (args.gather_a) {
    return run_weight_grad<BlockN, Fp32, GatheredWeightGradConfig<BlockN, Gathered::kA>>(fn, plan, args, stream);
  }
  if (args.gather_b) {
    return run_weight_grad<BlockN, Fp32, GatheredWeightGradConfig<BlockN, Gathered::kB>>(fn, plan, args, stream);
  }
  return run_weight_grad<BlockN, Fp32, Config<BlockN, 1, Major::MN, Major::MN>>(fn, plan, args, stream);
}

template <int BlockN, bool Fp32>
int run_weight_grad(const std::string& fn, const megamoe_routing_plan& plan,
                    const megamoe_weight_grad_fp8_args& args, void* stream) {
  using Cfg = Fp8Config<BlockN>;
  using Epi = WeightGradEpilogue<BlockN, Fp32, Cfg>;
  typename Epi::Params epi;
  MEGAMOE_RETURN_IF_ERROR(weight_grad_epilogue<Epi>(fn, plan, args.out, args.m, args.n, 0, args.output, &epi));
  // Pool rows are K: 128-deep e4m3 k-blocks of Aᵀ [m, rows] and Bᵀ [n, rows]; A's scales by TMA
  // with the stage (a k-block's scales of a tile's 128 rows are one box), B's read by the math
  // warpgroups (one per 128 x 128 block).
  const uint64_t rows = uint64_t(routing::pool_rows(plan));
  CUtensorMap map_a, map_b;
  MEGAMOE_RETURN_IF_ERROR(make_fp8_tensor_map(&map_a, args.a_t, uint64_t(args.m), rows, kBlockM, fn, "a_t"));
  MEGAMOE_RETURN_IF_ERROR(make_fp8_tensor_map(&map_b, args.b_t, uint64_t(args.n), rows, Cfg::kBBoxRows, fn, "b_t"));
  typename Cfg::MainloopParams mainloop{};
  mainloop.b_scales = args.b_scales;
  MEGAMOE_RETURN_IF_ERROR(encode_tensor_map(&mainloop.a_scales, args.a_scales, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4,
                                            rows / kFp8BlockK, uint64_t(args.m), kBlockM, 1,
                                            CU_TENSOR_MAP_SWIZZLE_NONE, fn, "a_scales"));
  return launch<Epi, ExpertScheduler>(map_a, map_b, epi, ExpertScheduler::to_params<Cfg>(plan, args.m, args.n),
                                      stream, mainloop);
}

// The tile width (256 where n allows, else 128) and output format (bf16, or fp32 written or added
// to) of either version's arguments.
template <class Args>
int run_weight_grad(const std::string& fn, const megamoe_routing_plan& plan, const Args& args, void* stream) {
  const auto run = [&](auto fp32) {
    constexpr bool kFp32 = decltype(fp32)::value;
    return wide_tiles(args.n) ? run_weight_grad<256, kFp32>(fn, plan, args, stream)
                              : run_weight_grad<128, kFp32>(fn, plan, args, stream);
  };
  switch (args.output) {
    case MEGAMOE_GRAD_BF16:
      return run(std::false_type{});
    case MEGAMOE_GRAD_FP32:
    case MEGAMOE_GRAD_FP32_ADD:
      return run(std::true_type{});
    default:
      return invalid_argument(fn +
                              "output must be MEGAMOE_GRAD_BF16, MEGAMOE_GRAD_FP32 or MEGAMOE_GRAD_FP32_ADD, got " +
                              std::to_string(args.output));
  }
}

// What both entry points check of the plan and the sizes (multiples of `multiple`).
int check_weight_grad(const std::string& fn, const megamoe_routing_plan* plan, int32_t m, int32_t n,
                      int32_t multiple, const char* why) {
  if (plan->expert_offsets == nullptr || plan->expert_counts == nullptr) {
    return invalid_argument(fn + "the plan's expert_offsets and expert_counts must be non-null");
  }
  for (const auto& [size, name] : {std::pair{m, "m"}, std::pair{n, "n"}}) {
    if (size <= 0 || size % multiple != 0) {
      return invalid_argument(fn + name + " must be a positive multiple of " + std::to_string(multiple) + " (" +
                              why + "), got " + std::to_string(size));
    }
  }
  const int64_t experts = plan->shape.num_local_experts;
  MEGAMOE_RETURN_IF_ERROR(check_row_range(fn, routing::pool_rows(*plan), "the plan's pool rows"));
  MEGAMOE_RETURN_IF_ERROR(check_row_range(fn, experts * m, "num_local_experts * m (the rows of out)"));
  return check_row_range(fn, experts * ((m + 127) / 128) * ((n + 127) / 128), "the tile count");
}

}  // namespace

extern "C" int megamoe_grouped_weight_grad_fp8(const megamoe_routing_plan* plan,
                                               const megamoe_weight_grad_fp8_args* args, void* stream) {
  const std::string fn = "megamoe_grouped_weight_grad_fp8: ";
  MEGAMOE_RETURN_IF_ERROR(routing::check_plan(fn, plan));
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  const megamoe_weight_grad_fp8_args& a = *args;
  MEGAMOE_RETURN_IF_ERROR(check_pointers(fn, {{a.a_t, "a_t"}, {a.b_t, "b_t"}, {a.a_scales, "a_scales"}}));
  if (a.b_scales == nullptr) return invalid_argument(fn + "b_scales must be non-null");
  MEGAMOE_RETURN_IF_ERROR(check_weight_grad(fn, plan, a.m, a.n, kFp8SizeMultiple, "block-FP8 scale blocks"));
  return run_weight_grad(fn, *plan, a, stream);
}

extern "C" int megamoe_grouped_weight_grad_bf16(const megamoe_routing_plan* plan, const megamoe_weight_grad_args* args,
                                                void* stream) {
  const std::string fn = "megamoe_grouped_weight_grad_bf16: ";
  MEGAMOE_RETURN_IF_ERROR(routing::check_plan(fn, plan));
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  const megamoe_weight_grad_args& a = *args;
  MEGAMOE_RETURN_IF_ERROR(check_pointers(fn, {{a.a_pool, "a_pool"}, {a.b_pool, "b_pool"}}));
  MEGAMOE_RETURN_IF_ERROR(check_weight_grad(fn, plan, a.m, a.n, kBf16SizeMultiple, "16-byte bf16 rows"));
  if (a.out_ld != 0 && (a.out_ld < a.n || a.out_ld % kBf16SizeMultiple != 0)) {
    return invalid_argument(fn + "out_ld must be 0 (n) or a multiple of 8 no smaller than n = " + std::to_string(a.n) +
                            ", got " + std::to_string(a.out_ld));
  }
  MEGAMOE_RETURN_IF_ERROR(check_gather_flag(fn, a.gather_a, "gather_a", "a_pool"));
  MEGAMOE_RETURN_IF_ERROR(check_gather_flag(fn, a.gather_b, "gather_b", "b_pool"));
  if (a.gather_a && a.gather_b) {
    return invalid_argument(fn + "gather_a and gather_b cannot both be 1 (one operand is gathered at most)");
  }
  return run_weight_grad(fn, *plan, a, stream);
}
