"""What each kernel launch of the fused layer costs sustained: the layer's time with that one launch
made twice, minus its time with every launch once.

Under a sustained load the H200 sits at its power limit, so a kernel's share of the layer's time is
its share of the energy, not the time it takes in a profile (where the clock is higher and the other
kernels do not compete for the power). Running one launch twice, in place (every library call
writes its outputs, none accumulates in this benchmark), adds what that launch costs in the loaded
layer. The repeat finds its inputs partly in L2, so a memory-bound launch is underestimated a little.

    python scripts/experiments/marginal_cost.py --preset qwen3-30b-a3b --precision fp8 bf16 --out DIR
    (--backend fused-recompute-gather etc.: any backend of megamoe.bench built on the library)

Prints, per precision, the calls of one fwd+bwd iteration in order, then for each: the median time
with it doubled, the difference to the interleaved baselines, clock and power; writes
marginal_cost.jsonl under --out.
"""

import argparse
import collections
import json
import statistics
from pathlib import Path

import torch

from megamoe import _native
from megamoe.bench import backends, runner
from megamoe.bench.timing import Budget, Device, measure
from megamoe.shapes import PRESETS


class DoublingCalls:
    """Wraps _native.call: counts each library function's calls per iteration (reset()) and runs the
    chosen (name, ordinal) call twice."""

    def __init__(self):
        self.original = _native.call
        self.counts = collections.Counter()
        self.sequence = []  # (name, ordinal) of the calls since reset()
        self.doubled = None

    def __call__(self, name, what, *args):
        ordinal = self.counts[name]
        self.counts[name] += 1
        self.sequence.append((name, ordinal))
        self.original(name, what, *args)
        if (name, ordinal) == self.doubled:
            self.original(name, what, *args)

    def reset(self):
        self.counts.clear()
        self.sequence = []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b", choices=list(PRESETS))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--backend", default="fused", choices=backends.BACKENDS)
    parser.add_argument("--precision", nargs="+", default=["fp8", "bf16"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    Budget.add_arguments(parser, warmup=2)
    args = parser.parse_args()
    device = Device(torch.device("cuda", 0))
    budget = Budget.from_arguments(args)
    shape = PRESETS[args.preset]
    x_all, w13, w2 = runner._preset_inputs(shape, args.tokens, device.device)
    sets = runner._operand_sets(shape, args.tokens, "balanced", x_all, w13, w2)
    dy = torch.randn(args.tokens, shape.hidden_size, generator=torch.Generator().manual_seed(runner.DY_SEED))
    dy = dy.to(device.device, torch.bfloat16)
    calls = DoublingCalls()
    _native.call = calls
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        with open(args.out / "marginal_cost.jsonl", "a") as log:
            for precision in args.precision:
                measure_precision(args, precision, shape, sets, dy, calls, device, budget, log)
                torch.cuda.empty_cache()
    finally:
        _native.call = calls.original


def measure_precision(args, precision, shape, sets, dy, calls, device, budget, log) -> None:
    """The rounds of one precision: each call of an iteration doubled in turn, baselines between."""
    fn = backends.build(args.backend, shape, precision, device.device)
    run = runner.step(fn, "fwdbwd", sets, dy)

    def reset():
        calls.reset()
        for s in sets:
            s.clear_grads()

    for i in range(2):  # the first call also fills the weight caches (FP8), which later calls find
        reset()
        run(i)
    torch.cuda.synchronize()
    order = list(calls.sequence)
    print(f"{args.preset} T={args.tokens} {args.backend} {precision} fwd+bwd: {len(order)} library calls",
          flush=True)

    def timed(doubled):
        calls.doubled = doubled
        try:
            return measure(run, reset, device, budget)
        finally:
            calls.doubled = None

    for r in range(args.rounds):
        bases, doubled = [timed(None)], []
        for i, step in enumerate(order):
            doubled.append(timed(step))
            if i % 6 == 5:
                bases.append(timed(None))
        bases.append(timed(None))
        base_ms = statistics.mean(b.median_ms for b in bases)
        print(f"round {r}: baseline {base_ms:.3f} ms ({', '.join(f'{b.median_ms:.3f}' for b in bases)}), "
              f"{statistics.mean(b.power_w or 0 for b in bases):.0f} W, "
              f"{statistics.mean(b.sm_clock_mhz or 0 for b in bases):.0f} MHz", flush=True)
        for (name, ordinal), m in zip(order, doubled):
            delta_us = round((m.median_ms - base_ms) * 1e3, 1)
            log.write(json.dumps({"preset": args.preset, "tokens": args.tokens, "backend": args.backend,
                                  "precision": precision, "round": r, "call": name, "ordinal": ordinal,
                                  "ms": round(m.median_ms, 4), "base_ms": round(base_ms, 4), "delta_us": delta_us,
                                  "sm_mhz": m.sm_clock_mhz, "power_w": m.power_w}) + "\n")
            print(f"  {name:48} #{ordinal}  {m.median_ms:.3f} ms  {delta_us:+7.1f} µs  "
                  f"{m.power_w or 0:.0f} W  {m.sm_clock_mhz or 0:.0f} MHz", flush=True)
        log.flush()


if __name__ == "__main__":
    main()
