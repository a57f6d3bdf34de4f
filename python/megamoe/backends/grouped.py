"""`grouped`: the TorchTitan-style path.

Sort routes by expert (each expert's rows padded to ALIGN_M for the grouped GEMM's 16-byte TMA
alignment), gather x, torch._grouped_mm, the gated activation (megamoe.activation), torch._grouped_mm,
then the weighted combine.
No host synchronisation and no data-dependent shapes (torch.compile traces it whole): the sorted
buffer has a fixed worst-case size, and the last group is stretched over the unused tail, whose rows
gather a zero row, so every row is computed and finite. The row permutations are gathers in both
directions (no scatter-add atomics), so forward and backward are deterministic.
"""

from __future__ import annotations

import torch

from ..activation import check_activation, gated

ALIGN_M = 8  # TorchTitan's token-group alignment for bf16


def sort_routes_by_expert(topk_ids: torch.Tensor, num_local: int, expert_begin: int, align_m: int = ALIGN_M):
    """(route_row [T*K]: row of each route in the padded expert-major buffer, masked and non-local
    routes pointing at the last row (in the tail); row_token [rows]: source token of each row, T for
    padding; group_ends [E_local] int32, the last one = rows). Every group starts at a multiple of
    align_m."""
    num_tokens, top_k = topk_ids.shape
    local = topk_ids.flatten().long() - expert_begin
    is_local = (local >= 0) & (local < num_local)
    key = torch.where(is_local, local, num_local)  # others sort last
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.long, device=key.device).index_add_(
        0, key, torch.ones_like(key))[:num_local]
    padded = (counts + align_m - 1) // align_m * align_m
    rows = topk_ids.numel() + num_local * (align_m - 1) + 1  # worst case, plus a tail row
    sorted_key = key[order]
    expert = sorted_key.clamp_max(num_local - 1)
    rank_in_expert = torch.arange(order.numel(), device=order.device) - (torch.cumsum(counts, 0) - counts)[expert]
    sorted_row = torch.where(sorted_key < num_local, (torch.cumsum(padded, 0) - padded)[expert] + rank_in_expert,
                             rows - 1)
    route_row = torch.empty_like(sorted_row).scatter_(0, order, sorted_row)
    route_token = torch.where(is_local, torch.arange(topk_ids.numel(), device=key.device) // top_k, num_tokens)
    # Non-local routes all land on the tail row with the zero row's index: duplicates of one value.
    row_token = torch.full((rows,), num_tokens, dtype=torch.long, device=key.device).scatter_(
        0, route_row, route_token)
    group_ends = torch.cumsum(padded, 0)
    group_ends[-1] = rows
    return route_row, row_token, group_ends.to(torch.int32)


class _GatherTokens(torch.autograd.Function):
    """xs[r] = x[row_token[r]] (row T = zero); backward sums each token's K route rows (a gather)."""

    @staticmethod
    def forward(ctx, x, row_token, route_row, top_k):
        ctx.save_for_backward(route_row)
        ctx.top_k = top_k
        return torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, row_token)

    @staticmethod
    def backward(ctx, grad_rows):
        (route_row,) = ctx.saved_tensors
        grad = grad_rows.index_select(0, route_row).view(-1, ctx.top_k, grad_rows.shape[1])
        return grad.sum(dim=1, dtype=torch.float32).to(grad_rows.dtype), None, None, None


class _GatherRoutes(torch.autograd.Function):
    """routed[i] = o[route_row[i]]; each row of o feeds at most one route except the zero tail row,
    so the backward is a plain index_copy (no atomics)."""

    @staticmethod
    def forward(ctx, o, route_row):
        ctx.save_for_backward(route_row)
        ctx.rows = o.shape[0]
        return o.index_select(0, route_row)

    @staticmethod
    def backward(ctx, grad_routed):
        (route_row,) = ctx.saved_tensors
        grad = grad_routed.new_zeros(ctx.rows, grad_routed.shape[1]).index_copy_(0, route_row, grad_routed)
        return grad, None


def grouped_moe(x, topk_ids, topk_weights, w13, w2, *, expert_begin: int = 0,
                activation: str = "swiglu") -> torch.Tensor:
    return expert_path(x, topk_ids, topk_weights, w13, w2, _bf16_grouped_mm, expert_begin=expert_begin,
                       activation=activation)


def _bf16_grouped_mm(a: torch.Tensor, w: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, w.transpose(-2, -1), offs=group_ends)


def expert_path(x, topk_ids, topk_weights, w13, w2, grouped_mm, *, expert_begin: int = 0,
                activation: str = "swiglu", align_m: int = ALIGN_M) -> torch.Tensor:
    """The grouped path with its two expert GEMMs done by grouped_mm(a [rows, K], w [E, N, K],
    group_ends) -> [rows, N] (a's rows of group e times w[e]ᵀ); groups aligned to align_m rows."""
    check_activation(activation)
    num_tokens, top_k = topk_ids.shape
    num_local, _, hidden = w13.shape
    route_row, row_token, group_ends = sort_routes_by_expert(topk_ids, num_local, expert_begin, align_m)
    xs = _GatherTokens.apply(x, row_token, route_row, top_k)
    z = grouped_mm(xs, w13, group_ends)
    h = gated(z, activation)
    o = grouped_mm(h, w2, group_ends)
    routed = _GatherRoutes.apply(o, route_row).view(num_tokens, top_k, hidden)
    # Masked routes read the tail row (zero input, zero output); a zero weight also zeroes the
    # gradient they would send back into that shared row.
    weights = torch.where(route_row.view(num_tokens, top_k) == o.shape[0] - 1, 0, topk_weights)
    # Weighted combine as one batched [1, K] x [K, H] product: fp32 accumulation, one rounding,
    # deterministic (no scatter-add atomics); p is rounded to bf16 on the way in.
    y = torch.bmm(weights.to(x.dtype)[:, None, :], routed)
    return y.view(num_tokens, hidden)
