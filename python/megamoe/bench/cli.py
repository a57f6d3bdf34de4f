"""Command line of `python -m megamoe.bench`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from megamoe.shapes import PRESETS, ROUTINGS
from megamoe.validation import PRECISIONS

from .backends import BACKENDS
from .peak import measure_peaks
from .plot import pyplot, write_chart
from .record import MODES, fill_derived
from .report import add_out_argument, build_result, print_table, write_json
from .runner import Plan, run_plan
from .timing import Budget, Device


# `--device cpu` is a smoke test of the harness (its times say nothing about the kernels): unless the
# command line says otherwise it runs the tiny preset on short budgets, about a minute in all.
CPU_DEFAULTS = {"preset": ["tiny"], "tokens": [64, 256], "skewed_tokens": [256], "warmup": 1,
                "warmup_seconds": 0.0, "budget": 0.1}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m megamoe.bench",
        description="Time MoE-layer backends on the same inputs; print a table and write JSON (and a PNG).",
        epilog="With --device cpu the defaults are a smoke run: " + ", ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in CPU_DEFAULTS.items()) + ".")
    parser.add_argument("--preset", nargs="+", choices=list(PRESETS), default=["qwen3-30b-a3b", "qwen3-235b-a22b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384, 65536])
    parser.add_argument("--routing", nargs="+", choices=ROUTINGS, default=["balanced"])
    parser.add_argument("--skewed-tokens", nargs="*", type=int, default=[16384], metavar="TOKENS",
                        help="of --tokens, those also measured with skewed routing (default: 16384; empty: none)")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                        help="default: all; those that cannot run here are recorded as skipped, with the reason")
    parser.add_argument("--precision", nargs="+", choices=PRECISIONS, default=["bf16"])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="fwd: forward under no_grad; fwdbwd: forward + y.backward(dy)")
    parser.add_argument("--main-grad", action="store_true",
                        help="give w13 and w2 fp32 main_grad buffers (the Megatron-LM convention): the fused "
                             "backward adds the weight gradients into them instead of writing a bf16 .grad; "
                             "the other backends ignore them")
    parser.add_argument("--ids", choices=("int32", "int64"), default="int32",
                        help="topk_ids' dtype (int64: as torch.topk gives them to MoELayer and most routers)")
    Budget.add_arguments(parser, warmup=5)
    add_out_argument(parser)
    parser.add_argument("--plot", action="store_true", help="also write a PNG chart next to the JSON")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu only for smoke tests: its times say nothing about the kernels")
    args = parser.parse_args(argv)
    if args.plot:  # before the measurements, not after them
        try:
            pyplot()
        except ImportError as error:
            parser.error(f"--plot: {error}")
    if args.device == "cpu":  # the same command line again, with the smoke run's defaults
        parser.set_defaults(**CPU_DEFAULTS)
        args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device; --device cpu runs a smoke test")
    if min(args.tokens) < 1 or args.warmup < 0 or args.repeat < 1 or args.warmup_seconds < 0:
        parser.error("--tokens and --repeat must be >= 1, --warmup and --warmup-seconds >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = Device(torch.device(args.device))
    budget = Budget.from_arguments(args)
    plan = Plan(presets=list(dict.fromkeys(args.preset)),
                tokens=list(dict.fromkeys(args.tokens)),
                routings=list(dict.fromkeys(args.routing)),
                backends=list(dict.fromkeys(args.backends)),
                precisions=list(dict.fromkeys(args.precision)),
                modes=[m for m in MODES if m in args.modes],  # fwd first, so fwdbwd's memory figure is kept
                budget=budget,
                skewed_tokens=list(dict.fromkeys(args.skewed_tokens)),
                main_grad=args.main_grad,
                id_dtype=getattr(torch, args.ids))

    peaks = measure_peaks(device, budget)
    records = run_plan(plan, device)
    fill_derived(records, peaks.bf16_tflops)
    settings = {"device": args.device, "warmup": args.warmup, "warmup_s": args.warmup_seconds, "repeat": args.repeat,
                "budget_s": args.budget, "main_grad": args.main_grad, "ids": args.ids}
    result = build_result(records, peaks, device.name(), argv, settings)
    paths = write_json(result, args.out)
    print_table(result)
    if args.plot:
        write_chart(result, [p.with_suffix(".png") for p in paths])
    print(f"wrote {', '.join(str(p) for p in paths)}" + (" (+ .png)" if args.plot else ""))
    return 0
