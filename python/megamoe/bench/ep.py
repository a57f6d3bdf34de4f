"""Expert-parallel mode: the fused layer over a process group of W ranks against the same layer on
one GPU and against the TorchTitan-style all-to-all path over the same group
(megamoe/backends/all_to_all.py: all-to-all dispatch, grouped GEMMs, all-to-all combine), for one
global batch of tokens.

    python -m megamoe.bench.ep [--preset ...] [--tokens ...] [--world W] [--one-gpu] [--out DIR]

W processes are started, one per GPU (NCCL group) or, with --one-gpu, all on GPU 0 (gloo group:
a check of the path, not a speed figure, since the processes take turns on the GPU). Each rank
routes tokens / W tokens over all E experts and holds E / W of them. Every rank makes the same calls
(they are collective): the ranks time a few iterations, agree on the slowest rank's time, and from it
on the numbers of warm-up and timed iterations that fill --warmup-seconds and --budget, so the layer
is timed sustained, as in `python -m megamoe.bench`. A layer's time is the slowest rank's median.
Rank 0 first times the single-GPU fused layer on the whole batch with the same routing (sustained).
Every rank also times its share of the work without the exchange (`local_*`): the fused layer on its
own GPU over the whole batch with only the routes to its own experts kept (the rest masked), the same
rows through the same GEMMs as its part of the group's layer. The group's time minus that is the
communication the layer does not hide (`exposed_*`, a share of the group's time).
Each layer also reports what one forward keeps for its backward (`saved_gb`, the largest rank's
and `one_gpu_saved_gb`), for each --precision and --recompute of the fused layer (the all-to-all path
computes in bf16 and keeps what autograd saves, whatever those say).
The all-to-all path needs a backend whose all-to-all takes the tensors' device (NCCL on GPUs); where
it cannot run (gloo with GPU tensors, --one-gpu), the record says why.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import megamoe
from megamoe.backends.all_to_all import all_to_all_moe
from megamoe.shapes import PRESETS, ROUTINGS, make_routing
from megamoe.validation import FUSED_PRECISIONS

from .report import add_out_argument, provenance
from .runner import Operands, saved_for_backward_gb
from .timing import MIN_REPEATS, Budget, Device, measure

_FIXED = 1e9  # Budget.seconds that never cuts warm-up or repeats short: every rank makes the same calls
_PROBE = Budget(warmup=2, repeat=3, seconds=_FIXED)
RECOMPUTE = {"false": False, "gather": "gather", "true": True}  # --recompute's words: megamoe.moe's values


def _problem(shape, tokens: int, routing: str, device: torch.device):
    """The whole batch and layer, the same in every process (seeded generators)."""
    ids, weights = make_routing(tokens, shape.num_experts, shape.top_k, routing,
                                generator=torch.Generator().manual_seed(0))
    g = torch.Generator(device).manual_seed(0)
    h, i, e = shape.hidden_size, shape.intermediate_size, shape.num_experts
    x = torch.randn(tokens, h, generator=g, device=device).to(torch.bfloat16)
    w13 = (torch.randn(e, 2 * i, h, generator=g, device=device) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g, device=device) / i**0.5).to(torch.bfloat16)
    return x, ids.to(device), weights.to(device), w13, w2


def _leaves(x, ids, weights, w13, w2) -> Operands:
    """A layer's operands as leaves of their own (ids as they are)."""
    x, weights, w13, w2 = (t.clone().requires_grad_() for t in (x, weights, w13, w2))
    return Operands(x, ids, weights, w13, w2)


def _time(fn, operands: Operands, dy: torch.Tensor, device: Device, budget) -> dict:
    """fwd (no_grad) and fwd+bwd medians of fn(*operands.args()) -> y in ms; gradients dropped between runs.
    budget: a Budget, or a function of a mode's probe-measured ms that returns the Budget (collective)."""
    def forward(_):
        with torch.no_grad():
            fn(*operands.args())

    def forward_backward(_):
        fn(*operands.args()).backward(dy)

    reset = operands.clear_grads

    def timed(run):
        if isinstance(budget, Budget):
            return measure(run, reset, device, budget).median_ms
        return measure(run, reset, device, budget(measure(run, reset, device, _PROBE).median_ms)).median_ms

    return {"fwd_ms": timed(forward), "fwdbwd_ms": timed(forward_backward)}


