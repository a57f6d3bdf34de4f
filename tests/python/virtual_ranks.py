"""Expert parallelism's data path (docs/DESIGN.md), pull model, run on W virtual ranks of one GPU:
the library's dispatch and combine over peers (megamoe.exchange) and the owners' backward
(megamoe.expert_parallel_group.owner_backward), driven rank by rank in one process for the tests.

Rank r holds tokens x_r [T_r, H] with router output (topk_ids_r, topk_weights_r) over all E experts,
and the weights of its E / W experts [r E/W, (r + 1) E/W). One forward:

1. metadata: every rank gets every rank's topk_ids (an all-gather; here a concatenation), so each
   builds the routing plan of its own experts over all routes, numbered rank by rank;
2. dispatch: each rank pulls the token rows its experts need from the other ranks' x into its
   expert-major pool (exchange.pull_rows, through a table of the ranks' x pointers);
3. GEMM1 with the gated activation and GEMM2 on the rank's own pool, the kernels of one rank, GEMM2 in pool order;
4. combine: each rank pulls its routes' output rows from the experts' owners and reduces them in the
   single-rank combine's fixed order (exchange.combine_from_owners), so W ranks give bit for bit the
   output of one rank holding every expert.

Here the phases run one after another over the ranks on one stream, which stands in for the
barriers real ranks need between phases, and the peer tables point at buffers of one device where
real ranks would pass symmetric memory of their peers. That checks the protocol and the kernels on
one GPU; megamoe.moe(group=...) runs the same kernels between the processes of a group
(megamoe/expert_parallel_group.py).
backward_virtual_ranks is the backward of the same data path (owners pull dy and p, run the
single-rank backward kernels on their pools, ranks pull dx rows and dp values back).
"""

from __future__ import annotations

import ctypes
import itertools

import torch

from megamoe import _native
from megamoe.exchange import combine_from_owners, pointer_table, pull_rows
from megamoe.expert_parallel_group import owner_backward
from megamoe.activation import check_activation
from megamoe.gemm import gated_gemm, grouped_gemm
from megamoe.routing import build_routing
from megamoe.validation import IdRangeCheck, check_fused_support


def _check(xs, topk_ids, topk_weights, w13s, w2s, activation) -> None:
    check_activation(activation)
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


class _Ranks:
    """The W ranks' shared view: global route numbering, every owner's plan over all routes, and
    the peer tables the pull kernels take."""

    def __init__(self, xs, topk_ids, w13s):
        self.world, (self.num_local, two_i, self.hidden) = len(xs), w13s[0].shape
        self.inter, self.top_k = two_i // 2, topk_ids[0].shape[1]
        self.num_experts = self.world * self.num_local
        self.route_offsets = list(itertools.accumulate((x.shape[0] * self.top_k for x in xs), initial=0))
        ids_all = torch.cat([ids.to(torch.int32) for ids in topk_ids]).contiguous()  # the metadata all-gather
        self.plans = [build_routing(ids_all, self.num_experts, d * self.num_local, self.num_local)
                      for d in range(self.world)]
        # Every owner's plan over all routes counts the same ids outside [-1, E): one plan tells.
        self.id_range = IdRangeCheck(self.plans[0], self.num_experts)
        self.offsets = (ctypes.c_int64 * (self.world + 1))(*self.route_offsets)

    def pull_rows(self, d, rows, weights=None):
        """Owner d's pool of the ranks' `rows` [T_r, H] (and, with weights [T_r, K], each pool row's weight)."""
        return pull_rows(self.plans[d], pointer_table(rows), self.offsets, rows[0],
                         None if weights is None else pointer_table(weights))

    def combine(self, r, x, out_pools, weights):
        """Rank r's [T_r, H] = Σ_k weights[t, k] · (its route's row in its expert owner's out pool)."""
        return combine_from_owners(pointer_table(out_pools), pointer_table([plan.route_to_slot for plan in self.plans]),
                                   self.world, weights, self.route_offsets[r], x, weights.shape[1])


