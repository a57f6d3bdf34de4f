"""Training transformers' Qwen3-MoE with megamoe experts, from a TOML config.

    python -m megamoe.train --config configs/tiny.toml [--backend grouped] [--set train.steps=20] [--fresh]
    python -m megamoe.train.bench      # training-step time per backend → runs/bench/train_latest.json
    python -m megamoe.train.parity     # loss curves of several backends from one init → train_parity_latest.*
"""

from .config import Config, ConfigError, load_config
from .loop import train

__all__ = ["Config", "ConfigError", "load_config", "train"]
