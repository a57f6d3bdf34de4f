"""One result row of the JSON contract, and the figures derived from its times."""

from __future__ import annotations

import dataclasses

from megamoe.shapes import PRESETS

MODES = ("fwd", "fwdbwd")
# Backward is 12·H·I per route against the forward's 6·H·I (docs/DESIGN.md): fwd + bwd = 3× forward.
FLOP_FACTOR = {"fwd": 1, "fwdbwd": 3}
BASELINE = "grouped"
FP8_BASELINE = "grouped-fp8"  # grouped with FP8 GEMMs (TorchTitan's FP8 path): the baseline at fp8


@dataclasses.dataclass
class Record:
    # Key: one record per (preset, tokens, routing, backend, precision).
    preset: str
    tokens: int
    routing: str
    backend: str
    precision: str
    # Median times; None when the mode was not requested or could not run.
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None
    # GB (1e9 bytes) at the peak of an iteration: the operands (one input set, plus dy for fwdbwd) and
    # everything the backend allocates on top. From the fwdbwd run, or fwd when only fwd ran. GPU only.
    peak_mem_gb: float | None = None
    # GB autograd keeps between forward and backward (saved tensors; the weights, which exist
    # anyway, excluded). None when fwdbwd did not run or the backend hides its saved tensors.
    saved_gb: float | None = None
    routes: int = 0  # non-masked (token, expert) routes
    fwd_repeats: int | None = None
    fwdbwd_repeats: int | None = None
    # Mean SM clock (MHz) and board power (W) over the timed iterations; None without nvidia-smi.
    fwd_sm_mhz: float | None = None
    fwdbwd_sm_mhz: float | None = None
    fwd_power_w: float | None = None
    fwdbwd_power_w: float | None = None
    # One call on its own (timing.SINGLE_CALLS): host, launches and GPU from the call to the finished
    # work, the GPU warm; what a call costs when nothing is queued ahead of it to hide its start.
    fwd_single_ms: float | None = None
    fwdbwd_single_ms: float | None = None
    skipped: str | None = None  # why a requested mode has no time ("fwdbwd: ..." when only one failed)
    # Derived (fill_derived).
    fwd_tflops: float | None = None
    fwdbwd_tflops: float | None = None
    fwd_pct_bf16_peak: float | None = None
    fwdbwd_pct_bf16_peak: float | None = None
    fwd_vs_grouped: float | None = None  # baseline time / this time: > 1 means faster than the baseline
    fwdbwd_vs_grouped: float | None = None
    grouped_baseline: str | None = None  # the record the ratios use, e.g. "grouped/bf16", "grouped-fp8/fp8"

    def ms(self, mode: str) -> float | None:
        return getattr(self, f"{mode}_ms")


def fill_derived(records: list[Record], peak_bf16_tflops: float) -> None:
    """TFLOPS, % of the measured dense bf16 peak, and the speed ratio to `grouped`.

    The ratio compares against `grouped` at the same precision where it ran, else `grouped-fp8` at that
    precision (fused fp8 against TorchTitan's FP8 path), else `grouped` in bf16.
    """
    grouped = {(r.backend, r.preset, r.tokens, r.routing, r.precision): r for r in records
               if r.backend in (BASELINE, FP8_BASELINE)}
    for r in records:
        shape = PRESETS[r.preset]
        base = _baseline(grouped, r)
        if base is not None:
            r.grouped_baseline = f"{base.backend}/{base.precision}"
        for mode in MODES:
            ms = r.ms(mode)
            if ms is None:
                continue
            tflops = shape.flops_forward(r.routes) * FLOP_FACTOR[mode] / (ms * 1e-3) / 1e12
            setattr(r, f"{mode}_tflops", tflops)
            setattr(r, f"{mode}_pct_bf16_peak", 100 * tflops / peak_bf16_tflops)
            if base is not None and base.ms(mode) is not None:
                setattr(r, f"{mode}_vs_grouped", base.ms(mode) / ms)


def _baseline(grouped: dict, r: Record) -> Record | None:
    for backend, precision in ((BASELINE, r.precision), (FP8_BASELINE, r.precision), (BASELINE, "bf16")):
        base = grouped.get((backend, r.preset, r.tokens, r.routing, precision))
        if base is not None and (base.fwd_ms is not None or base.fwdbwd_ms is not None):
            return base
    return None