def forward_virtual_ranks(xs, topk_ids, topk_weights, w13s, w2s, activation: str = "swiglu"
                          ) -> list[torch.Tensor]:
    """[y_r for each rank]: the MoE layer's forward with rank r's tokens (xs[r], topk_ids[r] global
    expert ids, -1 masked, topk_weights[r]) and rank r owning experts [r E/W, (r + 1) E/W) (w13s[r],
    w2s[r]), through the pull-model kernels and peer tables of expert parallelism."""
    _check(xs, topk_ids, topk_weights, w13s, w2s, activation)
    if sum(x.shape[0] for x in xs) == 0:
        return [torch.empty_like(x) for x in xs]
    ranks = _Ranks(xs, topk_ids, w13s)
    outs = []
    for d, plan in enumerate(ranks.plans):
        h = gated_gemm(ranks.pull_rows(d, xs), w13s[d], plan, activation)
        outs.append(grouped_gemm(h, w2s[d], plan))
    ys = [ranks.combine(r, x, outs, topk_weights[r]) for r, x in enumerate(xs)]
    ranks.id_range.raise_if_any()
    return ys


def backward_virtual_ranks(dys, xs, topk_ids, topk_weights, w13s, w2s, activation: str = "swiglu"):
    """(dxs, d topk_weights, dw13s, dw2s), one entry per rank: the backward of forward_virtual_ranks
    for output gradients dys[r] [T_r, H]. Each expert's owner pulls x, dy and p, recomputes z, and
    runs the single-rank backward kernels on its pool (dh with the activation's backward, dx per
    route in pool order, the weight gradients of its own experts, dp of the routes it owns); then
    every rank pulls its routes' dx rows and dp values from their owners. dp is pulled by adding the
    owners' per-route dp vectors, in which every other owner holds 0 for that route (exact)."""
    if len(dys) != len(xs):
        raise ValueError(f"dys needs one entry per rank ({len(xs)}), got {len(dys)}")
    for r, (dy, x) in enumerate(zip(dys, xs)):
        if dy.shape != x.shape or dy.dtype != torch.bfloat16 or dy.device != x.device:
            raise ValueError(f"dy of rank {r} must be a bfloat16 tensor shaped like its x {tuple(x.shape)} "
                             f"on {x.device}, got {dy.dtype} {tuple(dy.shape)} on {dy.device}")
    _check(xs, topk_ids, topk_weights, w13s, w2s, activation)
    if sum(x.shape[0] for x in xs) == 0:
        return ([torch.zeros_like(x) for x in xs], [torch.zeros_like(w) for w in topk_weights],
                [torch.zeros_like(w) for w in w13s], [torch.zeros_like(w) for w in w2s])
    ranks = _Ranks(xs, topk_ids, w13s)
    dys = [dy.contiguous() for dy in dys]
    weights = [w.to(torch.float32).contiguous() for w in topk_weights]
    dx_pools, dps, dw13s, dw2s = [], [], [], []
    for d, plan in enumerate(ranks.plans):
        x_pool = ranks.pull_rows(d, xs)
        dy_pool, p_pool = ranks.pull_rows(d, dys, weights)
        dx_pools.append(x_pool.new_empty(x_pool.shape))
        dw13s.append(torch.empty_like(w13s[d]))
        dw2s.append(torch.empty_like(w2s[d]))
        dps.append(owner_backward(x_pool, dy_pool, p_pool, w13s[d], w2s[d], plan,
                                  dx_pools[d], dw13s[d], dw2s[d], activation))
    ones = [torch.ones_like(w) for w in weights]
    dxs = [ranks.combine(r, x, dx_pools, ones[r]) for r, x in enumerate(xs)]
    dp_all = torch.stack(dps).sum(0)
    dweights = [dp_all[ranks.route_offsets[r]:ranks.route_offsets[r + 1]].view(topk_weights[r].shape)
                .to(topk_weights[r].dtype) for r in range(ranks.world)]
    ranks.id_range.raise_if_any()
    return dxs, dweights, dw13s, dw2s
