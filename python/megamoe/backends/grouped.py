"""`grouped`: the TorchTitan-style path.

Sort routes by expert (each expert's rows padded to ALIGN_M for the grouped GEMM's 16-byte TMA
alignment), gather x, torch._grouped_mm, SwiGLU, torch._grouped_mm, then the weighted combine.
No host synchronisation: buffers are sized for the worst case and padding rows are zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ALIGN_M = 8  # TorchTitan's token-group alignment for bf16


def sort_routes_by_expert(topk_ids: torch.Tensor, num_local: int, expert_begin: int):
    """(route_row [T*K]: row of each route in the padded expert-major buffer, or the last row,
    outside every group, for masked / non-local routes; is_local [T*K]; group_ends [E_local]
    int32; rows)."""
    local = topk_ids.flatten().long() - expert_begin
    is_local = (local >= 0) & (local < num_local)
    key = torch.where(is_local, local, num_local)  # non-local routes sort last
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_local + 1)[:num_local]
    padded = (counts + ALIGN_M - 1) // ALIGN_M * ALIGN_M
    padded_starts = torch.cumsum(padded, 0) - padded
    starts = torch.cumsum(counts, 0) - counts
    rows = topk_ids.numel() + num_local * (ALIGN_M - 1) + 1  # worst case, plus one zero row
    sorted_key = key[order]
    rank_in_expert = torch.arange(order.numel(), device=order.device) - starts.index_select(
        0, sorted_key.clamp_max(num_local - 1))
    sorted_row = torch.where(sorted_key < num_local,
                             padded_starts.index_select(0, sorted_key.clamp_max(num_local - 1))
                             + rank_in_expert, rows - 1)
    route_row = torch.empty_like(sorted_row).scatter_(0, order, sorted_row)
    return route_row, is_local, torch.cumsum(padded, 0).to(torch.int32), rows


def grouped_moe(x, topk_ids, topk_weights, w13, w2, *, expert_begin: int = 0):
    num_tokens, top_k = topk_ids.shape
    num_local, two_i, hidden = w13.shape
    route_row, is_local, group_ends, rows = sort_routes_by_expert(topk_ids, num_local, expert_begin)
    token = torch.arange(num_tokens, device=x.device).repeat_interleave(top_k)
    # Rows outside every group are never written by _grouped_mm (forward or backward): the
    # `where`s keep whatever they hold out of y and out of x's gradient.
    x_routes = torch.where(is_local[:, None], x.index_select(0, token), 0)
    xs = x.new_zeros(rows, hidden).index_copy(0, route_row, x_routes)
    z = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=group_ends)
    h = F.silu(z[:, : two_i // 2]) * z[:, two_i // 2:]
    o = torch._grouped_mm(h, w2.transpose(-2, -1), offs=group_ends)
    o = torch.where((torch.arange(rows, device=x.device) < group_ends[-1])[:, None], o, 0)
    routed = o.index_select(0, route_row).view(num_tokens, top_k, hidden)
    y = (routed.float() * topk_weights[..., None].float()).sum(dim=1)  # fixed order: deterministic
    return y.to(x.dtype)
