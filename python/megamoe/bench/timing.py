"""Timing and memory measurement: CUDA events on a GPU, perf_counter on the CPU."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import platform
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

# Slow backends get fewer repeats (see Budget.seconds), but never fewer than this: a median of
# one or two samples is too easily thrown by a single hiccup.
MIN_REPEATS = 3
# The benchmarks' defaults, the sustained case (Budget.warmup_seconds): warm up at least this long,
# then fill about this long with timed iterations; the cap on their number is not what ends them.
SUSTAINED_WARMUP_S = 1.0
SUSTAINED_BUDGET_S = 2.0
REPEAT_CAP = 10000
# After the timed iterations, up to this many calls are timed one at a time (single_call_ms): the
# device synchronised before and after each, the wall clock from the call to the finished work, host
# and launches included, the GPU still warm from the sustained run.
SINGLE_CALLS = 10
# A GPU that was idle before (a process's first measurement) stays below its power limit for the
# first seconds of load: on the H200 the first figure of a process ran at ~510 W and 2.45 ms where the
# same call right after ran at 692 W and 2.52 ms (docs/PERFORMANCE.md, sustained timing).
# A device's first sustained warm-up therefore lasts at least this long.
FIRST_LOAD_WARMUP_S = 4.0


@dataclasses.dataclass(frozen=True)
class Budget:
    warmup: int  # warm-up iterations (at least 2 if any; a slow backend stops there once `seconds` is spent)
    repeat: int  # timed iterations (at most)
    seconds: float  # rough wall-clock allowance per measurement; bounds the repeats of slow backends
    # Warm up for at least this long. Under a sustained load a warm H200 reaches its 700 W limit within
    # about half a second and lowers its clock (1.98 GHz -> 1.4-1.5 GHz under the fused GEMMs); a
    # measurement of a few dozen iterations right after a pause times the boost clock instead. After
    # a long idle it takes longer (FIRST_LOAD_WARMUP_S).
    warmup_seconds: float = 0.0

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, warmup: int) -> None:
        """--warmup, --warmup-seconds, --repeat and --budget, defaulting to the sustained case."""
        parser.add_argument("--warmup", type=int, default=warmup, help="warm-up iterations, at least")
        parser.add_argument("--warmup-seconds", type=float, default=SUSTAINED_WARMUP_S, metavar="SECONDS",
                            help="and at least this long, so the GPU runs at its sustained (power-limited) clock")
        parser.add_argument("--repeat", type=int, default=REPEAT_CAP, help="timed iterations, at most")
        parser.add_argument("--budget", type=float, default=SUSTAINED_BUDGET_S, metavar="SECONDS",
                            help="rough time per measurement: the repeats fill it (at least 3)")

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> Budget:
        return cls(warmup=args.warmup, repeat=args.repeat, seconds=args.budget, warmup_seconds=args.warmup_seconds)


@dataclasses.dataclass(frozen=True)
class Measurement:
    median_ms: float
    repeats: int
    peak_extra_bytes: int | None  # device memory allocated on top of what was live before; None on CPU
    sm_clock_mhz: float | None = None  # mean over the timed iterations (ClockSampler)
    power_w: float | None = None
    single_call_ms: float | None = None  # median of the calls timed one at a time (SINGLE_CALLS)


class Device:
    """The few device operations the benchmark needs, with CPU stand-ins.

    CPU ops run synchronously, so perf_counter marks bracket exactly the work and synchronize is a no-op.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"
        # The next sustained warm-up's minimum (FIRST_LOAD_WARMUP_S until the first one ran).
        self.settle_seconds = FIRST_LOAD_WARMUP_S if self.is_cuda else 0.0

    def sustained_warmup_seconds(self, requested: float) -> float:
        """How long to warm up now: `requested` (0: no warm-up by time), or longer on the device's
        first sustained warm-up (settle_seconds)."""
        if requested <= 0:
            return requested
        seconds, self.settle_seconds = max(requested, self.settle_seconds), 0.0
        return seconds

    def name(self) -> str:
        if self.is_cuda:
            return torch.cuda.get_device_name(self.device)
        return f"cpu ({platform.processor() or platform.machine()})"

    def mark(self):
        if self.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed_ms(self, start, end) -> float:
        """Time between two marks; call after synchronize()."""
        return start.elapsed_time(end) if self.is_cuda else (end - start) * 1e3

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def start_peak_tracking(self) -> int | None:
        """Reset the peak counter; returns the bytes allocated now (the baseline)."""
        if not self.is_cuda:
            return None
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak_bytes_since(self, baseline: int | None) -> int | None:
        if baseline is None:
            return None
        return torch.cuda.max_memory_allocated(self.device) - baseline

    def release_cached_memory(self) -> None:
        """After an out-of-memory error: drop dead tensors and hand cached blocks back."""
        gc.collect()
        if self.is_cuda:
            torch.cuda.empty_cache()


