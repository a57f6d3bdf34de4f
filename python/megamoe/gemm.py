"""The core's persistent grouped GEMM over a routing plan's pool (csrc/kernels/grouped_gemm)."""

from __future__ import annotations

import torch

from . import _native
from .routing import RoutingPlan


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """c [rows, N] with c[block] = a[block] · b[expert of block]ᵀ for the plan's live blocks.

    a: [max_blocks * 128, K] bf16 pool rows; b: [E_local, N, K] bf16. Rows past the live blocks
    are left unwritten.
    """
    rows = plan.block_expert.numel() * _native.BLOCK_M
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise TypeError(f"grouped_gemm takes bfloat16 operands, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or a.shape[0] != rows or b.dim() != 3 or b.shape[2] != a.shape[1]:
        raise ValueError(f"a must be [{rows}, K] and b [E_local, N, K]; got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if not (a.is_cuda and b.is_cuda and a.is_contiguous() and b.is_contiguous()):
        raise ValueError("grouped_gemm needs contiguous CUDA tensors")
    num_local, n, k = b.shape
    c = torch.empty(rows, n, dtype=torch.bfloat16, device=a.device)
    stream = torch.cuda.current_stream(a.device).cuda_stream
    status = _native.library().megamoe_grouped_gemm_bf16(
        a.data_ptr(), b.data_ptr(), c.data_ptr(), plan.block_expert.data_ptr(),
        plan.num_blocks.data_ptr(), plan.block_expert.numel(), n, k, num_local, stream)
    _native.check(status, "grouped_gemm")
    return c
