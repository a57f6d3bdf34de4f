"""`python -m megamoe.train.parity`: loss curves of several backends from the same initialisation and data.

Each backend trains a freshly built model (same seed, so the same weights) on the same batches, and its
curve is compared with the reference backend's (naive: transformers' eager loop over experts, bf16).
With --precision, each backend runs once per precision; a run in a precision other than bf16 is also
compared with the BF16 fused run (added when not asked for), by the same criteria. Backends that
cannot run here, or have no path at a precision, are recorded as skipped.

Tolerance. Backends compute the same math in bf16 and differ only in rounding (summation order), so:
- step 1 (same weights, same batch) must agree within STEP1_TOLERANCE, the bf16 bound the tests use (1e-2);
- after that, training amplifies last-bit differences chaotically: curves wander apart by the run-to-run
  noise of the training itself, not by an error. That noise is measured, not guessed: the reference
  trains --noise-runs more times, each from its initial weights changed by about one bf16 rounding
  (× (1 + 2^-9·N(0, 1)), a different draw each), and the widest mean relative gap between such a
  smoothed curve and the reference's is the noise floor (the gap is heavy-tailed: a run whose loss
  starts to fall a little later stays behind, so one sample can be 2-3× another). A backend passes when
  its own gap is at most FLOOR_FACTOR × the floor, and never needs to be below MIN_TOLERANCE. A wrong
  gradient or route shows as a gap that grows far beyond that floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Sequence

import torch

from megamoe.bench.report import add_out_argument
from megamoe.bench.timing import Device
from megamoe.validation import BACKENDS

from .cli import config_arguments
from .config import TRAINABLE_PRECISIONS, Config, ConfigError, backend_cannot_run, load_config
from .data import training_data
from .plot import write_if_plotting, write_parity_plot
from .results import environment, write_result
from .trainer import BACKEND_CANNOT_RUN, Trainer, resolve_device

DEFAULT_CONFIG = "configs/qwen3-30b-a3b-small.toml"
# 4096 tokens per step keeps 200 steps × 5 runs within about 6 minutes on one H200; --set overrides.
DEFAULT_OVERRIDES = ["train.seq_len=4096", "train.batch_size=1"]
STEP1_TOLERANCE = 1e-2
FLOOR_FACTOR = 2.0
MIN_TOLERANCE = 0.005
SMOOTHING = 10  # steps of the trailing mean the gaps are measured on
NOISE_RUNS = 2  # perturbed repeats of the reference (each costs one more run of the reference)
PERTURBED_SUFFIX = " (perturbed init {})"
PERTURBATION = 2.0**-9  # relative: about one bf16 rounding (8 mantissa bits)


BF16_BASELINE = "fused"  # what the runs in another precision are also compared with, in bf16


@dataclasses.dataclass
class Curve:
    name: str  # the backend ("<backend>/<precision>" other than bf16), or "<reference> (perturbed init i)"
    losses: list[float]
    skipped: str | None = None
    precision: str = "bf16"


def run_name(backend: str, precision: str) -> str:
    return backend if precision == "bf16" else f"{backend}/{precision}"


def runs(backends: Sequence[str], precisions: Sequence[str], reference: str) -> list[tuple[str, str]]:
    """(backend, precision) of every compared run: each backend at each precision, the reference in bf16
    left out, and the BF16 fused run added when another precision needs it as its baseline."""
    pairs = [(b, p) for p in precisions for b in backends if (b, p) != (reference, "bf16")]
    if any(p != "bf16" for _, p in pairs) and (BF16_BASELINE, "bf16") not in pairs and reference != BF16_BASELINE:
        pairs.insert(0, (BF16_BASELINE, "bf16"))
    return pairs


@torch.no_grad()
def perturb_weights(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        noise = torch.randn(p.shape, generator=generator).to(p.device)
        p.copy_(p.float() * (1 + PERTURBATION * noise))


def train_curve(config: Config, name: str, backend: str, perturbation: int = 0, precision: str = "bf16") -> Curve:
    """perturbation i > 0: the initial weights are perturbed with draw i (seed + i)."""
    why = backend_cannot_run(backend, precision)
    if why:
        return Curve(name, [], skipped=why, precision=precision)
    config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, backend=backend, precision=precision))
    trainer = Trainer(config)
    if perturbation:
        perturb_weights(trainer.model, config.train.seed + perturbation)
    corpus = training_data(config.data, config.model.vocab_size, config.train.seed)
    curve = Curve(name, [], precision=precision)
    print(f"{name}: {config.train.steps} steps", file=sys.stderr, flush=True)
    try:
        while trainer.step < config.train.steps:
            batch = corpus.batch(trainer.step, config.train.batch_size, config.train.seq_len)
            curve.losses.append(trainer.train_step(batch).lm_loss)
    except BACKEND_CANNOT_RUN as error:
        curve.skipped = f"{type(error).__name__}: {error}"
    device = Device(trainer.device)
    del trainer  # free the model and optimizer before the next backend builds its own
    device.release_cached_memory()
    return curve


def smooth(losses: Sequence[float], window: int = SMOOTHING) -> list[float]:
    """Trailing mean over `window` steps (fewer at the start)."""
    return [statistics.fmean(losses[max(0, i + 1 - window): i + 1]) for i in range(len(losses))]


def compare(curve: Curve, reference: Curve) -> dict:
    steps = min(len(curve.losses), len(reference.losses))
    a, b = curve.losses[:steps], reference.losses[:steps]
    gaps = [abs(x - y) / abs(y) for x, y in zip(smooth(a), smooth(b))]
    return {"backend": curve.name, "precision": curve.precision, "reference": reference.name, "steps": steps,
            "step1_rel_diff": abs(a[0] - b[0]) / abs(b[0]),
            "mean_smoothed_rel_gap": statistics.fmean(gaps), "max_smoothed_rel_gap": max(gaps),
            "max_abs_diff": max(abs(x - y) for x, y in zip(a, b)),
            "final_loss": statistics.fmean(a[-SMOOTHING:]),
            "final_loss_reference": statistics.fmean(b[-SMOOTHING:])}


def judge(comparison: dict, noise_floor: float, reference_steps: int) -> None:
    tolerance = max(FLOOR_FACTOR * noise_floor, MIN_TOLERANCE)
    comparison["tolerance"] = tolerance
    comparison["within_tolerance"] = (comparison["steps"] == reference_steps
                                      and comparison["step1_rel_diff"] <= STEP1_TOLERANCE
                                      and comparison["mean_smoothed_rel_gap"] <= tolerance)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m megamoe.train.parity",
                                     description=__doc__.split("\n\n")[0],
                                     epilog=f"defaults: {' '.join(DEFAULT_OVERRIDES)} (--set overrides them)")
    config_arguments(parser, DEFAULT_CONFIG)
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                        help="compared with the reference (default: all)")
    parser.add_argument("--reference", choices=BACKENDS, default="naive", help="runs in bf16 (default naive)")
    parser.add_argument("--precision", nargs="+", choices=TRAINABLE_PRECISIONS, default=None,
                        help="the compared runs' precision(s), a run each (default: the config's [moe].precision); "
                             f"fp8 and fp8_bwd run on backend fused and are also compared with the BF16 "
                             f"{BF16_BASELINE} run")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--noise-runs", type=int, default=NOISE_RUNS,
                        help=f"perturbed runs of the reference that measure the noise floor (default {NOISE_RUNS})")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2")
    if args.noise_runs < 1:
        parser.error("--noise-runs must be >= 1")
    try:
        config = load_config(args.config, DEFAULT_OVERRIDES + args.set + [f"train.steps={args.steps}"])
        precisions = list(dict.fromkeys(args.precision or [config.moe.precision]))
        reference = train_curve(config, args.reference, args.reference)
        if reference.skipped:
            parser.exit(1, f"the reference backend {args.reference} could not run: {reference.skipped}\n")
        noise_curves = [train_curve(config, args.reference + PERTURBED_SUFFIX.format(i), args.reference, i)
                        for i in range(1, args.noise_runs + 1)]
        for curve in noise_curves:
            if curve.skipped:
                parser.exit(1, f"{curve.name} could not run, so there is no noise floor: {curve.skipped}\n")
        backends = [train_curve(config, run_name(b, p), b, precision=p)
                    for b, p in runs(args.backends, precisions, args.reference)]
    except ConfigError as error:
        parser.error(str(error))
    curves = [reference, *noise_curves, *backends]

    noise_runs = [compare(c, reference) for c in noise_curves]
    noise = max(noise_runs, key=lambda n: n["mean_smoothed_rel_gap"])
    comparisons = [compare(c, reference) for c in backends if not c.skipped]
    bf16_baseline = next((c for c in backends if c.name == BF16_BASELINE and not c.skipped), None)
    if bf16_baseline is not None:  # (when fused is the reference, the comparisons above are these)
        comparisons += [compare(c, bf16_baseline) for c in backends if c.precision != "bf16" and not c.skipped]
    for comparison in comparisons:
        judge(comparison, noise["mean_smoothed_rel_gap"], len(reference.losses))
    result = {**environment(resolve_device(config), "megamoe.train.parity", argv), "config": config.to_dict(),
              "precisions": precisions,
              "criteria": {"step1_tolerance": STEP1_TOLERANCE, "floor_factor": FLOOR_FACTOR,
                           "min_tolerance": MIN_TOLERANCE, "smoothing": SMOOTHING, "perturbation": PERTURBATION},
              "noise_floor": noise, "noise_runs": noise_runs, "comparisons": comparisons,
              "curves": [dataclasses.asdict(c) for c in curves]}
    path = write_result(result, args.out, "train_parity")
    plotted = write_if_plotting(write_parity_plot, path.with_suffix(".png"),
                                {c.name: c.losses for c in curves if c.losses}, reference.name,
                                title=f"Qwen3-MoE loss parity, "
                                      f"{config.train.batch_size}×{config.train.seq_len} tokens/step")

    gaps = ", ".join(f"{n['mean_smoothed_rel_gap']:.2%}" for n in noise_runs)
    print(f"noise floor ({args.reference} from {len(noise_runs)} perturbed inits vs {reference.name}): widest mean "
          f"smoothed gap {noise['mean_smoothed_rel_gap']:.2%} (each: {gaps})")
    for c in backends:
        if c.skipped:
            print(f"{c.name}: skipped ({c.skipped[:120]})")
    for c in comparisons:
        print(f"{c['backend']} vs {c['reference']}: step-1 rel diff {c['step1_rel_diff']:.1e}, mean smoothed gap "
              f"{c['mean_smoothed_rel_gap']:.2%} (tolerance {c['tolerance']:.2%}): "
              f"{'PASS' if c['within_tolerance'] else 'FAIL'}")
    print(f"wrote {path}" + (f" and {path.with_suffix('.png')}" if plotted else ""))
    return 0 if all(c["within_tolerance"] for c in comparisons) else 1


if __name__ == "__main__":
    sys.exit(main())
