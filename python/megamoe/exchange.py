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

from . import _native, fp8
from .routing import RoutingPlan


def dispatch(plan: RoutingPlan, rows: torch.Tensor | None, weights: torch.Tensor | None = None):
    """The plan's pool [pool rows, H] of rows [T, H] of any dtype (rows of a multiple of 16 bytes, which
    may be columns of a wider tensor): each live pool row holds its route's token row; padding rows are
    zero. With weights [T, K], (pool, p [pool rows] fp32): also each live row's route weight, 0 on
    padding rows; with rows None, p alone (for GEMMs that read the rows by route themselves)."""
    if rows is None:
        if weights is None:
            raise ValueError("dispatch needs rows, weights or both")
        weights, weights_pool = _weights_pool(plan, weights)
        args = _native.DispatchArgs(0, 0, weights.data_ptr(), weights_pool.data_ptr(), 0, 0)
        _native.call("megamoe_dispatch_bf16", "fused dispatch", plan.native(), args, _native.stream(weights.device))
        return weights_pool
    if rows.stride(1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        raise ValueError(f"rows [T, H] must have contiguous columns and rows at least H apart, got strides "
                         f"{rows.stride()}")
    pool = rows.new_empty(plan.pool_rows, rows.shape[1])
    weights, weights_pool = _weights_pool(plan, weights)
    args = _native.DispatchArgs(rows.data_ptr(), pool.data_ptr(), _native.address(weights),
                                _native.address(weights_pool), _row_bytes(rows), rows.stride(0) * rows.element_size())
    _native.call("megamoe_dispatch_bf16", "fused dispatch", plan.native(), args, _native.stream(rows.device))
    return pool if weights is None else (pool, weights_pool)


def dispatch_fp8(plan: RoutingPlan, rows: torch.Tensor, weights: torch.Tensor | None = None,
                 token_rows: bool = False) -> tuple[torch.Tensor, ...]:
    """bf16 rows [T, H] quantised once per token (1 x 128 block FP8, megamoe.fp8) and dispatched in one
    pass: (e4m3 pool [pool rows, H], scales [H / 128, pool rows], the layout the FP8 GEMMs read);
    padding rows are 0 with scale 0. With weights [T, K], p [pool rows] fp32 follows, as dispatch gives
    it; with token_rows, the quantised rows once in token order follow last (e4m3 [T, H], scales
    [H / 128, T]: what fp8.quantize_rows makes of rows)."""
    hidden = rows.shape[1]
    pool = torch.empty(plan.pool_rows, hidden, dtype=torch.float8_e4m3fn, device=rows.device)
    scales = torch.empty(hidden // fp8.BLOCK, pool.shape[0], dtype=torch.float32, device=rows.device)
    weights, weights_pool = _weights_pool(plan, weights)
    quantized = (torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device=rows.device),
                 torch.empty(hidden // fp8.BLOCK, rows.shape[0], dtype=torch.float32, device=rows.device)
                 ) if token_rows else (None, None)
    _native.call("megamoe_dispatch_fp8", "FP8 dispatch", plan.native(),
                 _native.DispatchFp8Args(rows.data_ptr(), pool.data_ptr(), scales.data_ptr(), hidden,
                                         _native.address(weights), _native.address(weights_pool),
                                         *(_native.address(t) for t in quantized)),
                 _native.stream(rows.device))
    return (pool, scales) + ((weights_pool,) if weights is not None else ()) + (quantized if token_rows else ())


def _weights_pool(plan: RoutingPlan, weights: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """(weights as the dispatch kernels read them, fp32 and contiguous, and the pool of per-row weights
    they write), or (None, None) without weights."""
    if weights is None:
        return None, None
    weights = weights.to(torch.float32).contiguous()
    return weights, torch.empty(plan.pool_rows, dtype=torch.float32, device=weights.device)


def pool_scales(token_scales_pool: torch.Tensor, hidden: int) -> torch.Tensor:
    """A pool of token-major scale rows (fp8.quantize_rows(token_major=True), dispatched or pulled) as the
    FP8 GEMMs read the scales: [hidden / 128, pool rows]."""
    return token_scales_pool[:, :hidden // fp8.BLOCK].t().contiguous()


def combine(plan: RoutingPlan, routed: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """y [T, H] = Σ_k weights[t, k] · routed[t K + k] over the plan's routed (t, k) (masked routes
    add nothing; weights None: every weight 1), routed [T K, H] in (token, k) order, summed in a
    fixed order."""
    num_tokens, hidden = plan.shape.num_tokens, routed.shape[1]
    y = routed.new_empty(num_tokens, hidden)
    weights = None if weights is None else weights.to(torch.float32).contiguous()
    _native.call("megamoe_combine_bf16", "combine", plan.native(),
                 _native.CombineArgs(routed.data_ptr(), _native.address(weights), y.data_ptr(), hidden),
                 _native.stream(routed.device))
    return y


def _row_bytes(rows: torch.Tensor) -> int:
    return rows.shape[1] * rows.element_size()


def pointer_table(buffers):
    """A host array of device pointers (of tensors, or addresses): the peer tables the pull kernels take."""
    return (ctypes.c_void_p * len(buffers))(*(b if isinstance(b, int) else b.data_ptr() for b in buffers))


def pull_rows(plan: RoutingPlan, rows_table, route_offsets, like: torch.Tensor, weights_table=None):
    """The pool of the owner whose `plan` (over every rank's routes) this is: its routes' rows from
    every rank's rows [T_r, H] (rows_table; route_offsets: a host int64 array of W + 1, each rank's
    first route), and with weights_table (every rank's fp32 [T_r, K]) each pool row's weight as well."""
    pool = like.new_empty(plan.pool_rows, like.shape[1])
    weights_pool = None if weights_table is None else torch.empty(pool.shape[0], dtype=torch.float32,
                                                                  device=pool.device)
    args = _native.DispatchPeersArgs(ctypes.cast(rows_table, ctypes.c_void_p), ctypes.cast(route_offsets,
                                     ctypes.c_void_p), None if weights_table is None else
                                     ctypes.cast(weights_table, ctypes.c_void_p), pool.data_ptr(),
                                     _native.address(weights_pool), len(route_offsets) - 1, _row_bytes(like))
    _native.call("megamoe_dispatch_peers_bf16", "expert-parallel dispatch", plan.native(), args,
                 _native.stream(like.device))
    return pool if weights_table is None else (pool, weights_pool)


def combine_from_owners(out_table, route_to_slot_table, world: int, weights: torch.Tensor | None, route_offset: int,
                        like: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T, H] like `like` = Σ_k weights[t, k] · (route (t, k)'s row in its owner's out pool) (weights
    None: every weight 1), summed as the single-rank combine sums; route_offset: this rank's first
    route in the owners' plans."""
    y = torch.empty_like(like)
    weights = None if weights is None else weights.to(torch.float32).contiguous()
    args = _native.CombinePeersArgs(ctypes.cast(out_table, ctypes.c_void_p),
                                    ctypes.cast(route_to_slot_table, ctypes.c_void_p), _native.address(weights),
                                    y.data_ptr(), route_offset, y.shape[0], top_k, world, y.shape[1])
    _native.call("megamoe_combine_peers_bf16", "expert-parallel combine", args, _native.stream(like.device))
    return y
