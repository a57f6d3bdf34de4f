"""Where a single call of the fused layer spends its time: the host's steps and the GPU's kernels on
one timeline (torch.profiler, CPU and CUDA activities), for calls timed one at a time after a
sustained warm-up, as the benchmark's single-call figure takes them (synchronised before and after).

    python scripts/experiments/call_timeline.py [--preset qwen3-30b-a3b] [--tokens 1024]
        [--backend fused|fused-graphed] [--precision bf16] [--mode fwd|fwdbwd] [--calls 5]
        [--warmup-seconds 2]

Prints, for the median call: when each step of the layer ran on the host and each kernel on the
GPU (µs from the call's start), the GPU's idle gaps, and the total. The profiler slows the host 2–3×:
with --events, calls run unprofiled, and host marks (the forward returns, autograd reaches the
backward: a hook on y, the backward returns) stand beside CUDA events recorded at the same points
(the GPU idles at a call's start, so its first event runs as the call starts): medians over calls.
"""

import argparse
import statistics
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

import megamoe
import megamoe.fused
from megamoe.bench import backends
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
    parser.add_argument("--backend", choices=["fused", "fused-graphed"], default="fused",
                        help="fused-graphed: the benchmark's replay of CUDA graphs (no host steps to mark)")
    parser.add_argument("--precision", choices=["bf16", "fp8", "fp8_bwd"], default="bf16")
    parser.add_argument("--mode", choices=["fwd", "fwdbwd"], default="fwdbwd")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--warmup-seconds", type=float, default=2.0)
    parser.add_argument("--events", action="store_true", help="unprofiled: host marks and CUDA events")
    args = parser.parse_args()
    shape = PRESETS[args.preset]
    x, ids, weights, w13, w2 = megamoe.make_inputs(shape, args.tokens, "balanced", device="cuda")
    for t in (x, weights, w13, w2):
        t.requires_grad_(args.mode == "fwdbwd")
    dy = torch.randn_like(x)
    layer = backends.build(args.backend, shape, args.precision)

    def forward():  # the forward alone runs under no_grad, as the benchmark times it
        with torch.set_grad_enabled(args.mode == "fwdbwd"):
            return layer(x, ids, weights, w13, w2)

    def backward(y):
        y.backward(dy)

    def clear_grads():
        x.grad = weights.grad = w13.grad = w2.grad = None

    def call():
        y = forward()
        if args.mode == "fwdbwd":
            backward(y)
        clear_grads()

    start = time.perf_counter()
    while time.perf_counter() - start < args.warmup_seconds:
        call()
    torch.cuda.synchronize()
    if args.events:
        report_events(call, forward, backward if args.mode == "fwdbwd" else None, clear_grads, args)
        return
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
    print(f"{args.preset}, {args.tokens} tokens, {args.backend}, {args.precision}, {args.mode}: calls "
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


def report_events(call, forward, backward, clear_grads, args) -> None:
    """40 calls back to back, then unprofiled calls one at a time, made of call's parts (backward None:
    forwards alone): host marks and CUDA events at the same points, µs from the call's start, medians
    over args.calls calls."""
    torch.cuda.synchronize()
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    first.record()
    for _ in range(40):
        call()
    last.record()
    torch.cuda.synchronize()
    back_to_back = first.elapsed_time(last) * 1e3 / 40
    rows = []
    for _ in range(args.calls):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        host = {}

        def reached(grad):  # runs on autograd's thread, before the layer's backward
            host["backward reached"] = time.perf_counter()
            events[2].record()
        torch.cuda.synchronize()
        start = time.perf_counter()
        events[0].record()
        y = forward()
        host["forward returns"] = time.perf_counter()
        events[1].record()
        if backward is not None:
            y.register_hook(reached)
            backward(y)
            host["backward returns"] = time.perf_counter()
        events[3].record()
        torch.cuda.synchronize()
        host["call done"] = time.perf_counter()
        clear_grads()
        marks = {"forward's work done": events[1], "work done": events[3]}
        if backward is not None:
            marks["backward's work may start"] = events[2]
        gpu = {name: events[0].elapsed_time(e) * 1e3 for name, e in marks.items()}
        rows.append({**{f"host: {k}": (t - start) * 1e6 for k, t in host.items()},
                     **{f"gpu: {k}": t for k, t in gpu.items()}})
    print(f"{args.preset}, {args.tokens} tokens, {args.backend}, {args.precision}, {args.mode}, unprofiled, "
          f"µs from the call's start (medians of {len(rows)}); back to back {back_to_back:.1f} µs per call:")
    for name in sorted(rows[0], key=lambda n: statistics.median(r[n] for r in rows)):
        print(f"  {statistics.median(r[name] for r in rows):8.1f}  {name}")


def idle_us(kernels) -> float:
    """The GPU's idle time between consecutive kernels (ordered by start)."""
    return sum(b.time_range.start - a.time_range.end for a, b in zip(kernels, kernels[1:]))


if __name__ == "__main__":
    main()
