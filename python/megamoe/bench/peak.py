"""Measured dense-GEMM ceilings that the MoE numbers are compared against."""

from __future__ import annotations

import dataclasses
import sys

import torch

from .timing import Budget, Device, measure

# Square GEMM size. 8192³ saturates an H100/H200 and its operands do not fit in L2.
# On the CPU (smoke tests only) 8192³ would take minutes, so the CPU figure is for a smaller GEMM.
PEAK_GEMM_SIZE = {"cuda": 8192, "cpu": 1024}


@dataclasses.dataclass(frozen=True)
class Peaks:
    gemm_size: int
    bf16_tflops: float
    # None on the CPU (its fp8 matmul is a slow emulation, no ceiling) and on GPUs without fp8 support.
    fp8_tflops: float | None
    bf16_sm_mhz: float | None = None  # the SM clock the bf16 product ran at (None without nvidia-smi)


def measure_peaks(device: Device, budget: Budget) -> Peaks:
    n = PEAK_GEMM_SIZE[device.device.type]
    a = torch.randn(n, n, device=device.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device.device, dtype=torch.bfloat16)
    bf16 = measure(lambda _: torch.matmul(a, b), lambda: None, device, budget)

    fp8 = _fp8_tflops(n, a, b, device, budget) if device.is_cuda else None
    return Peaks(n, _tflops(n, bf16.median_ms), fp8, bf16.sm_clock_mhz)


def _fp8_tflops(n: int, a: torch.Tensor, b: torch.Tensor, device: Device, budget: Budget) -> float | None:
    """e4m3 operands with per-tensor scales. _scaled_mm wants the second operand column-major (a
    transposed view is; random data, so which matrix it is does not matter)."""
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn).t()
    scale = torch.ones((), device=device.device, dtype=torch.float32)
    try:
        def run(_):
            return torch._scaled_mm(a8, b8, scale, scale, out_dtype=torch.bfloat16)
        return _tflops(n, measure(run, lambda: None, device, budget).median_ms)
    except (RuntimeError, NotImplementedError) as error:  # e.g. a GPU without fp8 tensor cores
        print(f"megamoe.bench: fp8 peak not measured: {error}", file=sys.stderr)
        return None


def _tflops(n: int, ms: float) -> float:
    return 2 * n**3 / (ms * 1e-3) / 1e12
