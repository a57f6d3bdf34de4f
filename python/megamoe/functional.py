"""The functional API (docs/DESIGN.md): one MoE layer's experts through a chosen backend."""

from __future__ import annotations

from .backends import grouped_moe, naive_moe
from .expert_parallel_group import group_moe
from .fused import fused_moe_autograd
from .validation import check_fused_support, check_moe_inputs, check_options

_BASELINES = {"grouped": grouped_moe, "naive": naive_moe}


def moe(x, topk_ids, topk_weights, w13, w2, backend: str = "fused", precision: str = "bf16",
        group=None, recompute: bool | str = False, activation: str = "swiglu"):
    """y [T, H] = Σ_k p[t, k] · expert(topk_ids[t, k])(x[t]); differentiable w.r.t. x,
    topk_weights, w13 and w2. See docs/DESIGN.md for the math and the weight layouts.

    activation: the experts' h = act(gate) · up, one of megamoe.activation.ACTIVATIONS.

    precision (fused only for all but "bf16"): "fp8" runs forward and backward in block FP8 (the
    DeepSeek-V3 recipe: 1 x 128 activation and 128 x 128 weight scales, docs/DESIGN.md), "fp8_bwd"
    the bf16 forward with the FP8 backward; "mxfp8" needs Blackwell and raises here.

    recompute (fused only): what the backward redoes instead of keeping it from the forward. False
    keeps the pool of x and z = x·w13ᵀ (T·K·(H + 2I) bf16 plus padding); "gather" keeps z alone and
    gathers x's pool again in the backward (one more pass over T·K·H bf16); True keeps nothing but the
    inputs, gathers x and recomputes z (one more GEMM). The baselines keep what autograd saves for
    them."""
    check_options(backend, precision, recompute, activation, group)
    # The fused op checks the ids' range on the GPU (validation.IdRangeCheck), sparing the host a sync per call.
    problem = check_moe_inputs(x, topk_ids, topk_weights, w13, w2, group=group,
                               check_id_range=not (backend == "fused" and getattr(topk_ids, "is_cuda", False)))
    if backend == "fused":
        check_fused_support(x, problem.hidden_size, problem.intermediate_size, precision)
        if group is not None:
            return group_moe(x, topk_ids, topk_weights, w13, w2, group, activation, precision, recompute)
        return fused_moe_autograd(x, topk_ids, topk_weights, w13, w2, recompute, activation, precision)
    return _BASELINES[backend](x, topk_ids, topk_weights, w13, w2, activation=activation)


def fused_moe(x, topk_ids, topk_weights, w13, w2, precision: str = "bf16", group=None,
              recompute: bool | str = False, activation: str = "swiglu"):
    """The fused persistent-kernel backend (`moe(..., backend="fused")`)."""
    return moe(x, topk_ids, topk_weights, w13, w2, backend="fused", precision=precision, group=group,
               recompute=recompute, activation=activation)
