"""Profile mode: where one backend's time goes, kernel by kernel (torch.profiler, CUDA activity).

    python -m megamoe.bench.profile [--preset ...] [--tokens N] [--backend ...] [--mode fwd|fwdbwd]

Prints each kernel's time per iteration (summed over its launches) and its share of the GPU time,
and writes profile_<preset>_<backend>_<mode>.json. Use it to find the gap between the layer time and the
GEMMs' roofline; the timings of record come from `python -m megamoe.bench`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from megamoe.shapes import PRESETS, make_inputs

from . import backends, runner
from .record import MODES
from .report import git_commit

NAME_WIDTH = 90


def kernel_times(fn, iterations: int) -> dict[str, tuple[float, int]]:
    """{kernel name: (µs per iteration, launches per iteration)}."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            fn()
        torch.cuda.synchronize()
    total_us, launches = defaultdict(float), defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total_us[event.name] += event.device_time
            launches[event.name] += 1
    return {name: (us / iterations, launches[name] // iterations) for name, us in total_us.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megamoe.bench.profile", description=__doc__)
    parser.add_argument("--preset", choices=list(PRESETS), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--backend", choices=backends.BACKENDS, default="fused")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--mode", choices=MODES, default="fwdbwd")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)

    shape = PRESETS[args.preset]
    x, ids, weights, w13, w2 = make_inputs(shape, args.tokens, device="cuda")
    operands = runner.Operands(x.requires_grad_(), ids, weights.requires_grad_(), w13.requires_grad_(),
                               w2.requires_grad_())
    fn = backends.build(args.backend, shape, args.precision)
    run = runner.step(fn, args.mode, [operands], torch.randn_like(x))

    def iteration():
        run(0)
        operands.clear_grads()

    for _ in range(3):  # warm up: compilation, autotuning, allocator
        iteration()
    times = kernel_times(iteration, args.iterations)
    total = sum(us for us, _ in times.values())
    rows = sorted(times.items(), key=lambda item: -item[1][0])
    print(f"{args.preset} T={args.tokens} {args.backend} {args.precision} {args.mode}: "
          f"{total / 1e3:.3f} ms of kernels per iteration")
    print(f"{'kernel':{NAME_WIDTH}} {'launches':>8} {'µs':>9} {'share':>6}")
    for name, (us, count) in rows:
        print(f"{name[:NAME_WIDTH]:{NAME_WIDTH}} {count:8d} {us:9.1f} {us / total:6.1%}")
    result = {"gpu": torch.cuda.get_device_name(), "commit": git_commit(), "torch": torch.__version__,
              "preset": args.preset, "tokens": args.tokens, "backend": args.backend,
              "precision": args.precision, "mode": args.mode, "kernel_ms_per_iteration": total / 1e3,
              "command": "python -m megamoe.bench.profile " + " ".join(sys.argv[1:] if argv is None else argv),
              "kernels": [{"name": name, "launches": count, "us": us} for name, (us, count) in rows]}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"profile_{args.preset}_{args.backend}_{args.mode}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
