"""Routing plan: topk_ids -> expert-major pool with 128-row blocks (see csrc/include/megamoe/megamoe.h).

The same plan is built on the GPU (CUDA kernels) or on the host (the C++ reference), chosen by
the device of `topk_ids`.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import NamedTuple

import torch

from . import _native


class _PlanArray:
    """One array of a RoutingPlan: a view of the plan's buffer, made when first read, then kept."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, plan, owner=None):
        if plan is None:
            return self
        offset, size, shape = plan.layout.fields[self.name]
        view = plan.buffer[offset:offset + size].view(shape)
        plan.__dict__[self.name] = view
        return view


class RoutingPlan:
    """A routing plan: its arrays in one int32 buffer (what the fused op keeps of the forward's plan
    for the backward), and the shape it is built for (megamoe_routing_plan.shape). The C API's struct
    takes the arrays' addresses in the buffer; as tensors they are views made when first read."""

    expert_counts = _PlanArray()  # [E_local] int32
    expert_offsets = _PlanArray()  # [E_local + 1] int32, multiples of 128
    compact_offsets = _PlanArray()  # [E_local + 1] int32: prefix sums of expert_counts (z's rows)
    route_to_slot = _PlanArray()  # [T, K] int32, -1 for masked or non-local routes
    slot_to_route = _PlanArray()  # [capacity] int32, -1 for padding rows
    block_expert = _PlanArray()  # [max_blocks] int32, -1 past num_blocks
    num_blocks = _PlanArray()  # [1] int32
    num_invalid = _PlanArray()  # [1] int32: ids outside [-1, E), treated as masked

    def __init__(self, buffer: torch.Tensor, shape: _native.RoutingShape, layout: PlanLayout):
        self.buffer, self.shape, self.layout = buffer, shape, layout
        self._native_plan = None  # native()'s struct without a workspace: every kernel of a layer takes it
        # The GPU build's copy of num_invalid in pinned host memory (an int32 the host reads without a
        # copy once the build has run; -1 until then), or None: validation.IdRangeCheck reads it.
        self.num_invalid_host: ctypes.c_int32 | None = None

    @classmethod
    def from_buffer(cls, buffer: torch.Tensor, num_tokens: int, top_k: int, num_local_experts: int,
                    num_experts: int | None = None, expert_begin: int = 0) -> RoutingPlan:
        """The plan whose fields `buffer` holds (as build_routing laid them out), for the experts
        [expert_begin, expert_begin + num_local_experts) of num_experts (default: all are local)."""
        shape = _native.RoutingShape(num_tokens, top_k, num_local_experts if num_experts is None else num_experts,
                                     expert_begin, num_local_experts)
        return cls(buffer, shape, _buffer_layout(num_tokens, top_k, num_local_experts))

    @property
    def pool_rows(self) -> int:
        """Rows of the plan's pool (its capacity): max_blocks * 128."""
        return self.layout.fields["slot_to_route"][1]

    @property
    def num_routes(self) -> int:
        """T * K: the (token, k) routes the plan maps."""
        return self.layout.fields["route_to_slot"][1]

    def native(self, workspace: torch.Tensor | None = None) -> _native.RoutingPlan:
        """The megamoe_routing_plan the C API takes: this plan's arrays and shape."""
        if workspace is None and self._native_plan is not None:
            return self._native_plan
        base = self.buffer.data_ptr()
        plan = _native.RoutingPlan(*(base + offset for offset in self.layout.byte_offsets),
                                   _native.address(workspace), self.shape)
        if workspace is None:
            self._native_plan = plan
        return plan

    def __repr__(self) -> str:
        return f"RoutingPlan({', '.join(f'{name}={getattr(self, name)}' for name in PLAN_FIELDS)})"


# The plan's arrays, in the order of megamoe_routing_plan's pointers.
PLAN_FIELDS = ("expert_counts", "expert_offsets", "compact_offsets", "route_to_slot", "slot_to_route", "block_expert",
               "num_blocks", "num_invalid")


