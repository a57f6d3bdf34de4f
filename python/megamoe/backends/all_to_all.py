"""The TorchTitan-style expert-parallel baseline: all-to-all dispatch, grouped GEMMs, all-to-all
combine, one step after the other (the comparison for megamoe.moe(..., group=), which pulls rows
between the ranks inside its own kernels).

Each rank sends every route's token row to the rank that owns the route's expert (routes sorted by
that rank, split sizes exchanged first, then the rows and their local expert ids, through
torch.distributed's all_to_all_single), runs the received rows through its experts with the grouped
path (megamoe/backends/grouped.py, one route per row), sends the outputs back the same way, and sums
each token's routes weighted by its topk weights. The rows' all-to-alls have autograd (functional
collectives' all_to_all_single_autograd, as TorchTitan's), so the backward runs the same exchanges
in reverse. The split
sizes reach the host before the rows can move: one synchronisation per exchange, as in TorchTitan.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from .grouped import grouped_moe


def all_to_all_moe(x, topk_ids, topk_weights, w13, w2, group, activation: str = "swiglu") -> torch.Tensor:
    """y [T_r, H] for this rank's tokens x [T_r, H], routed by topk_ids [T_r, K] over all E = W ·
    E_local experts (-1: masked), with this rank's experts w13 [E_local, 2I, H], w2 [E_local, H, I]."""
    world = dist.get_world_size(group)
    num_tokens, top_k = topk_ids.shape
    num_local = w13.shape[0]
    ids = topk_ids.flatten().long()
    live = ids >= 0
    owner = torch.where(live, ids // num_local, world)  # masked routes sort last and are not sent
    order = torch.argsort(owner, stable=True)
    send_counts = torch.bincount(owner, minlength=world + 1)[:world]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    sent = order[:sum(send_splits)]  # the live routes, by owner
    rows = all_to_all_single_autograd(x[sent // top_k], recv_splits, send_splits, group)
    local_ids = torch.empty(sum(recv_splits), dtype=torch.long, device=x.device)
    dist.all_to_all_single(local_ids, ids[sent] % num_local, recv_splits, send_splits, group=group)
    ones = torch.ones(rows.shape[0], 1, dtype=topk_weights.dtype, device=x.device)
    out = grouped_moe(rows, local_ids.view(-1, 1), ones, w13, w2, activation=activation)
    back = all_to_all_single_autograd(out, send_splits, recv_splits, group)
    routed = x.new_zeros(num_tokens * top_k, x.shape[1]).index_copy(0, sent, back)
    weights = torch.where(live.view(num_tokens, top_k), topk_weights, 0)
    hidden = x.shape[1]
    y = torch.bmm(weights.to(x.dtype)[:, None, :], routed.view(num_tokens, top_k, hidden))
    return y.view(num_tokens, hidden)
