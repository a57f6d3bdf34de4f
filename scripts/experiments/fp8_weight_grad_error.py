"""The error a block-FP8 weight gradient would add: dW = Aᵀ·B over one expert's tokens with A and B
quantised in 1 x 128 blocks along the tokens (the contraction; megamoe.fp8's row recipe applied to
Aᵀ and Bᵀ), against the exact product of the bf16 operands, next to the error of the bf16 GEMM's
one output rounding, at the weight-gradient shapes of the two Qwen3 presets (random Gaussian
operands, fp64 math, CPU).
  python3 scripts/experiments/fp8_weight_grad_error.py [--tokens 1024]
"""

import argparse

import torch

from megamoe import fp8
from megamoe.reference import relative_error
from megamoe.shapes import PRESETS


def along_tokens(a: torch.Tensor) -> torch.Tensor:
    """a [T, C] through e4m3 with one scale per column and 128 tokens, back in fp64."""
    return fp8.dequantize_rows(*fp8.quantize_rows(a.T.contiguous())).double().T


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="rows of one expert (a multiple of 128)")
    args = parser.parse_args()
    torch.manual_seed(0)
    for preset in ("qwen3-30b-a3b", "qwen3-235b-a22b"):
        shape = PRESETS[preset]
        h, i = shape.hidden_size, shape.intermediate_size
        for name, m, n in (("dW2 = dyᵀ·(p·h)", h, i), ("dW13 = dzᵀ·x", 2 * i, h)):
            a = torch.randn(args.tokens, m).bfloat16()
            b = torch.randn(args.tokens, n).bfloat16()
            exact = a.double().T @ b.double()
            fp8_error = relative_error(along_tokens(a).T @ along_tokens(b), exact)
            bf16_error = relative_error(exact.float().bfloat16(), exact)
            print(f"{preset} {name} [{m} x {n}], {args.tokens} tokens: FP8 1x128 along tokens {fp8_error:.4f}, "
                  f"bf16 output rounding {bf16_error:.4f}")


if __name__ == "__main__":
    main()
