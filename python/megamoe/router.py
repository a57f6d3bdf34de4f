"""The Qwen3-MoE router and the load-balancing loss, as transformers computes them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F


class Routing(NamedTuple):
    router_logits: torch.Tensor  # [T, E] in the hidden states' dtype: what the aux loss consumes
    topk_ids: torch.Tensor  # [T, K] int64
    topk_weights: torch.Tensor  # [T, K] fp32


def route(hidden_states: torch.Tensor, gate_weight: torch.Tensor, top_k: int, norm_topk_prob: bool = True,
          expert_bias: torch.Tensor | None = None) -> Routing:
    """Qwen3's router: linear gate without bias → fp32 softmax → top-k → optional renormalisation.

    expert_bias [E] (aux-loss-free balancing, DeepSeek-V3) shifts which experts are selected but not
    their weights, which stay the unbiased probabilities. The weights stay fp32 (Qwen3 rounds them
    to the hidden dtype; megamoe.moe takes them in fp32).
    """
    router_logits = F.linear(hidden_states, gate_weight)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    if expert_bias is None:
        topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    else:
        topk_ids = torch.topk(probs + expert_bias, top_k, dim=-1).indices
        topk_weights = probs.gather(-1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return Routing(router_logits, topk_ids, topk_weights)


def load_balancing_loss(router_logits: torch.Tensor | Sequence[torch.Tensor], top_k: int,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The auxiliary loss of transformers' Qwen3-MoE (`load_balancing_loss_func`), over one layer's
    router logits [T, E] or a sequence of layers'.

    E · Σ_e f_e · P_e, where f_e = top-k assignments to expert e per token and P_e = mean router
    probability of e, both summed over layers and divided by the (unmasked) token count of all
    layers together. attention_mask [B, S] (T = B·S) leaves padding tokens out. Uniform routing
    gives K, as in transformers.
    """
    layers = [router_logits] if isinstance(router_logits, torch.Tensor) else list(router_logits)
    num_tokens, num_experts = layers[0].shape
    device = layers[0].device
    mask = (torch.ones(num_tokens, device=device) if attention_mask is None
            else attention_mask.reshape(-1).to(device, torch.float32))
    assignments = torch.zeros(num_experts, device=device)
    prob_sum = torch.zeros(num_experts, device=device)
    for logits in layers:
        probs = torch.softmax(logits, dim=-1)  # in the logits' dtype, as transformers does
        selected = torch.topk(probs, top_k, dim=-1).indices
        assignments = assignments.scatter_add(0, selected.flatten(), mask.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs.float() * mask[:, None]).sum(dim=0)
    rows = mask.sum() * len(layers)
    return num_experts * torch.sum((assignments / rows) * (prob_sum / rows))
