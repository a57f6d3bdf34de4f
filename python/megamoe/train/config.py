"""The TOML training config: sections, defaults, model presets, validation and command-line overrides.

Every mistake raises ConfigError naming the offending key, before anything is built.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megamoe._native import MAX_PEERS
from megamoe.shapes import PRESETS, MoEShape
from megamoe.validation import BACKENDS


class ConfigError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """transformers' Qwen3MoeConfig fields; every layer is an MoE layer."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's; Qwen3MoeConfig wants it, unused when every layer is MoE
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    backend: str = "fused"
    precision: str = "bf16"
    expert_parallel: int = 1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seq_len: int
    batch_size: int
    steps: int
    micro_batches: int = 1  # the batch run as this many forward + backward passes before each optimizer step
    lr: float = 3e-4
    warmup_steps: int = 0  # linear warm-up, then cosine decay to 10% of lr at `steps`
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping
    seed: int = 0  # model initialisation and data
    # "none" | "full" (every decoder layer) | "moe" (the experts) | "moe-gather" (the fused experts keep z
    # and gather x again: megamoe.moe's recompute="gather")
    activation_checkpointing: str = "none"
    device: str = "auto"  # "auto" = cuda when there is a GPU
    eval_every: int = 0  # steps between evaluations of the held-out loss (and one at the end); 0 = none
    eval_batches: int = 4  # batches of batch_size sequences per evaluation


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """A file of token ids (megamoe.train.data.TokenFile) or, without one, the synthetic corpus: random
    phrases from a fixed random phrase book."""

    tokens: str = ""  # path of a flat binary file of token ids; "" = the synthetic corpus
    token_dtype: str = "uint16"  # the file's id type: "uint16" (vocabularies up to 65536) or "uint32"
    eval_tokens: str = ""  # held-out ids in the same form, for [train].eval_every (with tokens)
    phrases: int = 1024  # the synthetic corpus's
    phrase_length: int = 16


@dataclasses.dataclass(frozen=True)
class OutputConfig:
    dir: str  # metrics.jsonl, loss.png, checkpoint.pt
    checkpoint_every: int = 0  # steps between checkpoints (and one at the end); 0 = no checkpoints


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig
    moe: MoEConfig
    train: TrainConfig
    data: DataConfig
    output: OutputConfig

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _preset(shape: MoEShape, **sizes) -> dict[str, Any]:
    return dict(hidden_size=shape.hidden_size, moe_intermediate_size=shape.intermediate_size,
                num_experts=shape.num_experts, num_experts_per_tok=shape.top_k, **sizes)


# [model] preset = NAME; explicit keys next to it override the preset's.
MODEL_PRESETS = {
    # Qwen3-30B-A3B's real hidden, attention and expert sizes, 4 of its 48 layers, and a small vocabulary
    # so that the MoE layers, not the embedding, dominate the step.
    "qwen3-30b-a3b-4layers": _preset(PRESETS["qwen3-30b-a3b"], intermediate_size=6144, num_hidden_layers=4,
                                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=8192),
    "tiny": _preset(PRESETS["tiny"], intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, vocab_size=512),
}

SECTIONS = {"model": ModelConfig, "moe": MoEConfig, "train": TrainConfig, "data": DataConfig,
            "output": OutputConfig}
CHECKPOINTING = ("none", "full", "moe", "moe-gather")
# The precisions a model trains in: bf16, block FP8 forward and backward, BF16 forward with an FP8
# backward. "mxfp8" (validation.PRECISIONS) needs Blackwell and is refused.
TRAINABLE_PRECISIONS = ("bf16", "fp8", "fp8_bwd")
# The backends each precision runs on: FP8 is the fused kernels' (the baselines compute in bf16).
PRECISION_BACKENDS = {"bf16": BACKENDS, "fp8": ("fused",), "fp8_bwd": ("fused",)}
DEVICES = ("auto", "cuda", "cpu")
TOKEN_BYTES = {"uint16": 2, "uint32": 4}  # [data].token_dtype -> bytes per token id
_UNTRAINABLE = {"mxfp8": "needs Blackwell (sm_100) block-scaled tensor cores; on Hopper use 'fp8' "
                         "(1x128 / 128x128 block scales)"}


