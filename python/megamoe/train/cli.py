"""Command line of `python -m megamoe.train`."""

from __future__ import annotations

import argparse
from pathlib import Path
from collections.abc import Sequence

from .config import ConfigError, load_config
from .distributed import checkpoint_name
from .loop import CHECKPOINT, METRICS, PLOT, train


def config_arguments(parser: argparse.ArgumentParser, default_config: str | None = None) -> None:
    """--config, --backend and --set, shared by the training, benchmark and parity commands."""
    default = f"; default {default_config}" if default_config else ""
    parser.add_argument("--config", required=default_config is None, default=default_config,
                        help=f"TOML config (see configs/){default}")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value, e.g. --set train.steps=20 (repeatable)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megamoe.train",
                                     description="Train transformers' Qwen3-MoE with megamoe experts.")
    config_arguments(parser)
    parser.add_argument("--backend",
                        help="override [moe].backend: fused (a Hopper GPU), grouped or naive (also on the CPU)")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true",
                       help="continue from <output.dir>/checkpoint.pt and fail if there is none "
                            "(by default a run continues from it when it is there)")
    start.add_argument("--fresh", action="store_true",
                       help="start over: delete <output.dir>/checkpoint.pt and overwrite the metrics")
    args = parser.parse_args(argv)
    overrides = args.set + ([f"moe.backend={args.backend}"] if args.backend else [])
    try:
        config = load_config(args.config, overrides)
        records = train(config, resume=True if args.resume else False if args.fresh else None)
    except ConfigError as error:
        parser.error(str(error))
    if records and _lead_rank():
        last = records[-1]
        ranks = config.moe.expert_parallel
        checkpoints = [checkpoint_name(CHECKPOINT, rank, ranks) for rank in range(ranks)]
        written = [name for name in (METRICS, PLOT, *checkpoints) if (Path(config.output.dir) / name).exists()]
        print(f"step {last['step']}: loss {last['lm_loss']:.4f}; wrote {config.output.dir}/{{{', '.join(written)}}}")
    return 0


def _lead_rank() -> bool:
    """Whether this process reports: the only one, or rank 0 of [moe].expert_parallel's ranks."""
    import torch.distributed as dist
    return not dist.is_initialized() or dist.get_rank() == 0
