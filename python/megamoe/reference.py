"""fp64 references for tests.

reference_moe: a dense formulation that shares no indexing code with the backends. Every token goes
through every expert; a dense routing matrix P[t, e] = Σ_k p[t, k]·[ids[t, k] = e] selects and
weights the outputs. Differentiable (autograd in fp64) for the gradient checks.

reference_moe_grads: the output and the four gradients by explicit formulas, quantising (and
dequantising) where the block-FP8 recipe of a precision does, the math itself in fp64: the
reference the FP8 kernels are held to, since they add no error of their own beyond the recipe's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fp8
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


def _fp8_rows(a: torch.Tensor) -> torch.Tensor:
    """a [rows, K] through 1 x 128 block FP8 and back (fp64)."""
    return fp8.dequantize_rows(*fp8.quantize_rows(a)).double()


def _fp8_blocks(w: torch.Tensor) -> torch.Tensor:
    """w [E, N, K] through 128 x 128 block FP8 and back (fp64)."""
    return fp8.dequantize_blocks(*fp8.quantize_blocks(w)).double()


def _bf16(a: torch.Tensor) -> torch.Tensor:
    return a.to(torch.bfloat16).double()


def _padded_to_blocks(a: torch.Tensor) -> torch.Tensor:
    """An expert's rows [n, C] (in pool order) with zero rows up to a multiple of 128, as the pool pads them."""
    return F.pad(a, (0, 0, 0, -a.shape[0] % fp8.BLOCK))


def fp8_along_tokens(a: torch.Tensor) -> torch.Tensor:
    """An expert's rows [n, C] through block FP8 with one scale per column and 128 rows (fp64)."""
    padded = _padded_to_blocks(a)
    return fp8.dequantize_rows(*fp8.quantize_rows(padded.T.contiguous())).double().T[:a.shape[0]]


def fp8_token_blocks(a: torch.Tensor) -> torch.Tensor:
    """An expert's rows [n, C] through block FP8 with one scale per 128 rows x 128 columns (fp64)."""
    padded = _padded_to_blocks(a)
    return fp8.dequantize_blocks(*fp8.quantize_blocks(padded.unsqueeze(0))).double()[0, :a.shape[0]]


def reference_moe_grads(x, topk_ids, topk_weights, w13, w2, dy, *, activation: str = "swiglu",
                        precision: str = "bf16"):
    """(y, dx, d topk_weights, dw13, dw2) in fp64 for output gradient dy, route by route.

    precision "bf16": no quantisation (what autograd gives for reference_moe). "fp8": the forward
    quantises x per token and h per row (1 x 128), w13 and w2 per 128 x 128 block; "fp8" and
    "fp8_bwd" (bf16 forward): the data-gradient GEMMs quantise dy per token and dz per row (1 x 128)
    with the weights' blocks (dh = dy·w2, dx = dz·w13), and the weight gradients quantise each
    expert's rows (in pool order, padded to 128) of dy and dz in 1 x 128 blocks along the tokens and
    of p·h and x in 128 x 128 blocks (dw2 = dyᵀ·(p·h), dw13 = dzᵀ·x), dy taken from its per-row copy
    (dh's operand) dequantised to bf16, dz from bf16 (dh quantises it both ways). dp = ⟨h, dh⟩ with h before its
    quantisation. In the FP8 backward the tensors the kernels hold in bf16 are rounded to bf16 where
    they do: z (kept from the forward), dz and p·h."""
    check_activation(activation)
    fp8_forward, fp8_backward = precision == "fp8", precision in ("fp8", "fp8_bwd")
    ids, p = topk_ids.long(), topk_weights.double()
    xd = x.double()
    xf = _fp8_rows(x) if fp8_forward else xd
    exact, blocks = (w13.double(), w2.double()), None
    if fp8_backward:  # fp8_forward implies it: the weights' 128 x 128 round trip, made once
        blocks = (_fp8_blocks(w13), _fp8_blocks(w2))
    w13f, w2f = blocks if fp8_forward else exact
    w13b, w2b = blocks if fp8_backward else exact
    dyd = dy.double()
    dyb = _fp8_rows(dy) if fp8_backward else dyd
    y, dx = torch.zeros_like(xf), torch.zeros_like(xf)
    dp = torch.zeros_like(p)
    dw13, dw2 = torch.zeros_like(w13f), torch.zeros_like(w2f)
    for e in range(w13.shape[0]):
        t, k = torch.where(ids == e)
        if t.numel() == 0:
            continue
        pe = p[t, k].unsqueeze(1)
        z = xf[t] @ w13f[e].T
        h = gated(z, activation)
        y.index_add_(0, t, pe * ((_fp8_rows(h) if fp8_forward else h) @ w2f[e].T))
        if fp8_backward:
            z = _bf16(z)
        z = z.detach().requires_grad_(True)
        h = gated(z, activation)
        dh = dyb[t] @ w2b[e]
        (dz,) = torch.autograd.grad(h, z, grad_outputs=pe * dh)  # the activation's gradient at z, weighted
        h = h.detach()
        dp[t, k] = (h * dh).sum(dim=1)
        dz_rows = _fp8_rows(_bf16(dz)) if fp8_backward else dz
        dx.index_add_(0, t, dz_rows @ w13b[e])
        if fp8_backward:
            dw2[e] = fp8_along_tokens(_bf16(dyb[t])).T @ fp8_token_blocks(_bf16(pe * h))
            dw13[e] = fp8_along_tokens(_bf16(dz)).T @ fp8_token_blocks(xd[t])
        else:
            dw2[e] = dyd[t].T @ (pe * h)
            dw13[e] = dz.T @ xd[t]
    return y, dx, dp, dw13, dw2


_SLICE = 1 << 24  # values per slice of relative_error: 128 MB in fp64


@torch.no_grad()
def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp64 (NaN when out has NaNs, so NaN never passes a bound), over slices of
    2**24 values, so comparing a weight gradient takes no fp64 copies of it (and no autograd graph
    keeps the slices when out requires grad)."""
    if out.shape != ref.shape:
        raise ValueError(f"relative_error compares tensors of one shape, got {tuple(out.shape)} and {tuple(ref.shape)}")
    squares = torch.zeros(2, dtype=torch.float64, device=ref.device)
    for o, r in zip(out.reshape(-1).split(_SLICE), ref.reshape(-1).split(_SLICE)):
        r = r.double()
        squares += torch.stack(((o.double() - r).square().sum(), r.square().sum()))
    error, norm = squares.sqrt()
    return (error / norm.clamp_min(1e-300)).item()
