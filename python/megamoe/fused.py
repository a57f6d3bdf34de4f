"""backend="fused": the Hopper kernels of the core behind one torch.library op.

Forward: routing plan (ids out of range are counted on the GPU and raise once the launches are
queued: validation.IdRangeCheck) → dispatch into the expert-major pool (exchange.py) → GEMM1 with
the gated activation (megamoe.activation; the kernels: SwiGLU) in its epilogue → GEMM2 whose
epilogue scatters each row into its (token, k) slot → fixed-order combine (exchange.py). The op has
a fake implementation, so torch.compile traces it without graph breaks.

Backward (a second op): the forward's routing plan (kept: one int32 buffer), gather dy (and each
row's topk weight p), take the pool of x and z = x·w13ᵀ (gate | up, pool order) as the forward kept
them, or gather and recompute them (recompute=True: only the inputs and the plan are kept, at the
price of a gather and a GEMM), then dh = dy·w2 with the activation's backward, p·h and dp partials
in its epilogue → dp (fixed-order reduce); dx per route = dz·w13 scattered to (token, k) rows and
combined; dw2 and dw13 as K-grouped GEMMs over each expert's rows. Deterministic: no atomics anywhere.
"""

from __future__ import annotations

import torch

from . import _native
from .exchange import combine, dispatch
from .activation import check_activation
from .gemm import gated_backward, gated_gemm, grouped_gemm, grouped_gemm_scatter, reduce_dp, weight_grad
from .routing import RoutingPlan, build_routing, plan_buffer_size, pool_capacity
from .validation import IdRangeCheck, main_grad_of


class _Pool:
    """The routing plan and the expert-major pool of x: what forward and backward both start from."""

    def __init__(self, x: torch.Tensor, topk_ids: torch.Tensor, num_local: int, x_pool: torch.Tensor | None = None,
                 plan_buffer: torch.Tensor | None = None, check_ids: bool = False):
        """plan_buffer: the forward's plan (RoutingPlan.buffer), or None to build it."""
        self.num_tokens, self.top_k = topk_ids.shape
        self.plan = (build_routing(topk_ids.to(torch.int32).contiguous(), num_local) if plan_buffer is None
                     else RoutingPlan.from_buffer(plan_buffer, self.num_tokens, self.top_k, num_local))
        self.id_range = IdRangeCheck(self.plan, num_local) if check_ids else None
        self.rows = self.plan.block_expert.numel() * _native.BLOCK_M
        self.x = dispatch(self.plan, x) if x_pool is None else x_pool

    def scatter_combine(self, a: torch.Tensor, b: torch.Tensor, hidden: int, weights: torch.Tensor,
                        b_is_k_by_n: bool = False) -> torch.Tensor:
        """[T, H] = Σ_k weights[t, k] · (a · B[e])[slot of (t, k)]: a scatter-epilogue GEMM into
        (token, k) rows (grouped_gemm_scatter), then the fixed-order combine."""
        routed = a.new_empty(self.num_tokens * self.top_k, hidden)
        grouped_gemm_scatter(a, b, self.plan, None, routed, b_is_k_by_n)
        return combine(self.plan, routed, weights)


