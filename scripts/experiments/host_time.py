"""Host time per call of `megamoe.moe` (backend fused) with every native call stubbed out: what the
Python side, torch's custom-op dispatch and autograd cost per layer call, on CPU tensors, no GPU. The
weights have fp32 `main_grad` buffers, so the backward allocates no weight gradients. With --gpu, the
real calls on the GPU, without the id check's wait (so the host runs ahead of the kernels): the host's
time per call, launches included, on that machine. With --steps (and --gpu), the id check stays, and
the host time of each step of the layer (the routing plan, each launch's wrapper, the FP8 weight
cache, the id check's wait) is reported as well, for the no_grad forward the benchmark times and
for the forward + backward. With --timeline, calls timed one at a time instead (with --gpu the device
synchronised before and after each, as the benchmark's single-call figure takes them): when each step
(the input checks, each launch's wrapper and the native call inside it) and the whole forward and
backward start and end on the host, µs from the call's start, for a no_grad forward, a forward
recorded for autograd whose output is dropped, and a forward + backward.

    python scripts/experiments/host_time.py [--preset qwen3-30b-a3b] [--tokens 1024] [--precision bf16] [--gpu]
                                            [--steps | --timeline]

Prints the median over rounds of the mean time per call, forward and forward + backward.
"""

import argparse
import collections
import statistics
import time

import torch

import megamoe
import megamoe.fp8
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
    # The FP8 quantisers take the core's path (stubbed) for CPU tensors too, not torch's fallback.
    megamoe.fp8._on_core = lambda a: a.dtype == torch.bfloat16 and a.is_contiguous()


# What fused.py calls for each step of the layer, by the module that holds it.
STEPS = {megamoe.fused: ("_plan", "dispatch", "dispatch_fp8", "gated_gemm", "gated_gemm_fp8", "grouped_gemm_scatter",
                         "grouped_gemm_scatter_fp8", "combine", "gated_backward", "gated_backward_fp8", "weight_grad",
                         "weight_grad_fp8", "reduce_dp"),
         megamoe.fp8: ("quantized_weight", "transposed_weight"), megamoe.fused.IdRangeCheck: ("raise_if_any",)}


# What a timeline marks: STEPS, the input checks, the routing build, the id check's set-up and the
# layer's whole forward and backward (host_time's own timeline marks each native call as well).
TIMELINE_STEPS = {**STEPS, megamoe.fused: STEPS[megamoe.fused] + ("build_routing", "IdRangeCheck", "fused_forward",
                                                                 "fused_backward"),
                  megamoe.functional: ("check_options", "check_moe_inputs", "check_fused_support",
                                       "fused_moe_autograd")}


def wrap_steps(steps: dict, wrapper) -> None:
    """Replaces each step of `steps` ({holder: names}) by wrapper(name, step)."""
    for holder, names in steps.items():
        for name in names:
            setattr(holder, name, wrapper(name, getattr(holder, name)))


