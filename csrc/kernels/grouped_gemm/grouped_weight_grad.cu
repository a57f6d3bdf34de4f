// megamoe_grouped_weight_grad_bf16: out[e] = A[rows of e]ᵀ · B[rows of e] for every local expert,
// K running over the expert's routed pool rows (kernel.cuh with scheduler_expert.cuh and
// epilogue_weight_grad.cuh; both operands token-major, i.e. MN-major).
#include "kernels/grouped_gemm/epilogue_weight_grad.cuh"
#include "kernels/grouped_gemm/launch.cuh"

using namespace megamoe;
using namespace megamoe::grouped_gemm;

namespace {

template <int BlockN, bool Fp32>
int run_weight_grad(const std::string& fn, const megamoe_routing_plan& plan, const megamoe_weight_grad_args& args,
                    void* stream) {
  using Epi = WeightGradEpilogue<BlockN, Fp32>;
  const typename Epi::Arguments epi_args{args.out, args.out_ld ? args.out_ld : args.n,
                                         args.output == MEGAMOE_GRAD_FP32_ADD};
  MEGAMOE_RETURN_IF_ERROR(Epi::can_implement(fn, epi_args));
  typename Epi::Params epi;
  MEGAMOE_RETURN_IF_ERROR(Epi::to_params(fn, plan, args.m, args.n, epi_args, &epi));
  // The pool's rows are K: 64 x 64 boxes of each token-major operand (operand.cuh, MN-major).
  const uint64_t rows = uint64_t(routing::pool_rows(plan));
  CUtensorMap map_a, map_b;
  MEGAMOE_RETURN_IF_ERROR(make_tensor_map(&map_a, args.a_pool, rows, uint64_t(args.m), kBlockK, fn, "a_pool"));
  MEGAMOE_RETURN_IF_ERROR(make_tensor_map(&map_b, args.b_pool, rows, uint64_t(args.n), kBlockK, fn, "b_pool"));
  return launch<Epi, ExpertScheduler>(map_a, map_b, epi, ExpertScheduler::to_params<BlockN>(plan, args.m, args.n),
                                      stream);
}

template <bool Fp32>
int run_weight_grad(const std::string& fn, const megamoe_routing_plan& plan, const megamoe_weight_grad_args& args,
                    void* stream) {
  return wide_tiles(args.n) ? run_weight_grad<256, Fp32>(fn, plan, args, stream)
                            : run_weight_grad<128, Fp32>(fn, plan, args, stream);
}

}  // namespace

extern "C" int megamoe_grouped_weight_grad_bf16(const megamoe_routing_plan* plan, const megamoe_weight_grad_args* args,
                                                void* stream) {
  const std::string fn = "megamoe_grouped_weight_grad_bf16: ";
  MEGAMOE_RETURN_IF_ERROR(routing::check_plan(fn, plan));
  if (args == nullptr) return invalid_argument(fn + "args must be non-null");
  const megamoe_weight_grad_args& a = *args;
  if (plan->expert_offsets == nullptr || plan->expert_counts == nullptr) {
    return invalid_argument(fn + "the plan's expert_offsets and expert_counts must be non-null");
  }
  MEGAMOE_RETURN_IF_ERROR(check_pointers(fn, {{a.a_pool, "a_pool"}, {a.b_pool, "b_pool"}}));
  for (const auto& [size, name] : {std::pair{a.m, "m"}, std::pair{a.n, "n"}}) {
    if (size <= 0 || size % kBf16SizeMultiple != 0) {
      return invalid_argument(fn + name + " must be a positive multiple of 8 (16-byte bf16 rows), got " +
                              std::to_string(size));
    }
  }
  if (a.out_ld != 0 && (a.out_ld < a.n || a.out_ld % kBf16SizeMultiple != 0)) {
    return invalid_argument(fn + "out_ld must be 0 (n) or a multiple of 8 no smaller than n = " + std::to_string(a.n) +
                            ", got " + std::to_string(a.out_ld));
  }
  const int64_t experts = plan->shape.num_local_experts;
  MEGAMOE_RETURN_IF_ERROR(check_row_range(fn, routing::pool_rows(*plan), "the plan's pool rows"));
  MEGAMOE_RETURN_IF_ERROR(check_row_range(fn, experts * a.m, "num_local_experts * m (the rows of out)"));
  MEGAMOE_RETURN_IF_ERROR(
      check_row_range(fn, experts * ((a.m + 127) / 128) * ((a.n + 127) / 128), "the tile count"));
  switch (a.output) {
    case MEGAMOE_GRAD_BF16:
      return run_weight_grad<false>(fn, *plan, a, stream);
    case MEGAMOE_GRAD_FP32:
    case MEGAMOE_GRAD_FP32_ADD:
      return run_weight_grad<true>(fn, *plan, a, stream);
    default:
      return invalid_argument(fn +
                              "output must be MEGAMOE_GRAD_BF16, MEGAMOE_GRAD_FP32 or MEGAMOE_GRAD_FP32_ADD, got " +
                              std::to_string(a.output));
  }
}
