"""Block-FP8 quantisation of the DeepSeek-V3 recipe (torch ops): e4m3 values with one fp32 scale per
row and 128 K values (activations) or per 128 x 128 block (weights), scale = amax / 448 so the
block's largest magnitude maps to e4m3's largest finite value."""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
BLOCK = 128


def _scales(amax: torch.Tensor) -> torch.Tensor:
    # An all-zero block gets scale 1 (its values quantise to 0 either way).
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def quantize_rows(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a [rows, K] -> (e4m3 [rows, K], scales fp32 [K / 128, rows]: k-block major, as the GEMM reads them)."""
    rows, k = a.shape
    if k % BLOCK:
        raise ValueError(f"K must be a multiple of {BLOCK} for 1x{BLOCK} scales, got {k}")
    blocks = a.float().view(rows, k // BLOCK, BLOCK)
    scales = _scales(blocks.abs().amax(dim=2))
    q = (blocks / scales.unsqueeze(2)).to(torch.float8_e4m3fn).view(rows, k)
    return q, scales.t().contiguous()


def quantize_blocks(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """b [E, N, K] -> (e4m3 [E, N, K], scales fp32 [E, N / 128, K / 128])."""
    e, n, k = b.shape
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"N and K must be multiples of {BLOCK} for {BLOCK}x{BLOCK} scales, got {n} and {k}")
    blocks = b.float().view(e, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scales = _scales(blocks.abs().amax(dim=(2, 4)))
    q = (blocks / scales[:, :, None, :, None]).to(torch.float8_e4m3fn).view(e, n, k)
    return q, scales.contiguous()


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values quantize_rows' output stands for."""
    rows, k = q.shape
    return (q.float().view(rows, k // BLOCK, BLOCK) * scales.t().unsqueeze(2)).view(rows, k)


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values quantize_blocks' output stands for."""
    e, n, k = q.shape
    blocks = q.float().view(e, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    return (blocks * scales[:, :, None, :, None]).view(e, n, k)
