"""What block-FP8 weight gradients would change: dW = Aᵀ·B over the tokens with A and B quantised in
1 x 128 blocks along the tokens (the contraction; megamoe.fp8's row recipe applied to Aᵀ and Bᵀ).

Error (CPU, fp64 math, random Gaussian operands, one expert's tokens): against the exact product of
the bf16 operands, next to the error of the bf16 GEMM's one output rounding. Two recipes: both
operands in 1 x 128 blocks along the tokens (a scale per column and 128 tokens on each side: the
GEMM's promotion scales every fragment column by its own scale), and the second operand in 128 x 128
blocks of 128 tokens and 128 columns instead (the promotion of the forward's FP8 GEMMs: one scale per
fragment row and 128-column block: how the layer runs dW13); and, as the layer runs dW2, the first
operand taken from its own 1 x 128 row copy (dh's operand dy, quantised along its columns),
dequantised to bf16, before it is quantised along the tokens. Each on Gaussian data, and with 1% of the second operand's
columns 50x larger (outlier channels, which a 128 x 128 block shares with 127 others).
Speed (--speed, a GPU): a bound, not the kernel. All experts' weight gradients together have the
FLOPs of one dense [m, R] x [R, n] product over the R = T·K routes; it is timed sustained as a bf16
torch.matmul and as an e4m3 torch._scaled_mm with row-wise scales (fewer scale multiplies than 1 x 128
blocks, so faster than a block-FP8 kernel can be), both operands K-major as an FP8 weight gradient
reads them, next to what making those operands costs: transposing a token-major pool and quantising
it along the tokens (torch's transpose, megamoe's row quantisation).
  python3 scripts/experiments/fp8_weight_grad.py [--tokens 1024] [--speed [--routes 131072]]
"""

import argparse

import torch

from megamoe import fp8
from megamoe.bench.timing import Budget, Device, measure
from megamoe.reference import fp8_along_tokens, fp8_token_blocks, relative_error
from megamoe.shapes import PRESETS

PRESETS_SHOWN = ("qwen3-30b-a3b", "qwen3-235b-a22b")


def gradients(preset: str):
    """(name, m, n) of the two weight gradients: dW2 [H, I] = dyᵀ·(p·h), dW13 [2I, H] = dzᵀ·x."""
    h, i = PRESETS[preset].hidden_size, PRESETS[preset].intermediate_size
    return (("dW2 = dyᵀ·(p·h)", h, i), ("dW13 = dzᵀ·x", 2 * i, h))


def error(tokens: int) -> None:
    for preset in PRESETS_SHOWN:
        for name, m, n in gradients(preset):
            for outliers in (False, True):
                a = torch.randn(tokens, m).bfloat16()
                b = torch.randn(tokens, n)
                if outliers:
                    b[:, torch.randperm(n)[:max(1, n // 100)]] *= 50
                b = b.bfloat16()
                exact = a.double().T @ b.double()
                both = relative_error(fp8_along_tokens(a).T @ fp8_along_tokens(b), exact)
                blocks = relative_error(fp8_along_tokens(a).T @ fp8_token_blocks(b), exact)
                a_rows = fp8.dequantize_rows(*fp8.quantize_rows(a), torch.bfloat16)
                twice = relative_error(fp8_along_tokens(a_rows).T @ fp8_token_blocks(b), exact)
                bf16_error = relative_error(exact.float().bfloat16(), exact)
                print(f"{preset} {name} [{m} x {n}], {tokens} tokens{', outlier columns' if outliers else ''}: "
                      f"FP8 1x128 along tokens {both:.4f}, second operand in 128x128 blocks {blocks:.4f}, "
                      f"first from its row copy too {twice:.4f}, bf16 output rounding {bf16_error:.4f}")


def speed(routes: int) -> None:
    device = Device(torch.device("cuda"))
    budget = Budget(warmup=3, repeat=50, seconds=2.0, warmup_seconds=1.0)
    for preset in PRESETS_SHOWN:
        for name, m, n in gradients(preset):
            pool = torch.randn(routes, m, device="cuda", dtype=torch.bfloat16)  # token-major, as the pools are
            a = pool.t().contiguous()  # [m, R]: tokens contiguous (K-major)
            b = torch.randn(n, routes, device="cuda", dtype=torch.bfloat16)  # [n, R] K-major, read transposed
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
            scale_a = torch.ones(m, 1, device="cuda", dtype=torch.float32)
            scale_b = torch.ones(1, n, device="cuda", dtype=torch.float32)
            cases = {
                "bf16 matmul": lambda _: torch.matmul(a, b.t()),
                "e4m3 row-wise _scaled_mm": lambda _: torch._scaled_mm(a8, b8.t(), scale_a, scale_b,
                                                                       out_dtype=torch.bfloat16),
                "transpose + quantise one operand": lambda _: fp8.quantize_rows(pool.t().contiguous()),
            }
            times = {case: measure(run, lambda: None, device, budget).median_ms for case, run in cases.items()}
            flops = 2 * m * n * routes
            print(f"{preset} {name}, {routes} routes ({flops / 1e12:.2f} TFLOP): " + ", ".join(
                f"{case} {ms:.3f} ms" for case, ms in times.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="error: rows of one expert (a multiple of 128)")
    parser.add_argument("--speed", action="store_true", help="also the speed bound (needs a GPU)")
    parser.add_argument("--routes", type=int, default=16384 * 8, help="speed: routes of all experts together")
    args = parser.parse_args()
    torch.manual_seed(0)
    error(args.tokens)
    if args.speed:
        speed(args.routes)


if __name__ == "__main__":
    main()
