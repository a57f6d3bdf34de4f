"""transformers' Qwen3MoeForCausalLM, patched with megamoe, in bf16 with AdamW: one training step,
and checkpoints."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from megamoe.hf import expert_parallel_parameters, patch_hf_model, qwen3_moe_experts

from .config import Config, ConfigError
from .distributed import ExpertParallel

MIN_LR_FRACTION = 0.1  # cosine decay ends at 10% of the peak learning rate
# What a step raises when its backend cannot run here: not built yet, another GPU, an unsupported size,
# dtype or device (megamoe checks these before any kernel runs), or too little memory.
BACKEND_CANNOT_RUN = (NotImplementedError, ValueError, TypeError, torch.OutOfMemoryError)


@dataclasses.dataclass(frozen=True)
class StepResult:
    loss: float  # language-model loss + router_aux_loss_coef · aux loss: what is optimised
    lm_loss: float
    aux_loss: float
    grad_norm: float  # before clipping
    lr: float


def resolve_device(config: Config, ep: ExpertParallel | None = None) -> torch.device:
    if ep is not None:  # distributed.start chose this rank's GPU
        return torch.device("cuda", torch.cuda.current_device())
    if config.train.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("[train].device = 'cuda' but there is no CUDA device (use 'auto' or 'cpu')")
    return torch.device(config.train.device)


def check_backend_runs_on(config: Config, device: torch.device) -> None:
    """Refuses, before anything is built, a backend that cannot run on this device at all."""
    if config.moe.backend == "fused" and device.type != "cuda":
        raise ConfigError(f"[moe].backend = 'fused' needs a CUDA GPU (Hopper) and this run is on the {device.type}; "
                          "the CPU runs --backend grouped or --backend naive")


def build_model(config: Config, device: torch.device, ep: ExpertParallel | None = None) -> torch.nn.Module:
    """Qwen3MoeForCausalLM from config.model, initialised from config.train.seed (the same weights for
    every backend on one device, and on every rank), in bf16, experts through megamoe (with ep, each
    rank keeps its share of them), with the chosen checkpointing."""
    try:
        from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    except ImportError as error:
        raise ImportError("megamoe.train needs transformers >= 5 (pip install 'megamoe[hf]')") from error
    sizes = dataclasses.asdict(config.model)
    rope_theta = sizes.pop("rope_theta")
    hf_config = Qwen3MoeConfig(**sizes, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                               max_position_embeddings=config.train.seq_len, use_cache=False)
    torch.manual_seed(config.train.seed)
    # Built in bf16 rather than cast afterwards: a cast would also round the fp32 RoPE frequencies.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    checkpointing = config.train.activation_checkpointing
    # The fused experts checkpoint themselves: they keep their inputs and recompute only the gather and
    # GEMM1 in the backward, where torch.utils.checkpoint would rerun their whole forward ("moe"), or
    # keep z and gather x again ("moe-gather").
    fused_recompute = checkpointing == "moe" and config.moe.backend == "fused"
    recompute = "gather" if checkpointing == "moe-gather" else fused_recompute
    patch_hf_model(model, backend=config.moe.backend, precision=config.moe.precision, recompute=recompute,
                   group=None if ep is None else ep.group)
    if checkpointing == "full":
        enable_activation_checkpointing(model)
    elif checkpointing == "moe" and not fused_recompute:
        recompute_experts(model)
    return model.train()


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Every decoder layer checkpointed (non-reentrant), by the name transformers gives it:
    `activation_checkpointing_enable` since 5.24, `gradient_checkpointing_enable` before (deprecated
    there, to be removed in 6)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def recompute_experts(model: torch.nn.Module) -> None:
    """Activation checkpointing of the experts only: their [T·K, 2I] and [T·K, I] intermediates are
    the bulk of an MoE layer's activations. The router stays outside, so the router logits the model
    records for its aux loss are recorded once."""
    for experts in qwen3_moe_experts(model):
        # The class's forward dispatches on the experts implementation at call time, so patching
        # the backend later still takes effect.
        experts.forward = functools.partial(checkpoint, experts.forward, use_reentrant=False)


class Trainer:
    def __init__(self, config: Config, ep: ExpertParallel | None = None):
        """ep: this process's rank of [moe].expert_parallel > 1 (distributed.start), else None."""
        self.config, self.ep = config, ep
        self.device = resolve_device(config, ep)
        self.model = build_model(config, self.device, ep)
        self.own_experts = expert_parallel_parameters(self.model)  # trained by this rank alone
        train = config.train
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": train.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # norms
        # On a GPU, one fused kernel per step instead of a chain of foreach passes over the AdamW state.
        self.optimizer = torch.optim.AdamW(groups, lr=train.lr, betas=(0.9, 0.95), eps=1e-8,
                                           fused=self.device.type == "cuda")
        self.step = 0  # completed optimizer steps

    def learning_rate(self, step: int) -> float:
        train = self.config.train
        if step < train.warmup_steps:
            return train.lr * (step + 1) / train.warmup_steps
        progress = (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return train.lr * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * cosine)

    def accumulate_gradients(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Forward and backward over the batch in [train].micro_batches equal parts, each loss divided
        by their number, so the parameters' gradients are the whole batch's mean loss's (summed in their
        dtype); returns that mean (loss, aux loss) as a 2-element fp32 tensor, on the device."""
        parts = self.config.train.micro_batches
        losses = torch.zeros(2, device=self.device)
        for ids in input_ids.to(self.device).chunk(parts):
            out = self.model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
            (out.loss / parts).backward()
            losses += torch.stack([out.loss.detach().float(), out.aux_loss.detach().float()]) / parts
        return losses

    def train_step(self, input_ids: torch.Tensor) -> StepResult:
        lr = self.learning_rate(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        losses = self.accumulate_gradients(input_ids)
        clip = self.config.train.grad_clip or math.inf
        if self.ep is None:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        else:
            self.ep.reduce_gradients(self.model, self.own_experts)
            grad_norm = self.ep.grad_norm(self.model, self.own_experts)
            if math.isfinite(clip):
                torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), clip, grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        coef = self.config.model.router_aux_loss_coef
        if self.ep is not None:  # the global batch's
            losses = self.ep.mean(losses)
        loss, aux_loss, grad_norm = torch.cat([losses, grad_norm.float().view(1)]).tolist()  # one host sync
        return StepResult(loss=loss, lm_loss=loss - coef * aux_loss, aux_loss=aux_loss, grad_norm=grad_norm, lr=lr)

    def evaluate(self, batches: list[torch.Tensor]) -> float:
        """The language-model loss (no aux loss) over `batches`, without gradients, each batch run in
        [train].micro_batches parts as in training; with expert parallelism each rank passes its rows of
        every global batch and gets the mean over the ranks."""
        parts = self.config.train.micro_batches
        total = torch.zeros(1, device=self.device)
        self.model.eval()
        with torch.no_grad():
            for batch in batches:
                for ids in batch.to(self.device).chunk(parts):
                    total += self.model(input_ids=ids, labels=ids, use_cache=False).loss.float()
        self.model.train()
        total /= len(batches) * parts
        return (total if self.ep is None else self.ep.mean(total)).item()

    def save(self, path: Path) -> None:
        """Atomically (write, then rename): an interrupted save leaves the previous checkpoint intact."""
        state = {"step": self.step, "config": self.config.to_dict(), "model": self.model.state_dict(),
                 "optimizer": self.optimizer.state_dict()}
        tmp = path.with_name(path.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)

    def load(self, path: Path) -> None:
        state = torch.load(path, map_location=self.device, weights_only=True)
        saved_model = state["config"]["model"]
        if saved_model != self.config.to_dict()["model"]:
            raise ConfigError(f"{path} was written for a different [model] ({saved_model}); "
                              "resume with the config it was trained with, or start over with --fresh")
        saved_ranks = state["config"]["moe"].get("expert_parallel", 1)
        if saved_ranks != self.config.moe.expert_parallel:
            raise ConfigError(f"{path} holds one rank's experts of [moe].expert_parallel = {saved_ranks}, not "
                              f"{self.config.moe.expert_parallel}; resume with that many ranks, or start over "
                              "with --fresh")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
