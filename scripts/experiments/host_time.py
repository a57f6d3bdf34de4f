"""Host time per call of `megamoe.moe` (backend fused) with every native call stubbed out: what the
Python side, torch's custom-op dispatch and autograd cost per layer call, on CPU tensors, no GPU. The
weights have fp32 `main_grad` buffers, so the backward allocates no weight gradients.

    python scripts/experiments/host_time.py [--preset qwen3-30b-a3b] [--tokens 1024]

Prints the median over rounds of the mean time per call, forward and forward + backward.
"""

import argparse
import statistics
import time

import torch

import megamoe
import megamoe.functional
import megamoe.fused
from megamoe import _native
from megamoe.shapes import PRESETS


class _NoIdCheck:
    def __init__(self, *args):
        pass

    def raise_if_any(self):
        pass


def stub_native_calls() -> None:
    _native.call = lambda *args, **kwargs: None
    _native.stream = lambda device: 0
    megamoe.functional.check_fused_support = lambda *args, **kwargs: None  # it refuses CPU tensors
    megamoe.fused.IdRangeCheck = _NoIdCheck


def per_call_us(fn, calls: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    stub_native_calls()
    shape = PRESETS[args.preset]
    hidden, inter, experts, top_k = shape.hidden_size, shape.intermediate_size, shape.num_experts, shape.top_k
    x = torch.randn(args.tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, experts, (args.tokens, top_k), dtype=torch.int32)
    weights = torch.rand(args.tokens, top_k, requires_grad=True)
    w13 = torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.empty(experts, hidden, inter, dtype=torch.bfloat16, requires_grad=True)
    for w in (w13, w2):
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    dy = torch.randn(args.tokens, hidden, dtype=torch.bfloat16)

    def forward():
        return megamoe.moe(x, ids, weights, w13, w2)

    def forward_backward():
        forward().backward(dy)
        x.grad = weights.grad = None

    for fn in (forward, forward_backward):
        per_call_us(fn, args.calls, 1)  # warm-up
    print(f"{args.preset}, {args.tokens} tokens, host time per call (native calls stubbed out): "
          f"forward {per_call_us(forward, args.calls, args.rounds):.0f} µs, "
          f"forward + backward {per_call_us(forward_backward, args.calls, args.rounds):.0f} µs")


if __name__ == "__main__":
    main()
