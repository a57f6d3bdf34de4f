"""Where a single call of the fused layer spends its time: the host's steps and the GPU's kernels on
one timeline (torch.profiler, CPU and CUDA activities), for calls timed one at a time after a
sustained warm-up, as the benchmark's single-call figure takes them (synchronised before and after).

    python scripts/experiments/call_timeline.py [--preset qwen3-30b-a3b] [--tokens 1024]
        [--precision bf16] [--mode fwd|fwdbwd] [--calls 5] [--warmup-seconds 2]

Prints, for the median call: when each step of the layer ran on the host and each kernel on the
GPU (µs from the call's start), the GPU's idle gaps, and the total.
"""

import argparse
import statistics
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

import megamoe
import megamoe.fused
from host_time import TIMELINE_STEPS, wrap_steps  # the layer's steps, by the module that holds them
from megamoe.shapes import PRESETS


def mark_steps() -> None:
    """Each step of host_time.TIMELINE_STEPS runs under a record_function of its name."""
    def marked(name, fn):
        def run(*args, **kwargs):
            with record_function(f"step:{name}"):
                return fn(*args, **kwargs)
        return run
    wrap_steps(TIMELINE_STEPS, marked)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--precision", choices=["bf16", "fp8", "fp8_bwd"], default="bf16")
    parser.add_argument("--mode", choices=["fwd", "fwdbwd"], default="fwdbwd")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--warmup-seconds", type=float, default=2.0)
    args = parser.parse_args()
    shape = PRESETS[args.preset]
    x, ids, weights, w13, w2 = megamoe.make_inputs(shape, args.tokens, "balanced", device="cuda")
    for t in (x, weights, w13, w2):
        t.requires_grad_(args.mode == "fwdbwd")
    dy = torch.randn_like(x)

    def call():
        y = megamoe.moe(x, ids, weights, w13, w2, backend="fused", precision=args.precision)
        if args.mode == "fwdbwd":
            y.backward(dy)
        x.grad = weights.grad = w13.grad = w2.grad = None

    start = time.perf_counter()
    while time.perf_counter() - start < args.warmup_seconds:
        call()
    torch.cuda.synchronize()
    mark_steps()
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            torch.cuda.synchronize()
            with record_function("call"):
                call()
                torch.cuda.synchronize()
    events = list(prof.events())
    calls = sorted((e for e in events if e.name == "call" and e.device_type == DeviceType.CPU),
                   key=lambda e: e.time_range.start)
    # CUDA events include the GPU-side ranges of the record_functions: kernels only
    kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA and e.name != "call"
                      and not e.name.startswith("step:")), key=lambda e: e.time_range.start)
    steps = sorted((e for e in events if e.name.startswith("step:")), key=lambda e: e.time_range.start)
    summaries = []
    for c in calls:
        t0, t1 = c.time_range.start, c.time_range.end
        ks = [k for k in kernels if t0 <= k.time_range.start <= t1]
        busy = sum(k.time_range.end - k.time_range.start for k in ks)
        summaries.append((t1 - t0, busy, c, ks))
    total, busy, c, ks = sorted(summaries, key=lambda s: s[0])[len(summaries) // 2]
    t0 = c.time_range.start
    print(f"{args.preset}, {args.tokens} tokens, {args.precision}, {args.mode}: calls "
          f"{', '.join(f'{s[0]:.0f}' for s in summaries)} µs, "
          f"GPU busy {', '.join(f'{s[1]:.0f}' for s in summaries)}")
    print(f"median call {total:.0f} µs, kernels {busy:.0f} µs, first kernel at {ks[0].time_range.start - t0:.0f}, "
          f"last ends at {ks[-1].time_range.end - t0:.0f}")
    rows = [(s.time_range.start - t0, s.time_range.end - t0, "host", s.name[5:]) for s in steps
            if t0 <= s.time_range.start <= c.time_range.end]
    previous_end = None
    for k in ks:
        start, end = k.time_range.start - t0, k.time_range.end - t0
        gap = "" if previous_end is None else f"  (idle {start - previous_end:.0f})"
        rows.append((start, end, "gpu ", k.name[:70] + gap))
        previous_end = end
    for start, end, where, name in sorted(rows):
        print(f"  {start:8.1f} {end:8.1f}  {where}  {name}")
    print(f"GPU idle between kernels {idle_us(ks):.0f} µs (median call), over calls "
          f"{statistics.median(idle_us(s[3]) for s in summaries):.0f}")


def idle_us(kernels) -> float:
    """The GPU's idle time between consecutive kernels (ordered by start)."""
    return sum(b.time_range.start - a.time_range.end for a, b in zip(kernels, kernels[1:]))


if __name__ == "__main__":
    main()
