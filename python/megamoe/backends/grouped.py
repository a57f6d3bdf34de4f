"""`grouped`: the TorchTitan-style path.

Sort routes by expert (each expert's rows padded to ALIGN_M for the grouped GEMM's 16-byte TMA
alignment), gather x, torch._grouped_mm, SwiGLU, torch._grouped_mm, then the weighted combine.
No host synchronisation: the sorted buffer has a fixed worst-case size, and the last group is
stretched over the unused tail, whose rows gather a zero row, so every row is computed and finite.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ALIGN_M = 8  # TorchTitan's token-group alignment for bf16


def sort_routes_by_expert(topk_ids: torch.Tensor, num_local: int, expert_begin: int):
    """(route_row [T*K]: row of each route in the padded expert-major buffer, masked and non-local
    routes pointing at the last row (in the tail); row_token [rows]: source token of each row, T for
    padding; group_ends [E_local] int32, the last one = rows)."""
    num_tokens, top_k = topk_ids.shape
    local = topk_ids.flatten().long() - expert_begin
    key = torch.where((local >= 0) & (local < num_local), local, num_local)  # others sort last
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_local + 1)[:num_local]
    padded = (counts + ALIGN_M - 1) // ALIGN_M * ALIGN_M
    rows = topk_ids.numel() + num_local * (ALIGN_M - 1) + 1  # worst case, plus a tail row
    sorted_key = key[order]
    expert = sorted_key.clamp_max(num_local - 1)
    rank_in_expert = torch.arange(order.numel(), device=order.device) - (torch.cumsum(counts, 0) - counts)[expert]
    sorted_row = torch.where(sorted_key < num_local, (torch.cumsum(padded, 0) - padded)[expert] + rank_in_expert,
                             rows - 1)
    route_row = torch.empty_like(sorted_row).scatter_(0, order, sorted_row)
    token = torch.arange(topk_ids.numel(), device=order.device) // top_k
    row_token = torch.full((rows,), num_tokens, dtype=torch.long, device=order.device)
    row_token.scatter_(0, sorted_row[sorted_key < num_local], token[order][sorted_key < num_local])
    group_ends = torch.cumsum(padded, 0)
    group_ends[-1] = rows
    return route_row, row_token, group_ends.to(torch.int32)


def grouped_moe(x, topk_ids, topk_weights, w13, w2, *, expert_begin: int = 0):
    num_tokens, top_k = topk_ids.shape
    num_local, two_i, hidden = w13.shape
    route_row, row_token, group_ends = sort_routes_by_expert(topk_ids, num_local, expert_begin)
    x_and_zero = torch.cat([x, x.new_zeros(1, hidden)])
    xs = x_and_zero.index_select(0, row_token)
    z = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=group_ends)
    h = F.silu(z[:, : two_i // 2]) * z[:, two_i // 2:]
    o = torch._grouped_mm(h, w2.transpose(-2, -1), offs=group_ends)
    routed = o.index_select(0, route_row).view(num_tokens, top_k, hidden)  # masked: a zero tail row
    # Weighted combine as one batched [1, K] x [K, H] product: fp32 accumulation, one rounding,
    # deterministic (no scatter-add atomics); p is rounded to bf16 on the way in.
    y = torch.bmm(topk_weights.to(x.dtype)[:, None, :], routed)
    return y.view(num_tokens, hidden)
