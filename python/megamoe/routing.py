"""Routing plan: topk_ids -> expert-major pool with 128-row blocks (see csrc/include/megamoe/megamoe.h).

The same plan is built on the GPU (CUDA kernels) or on the host (the C++ reference), chosen by
the device of `topk_ids`.
"""

from __future__ import annotations

import ctypes
import dataclasses

import torch

from . import _native


@dataclasses.dataclass
class RoutingPlan:
    expert_counts: torch.Tensor  # [E_local] int32
    expert_offsets: torch.Tensor  # [E_local + 1] int32, multiples of 128
    route_to_slot: torch.Tensor  # [T, K] int32, -1 for masked or non-local routes
    slot_to_route: torch.Tensor  # [capacity] int32, -1 for padding rows
    block_expert: torch.Tensor  # [max_blocks] int32, -1 past num_blocks
    num_blocks: torch.Tensor  # [1] int32
    num_invalid: torch.Tensor  # [1] int32: ids outside [-1, E), treated as masked


def pool_capacity(num_routes, num_local_experts: int):
    """Pool rows of a plan (megamoe_routing_capacity), in Python so fake tensors can be sized
    from symbolic shapes: the routes rounded up to blocks, plus a padding block per local expert."""
    block = _native.BLOCK_M
    return -(-num_routes // block) * block + num_local_experts * block


def build_routing(topk_ids: torch.Tensor, num_experts: int, expert_begin: int = 0,
                  num_local_experts: int | None = None) -> RoutingPlan:
    """Plan for the experts [expert_begin, expert_begin + num_local_experts) (default: all)."""
    if topk_ids.dtype != torch.int32 or topk_ids.dim() != 2 or not topk_ids.is_contiguous():
        raise ValueError("topk_ids must be a contiguous int32 tensor [T, K], got "
                         f"{topk_ids.dtype} {tuple(topk_ids.shape)}")
    lib = _native.library()
    shape = _native.RoutingShape(topk_ids.shape[0], topk_ids.shape[1], num_experts, expert_begin,
                                 num_experts - expert_begin if num_local_experts is None
                                 else num_local_experts)
    capacity = lib.megamoe_routing_capacity(ctypes.byref(shape))
    max_blocks = lib.megamoe_routing_max_blocks(ctypes.byref(shape))
    device = topk_ids.device
    int32 = dict(dtype=torch.int32, device=device)
    plan = RoutingPlan(
        expert_counts=torch.empty(max(shape.num_local_experts, 0), **int32),
        expert_offsets=torch.empty(max(shape.num_local_experts + 1, 0), **int32),
        route_to_slot=torch.empty(topk_ids.shape, **int32),
        slot_to_route=torch.empty(max(capacity, 0), **int32),
        block_expert=torch.empty(max(max_blocks, 0), **int32),
        num_blocks=torch.empty(1, **int32),
        num_invalid=torch.empty(1, **int32),
    )
    pointers = _native.RoutingPlanPointers(
        *(getattr(plan, f.name).data_ptr() for f in dataclasses.fields(plan)), None)
    if device.type == "cuda":
        workspace = torch.empty(lib.megamoe_routing_workspace_bytes(ctypes.byref(shape)),
                                dtype=torch.uint8, device=device)
        pointers.workspace = workspace.data_ptr()
        stream = torch.cuda.current_stream(device).cuda_stream
        status = lib.megamoe_build_routing_cuda(topk_ids.data_ptr(), ctypes.byref(shape),
                                                ctypes.byref(pointers), stream)
    else:
        status = lib.megamoe_build_routing_host(topk_ids.data_ptr(), ctypes.byref(shape),
                                                ctypes.byref(pointers))
    _native.check(status, "build_routing")
    return plan
