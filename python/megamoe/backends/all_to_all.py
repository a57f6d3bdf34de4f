"""The TorchTitan-style expert-parallel baseline: all-to-all dispatch, grouped GEMMs, all-to-all
combine, one step after the other (the comparison for megamoe.moe(..., group=), which pulls rows
between the ranks inside its own kernels).

Each rank sends every route's token row to the rank that owns the route's expert (routes sorted by
that rank, split sizes exchanged first, then the rows and their local expert ids, through
torch.distributed's all_to_all_single), runs the received rows through its experts with the grouped
path (megamoe/backends/grouped.py, one route per row), sends the outputs back the same way, and sums
each token's routes weighted by its topk weights. The rows' all-to-alls are differentiable: the
backward runs the same exchanges in reverse, as TorchTitan's all_to_all_single_autograd does. They
call torch.distributed's all_to_all_single itself: functional collectives keep references to the
group past destroy_process_group, so it would be torn down only as the interpreter exits, where gloo
at times aborts the process. The split sizes reach the host before the rows can move: one
synchronisation per exchange, as in TorchTitan.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .grouped import grouped_moe


def _exchange(rows: torch.Tensor, recv_splits: list, send_splits: list, group) -> torch.Tensor:
    """rows [sum(send_splits), ...] sent in rank order, the rows received [sum(recv_splits), ...]."""
    received = rows.new_empty(sum(recv_splits), *rows.shape[1:])
    dist.all_to_all_single(received, rows.contiguous(), recv_splits, send_splits, group=group)
    return received


class _ExchangeRows(torch.autograd.Function):
    """_exchange with a backward: each row's gradient goes back to the rank that sent the row."""

    @staticmethod
    def forward(ctx, rows, recv_splits, send_splits, group):
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        return _exchange(rows, recv_splits, send_splits, group)

    @staticmethod
    def backward(ctx, grad):
        recv_splits, send_splits = ctx.splits
        return _exchange(grad, send_splits, recv_splits, ctx.group), None, None, None


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
    rows = _ExchangeRows.apply(x[sent // top_k], recv_splits, send_splits, group)
    local_ids = _exchange(ids[sent] % num_local, recv_splits, send_splits, group)
    ones = torch.ones(rows.shape[0], 1, dtype=topk_weights.dtype, device=x.device)
    out = grouped_moe(rows, local_ids.view(-1, 1), ones, w13, w2, activation=activation)
    back = _ExchangeRows.apply(out, send_splits, recv_splits, group)
    routed = x.new_zeros(num_tokens * top_k, x.shape[1]).index_copy(0, sent, back)
    weights = torch.where(live.view(num_tokens, top_k), topk_weights, 0)
    hidden = x.shape[1]
    y = torch.bmm(weights.to(x.dtype)[:, None, :], routed.view(num_tokens, top_k, hidden))
    return y.view(num_tokens, hidden)