@torch.library.custom_op("megamoe::fused_moe_forward", mutates_args=())
def fused_moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      w13: torch.Tensor, w2: torch.Tensor, activation: str, keep: bool, keep_plan: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, x_pool, z, plan) with the experts' h = act(gate) · up for `activation` (megamoe.activation).
    With keep, the pool of x [pool rows, H] and GEMM1's gate | up output z [pool rows, 2I] for the
    backward; otherwise both empty. With keep_plan, the routing plan's buffer (RoutingPlan.buffer),
    so the backward does not build it again; otherwise empty."""
    check_activation(activation)
    x_pool, z, plan = x.new_empty(0), x.new_empty(0), topk_ids.new_empty(0, dtype=torch.int32)
    if topk_ids.shape[0] == 0:
        return torch.empty_like(x), x_pool, z, plan
    num_local, two_i, hidden = w13.shape
    pool = _Pool(x, topk_ids, num_local, check_ids=True)
    if keep:
        x_pool, z = pool.x, x.new_empty(pool.rows, two_i)
    if keep_plan:
        plan = pool.plan.buffer
    h = gated_gemm(pool.x, w13, pool.plan, activation, z if keep else None)
    del pool.x
    y = pool.scatter_combine(h, w2, hidden, topk_weights)
    pool.id_range.raise_if_any()
    return y, x_pool, z, plan


@fused_moe_forward.register_fake
def _(x, topk_ids, topk_weights, w13, w2, activation, keep, keep_plan):
    check_activation(activation)
    x_pool, z, plan = x.new_empty(0), x.new_empty(0), topk_ids.new_empty(0, dtype=torch.int32)
    if topk_ids.shape[0] == 0:
        return torch.empty_like(x), x_pool, z, plan
    if keep:
        rows = pool_capacity(topk_ids.numel(), w13.shape[0])
        x_pool, z = x.new_empty(rows, x.shape[1]), x.new_empty(rows, w13.shape[1])
    if keep_plan:
        plan = topk_ids.new_empty(plan_buffer_size(topk_ids.shape[0], topk_ids.shape[1], w13.shape[0]),
                                  dtype=torch.int32)
    return torch.empty_like(x), x_pool, z, plan


@torch.library.custom_op("megamoe::fused_moe_backward", mutates_args=("main_grad13", "main_grad2"))
def fused_moe_backward(dy: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, activation: str,
                       x_pool: torch.Tensor, z: torch.Tensor, plan: torch.Tensor, need_dx: bool,
                       need_dweights: bool, need_dw13: bool, need_dw2: bool,
                       main_grad13: torch.Tensor | None, main_grad2: torch.Tensor | None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, d topk_weights, dw13, dw2); a gradient not asked for comes back empty and is not computed.

    activation: the forward's. x_pool, z, plan: what fused_moe_forward kept, or empty to gather,
    recompute and rebuild them.
    main_grad13 / main_grad2: None, or fp32 buffers shaped like w13 / w2 that the weight gradient is
    added to in fp32 instead of being returned (it then comes back empty). Required arguments: torch's
    in-place bookkeeping of mutated arguments fails on defaulted ones (IndexError, torch 2.11)."""
    check_activation(activation)
    dx, dweights, dw13, dw2 = _empty_grads(x, topk_weights, w13, w2, need_dx, need_dweights, need_dw13, need_dw2,
                                           main_grad13, main_grad2)
    if topk_ids.shape[0] == 0:
        return dx.zero_(), dweights.zero_(), dw13.zero_(), dw2.zero_()
    num_local, _, hidden = w13.shape
    pool = _Pool(x, topk_ids, num_local, x_pool if x_pool.numel() else None, plan if plan.numel() else None)
    plan = pool.plan
    dy_pool, p_pool = dispatch(plan, dy.contiguous(), topk_weights)
    if z.numel() == 0:
        z = grouped_gemm(pool.x, w13, plan)  # [rows, 2I]: gate | up pre-activations
    dz, hp, dp_partial = gated_backward(dy_pool, w2, z, p_pool, plan, activation)
    del z
    if need_dweights:
        dweights = reduce_dp(dp_partial, plan).view(topk_weights.shape).to(topk_weights.dtype)
    if need_dx:
        ones = torch.ones(topk_ids.shape, dtype=torch.float32, device=x.device)
        dx = pool.scatter_combine(dz, w13, hidden, ones, b_is_k_by_n=True)
    # Into the returned bf16 gradient, or added in fp32 to main_grad (the returned one is then empty).
    for need, out, main_grad, a, b in ((need_dw2, dw2, main_grad2, dy_pool, hp),
                                       (need_dw13, dw13, main_grad13, dz, pool.x)):
        if need:
            weight_grad(a, b, plan, out if main_grad is None else main_grad)
    return dx, dweights, dw13, dw2


def _empty_grads(x, topk_weights, w13, w2, need_dx, need_dweights, need_dw13, need_dw2, main_grad13, main_grad2):
    needs = (need_dx, need_dweights, need_dw13 and main_grad13 is None, need_dw2 and main_grad2 is None)
    return tuple(t.new_empty(t.shape if need else (0,)) for t, need in zip((x, topk_weights, w13, w2), needs))


@fused_moe_backward.register_fake
def _(dy, x, topk_ids, topk_weights, w13, w2, activation, x_pool, z, plan, need_dx, need_dweights, need_dw13,
      need_dw2, main_grad13, main_grad2):
    check_activation(activation)
    return _empty_grads(x, topk_weights, w13, w2, need_dx, need_dweights, need_dw13, need_dw2, main_grad13,
                        main_grad2)


def _setup_context(ctx, inputs, output):
    x, topk_ids, topk_weights, w13, w2, activation, _, _ = inputs
    _, x_pool, z, plan = output
    ctx.activation = activation
    ctx.mark_non_differentiable(x_pool, z, plan)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for x_pool, z and plan
    ctx.save_for_backward(x, topk_ids, topk_weights, w13, w2, x_pool, z, plan)


def _backward(ctx, dy, _dx_pool, _dz, _dplan):
    x, topk_ids, topk_weights, w13, w2, x_pool, z, plan = ctx.saved_tensors
    needs = [ctx.needs_input_grad[i] for i in (0, 2, 3, 4)]
    if not any(needs) or dy is None:
        return None, None, None, None, None, None, None, None
    main_grads = [main_grad_of(w, name) if need else None
                  for w, name, need in ((w13, "w13", needs[2]), (w2, "w2", needs[3]))]
    grads = fused_moe_backward(dy, x, topk_ids, topk_weights, w13, w2, ctx.activation, x_pool, z, plan, *needs,
                               *main_grads)
    wants = needs[:2] + [need and main is None for need, main in zip(needs[2:], main_grads)]
    dx, dweights, dw13, dw2 = (g if want else None for g, want in zip(grads, wants))
    return dx, None, dweights, dw13, dw2, None, None, None


fused_moe_forward.register_autograd(_backward, setup_context=_setup_context)


def fused_moe_autograd(x, topk_ids, topk_weights, w13, w2, recompute: bool, activation: str = "swiglu"
                       ) -> torch.Tensor:
    """y of the fused op; the routing plan is kept for the backward when one will run, and the pool
    of x and z as well unless recompute is on."""
    backward_will_run = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x, topk_weights, w13, w2))
    return fused_moe_forward(x, topk_ids, topk_weights, w13, w2, activation, backward_will_run and not recompute,
                             backward_will_run)[0]