def pool_capacity(num_routes, num_local_experts: int):
    """Pool rows of a plan (megamoe_routing_capacity), in Python so fake tensors can be sized
    from symbolic shapes: the routes rounded up to blocks, plus a padding block per local expert."""
    block = _native.BLOCK_M
    return -(-num_routes // block) * block + num_local_experts * block


def _field_shapes(num_tokens, top_k: int, num_local_experts: int) -> dict:
    capacity = pool_capacity(num_tokens * top_k, num_local_experts)
    return {"expert_counts": (num_local_experts,), "expert_offsets": (num_local_experts + 1,),
            "compact_offsets": (num_local_experts + 1,),
            "route_to_slot": (num_tokens, top_k), "slot_to_route": (capacity,),
            "block_expert": (capacity // _native.BLOCK_M,), "num_blocks": (1,), "num_invalid": (1,)}


class PlanLayout(NamedTuple):
    """Where a plan's arrays lie in its int32 buffer."""
    fields: dict  # {field: (offset, int32 count, shape)} in PLAN_FIELDS order
    size: int  # int32 elements of the buffer
    byte_offsets: tuple  # each field's offset in bytes, in PLAN_FIELDS order (megamoe_routing_plan's pointers)


@functools.lru_cache(maxsize=64)
def _buffer_layout(num_tokens: int, top_k: int, num_local_experts: int) -> PlanLayout:
    """The plan buffer's layout for a shape: computed once per shape (every layer call builds a plan)."""
    shapes = _field_shapes(num_tokens, top_k, num_local_experts)
    fields, offset = {}, 0
    for name in PLAN_FIELDS:
        size = math.prod(shapes[name])
        fields[name] = (offset, size, shapes[name])
        offset += size
    return PlanLayout(fields, offset, tuple(4 * fields[name][0] for name in PLAN_FIELDS))


def plan_buffer_size(num_tokens, top_k: int, num_local_experts: int):
    """int32 elements of RoutingPlan.buffer (symbolic shapes welcome: fake tensors size it)."""
    return sum(math.prod(shape) for shape in _field_shapes(num_tokens, top_k, num_local_experts).values())


# Pinned host int32 slots per device, handed out in turn, one per GPU plan build (RoutingPlan.num_invalid_host):
# a slot is read by the layer call that built the plan before it returns, so it is free again long
# before the ring comes back to it.
_HOST_COUNT_SLOTS = 1024
_host_counts: dict[int, list] = {}  # device index -> [pinned int32 tensor, next slot]


def _host_count_slot(device: torch.device) -> ctypes.c_int32:
    """The next pinned slot of `device`'s ring, set to -1 (not written yet)."""
    index = torch.cuda.current_device() if device.index is None else device.index
    ring = _host_counts.get(index)
    if ring is None:
        ring = _host_counts[index] = [torch.empty(_HOST_COUNT_SLOTS, dtype=torch.int32, pin_memory=True), 0]
    slots, next_slot = ring
    ring[1] = (next_slot + 1) % _HOST_COUNT_SLOTS
    slot = ctypes.c_int32.from_address(slots.data_ptr() + 4 * next_slot)
    slot.value = -1
    return slot


@functools.lru_cache(maxsize=64)
def _workspace_bytes(num_tokens: int, top_k: int, num_experts: int, expert_begin: int, num_local: int) -> int:
    """megamoe_routing_workspace_bytes of a plan's shape, asked once per shape."""
    shape = _native.RoutingShape(num_tokens, top_k, num_experts, expert_begin, num_local)
    return _native.library().megamoe_routing_workspace_bytes(ctypes.byref(shape))


@_native.on_the_tensors_gpu
def build_routing(topk_ids: torch.Tensor, num_experts: int, expert_begin: int = 0,
                  num_local_experts: int | None = None) -> RoutingPlan:
    """Plan for the experts [expert_begin, expert_begin + num_local_experts) (default: all), from
    int32 or int64 ids (an int64 id past int32's range is counted in num_invalid like any other)."""
    if topk_ids.dtype not in (torch.int32, torch.int64) or topk_ids.dim() != 2 or not topk_ids.is_contiguous():
        raise ValueError("topk_ids must be a contiguous int32 or int64 tensor [T, K], got "
                         f"{topk_ids.dtype} {tuple(topk_ids.shape)}")
    num_local = num_experts - expert_begin if num_local_experts is None else num_local_experts
    local = max(num_local, 0)  # the library rejects a bad shape below, with its message
    device = topk_ids.device
    num_tokens, top_k = topk_ids.shape
    layout = _buffer_layout(num_tokens, top_k, local)
    shape = _native.RoutingShape(num_tokens, top_k, num_experts, expert_begin, num_local)
    plan = RoutingPlan(torch.empty(layout.size, dtype=torch.int32, device=device), shape, layout)
    if device.type == "cuda":
        workspace_bytes = _workspace_bytes(num_tokens, top_k, num_experts, expert_begin, num_local)
        if workspace_bytes:
            native = plan.native(torch.empty(workspace_bytes, dtype=torch.uint8, device=device))
        else:  # a small plan, built by one cluster: a copy of the consumers' struct, the count slot the build's own
            native = _native.RoutingPlan.from_buffer_copy(plan.native())
        if not torch.cuda.is_current_stream_capturing():  # a replayed graph would write a slot since reused
            plan.num_invalid_host = _host_count_slot(device)
            native.num_invalid_host = ctypes.addressof(plan.num_invalid_host)
        _native.call("megamoe_build_routing_cuda", "build_routing", topk_ids.data_ptr(), topk_ids.element_size(),
                     native, _native.stream(device))
    else:
        _native.call("megamoe_build_routing_host", "build_routing", topk_ids.data_ptr(), topk_ids.element_size(),
                     plan.native())
    return plan