def backend_cannot_run(backend: str, precision: str) -> str | None:
    """Why `backend` cannot train at `precision`, or None when it can."""
    backends = PRECISION_BACKENDS.get(precision, ())
    if backend in backends:
        return None
    return f"precision {precision!r} runs on backend {' or '.join(repr(b) for b in backends)} only, not {backend!r}"


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Reads a TOML config; overrides are "section.key=value" (value in TOML syntax, or a bare string)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path} is not valid TOML: {error}") from None
    for override in overrides:
        apply_override(raw, override)
    return parse_config(raw)


def apply_override(raw: dict[str, Any], override: str) -> None:
    key, sep, text = override.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not name:
        raise ConfigError(f"override {override!r} must look like section.key=value, e.g. moe.backend=grouped")
    try:
        value = tomllib.loads(f"value = {text.strip()}")["value"]
    except tomllib.TOMLDecodeError:
        value = text.strip()  # a bare word such as grouped
    table = raw.setdefault(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"override {override!r}: [{section}] is not a table")
    table[name] = value


def parse_config(raw: dict[str, Any]) -> Config:
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"unknown section(s) {', '.join(f'[{s}]' for s in unknown)}; known: "
                          f"{', '.join(f'[{s}]' for s in SECTIONS)}")
    tables = {}
    for name in SECTIONS:
        table = raw.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"[{name}] must be a table")
        tables[name] = dict(table)
    tables["model"] = _resolve_preset(tables["model"])
    config = Config(**{name: _build(cls, name, tables[name]) for name, cls in SECTIONS.items()})
    _validate(config)
    return config


def _resolve_preset(table: dict[str, Any]) -> dict[str, Any]:
    if "preset" not in table:
        return table
    preset = table.pop("preset")
    if preset not in MODEL_PRESETS:
        raise ConfigError(f"[model].preset = {preset!r} is unknown; known presets: {', '.join(MODEL_PRESETS)}")
    return {**MODEL_PRESETS[preset], **table}


def _build(cls, section: str, table: dict[str, Any]):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        extra = " (or preset)" if section == "model" else ""
        raise ConfigError(f"unknown key(s) {', '.join(f'[{section}].{k}' for k in unknown)}; known keys: "
                          f"{', '.join(fields)}{extra}")
    missing = [name for name, f in fields.items()
               if name not in table and f.default is dataclasses.MISSING]
    if missing:
        hint = " (or set [model].preset)" if section == "model" else ""
        raise ConfigError(f"missing key(s) {', '.join(f'[{section}].{k}' for k in missing)}{hint}")
    for name, value in table.items():
        table[name] = _check_type(f"[{section}].{name}", value, fields[name].type)
    return cls(**table)


_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _check_type(key: str, value: Any, annotation: str):
    expected = _TYPES[annotation]
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise ConfigError(f"{key} must be of type {annotation}, got {value!r} ({type(value).__name__})")
    return value


def _require(condition: bool, key: str, value: Any, why: str) -> None:
    if not condition:
        raise ConfigError(f"{key} = {value!r}: {why}")


