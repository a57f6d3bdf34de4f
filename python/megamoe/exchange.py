"""Every dispatch and combine of the fused layer (the core's csrc/kernels/dispatch_combine), on one rank and over
the ranks of expert parallelism (docs/DESIGN.md).

dispatch: token rows [T, H] -> a routing plan's expert-major pool [pool rows, H] (and, with the
routes' topk weights, each pool row's weight); combine: the routes' rows -> y [T, H] = Σ_k p[t, k] ·
row of (t, k), summed in a fixed order. Over W ranks the model is pull: each owner pulls the rows its
experts need from every rank (pull_rows), and each rank pulls its routes' rows back from their
owners and sums them in the single-rank combine's order (combine_from_owners), so W ranks give bit
for bit the output of one. The peers' buffers are passed as host tables of device pointers
(pointer_table). expert_parallel_group.py runs this between the processes of a group.
"""

from __future__ import annotations

import ctypes

import torch

from . import _native
from .routing import RoutingPlan


def dispatch(plan: RoutingPlan, rows: torch.Tensor, weights: torch.Tensor | None = None):
    """The plan's pool [pool rows, H] of rows [T, H]: each live pool row holds its route's token row;
    padding rows are zero. With weights [T, K], (pool, p [pool rows] fp32): also each live row's
    route weight, 0 on padding rows."""
    num_tokens, top_k = plan.route_to_slot.shape
    max_blocks = plan.block_expert.numel()
    pool = rows.new_empty(max_blocks * _native.BLOCK_M, rows.shape[1])
    if weights is not None:
        weights = weights.to(torch.float32).contiguous()
        weights_pool = torch.empty(pool.shape[0], dtype=torch.float32, device=pool.device)
    _native.check(_native.library().megamoe_dispatch_bf16(
        rows.data_ptr(), pool.data_ptr(), plan.route_to_slot.data_ptr(), plan.slot_to_route.data_ptr(),
        plan.num_blocks.data_ptr(), num_tokens, max_blocks, top_k, rows.shape[1],
        None if weights is None else weights.data_ptr(), None if weights is None else weights_pool.data_ptr(),
        _native.stream(rows.device)), "fused dispatch")
    return pool if weights is None else (pool, weights_pool)


def combine(plan: RoutingPlan, routed: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [T, H] = Σ_k weights[t, k] · routed[t K + k] over the plan's routed (t, k) (masked routes
    add nothing), routed [T K, H] in (token, k) order, summed in a fixed order."""
    num_tokens, top_k = plan.route_to_slot.shape
    hidden = routed.shape[1]
    y = routed.new_empty(num_tokens, hidden)
    weights = weights.to(torch.float32).contiguous()
    _native.check(_native.library().megamoe_combine_bf16(
        routed.data_ptr(), weights.data_ptr(), plan.route_to_slot.data_ptr(), y.data_ptr(), num_tokens, top_k,
        hidden, _native.stream(routed.device)), "combine")
    return y


def pointer_table(buffers):
    """A host array of device pointers (of tensors, or addresses): the peer tables the pull kernels take."""
    return (ctypes.c_void_p * len(buffers))(*(b if isinstance(b, int) else b.data_ptr() for b in buffers))


def pull_rows(plan: RoutingPlan, rows_table, route_offsets, like: torch.Tensor, weights_table=None):
    """The pool of the owner whose `plan` (over every rank's routes) this is: its routes' rows from
    every rank's rows [T_r, H] (rows_table; route_offsets: a host int64 array of W + 1, each rank's
    first route), and with weights_table (every rank's fp32 [T_r, K]) each pool row's weight as well."""
    world, (top_k, hidden) = len(route_offsets) - 1, (plan.route_to_slot.shape[1], like.shape[1])
    max_blocks = plan.block_expert.numel()
    pool = like.new_empty(max_blocks * _native.BLOCK_M, hidden)
    weights_pool = None if weights_table is None else torch.empty(pool.shape[0], dtype=torch.float32,
                                                                  device=pool.device)
    _native.check(_native.library().megamoe_dispatch_peers_bf16(
        rows_table, route_offsets, world, pool.data_ptr(), plan.slot_to_route.data_ptr(), plan.num_blocks.data_ptr(),
        max_blocks, top_k, hidden, weights_table, None if weights_table is None else weights_pool.data_ptr(),
        _native.stream(like.device)), "expert-parallel dispatch")
    return pool if weights_table is None else (pool, weights_pool)


def combine_from_owners(out_table, route_to_slot_table, world: int, weights: torch.Tensor, route_offset: int,
                        like: torch.Tensor) -> torch.Tensor:
    """[T, H] like `like` = Σ_k weights[t, k] · (route (t, k)'s row in its owner's out pool), summed as
    the single-rank combine sums; route_offset: this rank's first route in the owners' plans."""
    y = torch.empty_like(like)
    weights = weights.to(torch.float32).contiguous()
    _native.check(_native.library().megamoe_combine_peers_bf16(
        out_table, route_to_slot_table, world, weights.data_ptr(), route_offset, y.data_ptr(), y.shape[0],
        weights.shape[1], y.shape[1], _native.stream(like.device)), "expert-parallel combine")
    return y
