"""Sustained fwd / fwd+bwd times of `megamoe.moe` from whichever megamoe package is on PYTHONPATH,
timed with this tree's python/megamoe/bench/timing.py (its warm-up seconds, timed seconds, clock and
power sampling).

For A/B of revisions whose own `megamoe.bench` predates sustained timing (ab_libraries.sh with
AB_MODULE=time_moe): only `megamoe.moe` and `megamoe.shapes` of the revision are used, and they have
kept their signatures; --recompute and --activation are passed to `megamoe.moe` only when given (a
revision's own default otherwise), so one revision's default can be timed against another's option.
The timing options (--warmup, --warmup-seconds, --repeat, --budget) are the benchmarks'. Prints one
JSON line per (preset, mode) and writes them to --out/time_moe.jsonl.
"""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

import megamoe
from megamoe.shapes import PRESETS, make_inputs


# --recompute's words, megamoe.bench.ep's: not imported from there, since only megamoe.moe and
# megamoe.shapes of the timed revision may be used.
RECOMPUTE = {"false": False, "true": True, "gather": "gather"}


def load_timing():
    path = Path(__file__).resolve().parents[2] / "python" / "megamoe" / "bench" / "timing.py"
    spec = importlib.util.spec_from_file_location("this_tree_timing", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    timing = load_timing()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--preset", nargs="+", default=["qwen3-30b-a3b", "qwen3-235b-a22b"])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--recompute", choices=["false", "true", "gather"],
                        help="megamoe.moe's recompute (default: the revision's own default)")
    parser.add_argument("--activation", help="megamoe.moe's activation (default: the revision's own default)")
    timing.Budget.add_arguments(parser, warmup=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = timing.Device(torch.device("cuda", 0))
    budget = timing.Budget.from_arguments(args)
    args.out.mkdir(parents=True, exist_ok=True)
    options = {} if args.recompute is None else {"recompute": RECOMPUTE[args.recompute]}
    options |= {} if args.activation is None else {"activation": args.activation}
    with open(args.out / "time_moe.jsonl", "a") as log:
        for preset in args.preset:
            for mode, m in time_preset(timing, device, budget, PRESETS[preset], args.tokens, options):
                line = json.dumps({"label": args.label, "preset": preset, "tokens": args.tokens, "mode": mode,
                                   "recompute": args.recompute or "default",
                                   "activation": args.activation or "default",
                                   "ms": round(m.median_ms, 4), "repeats": m.repeats, "sm_mhz": m.sm_clock_mhz,
                                   "power_w": m.power_w})
                print(line, flush=True)
                log.write(line + "\n")
            torch.cuda.empty_cache()


def time_preset(timing, device, budget, shape, tokens: int, options: dict):
    """(mode, Measurement) of the no-grad forward and of forward + backward, balanced routing."""
    x, ids, weights, w13, w2 = make_inputs(shape, tokens, device="cuda")
    params = [t.requires_grad_() for t in (x, weights, w13, w2)]
    dy = torch.randn_like(x)

    def reset():
        for p in params:
            p.grad = None

    def forward(_):
        with torch.no_grad():
            megamoe.moe(params[0], ids, *params[1:], **options)

    def forward_backward(_):
        megamoe.moe(params[0], ids, *params[1:], **options).backward(dy)

    return [(mode, timing.measure(run, reset, device, budget))
            for mode, run in (("fwd", forward), ("fwdbwd", forward_backward))]


if __name__ == "__main__":
    main()