def time_steps() -> collections.Counter:
    """Wraps each of STEPS so that its host time adds up in the returned counter (seconds)."""
    spent = collections.Counter()

    def timed(name, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
        return run
    wrap_steps(STEPS, timed)
    return spent


def mark_steps() -> list:
    """Wraps each of TIMELINE_STEPS so that its start and end are appended to the returned list as
    (label, time.perf_counter())."""
    marks = []

    def marked(label, fn, *args, **kwargs):
        marks.append((f"{label} starts", time.perf_counter()))
        try:
            return fn(*args, **kwargs)
        finally:
            marks.append((f"{label} ends", time.perf_counter()))
    def wrapped(name, fn):  # a function, so a wrapped method still binds to its instance
        def run(*args, **kwargs):
            return marked(name, fn, *args, **kwargs)
        return run
    wrap_steps(TIMELINE_STEPS, wrapped)
    call = _native.call  # each launch marked by its entry point: its own cost, apart from its wrapper's Python
    _native.call = lambda entry, *args, **kwargs: marked(entry, call, entry, *args, **kwargs)
    return marks


def per_call_us(fn, calls: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # each round starts with an empty queue
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--precision", choices=["bf16", "fp8", "fp8_bwd"], default="bf16")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--gpu", action="store_true",
                        help="the real calls on the GPU, the id check's wait left out (at most 20 calls a round, "
                             "so the launch queue never fills)")
    steps = parser.add_mutually_exclusive_group()
    steps.add_argument("--steps", action="store_true",
                       help="with --gpu: keep the id check and report the host time of each step of a forward "
                            "and of a forward + backward")
    steps.add_argument("--timeline", action="store_true",
                       help="time calls one at a time and print when each step starts and ends on the host")
    args = parser.parse_args()
    if args.steps and not args.gpu:
        parser.error("--steps needs --gpu")
    if args.gpu:
        if not (args.steps or args.timeline):
            megamoe.fused.IdRangeCheck = _NoIdCheck
        args.calls = min(args.calls, 20)
    else:
        stub_native_calls()
    device = "cuda" if args.gpu else "cpu"
    shape = PRESETS[args.preset]
    hidden, inter, experts, top_k = shape.hidden_size, shape.intermediate_size, shape.num_experts, shape.top_k
    x = torch.randn(args.tokens, hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
    ids = torch.randint(0, experts, (args.tokens, top_k), dtype=torch.int32, device=device)
    weights = torch.rand(args.tokens, top_k, device=device, requires_grad=True)
    w13 = torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
    w2 = torch.empty(experts, hidden, inter, dtype=torch.bfloat16, device=device, requires_grad=True)
    for w in (w13, w2):
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=device)
    dy = torch.randn(args.tokens, hidden, dtype=torch.bfloat16, device=device)

    def forward():
        return megamoe.moe(x, ids, weights, w13, w2, precision=args.precision)

    def forward_backward():
        forward().backward(dy)
        x.grad = weights.grad = None

    for fn in (forward, forward_backward):
        per_call_us(fn, args.calls, 1)  # warm-up
    if args.steps or args.timeline:
        recorded, report = (mark_steps(), report_timeline) if args.timeline else (time_steps(), report_steps)
        with torch.no_grad():
            report(forward, "no_grad forward", recorded, args)
        if args.timeline:
            report(forward, "forward recorded for autograd, no backward", recorded, args)
        report(forward_backward, "forward + backward", recorded, args)
        return
    what = "real calls on the GPU, no id-check wait" if args.gpu else "native calls stubbed out"
    print(f"{args.preset}, {args.tokens} tokens, {args.precision}, host time per call ({what}): "
          f"forward {per_call_us(forward, args.calls, args.rounds):.0f} µs, "
          f"forward + backward {per_call_us(forward_backward, args.calls, args.rounds):.0f} µs")


def report_steps(fn, label: str, spent: collections.Counter, args: argparse.Namespace) -> None:
    """Wall time per call of fn with the GPU, and each step's host time (spent: time_steps')."""
    calls = args.calls * args.rounds
    per_call_us(fn, args.calls, 1)  # warm-up, wrapped
    spent.clear()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / calls * 1e6
    steps = ", ".join(f"{name} {seconds / calls * 1e6:.1f}" for name, seconds in spent.most_common())
    print(f"{args.preset}, {args.tokens} tokens, {args.precision}, {label}: {wall:.0f} µs per call with "
          f"the GPU; host µs per call by step: {steps} (the rest: {wall - sum(spent.values()) / calls * 1e6:.0f})")


def report_timeline(fn, label: str, marks: list, args: argparse.Namespace) -> None:
    """For calls of fn timed one at a time (marks: mark_steps'), the median µs from a call's start at
    which each step starts and ends, and the call's total (with the GPU: until the device is done)."""
    timelines, totals = [], []
    for i in range(args.calls + 5):  # the first 5 warm up
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        marks.clear()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i >= 5:
            totals.append(time.perf_counter() - start)
            timelines.append([(name, t - start) for name, t in marks])
    names = [name for name, _ in timelines[0]]
    print(f"{args.preset}, {args.tokens} tokens, {args.precision}, {label}, calls one at a time "
          f"(µs from the call's start, medians of {len(timelines)}):")
    for i, name in enumerate(names):
        print(f"  {statistics.median(timeline[i][1] for timeline in timelines) * 1e6:8.1f}  {name}")
    print(f"  {statistics.median(totals) * 1e6:8.1f}  call done")


if __name__ == "__main__":
    main()
