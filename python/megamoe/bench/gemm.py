"""GEMM mode: the core's persistent grouped GEMM against torch._grouped_mm, alone, on the MoE
layer's two GEMM shapes over the same expert-major pool (each expert padded to 128 rows).

    python -m megamoe.bench.gemm [--preset ...] [--tokens ...] [--routing ...] [--out DIR]

TFLOPS count the real routed rows only (2·N·K per route), so padding is charged to the kernel.
`megamoe-fp8` is the block-FP8 kernel on the same operands quantised beforehand (megamoe.fp8, not
timed); its rel.err is against torch._grouped_mm on the dequantised operands (the kernel's own
error), and `quantization_error` against the bf16 result.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from megamoe import fp8
from megamoe.gemm import grouped_gemm, grouped_gemm_fp8
from megamoe.reference import relative_error
from megamoe.routing import build_routing
from megamoe.shapes import PRESETS, ROUTINGS, make_routing

from .report import add_out_argument, provenance
from .timing import Budget, Device, measure


def gemm_problems(preset: str) -> dict[str, tuple[int, int]]:
    """(N, K) of GEMM1 (x · w13ᵀ) and GEMM2 (h · w2ᵀ)."""
    s = PRESETS[preset]
    return {"gemm1": (2 * s.intermediate_size, s.hidden_size),
            "gemm2": (s.hidden_size, s.intermediate_size)}


def bench_one(preset: str, tokens: int, routing: str, device: Device, budget: Budget) -> list[dict]:
    shape = PRESETS[preset]
    g = torch.Generator().manual_seed(0)
    ids, _ = make_routing(tokens, shape.num_experts, shape.top_k, routing, generator=g)
    plan = build_routing(ids.cuda(), shape.num_experts)
    rows = plan.pool_rows
    routes = int((ids >= 0).sum())
    group_ends = plan.expert_offsets[1:]
    live_rows = int(plan.expert_offsets[-1])
    records = []
    for name, (n, k) in gemm_problems(preset).items():
        a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        b = (torch.randn(shape.num_experts, n, k, device="cuda") / k**0.5).to(torch.bfloat16)
        theirs = torch._grouped_mm(a, b.transpose(-2, -1), offs=group_ends)[:live_rows]
        (aq, a_scales), (bq, b_scales) = fp8.quantize_rows(a), fp8.quantize_blocks(b)
        dequantized = torch._grouped_mm(fp8.dequantize_rows(aq, a_scales).to(torch.bfloat16),
                                        fp8.dequantize_blocks(bq, b_scales).to(torch.bfloat16).transpose(-2, -1),
                                        offs=group_ends)[:live_rows]
        ours_fp8 = grouped_gemm_fp8(aq, a_scales, bq, b_scales, plan)[:live_rows]
        bf16_error = relative_error(grouped_gemm(a, b, plan)[:live_rows], theirs)
        errors = {"megamoe": bf16_error, "torch._grouped_mm": bf16_error,
                  "megamoe-fp8": relative_error(ours_fp8, dequantized)}
        flops = 2 * n * k * routes
        for backend, fn in (("megamoe", lambda i: grouped_gemm(a, b, plan)),
                            ("megamoe-fp8", lambda i: grouped_gemm_fp8(aq, a_scales, bq, b_scales, plan)),
                            ("torch._grouped_mm", lambda i: torch._grouped_mm(
                                a, b.transpose(-2, -1), offs=group_ends))):
            m = measure(fn, lambda: None, device, budget)
            record = {"preset": preset, "tokens": tokens, "routing": routing, "gemm": name,
                      "n": n, "k": k, "routes": routes, "pool_rows": live_rows,
                      "backend": backend, "ms": m.median_ms,
                      "tflops": flops / (m.median_ms * 1e-3) / 1e12,
                      "sm_mhz": m.sm_clock_mhz, "power_w": m.power_w,
                      "rel_error_vs_torch": errors[backend]}
            if backend == "megamoe-fp8":
                record["quantization_error"] = relative_error(ours_fp8, theirs)
            records.append(record)
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megamoe.bench.gemm", description=__doc__)
    parser.add_argument("--preset", nargs="+", choices=list(PRESETS), default=["qwen3-30b-a3b", "qwen3-235b-a22b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[16384])
    parser.add_argument("--routing", nargs="+", choices=ROUTINGS, default=["balanced", "skewed"])
    Budget.add_arguments(parser, warmup=5)
    add_out_argument(parser)
    args = parser.parse_args(argv)
    device = Device(torch.device("cuda"))
    budget = Budget.from_arguments(args)
    records = [r for p in args.preset for t in args.tokens for rt in args.routing
               for r in bench_one(p, t, rt, device, budget)]
    result = {**provenance(device.name(), "megamoe.bench.gemm", argv), "records": records}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gemm_latest.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'preset':16} {'tokens':>6} {'routing':9} {'gemm':6} {'backend':18} {'ms':>8} {'TFLOPS':>7} "
          f"{'MHz':>5} {'rel.err':>8}")
    for r in records:
        mhz = "-" if r["sm_mhz"] is None else f"{r['sm_mhz']:.0f}"
        print(f"{r['preset']:16} {r['tokens']:>6} {r['routing']:9} {r['gemm']:6} {r['backend']:18} "
              f"{r['ms']:8.3f} {r['tflops']:7.1f} {mhz:>5} {r['rel_error_vs_torch']:8.1e}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
