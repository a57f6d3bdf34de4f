"""Routing plan: topk_ids -> expert-major pool with 128-row blocks (see csrc/include/megamoe/megamoe.h).

The same plan is built on the GPU (CUDA kernels) or on the host (the C++ reference), chosen by
the device of `topk_ids`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math

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
    # Every field above is a view of this one int32 allocation: what the fused op keeps of the
    # forward's plan for its backward.
    buffer: torch.Tensor = dataclasses.field(repr=False, compare=False, default=None)
    # What the plan is built for (megamoe_routing_plan.shape).
    shape: _native.RoutingShape = dataclasses.field(repr=False, compare=False, default=None)
    # native()'s struct without a workspace, made once: every kernel of a layer takes the same one.
    _native_plan: _native.RoutingPlan | None = dataclasses.field(repr=False, compare=False, default=None,
                                                                  init=False)

    @classmethod
    def from_buffer(cls, buffer: torch.Tensor, num_tokens: int, top_k: int, num_local_experts: int,
                    num_experts: int | None = None, expert_begin: int = 0) -> RoutingPlan:
        """The plan whose fields `buffer` holds (as build_routing laid them out), for the experts
        [expert_begin, expert_begin + num_local_experts) of num_experts (default: all are local)."""
        sizes, shapes = _buffer_layout(num_tokens, top_k, num_local_experts)
        views = [part.view(shape) for part, shape in zip(buffer[:sum(sizes)].split(sizes), shapes)]
        shape = _native.RoutingShape(num_tokens, top_k, num_local_experts if num_experts is None else num_experts,
                                     expert_begin, num_local_experts)
        return cls(**dict(zip(PLAN_FIELDS, views)), buffer=buffer, shape=shape)

    def native(self, workspace: torch.Tensor | None = None) -> _native.RoutingPlan:
        """The megamoe_routing_plan the C API takes: this plan's arrays and shape."""
        if workspace is None and self._native_plan is not None:
            return self._native_plan
        plan = _native.RoutingPlan(*(getattr(self, name).data_ptr() for name in PLAN_FIELDS),
                                   _native.address(workspace), self.shape)
        if workspace is None:
            self._native_plan = plan
        return plan


# The plan's arrays, in the order of megamoe_routing_plan's pointers (the dataclass order).
PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(RoutingPlan)
                    if f.name not in ("buffer", "shape", "_native_plan"))


def pool_capacity(num_routes, num_local_experts: int):
    """Pool rows of a plan (megamoe_routing_capacity), in Python so fake tensors can be sized
    from symbolic shapes: the routes rounded up to blocks, plus a padding block per local expert."""
    block = _native.BLOCK_M
    return -(-num_routes // block) * block + num_local_experts * block


def _field_shapes(num_tokens, top_k: int, num_local_experts: int) -> dict:
    capacity = pool_capacity(num_tokens * top_k, num_local_experts)
    return {"expert_counts": (num_local_experts,), "expert_offsets": (num_local_experts + 1,),
            "route_to_slot": (num_tokens, top_k), "slot_to_route": (capacity,),
            "block_expert": (capacity // _native.BLOCK_M,), "num_blocks": (1,), "num_invalid": (1,)}


@functools.lru_cache(maxsize=64)
def _buffer_layout(num_tokens: int, top_k: int, num_local_experts: int) -> tuple[tuple[int, ...], tuple]:
    """(each field's int32 count, each field's shape), in PLAN_FIELDS order: one computation per shape."""
    fields = _field_shapes(num_tokens, top_k, num_local_experts)
    shapes = tuple(fields[name] for name in PLAN_FIELDS)
    return tuple(math.prod(shape) for shape in shapes), shapes


def plan_buffer_size(num_tokens, top_k: int, num_local_experts: int):
    """int32 elements of RoutingPlan.buffer (symbolic shapes welcome: fake tensors size it)."""
    return sum(math.prod(shape) for shape in _field_shapes(num_tokens, top_k, num_local_experts).values())


def build_routing(topk_ids: torch.Tensor, num_experts: int, expert_begin: int = 0,
                  num_local_experts: int | None = None) -> RoutingPlan:
    """Plan for the experts [expert_begin, expert_begin + num_local_experts) (default: all)."""
    if topk_ids.dtype != torch.int32 or topk_ids.dim() != 2 or not topk_ids.is_contiguous():
        raise ValueError("topk_ids must be a contiguous int32 tensor [T, K], got "
                         f"{topk_ids.dtype} {tuple(topk_ids.shape)}")
    num_local = num_experts - expert_begin if num_local_experts is None else num_local_experts
    local = max(num_local, 0)  # the library rejects a bad shape below, with its message
    device = topk_ids.device
    buffer = torch.empty(plan_buffer_size(topk_ids.shape[0], topk_ids.shape[1], local), dtype=torch.int32,
                         device=device)
    plan = RoutingPlan.from_buffer(buffer, topk_ids.shape[0], topk_ids.shape[1], local, num_experts, expert_begin)
    plan.shape.num_local_experts = num_local
    if device.type == "cuda":
        workspace = torch.empty(_native.library().megamoe_routing_workspace_bytes(ctypes.byref(plan.shape)),
                                dtype=torch.uint8, device=device)
        _native.call("megamoe_build_routing_cuda", "build_routing", topk_ids.data_ptr(), plan.native(workspace),
                     _native.stream(device))
    else:
        _native.call("megamoe_build_routing_host", "build_routing", topk_ids.data_ptr(), plan.native())
    return plan
