"""`python -m megamoe.train.torchtitan`: TorchTitan's Qwen3 MoE models trained with TorchTitan's own
experts or megamoe's (torchtitan 0.2 and its model converters, megamoe/torchtitan_converter.py), one
process on one GPU, as TorchTitan trains there: fp32 parameters, bf16 autocast, AdamW, TorchTitan's
activation checkpointing; synthetic phrase-book data (megamoe.train.data).

  bench   the reference setting: a flavour at a depth that fits one GPU (default 30B-A3B with 4 layers),
          16384-token sequences, full activation checkpointing. Step time, tokens/s and peak memory of
          each variant (and a PNG of them): native (TorchTitan's experts, bf16), native-fp8
          (TorchTitan's float8 grouped-GEMM converter; needs torchao), megamoe, megamoe-fp8; a variant
          that cannot run is recorded as skipped, with the reason. Writes torchtitan_bench_latest.json.
  parity  loss curves of the debug MoE model, TorchTitan's experts vs megamoe's, from the same weights
          and data; the noise floor is measured as megamoe.train.parity measures it (perturbed reruns
          of the reference) and judged by the same criteria. Writes torchtitan_parity_latest.json.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from megamoe.bench.report import add_out_argument
from megamoe.bench.timing import SUSTAINED_WARMUP_S, Device

from .bench import PROFILED_KERNELS, BenchRecord, profile_step, time_steps
from .config import DataConfig
from .data import SyntheticCorpus
from .parity import NOISE_RUNS, PERTURBED_SUFFIX, Curve, compare, judge, perturb_weights
from .plot import write_if_plotting, write_parity_plot, write_step_plot
from .results import environment, write_result

VARIANTS = {"native": None, "native-fp8": None, "megamoe": "bf16", "megamoe-fp8": "fp8"}  # megamoe's precision


@dataclasses.dataclass
class Setting:
    flavor: str
    layers: int
    seq_len: int
    batch_size: int
    activation_checkpoint: str  # TorchTitan's mode: "full", "selective", "none"
    compile: bool
    backend: str  # megamoe's backend (fused; a baseline to run without a Hopper GPU)


def build_model(setting: Setting, variant: str, device: torch.device, seed: int) -> torch.nn.Module:
    """TorchTitan's Qwen3 model of `setting` with `variant`'s experts, initialised from `seed` as TorchTitan
    initialises it (the same weights for every variant)."""
    from torchtitan.config import JobConfig
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.qwen3 import Qwen3Model, qwen3_args

    from megamoe.torchtitan_converter import convert_moe_layers

    args = copy.deepcopy(qwen3_args[setting.flavor])
    args.n_layers = setting.layers
    args.max_seq_len = max(args.max_seq_len, setting.seq_len)
    args.moe_args.use_grouped_mm = device.type == "cuda"  # its grouped path pads with a Triton kernel
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Qwen3Model(args)
    if variant == "native-fp8":
        if device.type != "cuda":
            raise ValueError("TorchTitan's float8 grouped GEMMs need a CUDA GPU")
        _float8(model, setting)
    elif VARIANTS[variant] is not None:
        convert_moe_layers(model, backend=setting.backend, precision=VARIANTS[variant])
    job = JobConfig()
    job.activation_checkpoint.mode = setting.activation_checkpoint
    if setting.activation_checkpoint != "none":
        apply_ac(model, job.activation_checkpoint)
    if setting.compile:
        from torchtitan.models.llama4.infra.parallelize import apply_compile
        apply_compile(model, job.compile, ep_enabled=False)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    return model


def _float8(model: torch.nn.Module, setting: Setting) -> None:
    """TorchTitan's float8 training of the MoE experts: its grouped-GEMM converter (torchao's dynamic
    rowwise scaled grouped GEMMs; needs torchao with MoE training support and a GPU)."""
    from torchtitan.components.quantization.float8 import Float8GroupedMMConverter
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims

    job = JobConfig()
    job.model.converters = ["quantize.grouped_mm.float8"]
    job.quantize.grouped_mm.float8.fqns = ["experts"]
    job.compile.enable = setting.compile
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    Float8GroupedMMConverter(job, dims).convert(model)


def train_step(model, optimizer, input_ids: torch.Tensor) -> float:
    """Next-token cross entropy, backward, AdamW; bf16 autocast on the GPU (TorchTitan without FSDP)."""
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=input_ids.is_cuda):
        logits = model(input_ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), input_ids[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    cuda = next(model.parameters()).is_cuda
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=cuda)


def bench(setting: Setting, variants: Sequence[str], device: torch.device, steps: int, warmup: int,
          warmup_seconds: float, lr: float, profile: bool = False) -> list[dict]:
    corpus = SyntheticCorpus(DataConfig(), _vocab(setting), seed=0)
    timer = Device(device)
    records = []
    for variant in variants:
        record = BenchRecord(variant, "fp8" if variant.endswith("fp8") else "bf16")
        try:
            model = build_model(setting, variant, device, seed=0)
            optimizer = _optimizer(model, lr)

            def step(i: int) -> float:
                batch = corpus.batch(i, setting.batch_size, setting.seq_len + 1).to(device)
                return train_step(model, optimizer, batch)  # .item(): the step has finished

            time_steps(record, step, setting.batch_size * setting.seq_len, warmup, warmup_seconds, steps, timer)
            if profile and timer.is_cuda:
                record.profile = profile_step(step)
        except (ImportError, NotImplementedError, ValueError, torch.OutOfMemoryError) as error:
            record.skipped = f"{type(error).__name__}: {str(error)[:300]}"
        model = optimizer = None
        timer.release_cached_memory()
        records.append({"variant": variant, **{key: value for key, value in dataclasses.asdict(record).items()
                                               if key not in ("backend", "vs_grouped")}})
    base = next((r for r in records if r["variant"] == "native" and not r["skipped"]), None)
    for r in records:
        if base is not None and not r["skipped"]:
            r["vs_native"] = base["step_ms"] / r["step_ms"]
    return records


def train_curve(setting: Setting, name: str, variant: str, device: torch.device, steps: int, lr: float,
                perturbation: int = 0) -> Curve:
    corpus = SyntheticCorpus(DataConfig(), _vocab(setting), seed=0)
    model = build_model(setting, variant, device, seed=0)
    if perturbation:
        perturb_weights(model, perturbation)
    optimizer = _optimizer(model, lr)
    curve = Curve(name, [], "bf16")
    for step in range(steps):
        batch = corpus.batch(step, setting.batch_size, setting.seq_len + 1).to(device)
        curve.losses.append(train_step(model, optimizer, batch))
    model = optimizer = None
    Device(device).release_cached_memory()
    return curve


def parity(setting: Setting, device: torch.device, steps: int, noise_runs: int, lr: float) -> dict:
    reference = train_curve(setting, "native", "native", device, steps, lr)
    noise_curves = [train_curve(setting, "native" + PERTURBED_SUFFIX.format(i), "native", device, steps, lr, i)
                    for i in range(1, noise_runs + 1)]
    curves = [reference, *noise_curves, train_curve(setting, "megamoe", "megamoe", device, steps, lr)]
    noise_runs_cmp = [compare(c, reference) for c in noise_curves]
    noise = max(noise_runs_cmp, key=lambda n: n["mean_smoothed_rel_gap"])
    comparison = compare(curves[-1], reference)
    judge(comparison, noise["mean_smoothed_rel_gap"], steps)
    return {"noise_floor": noise, "noise_runs": noise_runs_cmp, "comparisons": [comparison],
            "curves": [dataclasses.asdict(c) for c in curves]}


def _vocab(setting: Setting) -> int:
    from torchtitan.models.qwen3 import qwen3_args
    return qwen3_args[setting.flavor].vocab_size


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m megamoe.train.torchtitan", description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("bench", "parity"))
    parser.add_argument("--flavor", help="TorchTitan's Qwen3 flavour (default: 30B-A3B for bench, "
                                         "debugmodel_moe for parity)")
    parser.add_argument("--layers", type=int, help="decoder layers (default: 4 for bench, the flavour's for parity)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: 16384 for bench, 2048 for parity)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--activation-checkpoint", choices=("full", "selective", "none"), default="full")
    parser.add_argument("--compile", action="store_true", help="TorchTitan's per-block torch.compile")
    parser.add_argument("--backend", default="fused", help="megamoe's backend (a baseline runs without a Hopper GPU)")
    parser.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS),
                        help="bench: what to time (default: all)")
    parser.add_argument("--steps", type=int, help="bench: timed steps (default 10); parity: steps (default 200)")
    parser.add_argument("--warmup", type=int, default=3, help="bench: untimed steps, at least")
    parser.add_argument("--warmup-seconds", type=float, default=SUSTAINED_WARMUP_S,
                        help="bench: and at least this long (the GPU at its sustained clock)")
    parser.add_argument("--profile", action="store_true",
                        help=f"bench: after the timed steps, profile one more (GPU): its {PROFILED_KERNELS} longest "
                             "kernels into the record")
    parser.add_argument("--noise-runs", type=int, default=NOISE_RUNS, help="parity: perturbed reference runs")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    bench_mode = args.mode == "bench"
    try:
        from torchtitan.models.qwen3 import qwen3_args
    except ImportError as error:
        parser.exit(2, f"needs torchtitan 0.2 (pip install 'torchtitan==0.2.2'): {error}\n")
    flavor = args.flavor or ("30B-A3B" if bench_mode else "debugmodel_moe")
    if flavor not in qwen3_args or not qwen3_args[flavor].moe_enabled:
        parser.error(f"--flavor must be one of TorchTitan's Qwen3 MoE flavours, got {flavor!r}")
    setting = Setting(flavor, args.layers or (4 if bench_mode else qwen3_args[flavor].n_layers),
                      args.seq_len or (16384 if bench_mode else 2048), args.batch_size, args.activation_checkpoint,
                      args.compile, args.backend)
    device = torch.device(args.device)
    if bench_mode:
        records = bench(setting, args.variants, device, args.steps or 10, args.warmup, args.warmup_seconds, args.lr,
                        args.profile)
        result = {**environment(device, "megamoe.train.torchtitan", argv), "setting": dataclasses.asdict(setting),
                  "records": records}
        path = write_result(result, args.out, "torchtitan_bench")
        write_if_plotting(write_step_plot, path.with_suffix(".png"), records,
                          title=f"TorchTitan {flavor}, {setting.layers} layers, {setting.batch_size}×{setting.seq_len} "
                                f"tokens/step, AC {setting.activation_checkpoint}")
        for r in records:
            figures = r["skipped"] or (f"{r['step_ms']:.1f} ms/step, {r['tokens_per_s']:.0f} tokens/s"
                                       + (f", peak {r['peak_mem_gb']:.1f} GB" if r["peak_mem_gb"] is not None else "")
                                       + (f", {r['vs_native']:.2f}x native" if "vs_native" in r else ""))
            print(f"{r['variant']:12s} {figures}")
    else:
        result = {**environment(device, "megamoe.train.torchtitan", argv), "setting": dataclasses.asdict(setting),
                  **parity(setting, device, args.steps or 200, args.noise_runs, args.lr)}
        path = write_result(result, args.out, "torchtitan_parity")
        write_if_plotting(write_parity_plot, path.with_suffix(".png"),
                          {c["name"]: c["losses"] for c in result["curves"]}, "native",
                          title=f"TorchTitan {flavor}: native vs megamoe experts, "
                                f"{setting.batch_size}×{setting.seq_len} tokens/step")
        c = result["comparisons"][0]
        print(f"noise floor {result['noise_floor']['mean_smoothed_rel_gap']:.2%}; megamoe vs native: mean smoothed "
              f"gap {c['mean_smoothed_rel_gap']:.2%} (tolerance {c['tolerance']:.2%}), step 1 "
              f"{c['step1_rel_diff']:.2e}: {'within' if c['within_tolerance'] else 'OUTSIDE'} tolerance")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
