"""backend="fused": the Hopper kernels of the core behind one torch.library op.

Forward: routing plan → dispatch into the expert-major pool → GEMM1 with SwiGLU in its epilogue →
GEMM2 whose epilogue scatters each row into its (token, k) slot → fixed-order combine. The op has
a fake implementation, so torch.compile traces it without graph breaks.

Backward: until the fused backward kernel lands, the gradients come from the `grouped` backend
re-run on the saved inputs (its forward is recomputed, then its backward runs).
"""

from __future__ import annotations

import torch

from . import _native
from .backends import grouped_moe
from .routing import build_routing

# Sizes the kernels take: H and I are tile multiples, H fits the dispatch row copy.
SIZE_MULTIPLE = 128
MAX_HIDDEN = 4096


def check_fused_support(x: torch.Tensor, hidden: int, intermediate: int) -> None:
    """Raises before any launch when the kernels cannot run this problem."""
    if x.device.type != "cuda":
        raise ValueError(f"backend='fused' runs on CUDA tensors, got {x.device}; use backend='grouped' on the CPU")
    major, minor = torch.cuda.get_device_capability(x.device)
    if (major, minor) != (9, 0):
        raise NotImplementedError(
            f"backend='fused' needs a Hopper GPU (sm_90, H100/H200), this is sm_{major}{minor}; "
            "use backend='grouped'")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"backend='fused' computes in bfloat16, got x, w13, w2 in {x.dtype}")
    if hidden % SIZE_MULTIPLE or intermediate % SIZE_MULTIPLE or hidden > MAX_HIDDEN:
        raise ValueError(
            f"backend='fused' needs H and I to be multiples of {SIZE_MULTIPLE} (the GEMM tiles) and "
            f"H <= {MAX_HIDDEN}; got H = {hidden}, I = {intermediate}. Use backend='grouped' for this shape")


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


@torch.library.custom_op("megamoe::fused_moe_forward", mutates_args=())
def fused_moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    lib = _native.library()
    num_tokens, top_k = topk_ids.shape
    num_local, two_i, hidden = w13.shape
    plan = build_routing(topk_ids.to(torch.int32).contiguous(), num_local)
    max_blocks = plan.block_expert.numel()
    rows = max_blocks * _native.BLOCK_M
    stream = _stream(x)
    y = torch.empty_like(x)
    if num_tokens == 0:
        return y
    pool = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    _native.check(lib.megamoe_dispatch_bf16(
        x.data_ptr(), pool.data_ptr(), plan.slot_to_route.data_ptr(), plan.num_blocks.data_ptr(),
        max_blocks, top_k, hidden, stream), "fused dispatch")
    h = torch.empty(rows, two_i // 2, dtype=x.dtype, device=x.device)
    _native.check(lib.megamoe_grouped_gemm_swiglu_bf16(
        pool.data_ptr(), w13.data_ptr(), h.data_ptr(), plan.block_expert.data_ptr(),
        plan.num_blocks.data_ptr(), max_blocks, two_i // 2, hidden, num_local, stream), "fused GEMM1")
    del pool
    routed = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _native.check(lib.megamoe_grouped_gemm_scatter_bf16(
        h.data_ptr(), w2.data_ptr(), routed.data_ptr(), plan.slot_to_route.data_ptr(),
        plan.block_expert.data_ptr(), plan.num_blocks.data_ptr(), max_blocks, hidden, two_i // 2,
        num_local, routed.shape[0], stream), "fused GEMM2")
    del h
    weights = topk_weights.to(torch.float32).contiguous()
    _native.check(lib.megamoe_combine_bf16(
        routed.data_ptr(), weights.data_ptr(), plan.route_to_slot.data_ptr(), y.data_ptr(),
        num_tokens, top_k, hidden, stream), "fused combine")
    return y


@fused_moe_forward.register_fake
def _(x, topk_ids, topk_weights, w13, w2):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    x, topk_ids, topk_weights, w13, w2 = ctx.saved_tensors
    wanted = [ctx.needs_input_grad[i] for i in (0, 2, 3, 4)]
    if not any(wanted):
        return None, None, None, None, None
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(need) for t, need in zip((x, topk_weights, w13, w2), wanted)]
        y = grouped_moe(leaves[0], topk_ids, leaves[1], leaves[2], leaves[3])
        inputs = [t for t, need in zip(leaves, wanted) if need]
        grads = iter(torch.autograd.grad(y, inputs, dy))
    dx, dweights, dw13, dw2 = (next(grads) if need else None for need in wanted)
    return dx, None, dweights, dw13, dw2


fused_moe_forward.register_autograd(_backward, setup_context=_setup_context)
