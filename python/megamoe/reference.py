"""fp64 reference for tests: a dense formulation that shares no indexing code with the backends.

Every token goes through every expert; a dense routing matrix P[t, e] = Σ_k p[t, k]·[ids[t, k] = e]
selects and weights the outputs. Differentiable (autograd in fp64) for the gradient checks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .activation import check_activation, gated


def dense_routing_matrix(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int):
    ids = topk_ids.long()
    valid = ids >= 0
    one_hot = F.one_hot(ids.clamp_min(0), num_experts).to(topk_weights.dtype)
    return (one_hot * (topk_weights * valid)[..., None]).sum(dim=1)  # [T, E]


def reference_moe(x, topk_ids, topk_weights, w13, w2, *, activation: str = "swiglu",
                  dtype: torch.dtype = torch.float64):
    """y [T, H] in `dtype` for all experts on this device (E = w13.shape[0]), h = act(gate) · up with
    act the `activation` (megamoe.activation.ACTIVATIONS)."""
    check_activation(activation)
    x, weights, w13, w2 = (t.to(dtype) for t in (x, topk_weights, w13, w2))
    num_experts = w13.shape[0]
    routing = dense_routing_matrix(topk_ids, weights, num_experts)
    y = torch.zeros_like(x)
    for e in range(num_experts):
        h = gated(x @ w13[e].T, activation)
        y = y + routing[:, e: e + 1] * (h @ w2[e].T)
    return y


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp64 (NaN when out has NaNs, so NaN never passes a bound)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()
