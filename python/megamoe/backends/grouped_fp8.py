"""`grouped-fp8`: the TorchTitan-style FP8 baseline of the benchmark (not a megamoe.moe backend).

What TorchTitan's FP8 MoE training (torchao's rowwise-scaled grouped GEMM) runs on Hopper: the `grouped`
path (sort by expert, gather, grouped GEMM, gated activation, grouped GEMM, weighted combine; see
grouped.py) with both expert GEMMs in FP8 through `torch._scaled_grouped_mm`:

- forward: the activation quantised rowwise (e4m3, one fp32 scale per row, over the contraction
  dimension), the weight rowwise per output column (one scale per expert and row of w [E, N, K]);
  bf16 output, fast accumulation as torchao uses it;
- backward dA in FP8 the same way: dy rowwise, and w's transposed copy [E, K, N] quantised along N;
- backward dW in BF16 through `torch._grouped_mm` (dyᵀ·a per group), as TorchTitan on Hopper.

Weights are quantised on every call, as TorchTitan does (no cache across micro-batches). Scales are
rounded up to powers of two (torchao's round_scales_to_power_of_2). Groups are aligned to 16 rows,
TorchTitan's token-group alignment for FP8.
"""

from __future__ import annotations

import torch

from ..activation import check_activation
from ..fp8 import E4M3_MAX
from ..validation import check_moe_inputs
from .grouped import expert_path

ALIGN_M = 16  # TorchTitan's token-group alignment for FP8 rowwise grouped GEMMs
ALIGN_K = 16  # torch._scaled_grouped_mm wants the GEMMs' dimensions divisible by 16

# Called through the module, so CPU tests can put an emulation in its place; None in a torch without it.
_scaled_grouped_mm = getattr(torch, "_scaled_grouped_mm", None)


def quantize_rowwise(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a [..., K] -> (e4m3 [..., K] contiguous, fp32 scales [...]) with one scale per row over the last
    dimension: the smallest power of two >= amax / 448 (1 for an all-zero row), so a ≈ q · scale."""
    amax = a.detach().abs().amax(dim=-1, keepdim=True).float()
    scales = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX))), torch.ones_like(amax))
    q = (a.float() / scales).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).contiguous()
    return q, scales.squeeze(-1)


def _fp8_mm(a: torch.Tensor, w_rows: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """a [rows, K] times w_rows[e]ᵀ ([E, N, K]) per group, both quantised rowwise over K; bf16 out."""
    aq, a_scales = quantize_rowwise(a)
    wq, w_scales = quantize_rowwise(w_rows)
    # mat_b column-major [E, K, N]: the transpose of the row-major quantised w_rows.
    return _scaled_grouped_mm(aq, wq.transpose(-2, -1), a_scales, w_scales, offs=group_ends,
                              out_dtype=torch.bfloat16, use_fast_accum=True)


class _Float8GroupedMM(torch.autograd.Function):
    """out [rows, N] = a [rows, K] · w[e]ᵀ for the rows of group e (w [E, N, K]): forward and dA in FP8,
    dW in BF16. Keeps a and w (bf16) for the backward, as torchao does."""

    @staticmethod
    def forward(ctx, a, w, group_ends):
        ctx.save_for_backward(a, w, group_ends)
        return _fp8_mm(a, w, group_ends)

    @staticmethod
    def backward(ctx, grad):
        a, w, group_ends = ctx.saved_tensors
        grad = grad.contiguous()
        grad_a = grad_w = None
        if ctx.needs_input_grad[0]:
            # dA [rows, K] = grad [rows, N] · w[e] [N, K]: w's transposed copy [E, K, N] quantised along N.
            grad_a = _fp8_mm(grad, w.transpose(1, 2).contiguous(), group_ends)
        if ctx.needs_input_grad[1]:
            # dW[e] [N, K] = grad_eᵀ · a_e, the groups running along the contraction (rows).
            grad_w = torch._grouped_mm(grad.t(), a.to(grad.dtype), offs=group_ends)
        return grad_a, grad_w, None


def _float8_grouped_mm(a: torch.Tensor, w: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    return _Float8GroupedMM.apply(a, w, group_ends)


def grouped_fp8_moe(x, topk_ids, topk_weights, w13, w2, *, expert_begin: int = 0,
                    activation: str = "swiglu") -> torch.Tensor:
    """The grouped path with FP8 expert GEMMs (module docstring); x, w13 and w2 in bf16, H and I multiples
    of 16; differentiable with respect to x, topk_weights, w13 and w2. Needs torch._scaled_grouped_mm
    on an sm_90 GPU."""
    check_activation(activation)
    problem = check_moe_inputs(x, topk_ids, topk_weights, w13, w2)
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        if t.dtype != torch.bfloat16:
            raise TypeError(f"grouped-fp8 takes bf16 {name} (its FP8 GEMMs write bf16), got {t.dtype}")
    for name, size in (("H", problem.hidden_size), ("I", problem.intermediate_size)):
        if size % ALIGN_K:
            raise ValueError(f"grouped-fp8 needs {name} divisible by {ALIGN_K} (torch._scaled_grouped_mm), got {size}")
    return expert_path(x, topk_ids, topk_weights, w13, w2, _float8_grouped_mm, expert_begin=expert_begin,
                       activation=activation, align_m=ALIGN_M)
