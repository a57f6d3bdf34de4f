"""Expert parallelism's data path (DESIGN.md §3), pull model, run on W virtual ranks of one GPU.

Rank r holds tokens x_r [T_r, H] with router output (topk_ids_r, topk_weights_r) over all E experts,
and the weights of its E / W experts [r E/W, (r + 1) E/W). One forward:

1. metadata: every rank gets every rank's topk_ids (an all-gather; here a concatenation), so each
   builds the routing plan of its own experts over all routes, numbered rank by rank;
2. dispatch: each rank pulls the token rows its experts need from the other ranks' x into its
   expert-major pool (megamoe_dispatch_peers_bf16, through a table of the ranks' x pointers);
3. GEMM1 + SwiGLU and GEMM2 on the rank's own pool, the kernels of one rank, GEMM2 in pool order;
4. combine: each rank pulls its routes' output rows from the experts' owners and reduces them in the
   single-rank combine's fixed order (megamoe_combine_peers_bf16), so W ranks give bit for bit the
   output of one rank holding every expert.

Here the phases run one after another over the ranks on one stream, which stands in for the
barriers real ranks need between phases, and the peer tables point at buffers of one device where
real ranks would pass symmetric memory of their peers. That checks the protocol and the kernels on
one GPU; megamoe.moe(group=...) over a process group is not wired to it yet (it raises), and this
path has no backward yet.
"""

from __future__ import annotations

import ctypes
import itertools

import torch

from . import _native
from .fused import check_fused_support
from .gemm import grouped_gemm
from .routing import build_routing
from .validation import id_range_message


def _check(xs, topk_ids, topk_weights, w13s, w2s) -> None:
    world = len(xs)
    if not 1 <= world <= _native.MAX_PEERS:
        raise ValueError(f"expert parallelism runs 1 to {_native.MAX_PEERS} ranks, got {world}")
    if not len(topk_ids) == len(topk_weights) == len(w13s) == len(w2s) == world:
        raise ValueError("xs, topk_ids, topk_weights, w13s and w2s need one entry per rank, got "
                         f"{len(xs)}, {len(topk_ids)}, {len(topk_weights)}, {len(w13s)}, {len(w2s)}")
    w13_shape, w2_shape = tuple(w13s[0].shape), tuple(w2s[0].shape)
    if len(w13_shape) != 3 or len(w2_shape) != 3 or w2_shape != (w13_shape[0], w13_shape[2], w13_shape[1] // 2):
        raise ValueError(f"w13 must be [E/W, 2I, H] and w2 [E/W, H, I], got {w13_shape} and {w2_shape}")
    top_k = topk_ids[0].shape[1] if topk_ids[0].dim() == 2 else -1
    for r in range(world):
        if tuple(w13s[r].shape) != w13_shape or tuple(w2s[r].shape) != w2_shape:
            raise ValueError(f"every rank holds as many experts of the same shape: rank {r} has w13 "
                             f"{tuple(w13s[r].shape)} and w2 {tuple(w2s[r].shape)}, rank 0 {w13_shape} and {w2_shape}")
        if xs[r].dim() != 2 or xs[r].shape[1] != w13_shape[2]:
            raise ValueError(f"x of rank {r} must be [T, {w13_shape[2]}], got {tuple(xs[r].shape)}")
        if topk_ids[r].dim() != 2 or topk_ids[r].shape != (xs[r].shape[0], top_k):
            raise ValueError(f"topk_ids of rank {r} must be [{xs[r].shape[0]}, K] with the same K on every rank, "
                             f"got {tuple(topk_ids[r].shape)}")
        if topk_weights[r].shape != topk_ids[r].shape:
            raise ValueError(f"topk_weights of rank {r} must be shaped like its topk_ids, got "
                             f"{tuple(topk_weights[r].shape)}")
        for name, t in (("x", xs[r]), ("w13", w13s[r]), ("w2", w2s[r])):
            if t.dtype != torch.bfloat16 or t.device != xs[0].device or not t.is_contiguous():
                raise TypeError(f"{name} of rank {r} must be a contiguous bfloat16 tensor on {xs[0].device}, "
                                f"got {t.dtype} on {t.device}")
    check_fused_support(xs[0], w13_shape[2], w13_shape[1] // 2)


def forward_virtual_ranks(xs, topk_ids, topk_weights, w13s, w2s) -> list[torch.Tensor]:
    """[y_r for each rank]: the MoE layer's forward with rank r's tokens (xs[r], topk_ids[r] global
    expert ids, -1 masked, topk_weights[r]) and rank r owning experts [r E/W, (r + 1) E/W) (w13s[r],
    w2s[r]), through the pull-model kernels and peer tables of expert parallelism."""
    _check(xs, topk_ids, topk_weights, w13s, w2s)
    world, (num_local, two_i, hidden) = len(xs), w13s[0].shape
    num_experts, top_k = world * num_local, topk_ids[0].shape[1]
    lib, stream = _native.library(), torch.cuda.current_stream(xs[0].device).cuda_stream
    route_offsets = list(itertools.accumulate((x.shape[0] * top_k for x in xs), initial=0))
    if route_offsets[-1] == 0:
        return [torch.empty_like(x) for x in xs]
    ids_all = torch.cat([ids.to(torch.int32) for ids in topk_ids]).contiguous()  # the metadata all-gather

    plans = [build_routing(ids_all, num_experts, d * num_local, num_local) for d in range(world)]
    x_table = (ctypes.c_void_p * world)(*(x.data_ptr() for x in xs))
    offsets = (ctypes.c_int64 * (world + 1))(*route_offsets)
    outs = []
    for d, plan in enumerate(plans):
        max_blocks = plan.block_expert.numel()
        pool = xs[0].new_empty(max_blocks * _native.BLOCK_M, hidden)
        _native.check(lib.megamoe_dispatch_peers_bf16(
            x_table, offsets, world, pool.data_ptr(), plan.slot_to_route.data_ptr(), plan.num_blocks.data_ptr(),
            max_blocks, top_k, hidden, stream), f"expert-parallel dispatch to rank {d}")
        h = xs[0].new_empty(pool.shape[0], two_i // 2)
        _native.check(lib.megamoe_grouped_gemm_swiglu_bf16(
            pool.data_ptr(), w13s[d].data_ptr(), h.data_ptr(), None, plan.block_expert.data_ptr(),
            plan.num_blocks.data_ptr(), max_blocks, two_i // 2, hidden, num_local, stream),
            f"expert-parallel GEMM1 on rank {d}")
        del pool
        outs.append(grouped_gemm(h, w2s[d], plan))

    out_table = (ctypes.c_void_p * world)(*(o.data_ptr() for o in outs))
    slot_table = (ctypes.c_void_p * world)(*(plan.route_to_slot.data_ptr() for plan in plans))
    ys = []
    for r, x in enumerate(xs):
        y = torch.empty_like(x)
        weights = topk_weights[r].to(torch.float32).contiguous()
        _native.check(lib.megamoe_combine_peers_bf16(
            out_table, slot_table, world, weights.data_ptr(), route_offsets[r], y.data_ptr(), x.shape[0], top_k,
            hidden, stream), f"expert-parallel combine on rank {r}")
        ys.append(y)
    invalid = int(plans[0].num_invalid)  # every plan counts the same ids outside [-1, E)
    if invalid:
        raise ValueError(id_range_message(num_experts, f"{invalid} ids outside it"))
    return ys
