"""`MoELayer`: a full MoE block (Qwen3 router + experts through `megamoe.moe`), see docs/DESIGN.md."""

from __future__ import annotations

import torch
from torch import nn

from .activation import check_activation
from .functional import moe
from .router import route
from .validation import BACKENDS, PRECISIONS, check_recompute, group_rank_and_size


class MoELayer(nn.Module):
    """Router as Qwen3 (linear gate, fp32 softmax, top-k, optional renormalisation) and gated experts
    (activation: one of megamoe.activation.ACTIVATIONS, SwiGLU by default).

    forward(hidden_states [..., H]) -> (y [..., H], router_logits [T, E]); the logits feed
    `megamoe.load_balancing_loss` (the aux loss of transformers' Qwen3-MoE).

    With use_expert_bias, a bias buffer [E] shifts expert *selection* (not the weights) and
    `update_expert_bias` nudges it towards balanced load (aux-loss-free balancing, DeepSeek-V3).

    With a process group of W ranks, w13/w2 hold this rank's E/W experts (docs/DESIGN.md); the router
    still scores all E experts.

    recompute (fused only): the experts keep only their inputs for the backward and recompute the
    rest there (`megamoe.moe(..., recompute=True)`): activation checkpointing of the experts, cheaper
    than wrapping them in torch.utils.checkpoint.

    dtype (default torch.bfloat16, what backend='fused' computes in): the gate's and the experts'
    parameters; forward takes hidden states of this dtype (the router's softmax runs in fp32).
    """

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool = True, backend: str = "fused", precision: str = "bf16", group=None,
                 *, use_expert_bias: bool = False, recompute: bool = False, initializer_range: float = 0.02,
                 activation: str = "swiglu", device=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        check_recompute(backend, recompute)
        self.activation = check_activation(activation)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must lie in [1, num_experts = {num_experts}], got {top_k}")
        _, world = group_rank_and_size(group)
        if num_experts % world:
            raise ValueError(f"num_experts = {num_experts} must be divisible by the group size {world}")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.norm_topk_prob, self.backend, self.precision, self.group = norm_topk_prob, backend, precision, group
        self.recompute = recompute
        self.initializer_range = initializer_range
        factory = dict(device=device, dtype=dtype)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        local = num_experts // world
        self.w13 = nn.Parameter(torch.empty(local, 2 * moe_intermediate_size, hidden_size, **factory))
        self.w2 = nn.Parameter(torch.empty(local, hidden_size, moe_intermediate_size, **factory))
        if use_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
            # Selections per expert in the last forward. Overwritten, not accumulated, so that a
            # recomputation under activation checkpointing does not count tokens twice.
            self.register_buffer("expert_load", torch.zeros(num_experts, device=device, dtype=torch.float32),
                                 persistent=False)
        else:
            self.register_buffer("expert_bias", None)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """As transformers initialises Qwen3-MoE: N(0, initializer_range) for the gate and the experts."""
        for weight in (self.gate.weight, self.w13, self.w2):
            weight.normal_(0.0, self.initializer_range)
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if hidden_states.dtype != self.w13.dtype:
            raise TypeError(
                f"MoELayer got hidden_states in {hidden_states.dtype} but its parameters are {self.w13.dtype}; "
                f"cast the input (hidden_states.to({self.w13.dtype})) or build the layer with "
                f"dtype={hidden_states.dtype} (backend='fused' computes in torch.bfloat16)")
        x = hidden_states.reshape(-1, self.hidden_size)
        routing = route(x, self.gate.weight, self.top_k, self.norm_topk_prob, self.expert_bias)
        if self.expert_bias is not None:
            with torch.no_grad():  # index_add_ rather than bincount: no host synchronisation
                ids = routing.topk_ids.flatten()
                self.expert_load.zero_().index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
        y = moe(x.contiguous(), routing.topk_ids, routing.topk_weights, self.w13, self.w2,
                backend=self.backend, precision=self.precision, group=self.group, recompute=self.recompute,
                activation=self.activation)
        return y.view(hidden_states.shape), routing.router_logits

    @torch.no_grad()
    def update_expert_bias(self, expert_load: torch.Tensor | None = None, rate: float = 1e-3) -> None:
        """bias_e += rate · sign(mean load − load_e): overloaded experts become less likely to be picked.

        expert_load [E] defaults to the last forward's selections; with gradient accumulation or data
        parallelism pass the load summed over micro-batches / ranks.
        """
        if self.expert_bias is None:
            raise RuntimeError("this MoELayer has no expert bias (construct it with use_expert_bias=True)")
        load = (self.expert_load if expert_load is None else expert_load).to(self.expert_bias)
        self.expert_bias.add_(rate * torch.sign(load.mean() - load))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, moe_intermediate_size={self.w2.shape[-1]}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}, "
                f"activation={self.activation!r}, backend={self.backend!r}, precision={self.precision!r}, "
                f"recompute={self.recompute}, expert_bias={self.expert_bias is not None}")