def _validate(config: Config) -> None:
    for section in SECTIONS:
        for name, value in dataclasses.asdict(getattr(config, section)).items():
            if isinstance(value, int) and not isinstance(value, bool):
                minimum = 0 if name in ("seed", "warmup_steps", "checkpoint_every", "eval_every") else 1
                _require(value >= minimum, f"[{section}].{name}", value, f"must be >= {minimum}")
            elif isinstance(value, float):
                minimum_is_zero = name in ("router_aux_loss_coef", "weight_decay", "grad_clip")
                _require(value >= 0 if minimum_is_zero else value > 0, f"[{section}].{name}", value,
                         "must be >= 0" if minimum_is_zero else "must be > 0")
    model, moe, train = config.model, config.moe, config.train
    _require(model.num_experts_per_tok <= model.num_experts, "[model].num_experts_per_tok",
             model.num_experts_per_tok, f"exceeds num_experts = {model.num_experts}")
    _require(model.num_attention_heads % model.num_key_value_heads == 0, "[model].num_key_value_heads",
             model.num_key_value_heads, f"must divide num_attention_heads = {model.num_attention_heads}")
    _require(moe.backend in BACKENDS, "[moe].backend", moe.backend, f"must be one of {', '.join(BACKENDS)}")
    _require(moe.precision in TRAINABLE_PRECISIONS, "[moe].precision", moe.precision,
             f"{_UNTRAINABLE.get(moe.precision, 'unknown')}; supported: {', '.join(TRAINABLE_PRECISIONS)}")
    why = backend_cannot_run(moe.backend, moe.precision)
    _require(why is None, "[moe].precision", moe.precision, f"{why}; set [moe].backend = 'fused' or precision = 'bf16'")
    _require(moe.expert_parallel >= 1 and model.num_experts % moe.expert_parallel == 0, "[moe].expert_parallel",
             moe.expert_parallel, f"must be >= 1 and divide num_experts = {model.num_experts}")
    _require(moe.expert_parallel <= MAX_PEERS, "[moe].expert_parallel", moe.expert_parallel,
             f"exceeds {MAX_PEERS}: expert parallelism runs over the GPUs of one host (CUDA IPC)")
    _require(moe.expert_parallel == 1 or moe.backend == "fused", "[moe].expert_parallel", moe.expert_parallel,
             f"splits the experts of backend 'fused' over the ranks; backend {moe.backend!r} runs on one GPU "
             "(set [moe].expert_parallel = 1)")
    _require(train.seq_len >= 2, "[train].seq_len", train.seq_len, "must be >= 2 (next-token prediction)")
    _require(train.batch_size % train.micro_batches == 0, "[train].micro_batches", train.micro_batches,
             f"must divide batch_size = {train.batch_size} (each micro-batch holds batch_size / micro_batches "
             "sequences)")
    _require(train.activation_checkpointing in CHECKPOINTING, "[train].activation_checkpointing",
             train.activation_checkpointing, f"must be one of {', '.join(CHECKPOINTING)}")
    _require(train.activation_checkpointing != "moe-gather" or moe.backend == "fused",
             "[train].activation_checkpointing", train.activation_checkpointing,
             "is the fused experts' own (set [moe].backend = 'fused', or use 'moe')")
    _require(train.device in DEVICES, "[train].device", train.device, f"must be one of {', '.join(DEVICES)}")
    data = config.data
    _require(data.token_dtype in TOKEN_BYTES, "[data].token_dtype", data.token_dtype,
             f"must be one of {', '.join(TOKEN_BYTES)}")
    _require(not data.eval_tokens or data.tokens, "[data].eval_tokens", data.eval_tokens,
             "is held-out text for a run on [data].tokens (the synthetic language holds out its own)")
    _require(not (train.eval_every and data.tokens and not data.eval_tokens), "[train].eval_every", train.eval_every,
             "a run on [data].tokens evaluates on held-out ids: set [data].eval_tokens")
    for key in ("tokens", "eval_tokens"):
        if getattr(data, key):
            _validate_token_file(f"[data].{key}", getattr(data, key), data.token_dtype, train.seq_len)


def _validate_token_file(key: str, path: str, token_dtype: str, seq_len: int) -> None:
    _require(Path(path).is_file(), key, path, "no such file")
    size, itemsize = Path(path).stat().st_size, TOKEN_BYTES[token_dtype]
    _require(size % itemsize == 0, key, path,
             f"{size} bytes are not a whole number of {token_dtype} token ids: set [data].token_dtype to the file's")
    _require(size // itemsize >= seq_len, key, path,
             f"holds {size // itemsize} token ids, fewer than [train].seq_len = {seq_len}")
