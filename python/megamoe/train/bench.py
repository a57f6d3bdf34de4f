"""`python -m megamoe.train.bench`: training-step time and tokens/s of each backend on one model.

One model (the config's, by default Qwen3-30B-A3B sizes with 4 layers on 16384-token sequences) is
built once and re-patched per backend and precision (--precision: one row each; a backend that has no
path at a precision is recorded as skipped); each gets warm-up steps (at least --warmup of them and
--warmup-seconds of time, so the GPU runs at its sustained, power-limited clock), then timed full
training steps (forward, backward, AdamW). A backend that cannot run (NotImplementedError, out of memory) is
recorded as skipped, with the reason, and the others still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

from megamoe.bench.profile import gpu_events, idle_gaps, kernel_times, short_name
from megamoe.bench.report import add_out_argument
from megamoe.bench.timing import SUSTAINED_WARMUP_S, Device
from megamoe.hf import patch_hf_model
from megamoe.validation import BACKENDS

from .cli import config_arguments
from .config import TRAINABLE_PRECISIONS, Config, ConfigError, backend_cannot_run, load_config
from .data import Corpus, training_data
from .results import environment, write_result
from .trainer import BACKEND_CANNOT_RUN, Trainer, resolve_device

DEFAULT_CONFIG = "configs/qwen3-30b-a3b-small.toml"
PROFILED_KERNELS = 25  # --profile: the longest kernels of a step kept in the record


@dataclasses.dataclass
class BenchRecord:
    backend: str
    precision: str
    skipped: str | None = None  # why this backend has no time
    step_ms: float | None = None  # median over the timed steps
    step_ms_min: float | None = None
    tokens_per_s: float | None = None
    vs_grouped: float | None = None  # grouped's (bf16) step time / this one's: > 1 is faster than grouped
    peak_mem_gb: float | None = None  # device memory at the peak of a step (GPU only)
    warmup_steps: int | None = None  # untimed steps run: --warmup at least, and --warmup-seconds of them
    profile: dict | None = None  # with --profile: one more step's GPU time, kernel by kernel (GPU only)
    losses: list[float] = dataclasses.field(default_factory=list)  # warm-up and timed steps


def time_steps(record: BenchRecord, step: Callable[[int], float], tokens: int, warmup: int, warmup_seconds: float,
               steps: int, device: Device) -> None:
    """Runs step(i), one training step that returns its loss once the step has finished, at least `warmup`
    times and for warmup_seconds (device.sustained_warmup_seconds), then `steps` timed times; fills
    record's losses, warmup_steps, step times, tokens/s (`tokens` per step) and, on a GPU, the peak
    memory over the timed steps. An exception of a step propagates."""
    warmup_s = device.sustained_warmup_seconds(warmup_seconds)
    times = []

    def run(i: int) -> None:
        start = time.perf_counter()
        record.losses.append(step(i))
        times.append(time.perf_counter() - start)

    while len(times) < warmup or sum(times[1:]) < warmup_s:  # the first step may include set-up
        run(len(times))
    record.warmup_steps = len(times)
    if device.is_cuda:
        torch.cuda.reset_peak_memory_stats(device.device)
    for _ in range(steps):
        run(len(times))
    timed = times[record.warmup_steps:]
    record.step_ms = 1e3 * statistics.median(timed)
    record.step_ms_min = 1e3 * min(timed)
    record.tokens_per_s = tokens / statistics.median(timed)
    if device.is_cuda:
        record.peak_mem_gb = torch.cuda.max_memory_allocated(device.device) / 1e9


def profile_step(step: Callable[[int], float]) -> dict:
    """Two more steps under torch.profiler, the second one's GPU time kernel by kernel (the
    PROFILED_KERNELS longest, µs summed over their launches), the kernels' total and the GPU's idle
    time between kernels (the first step's events are dropped, as megamoe.bench.profile drops them)."""
    events = gpu_events(lambda: step(0), 1)
    times = sorted(kernel_times(events, 1).items(), key=lambda item: -item[1][0])
    return {"kernel_ms": sum(us for _, (us, _) in times) / 1e3,
            "idle_ms": sum(idle_gaps(events, 1).values()) / 1e3,
            "kernels": [{"name": short_name(name), "us": us, "launches": count}
                        for name, (us, count) in times[:PROFILED_KERNELS]]}


def bench_backend(trainer: Trainer, corpus: Corpus, backend: str, warmup: int, warmup_seconds: float,
                  steps: int, device: Device, precision: str | None = None, profile: bool = False) -> BenchRecord:
    """precision None: the config's; profile: also profile_step."""
    config = trainer.config
    record = BenchRecord(backend, precision or config.moe.precision)
    record.skipped = backend_cannot_run(backend, record.precision)
    if record.skipped:
        return record
    patch_hf_model(trainer.model, backend=backend, precision=record.precision)

    def step(_: int) -> float:
        input_ids = corpus.batch(trainer.step, config.train.batch_size, config.train.seq_len)
        return trainer.train_step(input_ids).lm_loss  # ends in a host sync

    try:
        time_steps(record, step, config.train.batch_size * config.train.seq_len, warmup, warmup_seconds, steps,
                   device)
        if profile and device.is_cuda:
            record.profile = profile_step(step)
    except BACKEND_CANNOT_RUN as error:
        record.skipped = f"{type(error).__name__}: {error}"
        trainer.optimizer.zero_grad(set_to_none=True)  # drop what the failed step left behind
        device.release_cached_memory()
    return record


def run_bench(config: Config, backends: Sequence[str], warmup: int, warmup_seconds: float,
              steps: int, precisions: Sequence[str] | None = None, profile: bool = False) -> list[BenchRecord]:
    """One record per precision (None: the config's) and backend, in that order."""
    trainer = Trainer(config)
    corpus = training_data(config.data, config.model.vocab_size, config.train.seed)
    device = Device(trainer.device)
    records = []
    for precision in precisions or [config.moe.precision]:
        for backend in backends:
            print(f"{backend}/{precision}: >= {warmup} warm-up steps and {warmup_seconds:g} s, {steps} timed steps",
                  file=sys.stderr, flush=True)
            records.append(bench_backend(trainer, corpus, backend, warmup, warmup_seconds, steps, device, precision,
                                         profile))
    grouped = next((r for r in records if r.backend == "grouped" and r.precision == "bf16" and r.step_ms), None)
    for r in records:
        if grouped and r.step_ms:
            r.vs_grouped = grouped.step_ms / r.step_ms
    return records


def print_table(records: Sequence[BenchRecord], tokens: int) -> None:
    print(f"{'backend':<10}{'prec':<9}{'step ms':>10}{'tokens/s':>12}{'x grouped':>11}{'mem GB':>8}  "
          f"(tokens per step: {tokens})")
    for r in records:
        if r.skipped:
            print(f"{r.backend:<10}{r.precision:<9}skipped: {r.skipped[:100]}")
            continue
        mem = f"{r.peak_mem_gb:.1f}" if r.peak_mem_gb is not None else "-"
        ratio = f"{r.vs_grouped:.2f}" if r.vs_grouped is not None else "-"
        print(f"{r.backend:<10}{r.precision:<9}{r.step_ms:>10.1f}{r.tokens_per_s:>12,.0f}{ratio:>11}{mem:>8}")
        if r.profile:
            print(f"    {r.profile['kernel_ms']:.1f} ms of kernels, {r.profile['idle_ms']:.1f} ms idle; the longest:")
            for k in r.profile["kernels"][:8]:
                print(f"    {k['us'] / 1e3:8.2f} ms  {k['launches']:4d}x  {k['name'][:80]}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m megamoe.train.bench", description=__doc__.split("\n\n")[0])
    config_arguments(parser, DEFAULT_CONFIG)
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per backend, at least (default 3)")
    parser.add_argument("--warmup-seconds", type=float, default=SUSTAINED_WARMUP_S, metavar="SECONDS",
                        help="and at least this long (4 s for the first backend), so the GPU runs at its sustained "
                             "(power-limited) clock")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per backend (default 10)")
    parser.add_argument("--precision", nargs="+", choices=TRAINABLE_PRECISIONS, default=None,
                        help="the experts' precision(s), a row each (default: the config's [moe].precision); "
                             "fp8 and fp8_bwd run on backend fused")
    parser.add_argument("--profile", action="store_true",
                        help=f"after the timed steps, profile one more (GPU): its {PROFILED_KERNELS} longest kernels "
                             "into the record and the table")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.steps < 1:
        parser.error("--warmup must be >= 0 and --steps >= 1")
    try:
        # The learning-rate schedule spans the counted steps; a warm-up that runs longer by time
        # continues at the schedule's final rate (the step time does not depend on it).
        precisions = list(dict.fromkeys(args.precision)) if args.precision else None
        total_steps = len(args.backends) * len(precisions or [None]) * (args.warmup + args.steps + 2 * args.profile)
        config = load_config(args.config, args.set + [f"train.steps={total_steps}"])
        records = run_bench(config, args.backends, args.warmup, args.warmup_seconds, args.steps, precisions,
                            args.profile)
    except ConfigError as error:
        parser.error(str(error))
    tokens = config.train.batch_size * config.train.seq_len
    result = {**environment(resolve_device(config), "megamoe.train.bench", argv),
              "config": config.to_dict(), "tokens_per_step": tokens, "warmup": args.warmup,
              "warmup_s": args.warmup_seconds, "steps": args.steps, "records": [dataclasses.asdict(r) for r in records]}
    path = write_result(result, args.out, "train")
    print_table(records, tokens)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
