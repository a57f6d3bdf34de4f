"""What megamoe's TorchTitan adapters share (megamoe/torchtitan.py: the override for torchtitan 0.3;
megamoe/torchtitan_converter.py: the model converter for 0.2): the experts' gate and up weights as
one parameter w13 [E, 2F, D] (gate rows, then up rows: what the kernels read, so a step copies no
weights), checkpointed in TorchTitan's split layout, this rank's part of a distributed weight, and the
routed experts as one megamoe.moe call."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .functional import moe


def checkpoint_split(module: nn.Module, gate: str, up: str) -> None:
    """State dicts of `module` hold w13 as TorchTitan's `gate` and `up` [E, F, D] (split on save,
    merged on load), so checkpoints move between the native and the megamoe model both ways."""
    def split(module, state_dict, prefix, local_metadata) -> None:
        w13 = state_dict.pop(f"{prefix}w13")
        inter = w13.shape[1] // 2
        state_dict[f"{prefix}{gate}"], state_dict[f"{prefix}{up}"] = w13[:, :inter], w13[:, inter:]

    def merge(module, state_dict, prefix, *args) -> None:
        if f"{prefix}{gate}" in state_dict and f"{prefix}{up}" in state_dict:
            state_dict[f"{prefix}w13"] = torch.cat([state_dict.pop(f"{prefix}{gate}"),
                                                    state_dict.pop(f"{prefix}{up}")], dim=1)

    module.register_state_dict_post_hook(split)
    module.register_load_state_dict_pre_hook(merge)


def local_part(weight: torch.Tensor) -> torch.Tensor:
    """This rank's part of a weight TorchTitan distributed as a DTensor (plain tensors as they are)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def routed_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_scores: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor, **options) -> torch.Tensor:
    """Σ_k score · expert(x) for x [..., D], ids and scores [..., K], as TorchTitan's grouped experts
    compute it: bf16 operands (under FSDP's mixed precision the casts are no-ops), x's dtype out.
    options: megamoe.moe's backend, precision, recompute, activation."""
    dim, top_k = x.shape[-1], topk_ids.shape[-1]
    y = moe(x.reshape(-1, dim).bfloat16(), topk_ids.reshape(-1, top_k), topk_scores.reshape(-1, top_k).float(),
            w13.bfloat16(), w2.bfloat16(), **options)
    return y.view(x.shape).type_as(x)
