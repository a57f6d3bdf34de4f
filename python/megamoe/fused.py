"""backend="fused": the Hopper kernels of the core behind one torch.library op.

Forward: routing plan (ids out of range are counted on the GPU and raise once the launches are
queued: validation.IdRangeCheck) → dispatch into the expert-major pool (exchange.py; in bf16 at
small batches GEMM1 reads x's token rows by route instead, and there is no pool) → GEMM1 with
the gated activation (megamoe.activation; the kernels: SwiGLU) in its epilogue → GEMM2 whose
epilogue scatters each row into its (token, k) slot → fixed-order combine (exchange.py). The op has
a fake implementation, so torch.compile traces it without graph breaks; run eagerly, the same
functions go under a torch.autograd.Function instead, which spares the host the op's dispatch.

Backward (a second op): the forward's routing plan (kept: one int32 buffer), gather dy (and each
row's topk weight p), take the pool of x and z = x·w13ᵀ (gate | up, one row per route: compact, see
gemm.empty_z) as the forward kept them, or gather and recompute them (recompute=True: only the inputs
and the plan are kept, at the price of a gather and a GEMM), then dh = dy·w2 with the activation's
backward, p·h and dp partials in its epilogue → dp (fixed-order reduce); dx per route = dz·w13
scattered to (token, k) rows and combined; dw2 and dw13 as K-grouped GEMMs over each expert's rows.
Deterministic: no atomics anywhere.

Block FP8 (DeepSeek-V3 recipe; precision "fp8": forward and backward, "fp8_bwd": the bf16 forward and
the FP8 backward): x and dy are quantised once per token (1 x 128 scales) and dispatched in e4m3 with
their scales; GEMM1 quantises h in its epilogue for GEMM2; the weights' 128 x 128 block copies come from
megamoe.fp8's cache (once per weight version), the backward reading transposed copies of w2 (dh) and w13
(dx) because FP8 tensor cores read both operands K-major (in "fp8_bwd" the only copies); dh's epilogue
stores dz only in e4m3, quantised per row for dx.
The weight gradients are FP8 GEMMs too, K-grouped over each expert's rows: dy and dz transposed and
quantised in 1 x 128 blocks along the tokens, p·h and x in 128 x 128 blocks (128 tokens x 128
columns), so the promotion is the forward's FP8 GEMMs' (a scale per fragment row and 128-column
block); x's rows are read straight from its token rows, dy's and dz's from the e4m3 pools that dh
and dx read, dequantised to bf16: dy and dz are quantised twice on their way to dW2 and dW13, and no
bf16 dz is written or read back (about 0.9 GB less traffic at Qwen3-30B-A3B, 16384 tokens). Kept
for the backward in "fp8"
and "fp8_bwd": z (bf16) and the plan (an e4m3 pool of x from the forward would be quantised along
the hidden size, not the tokens, and cost T·K·H bytes).

Memory: z is kept compact (T·K rows, not the pool's worst case), and its memory is given back as
soon as dh has read it, unless a later backward through the same graph needs it (retain_graph); the
gradients are allocated just before their GEMMs. Where the bf16 pool of x was not kept
(recompute="gather"), dW13 is made in two column halves of H, each from a pool of x that half
wide, so the backward's peak (dW13, with dz and the other gradients live) holds half of that pool.
At small batches dW13 reads x's rows by route as GEMM1 does, and dh and dW2 dy's, with no pools at
all (only p is dispatched).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _native, fp8
from .activation import check_activation
from .exchange import combine, dispatch, dispatch_fp8
from .gemm import (empty_z, gated_backward, gated_backward_fp8, gated_gemm, gated_gemm_fp8, grouped_gemm_scatter,
                   grouped_gemm_scatter_fp8, recompute_z, reduce_dp, transpose_quantize, weight_grad, weight_grad_fp8)
from .routing import RoutingPlan, build_routing, plan_buffer_size, pool_capacity
from .validation import IdRangeCheck, check_fused_precision, is_plain_tensor, main_grad_of


def _plan(topk_ids: torch.Tensor, num_local: int, plan_buffer: torch.Tensor | None = None) -> RoutingPlan:
    """The routing plan: the forward's (plan_buffer, RoutingPlan.buffer), or built."""
    if plan_buffer is None:
        return build_routing(topk_ids.contiguous(), num_local)
    return RoutingPlan.from_buffer(plan_buffer, topk_ids.shape[0], topk_ids.shape[1], num_local)


