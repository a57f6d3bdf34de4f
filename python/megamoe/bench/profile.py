"""Profile mode: where one backend's time goes, kernel by kernel (torch.profiler, CUDA activity).

    python -m megamoe.bench.profile [--preset ...] [--tokens N] [--backend ...] [--mode fwd|fwdbwd]

Prints each kernel's time per iteration (summed over its launches) and its share of the GPU time,
then the idle stretches of the GPU between kernels, by the pair of kernels around them, and writes
profile_<preset>_<backend>_<mode>.json. Use it to find the gap between the layer time and the
GEMMs' roofline; the timings of record come from `python -m megamoe.bench`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from megamoe.shapes import PRESETS, make_inputs

from . import backends, runner
from .record import MODES
from .report import add_out_argument, provenance
from .timing import SUSTAINED_WARMUP_S

NAME_WIDTH = 90
GAPS_SHOWN = 12


def gpu_events(fn, iterations: int) -> list:
    """The GPU activities of the last `iterations` of iterations + 1 back-to-back calls of fn, in
    start order. The first call under the profiler pays its start-up on the host (0.1-0.3 ms of GPU
    idle around the first launches at 30B), which is not the code's, so its events are dropped."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations + 1):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return last_iterations(sorted(events, key=lambda e: e.time_range.start), iterations)


def last_iterations(events: list, iterations: int) -> list:
    """The events of the last `iterations` of iterations + 1 calls, each of which launched the same
    sequence (events in start order)."""
    calls = iterations + 1
    if len(events) % calls:
        raise RuntimeError(f"{len(events)} GPU activities from {calls} calls: the calls did not launch the same "
                           "sequence, so the first call's cannot be told apart; profile after more warm-up calls")
    return events[len(events) // calls:]


def kernel_times(events: list, iterations: int) -> dict[str, tuple[float, int]]:
    """{kernel name: (µs per iteration, launches per iteration)}."""
    total_us, launches = defaultdict(float), defaultdict(int)
    for event in events:
        total_us[event.name] += event.device_time
        launches[event.name] += 1
    return {name: (us / iterations, launches[name] // iterations) for name, us in total_us.items()}


def idle_gaps(events: list, iterations: int) -> dict[tuple[str, str], float]:
    """{(kernel before, kernel after): GPU idle µs per iteration between them}. A gap is time with no
    kernel running, so it is launch latency or the host falling behind, not overlap."""
    gaps, busy_until, previous = defaultdict(float), None, None
    for event in events:
        if busy_until is not None and event.time_range.start > busy_until:
            gaps[(previous, event.name)] += (event.time_range.start - busy_until) / iterations
        if busy_until is None or event.time_range.end >= busy_until:
            busy_until, previous = event.time_range.end, event.name
    return dict(gaps)


def short_name(kernel: str) -> str:
    """`void ns::kernel<Args...>(params)` → `kernel<Args...>`, our and torch's namespaces dropped."""
    name = kernel.removeprefix("void ").replace("(anonymous namespace)::", "")
    for namespace in ("megamoe::grouped_gemm::", "megamoe::routing::", "megamoe::", "at::native::"):
        name = name.replace(namespace, "")
    return name if name.startswith("Memset") else name.split("(")[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megamoe.bench.profile", description=__doc__)
    parser.add_argument("--preset", choices=list(PRESETS), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--backend", choices=backends.BACKENDS, default="fused")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--mode", choices=MODES, default="fwdbwd")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--warmup-seconds", type=float, default=SUSTAINED_WARMUP_S, metavar="SECONDS",
                        help="keep the GPU busy this long first, so the profiled kernels run at the sustained "
                             "(power-limited) clock, as the benchmark times them")
    add_out_argument(parser)
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
    torch.cuda.synchronize()
    start = time.perf_counter()
    while time.perf_counter() - start < args.warmup_seconds:
        iteration()
        torch.cuda.synchronize()
    events = gpu_events(iteration, args.iterations)
    times = kernel_times(events, args.iterations)
    gaps = sorted(idle_gaps(events, args.iterations).items(), key=lambda item: -item[1])
    total = sum(us for us, _ in times.values())
    rows = sorted(times.items(), key=lambda item: -item[1][0])
    print(f"{args.preset} T={args.tokens} {args.backend} {args.precision} {args.mode}: "
          f"{total / 1e3:.3f} ms of kernels per iteration")
    print(f"{'kernel':{NAME_WIDTH}} {'launches':>8} {'µs':>9} {'share':>6}")
    for name, (us, count) in rows:
        print(f"{name[:NAME_WIDTH]:{NAME_WIDTH}} {count:8d} {us:9.1f} {us / total:6.1%}")
    idle = sum(us for _, us in gaps)
    print(f"GPU idle between kernels: {idle:.1f} µs per iteration; the largest gaps:")
    for (before, after), us in gaps[:GAPS_SHOWN]:
        print(f"{us:9.1f} µs  {short_name(before)[:60]} → {short_name(after)[:60]}")
    result = {**provenance(torch.cuda.get_device_name(), "megamoe.bench.profile", argv),
              "preset": args.preset, "tokens": args.tokens, "backend": args.backend,
              "precision": args.precision, "mode": args.mode, "kernel_ms_per_iteration": total / 1e3,
              "kernels": [{"name": name, "launches": count, "us": us} for name, (us, count) in rows],
              "idle_us_per_iteration": idle,
              "idle_gaps": [{"before": before, "after": after, "us": us} for (before, after), us in gaps]}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"profile_{args.preset}_{args.backend}_{args.mode}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
