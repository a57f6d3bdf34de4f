"""The FP8 backward's K-major weight copies, two ways, at the Qwen3 presets' expert weights: the
forward's copy quantised and then transposed (what "fp8" does) against megamoe's straight
transposed quantisation (what "fp8_bwd" does), each as GPU time per weight (CUDA events over
back-to-back calls), and whether their bytes agree.

    python scripts/experiments/weight_copies.py [--preset qwen3-30b-a3b qwen3-235b-a22b]
"""

import argparse

import torch

from megamoe import fp8
from megamoe.shapes import PRESETS


def gpu_us(fn, calls: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", nargs="+", choices=list(PRESETS), default=["qwen3-30b-a3b", "qwen3-235b-a22b"])
    args = parser.parse_args()
    for preset in args.preset:
        shape = PRESETS[preset]
        experts, inter, hidden = shape.num_experts, shape.intermediate_size, shape.hidden_size
        for name, dims in (("w13", (experts, 2 * inter, hidden)), ("w2", (experts, hidden, inter))):
            w = torch.randn(dims, device="cuda").bfloat16()
            q = fp8.quantize_blocks(w)[0]
            same = torch.equal(fp8.quantize_blocks_transposed(w)[0].view(torch.uint8),
                               q.transpose(1, 2).contiguous().view(torch.uint8))
            print(f"{preset} {name} {tuple(w.shape)}: quantise {gpu_us(lambda: fp8.quantize_blocks(w)):.0f} µs, "
                  f"transpose {gpu_us(lambda: fp8._transposed_values(q)):.0f}, both "
                  f"{gpu_us(lambda: fp8._transposed_values(fp8.quantize_blocks(w)[0])):.0f}, straight "
                  f"{gpu_us(lambda: fp8.quantize_blocks_transposed(w)):.0f}; bytes equal: {same}")


if __name__ == "__main__":
    main()