def _agreed_budget(args: argparse.Namespace, device: Device):
    """Per mode: the slowest rank's probe time and its longest sustained warm-up (Device's, so a
    device's first lasts FIRST_LOAD_WARMUP_S), all-reduced -> the same warm-up and timed iteration
    counts on every rank, filling those seconds and --budget."""
    def budget(probe_ms: float) -> Budget:
        mine = [probe_ms, device.sustained_warmup_seconds(args.warmup_seconds)]
        slowest = torch.tensor(mine, dtype=torch.float64, device="cpu" if args.one_gpu else device.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        ms, warmup_s = max(float(slowest[0]), 1e-3), float(slowest[1])
        return Budget(warmup=max(args.warmup, math.ceil(warmup_s * 1e3 / ms)),
                      repeat=min(args.repeat, max(MIN_REPEATS, math.ceil(args.budget * 1e3 / ms))), seconds=_FIXED)
    return budget


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast
    dist.init_process_group("gloo" if args.one_gpu else "nccl", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    cuda = torch.device("cuda", 0 if args.one_gpu else rank)
    torch.cuda.set_device(cuda)
    device = Device(cuda)
    agreed = _agreed_budget(args, device)
    one_gpu_budget = Budget.from_arguments(args)
    records = []
    cases = [(preset, tokens, routing, precision, recompute) for preset in args.preset for tokens in args.tokens
             for routing in args.routing for precision in args.precision for recompute in args.recompute]
    for preset, tokens, routing, precision, recompute in cases:
        shape = PRESETS[preset]
        layer = functools.partial(megamoe.moe, precision=precision, recompute=RECOMPUTE[recompute])
        x, ids, weights, w13, w2 = _problem(shape, tokens, routing, cuda)
        dy = torch.randn_like(x)
        record = {"preset": preset, "tokens": tokens, "routing": routing, "world": world, "precision": precision,
                  "recompute": recompute}
        if rank == 0:
            one = _leaves(x, ids, weights, w13, w2)
            timed = _time(layer, one, dy, device, one_gpu_budget)
            timed["saved_gb"] = saved_for_backward_gb(layer, one)
            record.update({f"one_gpu_{k}": v for k, v in timed.items()})
        dist.barrier()
        tokens_r, local = tokens // world, shape.num_experts // world
        mine, experts = slice(rank * tokens_r, (rank + 1) * tokens_r), slice(rank * local, (rank + 1) * local)
        part = _leaves(x[mine], ids[mine], weights[mine], w13[experts], w2[experts])
        grouped = functools.partial(layer, group=dist.group.WORLD)
        ep = _time(grouped, part, dy[mine], device, agreed)
        ep["saved_gb"] = saved_for_backward_gb(grouped, part)
        local_ids = torch.where((ids >= experts.start) & (ids < experts.stop), ids - experts.start, -1)
        alone = _time(layer, _leaves(x, local_ids, weights, w13[experts], w2[experts]), dy, device, agreed)
        ep |= {f"local_{k}": v for k, v in alone.items()}
        try:
            a2a = _time(functools.partial(all_to_all_moe, group=dist.group.WORLD), part, dy[mine], device, agreed)
            ep |= {f"all_to_all_{k}": v for k, v in a2a.items()}
        except RuntimeError as error:  # the same on every rank: raised before any exchange
            record["all_to_all_skipped"] = f"{type(error).__name__}: {str(error)[:200]}"
        slowest = [None] * world
        dist.all_gather_object(slowest, ep)
        record.update({k: None if ep[k] is None else max(r[k] for r in slowest) for k in ep})
        record.update({f"exposed_{mode}": 1 - record[f"local_{mode}_ms"] / record[f"{mode}_ms"]
                       for mode in ("fwd", "fwdbwd")})
        records.append(record)
    if rank == 0:
        Path(out).write_text(json.dumps({"gpu": device.name(), "records": records}))
    dist.destroy_process_group()


def _gb(value: float | None) -> str:
    return f"{value:7.2f}" if value is not None else f"{'-':>7}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megamoe.bench.ep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", nargs="+", choices=list(PRESETS), default=["qwen3-30b-a3b", "qwen3-235b-a22b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[16384])
    parser.add_argument("--routing", nargs="+", choices=ROUTINGS, default=["balanced"])
    parser.add_argument("--precision", nargs="+", choices=FUSED_PRECISIONS, default=["bf16"])
    parser.add_argument("--recompute", nargs="+", choices=list(RECOMPUTE), default=["false"],
                        help="megamoe.moe's recompute: what the fused layer keeps for its backward")
    parser.add_argument("--world", type=int, default=None, help="ranks (default: every GPU; 2 with --one-gpu)")
    parser.add_argument("--one-gpu", action="store_true", help="all ranks on GPU 0 (checks the path, not its speed)")
    Budget.add_arguments(parser, warmup=3)
    add_out_argument(parser)
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count()
    world = args.world or (2 if args.one_gpu else gpus)
    if gpus == 0:
        parser.error("needs a CUDA GPU")
    if not args.one_gpu and not 2 <= world <= gpus:
        parser.error(f"--world {world} needs that many GPUs (this machine has {gpus}); "
                     "--one-gpu runs every rank on GPU 0")
    for preset in args.preset:
        shape = PRESETS[preset]
        if shape.num_experts % world or any(t % world for t in args.tokens):
            parser.error(f"{preset}: E = {shape.num_experts} and every --tokens must be divisible by W = {world}")
    args.out.mkdir(parents=True, exist_ok=True)
    result_path = args.out / "ep_latest.json"
    mp.spawn(_rank, args=(world, str(args.out / ".ep_store"), args, str(result_path)), nprocs=world, join=True)
    (args.out / ".ep_store").unlink(missing_ok=True)
    result = json.loads(result_path.read_text())
    result.update({**provenance(result["gpu"], "megamoe.bench.ep", argv), "one_gpu": args.one_gpu})
    result_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'preset':16} {'tokens':>6} {'routing':9} {'W':>2} {'precision':9} {'recompute':9} {'1 GPU fwd':>10} "
          f"{'fwd+bwd':>8} {'kept GB':>7} {'EP fwd':>8} {'fwd+bwd':>8} {'kept GB':>7} {'local fwd':>9} {'fwd+bwd':>8} "
          f"{'exposed':>7} {'':>5} {'a2a fwd':>8} {'fwd+bwd':>8}")
    for r in result["records"]:
        a2a = (f"{r['all_to_all_fwd_ms']:8.2f} {r['all_to_all_fwdbwd_ms']:8.2f}" if "all_to_all_fwd_ms" in r
               else f"  all-to-all skipped: {r['all_to_all_skipped'][:60]}")
        print(f"{r['preset']:16} {r['tokens']:>6} {r['routing']:9} {r['world']:>2} {r['precision']:9} "
              f"{r['recompute']:9} {r['one_gpu_fwd_ms']:10.2f} {r['one_gpu_fwdbwd_ms']:8.2f} "
              f"{_gb(r['one_gpu_saved_gb'])} {r['fwd_ms']:8.2f} {r['fwdbwd_ms']:8.2f} {_gb(r['saved_gb'])} "
              f"{r['local_fwd_ms']:9.2f} {r['local_fwdbwd_ms']:8.2f} {r['exposed_fwd']:7.1%} {r['exposed_fwdbwd']:5.1%} "
              f"{a2a}")
    print(f"wrote {result_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
