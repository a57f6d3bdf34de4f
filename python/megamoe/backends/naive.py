"""`naive`: a loop over experts, as transformers' eager Qwen3-MoE path does it."""

from __future__ import annotations

import torch

from ..activation import check_activation, gated


def naive_moe(x, topk_ids, topk_weights, w13, w2, *, expert_begin: int = 0,
              activation: str = "swiglu") -> torch.Tensor:
    check_activation(activation)
    num_local = w13.shape[0]
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local_ids = topk_ids.long() - expert_begin
    hit = torch.bincount(local_ids[(local_ids >= 0) & (local_ids < num_local)], minlength=num_local)
    # Skips experts without tokens (one host sync). With nothing routed, expert 0 runs on no rows,
    # so y still depends on every input and the backward gives zero gradients (as `grouped` does).
    for e in hit.nonzero().flatten().tolist() or [0]:
        token, k = torch.where(local_ids == e)
        o = gated(x[token] @ w13[e].T, activation) @ w2[e].T
        y = y.index_add(0, token, o.float() * topk_weights[token, k, None].float())
    return y.to(x.dtype)