def _routed(plan: RoutingPlan, x: torch.Tensor) -> torch.Tensor:
    """[T·K, H] bf16: one row per (token, k) route, written by the scatter GEMMs."""
    return x.new_empty(plan.num_routes, x.shape[1], dtype=torch.bfloat16)


def _gathers_rows(num_routes: int, num_local: int) -> bool:
    """Whether the bf16 GEMMs read token rows by route instead of dispatched pools (GEMM1 and dW13 x's,
    dh and dW2 dy's): where experts get at most a block of rows on average (T·K <= 128·E_local) the
    rows stay in L2 while the weights stream past, and a pool would be mostly padding, written and read
    back through DRAM."""
    return num_routes <= _native.BLOCK_M * num_local


def _forward_experts(plan: RoutingPlan, x: torch.Tensor, w13, w2, activation, z,
                     fp8_forward: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(routed [T·K, H]: each route's expert output, the bf16 pool of x or None): x dispatched into the
    pool (e4m3 with its scales in FP8; in bf16 at small batches GEMM1 gathers x's rows itself and
    there is no pool), GEMM1 with the activation (writing z unless it is None), then GEMM2 into the
    routes' rows (allocated once GEMM1 is queued: a small batch's GPU waits for the host until then)."""
    if fp8_forward:
        w13_fp8, w2_fp8 = fp8.quantized_weight(w13), fp8.quantized_weight(w2)
        x_pool, x_scales = dispatch_fp8(plan, x)
        h, h_scales = gated_gemm_fp8(x_pool, x_scales, w13_fp8.q, w13_fp8.scales, plan, activation, z)
        del x_pool, x_scales
        routed = _routed(plan, x)
        grouped_gemm_scatter_fp8(h, h_scales, w2_fp8.q, w2_fp8.scales, plan, routed)
        return routed, None
    if _gathers_rows(plan.num_routes, w13.shape[0]):
        x_pool = None
        h = gated_gemm(x.contiguous(), w13, plan, activation, z, gather=True)
    else:
        x_pool = dispatch(plan, x)
        h = gated_gemm(x_pool, w13, plan, activation, z)
    routed = _routed(plan, x)
    grouped_gemm_scatter(h, w2, plan, None, routed)
    return routed, x_pool


@_native.on_the_tensors_gpu
def fused_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, activation: str, precision: str, keep: bool, keep_pool: bool, keep_plan: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, x_pool, z, plan) with the experts' h = act(gate) · up for `activation` (megamoe.activation)
    in `precision` ("bf16", "fp8", "fp8_bwd": its forward is bf16). With keep, GEMM1's gate | up
    output z [T·K, 2I] bf16 (compact) for the backward, and with keep_pool as well, in "bf16", its pool
    of x [pool rows, H] (what dW13 reads; the FP8 weight gradients read x's token rows, so "fp8" and
    "fp8_bwd" keep none, and at small batches GEMM1 makes none: _gathers_rows); otherwise empty.
    With keep_plan, the routing plan's buffer (RoutingPlan.buffer), so the backward does not build it
    again; otherwise empty."""
    check_activation(activation)
    check_fused_precision(precision)
    if topk_ids.shape[0] == 0:
        return (torch.empty_like(x),) + _nothing_kept(x, topk_ids)
    plan = _plan(topk_ids, w13.shape[0])
    id_range = IdRangeCheck(plan, w13.shape[0])
    z = empty_z(plan, w13) if keep else None
    routed, pool = _forward_experts(plan, x, w13, w2, activation, z, precision == "fp8")
    x_pool = pool if keep and keep_pool and precision == "bf16" else None
    del pool
    y = combine(plan, routed, topk_weights)
    # What is not kept comes back as an empty tensor, made once every kernel is queued.
    no_pool, no_z, no_plan = _nothing_kept(x, topk_ids)
    id_range.raise_if_any()
    return y, no_pool if x_pool is None else x_pool, no_z if z is None else z, plan.buffer if keep_plan else no_plan


def _nothing_kept(x: torch.Tensor, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_pool, z, plan) as fused_forward returns them when it keeps none of them: empty tensors."""
    return x.new_empty(0), x.new_empty(0), topk_ids.new_empty(0, dtype=torch.int32)


@torch.library.custom_op("megamoe::fused_moe_forward", mutates_args=())
def fused_moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      w13: torch.Tensor, w2: torch.Tensor, activation: str, precision: str, keep: bool,
                      keep_pool: bool, keep_plan: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fused_forward as one op (what torch.compile sees)."""
    return fused_forward(x, topk_ids, topk_weights, w13, w2, activation, precision, keep, keep_pool, keep_plan)


@fused_moe_forward.register_fake
def _(x, topk_ids, topk_weights, w13, w2, activation, precision, keep, keep_pool, keep_plan):
    check_activation(activation)
    check_fused_precision(precision)
    x_pool, z, plan = _nothing_kept(x, topk_ids)
    if topk_ids.shape[0] == 0:
        return torch.empty_like(x), x_pool, z, plan
    if keep:
        z = x.new_empty(topk_ids.numel(), w13.shape[1])
        if keep_pool and precision == "bf16" and not _gathers_rows(topk_ids.numel(), w13.shape[0]):
            x_pool = x.new_empty(pool_capacity(topk_ids.numel(), w13.shape[0]), x.shape[1])
    if keep_plan:
        plan = topk_ids.new_empty(plan_buffer_size(topk_ids.shape[0], topk_ids.shape[1], w13.shape[0]),
                                  dtype=torch.int32)
    return torch.empty_like(x), x_pool, z, plan


@_native.on_the_tensors_gpu
def fused_backward(dy: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   w13: torch.Tensor, w2: torch.Tensor, activation: str, precision: str, x_pool: torch.Tensor,
                   z: torch.Tensor, plan: torch.Tensor, free_z: bool, need_dx: bool, need_dweights: bool,
                   need_dw13: bool, need_dw2: bool, main_grad13: torch.Tensor | None, main_grad2: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, d topk_weights, dw13, dw2); a gradient not asked for comes back empty and is not computed.

    activation, precision: the forward's. x_pool, z, plan: what fused_forward kept, or empty to
    dispatch, recompute and rebuild them. free_z: give the kept z's memory back once dh has read it
    (nothing reads it after this backward), so it is not live beside dz and the weight gradients.
    main_grad13 / main_grad2: None, or fp32 buffers shaped like w13 / w2 that the weight gradient is
    added to in fp32 instead of being returned (it then comes back empty)."""
    check_activation(activation)
    check_fused_precision(precision)
    if topk_ids.shape[0] == 0:
        return tuple(g.zero_() for g in _empty_grads(x, topk_weights, w13, w2, need_dx, need_dweights, need_dw13,
                                                     need_dw2, main_grad13, main_grad2))
    # Each gradient is allocated when it is computed, so the weight gradients (the backward's largest
    # tensors) are not live beside the pool of dy and hp while dh runs: a lower peak. Those not computed
    # come back as empty tensors made at the end, once every kernel is queued.
    dx = dweights = dw13 = dw2 = None
    plan = _plan(topk_ids, w13.shape[0], plan if plan.numel() else None)
    x_pool = x_pool if x_pool.numel() else None
    dy = dy.contiguous()
    fp8_backward = precision in ("fp8", "fp8_bwd")
    # In FP8, dh reads dy in e4m3 (dispatched with p below), dW2 dy's e4m3 token rows or pool and dW13
    # x's token rows: no bf16 pools.
    # At small batches the bf16 GEMMs read token rows by route (dh and dW2 dy's, dW13 x's): of dy only p
    # is dispatched.
    gather_rows = not fp8_backward and _gathers_rows(plan.num_routes, w13.shape[0])
    if gather_rows:
        dy_pool, p_pool = dy, dispatch(plan, None, topk_weights)
    elif not fp8_backward:
        dy_pool, p_pool = dispatch(plan, dy, topk_weights)
    if z.numel() == 0:  # recompute: z in the forward's precision (in bf16 its pool of x serves dW13 too)
        free_z = False  # our own: freed when it goes out of scope
        if precision == "fp8":
            w13_fp8 = fp8.quantized_weight(w13)
            x_fp8, x_scales = dispatch_fp8(plan, x)
            z = recompute_z(x_fp8, w13_fp8.q, plan, activation, x_scales, w13_fp8.scales)
            del x_fp8, x_scales
        else:
            pool = dispatch(plan, x)
            z = recompute_z(pool, w13, plan, activation)
            x_pool = None if fp8_backward else pool
            del pool
    if fp8_backward:
        # e4m3 rows and their scales: the pool for dh, and where they fit in L2 the token rows once, which
        # dW2's transposed dy is then gathered from (else from the pool)
        token_rows = need_dw2 and _fits_in_l2(dy.shape[0] * dy.shape[1], dy.device)
        dy_q, dy_scales, p_pool, *dy_rows = dispatch_fp8(plan, dy, topk_weights, token_rows=token_rows)
        w2t, w2t_scales = fp8.transposed_weight(w2)
        # dz for dx, and dz and hp transposed for the weight gradients: each freed once read
        dz_fp8, dz_t, hp, dp_partial, _, _ = gated_backward_fp8(dy_q, dy_scales, w2t, w2t_scales, z, p_pool, plan,
                                                                activation)
        dy_source = dy_rows if token_rows else (dy_q, dy_scales)  # e4m3 values and scales
        del dy_q, dy_scales, dy_rows
    else:
        dz, hp, dp_partial = gated_backward(dy_pool, w2, z, p_pool, plan, activation, gather=gather_rows)
    if free_z:
        z.untyped_storage().resize_(0)
    del z
    if need_dweights:
        dweights = reduce_dp(dp_partial, plan).view(topk_weights.shape).to(topk_weights.dtype)

    # dW2 first, so the pool of dy and hp are freed before dx needs its per-route rows.
    if need_dw2:
        if main_grad2 is None:
            dw2 = w2.new_empty(w2.shape)
        out = dw2 if main_grad2 is None else main_grad2
        if fp8_backward:
            values, scales = dy_source
            weight_grad_fp8(transpose_quantize(values, plan, in_blocks=False, tokens=token_rows, src_scales=scales),
                            hp, plan, out)
            del values, scales
        else:
            weight_grad(dy_pool, hp, plan, out, gather_a=gather_rows)
    dy_pool = dy_source = hp = None  # freed before dx needs its per-route rows
    if need_dx:
        routed = _routed(plan, x)
        if fp8_backward:
            w13t, w13t_scales = fp8.transposed_weight(w13)
            grouped_gemm_scatter_fp8(*dz_fp8, w13t, w13t_scales, plan, routed)
            del dz_fp8
        else:
            grouped_gemm_scatter(dz, w13, plan, None, routed, b_is_k_by_n=True)
        dx = combine(plan, routed, None)
        del routed
    if need_dw13:
        if main_grad13 is None:
            dw13 = w13.new_empty(w13.shape)
        out = dw13 if main_grad13 is None else main_grad13
        if fp8_backward:
            weight_grad_fp8(dz_t, x, plan, out, b_tokens=True)
        elif x_pool is not None:
            weight_grad(dz, x_pool, plan, out)
        elif gather_rows:  # small batches: x's rows read by route
            weight_grad(dz, x.contiguous(), plan, out, gather_b=True)
        else:  # not kept (recompute="gather"): dispatched again, half of H's columns at a time
            for cols in _column_halves(x.shape[1]):
                weight_grad(dz, dispatch(plan, x[:, cols]), plan, out[:, :, cols])
    return tuple(t.new_empty((0,)) if g is None else g
                 for g, t in zip((dx, dweights, dw13, dw2), (x, topk_weights, w13, w2)))


def _fits_in_l2(nbytes: int, device: torch.device) -> bool:
    """Whether nbytes fit in the GPU's L2 cache: then a pass that gathers rows by route reads them from L2
    (T rows read K times each) rather than from DRAM. Measured for dy's e4m3 token rows against its pool,
    one H100 (50 MB): 30B (34 MB) the FP8 backward 0.7% faster, 235B (67 MB) 0.6% slower
    (docs/PERFORMANCE.md)."""
    return device.type == "cuda" and nbytes <= torch.cuda.get_device_properties(device).L2_cache_size


def _column_halves(hidden: int) -> list[slice]:
    """The column slices dW13 is made in when the pool of x is dispatched for it: two, the first a whole
    number of 256-wide tiles, so the pool live beside dz and the gradients is half of T·K·H (the
    backward's peak) and the weight-gradient GEMMs run the same tiles as on all columns."""
    split = -(-hidden // 512) * 256
    return [slice(0, hidden)] if split >= hidden else [slice(0, split), slice(split, hidden)]


@torch.library.custom_op("megamoe::fused_moe_backward", mutates_args=("z", "main_grad13", "main_grad2"))
def fused_moe_backward(dy: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, activation: str,
                       precision: str, x_pool: torch.Tensor, z: torch.Tensor, plan: torch.Tensor, free_z: bool,
                       need_dx: bool, need_dweights: bool, need_dw13: bool, need_dw2: bool,
                       main_grad13: torch.Tensor | None, main_grad2: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fused_backward as one op (free_z counts as mutating z). main_grad13 / main_grad2 are required
    arguments: torch's in-place bookkeeping of mutated arguments fails on defaulted ones (IndexError,
    torch 2.11)."""
    return fused_backward(dy, x, topk_ids, topk_weights, w13, w2, activation, precision, x_pool, z, plan, free_z,
                          need_dx, need_dweights, need_dw13, need_dw2, main_grad13, main_grad2)


def _empty_grads(x, topk_weights, w13, w2, need_dx, need_dweights, need_dw13, need_dw2, main_grad13, main_grad2):
    needs = (need_dx, need_dweights, need_dw13 and main_grad13 is None, need_dw2 and main_grad2 is None)
    return tuple(t.new_empty(t.shape if need else (0,)) for t, need in zip((x, topk_weights, w13, w2), needs))


@fused_moe_backward.register_fake
def _(dy, x, topk_ids, topk_weights, w13, w2, activation, precision, x_pool, z, plan, free_z, need_dx,
      need_dweights, need_dw13, need_dw2, main_grad13, main_grad2):
    check_activation(activation)
    check_fused_precision(precision)
    return _empty_grads(x, topk_weights, w13, w2, need_dx, need_dweights, need_dw13, need_dw2, main_grad13,
                        main_grad2)


def _keep_for_backward(ctx, inputs, kept) -> None:
    """What either autograd path of the fused layer keeps: the forward's inputs, options and (x_pool,
    z, plan)."""
    x, topk_ids, topk_weights, w13, w2, activation, precision, _, _, _ = inputs
    ctx.activation, ctx.precision = activation, precision
    ctx.set_materialize_grads(False)  # no zero-filled gradients for what the backward reads
    ctx.save_for_backward(x, topk_ids, topk_weights, w13, w2, *kept)


def _setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(*output[1:])
    _keep_for_backward(ctx, inputs, output[1:])


def autograd_backward(ctx, dy, w13, w2, run) -> tuple:
    """The autograd backward of an op whose inputs begin (x, topk_ids, topk_weights, w13, w2):
    run(needs, main_grads) computes (dx, d topk_weights, dw13, dw2), needs saying which of them are
    asked for and main_grads w13's / w2's fp32 buffer where the weight gradient goes into it (or
    None). A weight gradient added into its main_grad reaches autograd as None."""
    needs = [ctx.needs_input_grad[i] for i in (0, 2, 3, 4)]
    rest = (None,) * (len(ctx.needs_input_grad) - 5)
    if not any(needs) or dy is None:
        return (None,) * 5 + rest
    main_grads = [main_grad_of(w, name) if need else None
                  for w, name, need in ((w13, "w13", needs[2]), (w2, "w2", needs[3]))]
    grads = run(needs, main_grads)
    wants = needs[:2] + [need and main is None for need, main in zip(needs[2:], main_grads)]
    dx, dweights, dw13, dw2 = (g if want else None for g, want in zip(grads, wants))
    return (dx, None, dweights, dw13, dw2) + rest


def _run_backward(ctx, dy, backward) -> tuple:
    """The autograd backward of either path: backward is fused_moe_backward or fused_backward."""
    x, topk_ids, topk_weights, w13, w2, x_pool, z, plan = ctx.saved_tensors
    free_z = not torch._C._autograd._get_current_graph_task_keep_graph()  # retain_graph: a later backward reads z
    return autograd_backward(ctx, dy, w13, w2, lambda needs, main_grads: backward(
        dy, x, topk_ids, topk_weights, w13, w2, ctx.activation, ctx.precision, x_pool, z, plan, free_z, *needs,
        *main_grads))


def _backward(ctx, dy, _dx_pool, _dz, _dplan):
    return _run_backward(ctx, dy, fused_moe_backward)


fused_moe_forward.register_autograd(_backward, setup_context=_setup_context)


class _EagerFusedMoE(torch.autograd.Function):
    """The fused layer run eagerly: fused_forward and fused_backward under autograd directly, without
    the Python layers torch wraps around a torch.library op (its autograd wrapper, argument filling
    and dispatch), which cost about a third of the host's time per call: the time that bounds the
    layer at small batches (docs/PERFORMANCE.md)."""

    @staticmethod
    def forward(ctx, *inputs):
        y, *kept = fused_forward(*inputs)
        _keep_for_backward(ctx, inputs, kept)
        return y

    @staticmethod
    def backward(ctx, dy):
        return _run_backward(ctx, dy, fused_backward)


def _runs_eagerly(*tensors: torch.Tensor) -> bool:
    """Whether the eager path may run: not while torch.compile traces, nor for tensor subclasses
    (fake or meta tensors, functorch's wrappers) or under a dispatch mode, which all need the op."""
    return (not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
            and all(is_plain_tensor(t) for t in tensors))


def fused_moe_autograd(x, topk_ids, topk_weights, w13, w2, recompute: bool | str, activation: str = "swiglu",
                       precision: str = "bf16") -> torch.Tensor:
    """y of the fused op; when a backward will run, the routing plan is kept for it, and by
    `recompute` (validation.RECOMPUTE_MODES) z and the pool of x (False), z alone ("gather") or
    neither (True)."""
    backward_will_run = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x, topk_weights, w13, w2))
    inputs = (x, topk_ids, topk_weights, w13, w2, activation, precision,
              backward_will_run and (not recompute or recompute == "gather"), not recompute, backward_will_run)
    if not _runs_eagerly(x, topk_ids, topk_weights, w13, w2):
        return fused_moe_forward(*inputs)[0]
    return _EagerFusedMoE.apply(*inputs) if backward_will_run else fused_forward(*inputs)[0]