class ClockSampler:
    """The GPU's mean SM clock (MHz) and board power (W) over a region, from nvidia-smi sampling every
    100 ms. Under the power limit the clock sets much of a kernel's time, so each measurement records
    the clock it ran at. None without a GPU or nvidia-smi, or for a region shorter than nvidia-smi's
    start-up (no sample)."""

    def __init__(self, device: Device):
        self._command, self._process = None, None
        self.sm_clock_mhz = self.power_w = None
        uuid = getattr(torch.cuda.get_device_properties(device.device), "uuid", None) if device.is_cuda else None
        if uuid is not None and shutil.which("nvidia-smi"):
            self._command = ["nvidia-smi", "-i", f"GPU-{uuid}", "--query-gpu=clocks.sm,power.draw",
                             "--format=csv,noheader,nounits", "-lms", "100"]

    def __enter__(self) -> ClockSampler:
        if self._command is not None:
            try:
                self._process = subprocess.Popen(self._command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                                 text=True)
            except OSError:  # nvidia-smi there but not runnable: no clock for this figure
                self._process = None
        return self

    def __exit__(self, *exc) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            out, _ = self._process.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a hung nvidia-smi costs the figure its clock, not the run
            self._process.kill()
            self._process.communicate()
            return
        self.sm_clock_mhz, self.power_w = mean_clock_and_power(out)


def mean_clock_and_power(samples: str) -> tuple[float | None, float | None]:
    """Means of nvidia-smi's "clock, power" lines; lines that are not two numbers ("[N/A]", a line
    cut off by the stop) are left out."""
    pairs = []
    for line in samples.splitlines():
        try:
            values = tuple(float(v) for v in line.split(","))
        except ValueError:
            continue
        if len(values) == 2:
            pairs.append(values)
    if not pairs:
        return None, None
    return statistics.mean(c for c, _ in pairs), statistics.mean(p for _, p in pairs)


def measure(run: Callable[[int], None], reset: Callable[[], None], device: Device,
            budget: Budget) -> Measurement:
    """Median time of run(i) over the timed iterations, after warm-up.

    reset() runs before every iteration, outside the timed region (e.g. to drop gradients).
    Iterations are enqueued back to back without synchronising, so a launch-bound backend is
    charged for its launch gaps and a GPU-bound one for its kernels only.
    """
    warmup_s = device.sustained_warmup_seconds(budget.warmup_seconds)
    # The first warm-up may include compilation or autotuning, with the GPU idle: the time that
    # warms the GPU up (loaded_s) starts after it.
    loaded_s, last_s, i = 0.0, None, 0
    while i < budget.warmup or loaded_s < warmup_s:
        reset()
        start = time.perf_counter()
        run(i)
        device.synchronize()
        last_s = time.perf_counter() - start
        loaded_s += last_s if i > 0 else 0.0
        i += 1
        # A slow backend (fewer than MIN_REPEATS calls per `seconds`) stops after two warm-ups.
        if i >= 2 and last_s * MIN_REPEATS > budget.seconds:
            break
    repeats = budget.repeat
    if last_s is not None:
        repeats = min(budget.repeat, max(MIN_REPEATS, int(budget.seconds / last_s)))

    reset()
    baseline = device.start_peak_tracking()
    marks = []
    with ClockSampler(device) as clocks:
        for i in range(repeats):
            reset()
            start = device.mark()
            run(i)
            marks.append((start, device.mark()))
        device.synchronize()
    peak_extra = device.peak_bytes_since(baseline)
    median_ms = statistics.median(device.elapsed_ms(start, end) for start, end in marks)
    single = []
    for i in range(min(SINGLE_CALLS, repeats)):  # a slow backend: as many as its timed iterations
        reset()
        device.synchronize()
        start = time.perf_counter()
        run(i)
        device.synchronize()
        single.append((time.perf_counter() - start) * 1e3)
    reset()
    return Measurement(median_ms, repeats, peak_extra, clocks.sm_clock_mhz, clocks.power_w,
                       statistics.median(single) if single else None)
