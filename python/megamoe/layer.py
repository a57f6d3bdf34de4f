"""`MoELayer`: a full MoE block (Qwen3 router + experts through `megamoe.moe`), see docs/DESIGN.md."""

from __future__ import annotations

import functools

import torch
from torch import nn

from .functional import moe
from .router import route
from .validation import check_options, group_rank_and_size


class MoELayer(nn.Module):
    """Router as Qwen3 (linear gate, fp32 softmax, top-k, optional renormalisation) and gated experts
    (activation: one of megamoe.activation.ACTIVATIONS, SwiGLU by default).

    forward(hidden_states [..., H]) -> (y [..., H], router_logits [T, E]); the logits feed
    `megamoe.load_balancing_loss` (the aux loss of transformers' Qwen3-MoE).

    With use_expert_bias, a bias buffer [E] shifts expert *selection* (not the weights) and
    `update_expert_bias` nudges it towards balanced load (aux-loss-free balancing, DeepSeek-V3).

    With a process group of W ranks, w13/w2 hold this rank's E/W experts (docs/DESIGN.md); the router
    still scores all E experts.

    recompute (fused only): False, "gather" or True, as in `megamoe.moe`: with True the experts keep
    only their inputs for the backward and recompute the rest there (activation checkpointing of the
    experts, cheaper than wrapping them in torch.utils.checkpoint); "gather" keeps z but not the pool
    of x.

    dtype (default torch.bfloat16, what backend='fused' computes in): the gate's and the experts'
    parameters; forward takes hidden states of this dtype (the router's softmax runs in fp32).

    shared_expert_intermediate_size (DeepSeek-V3, Qwen2-MoE): a gated MLP of that width that every
    token goes through, added to the routed experts' output; with shared_expert_gate, scaled per
    token by sigmoid(x · shared_expert_gate) (Qwen2-MoE). It runs in the same experts call as the
    routed ones: its width is cut into S = width / moe_intermediate_size slices of the experts'
    size (the activation is elementwise, so the slices' outputs add up to the MLP's), stored as the
    last S experts of w13 / w2, and every token is routed to all S with its gate as weight. With a
    group, the shared slices are replicated on every rank as shared_w13 [S, 2I, H] / shared_w2 [S, H, I]
    (average their gradients over the ranks, as the gate's) and run on the rank's own tokens in a
    second, local experts call. load_shared_expert copies a transformers-layout shared MLP in.
    """

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool = True, backend: str = "fused", precision: str = "bf16", group=None,
                 *, use_expert_bias: bool = False, recompute: bool | str = False, initializer_range: float = 0.02,
                 activation: str = "swiglu", shared_expert_intermediate_size: int = 0,
                 shared_expert_gate: bool = False, device=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        check_options(backend, precision, recompute, activation, group)
        self.activation = activation
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must lie in [1, num_experts = {num_experts}], got {top_k}")
        self.num_shared = _shared_slices(shared_expert_intermediate_size, moe_intermediate_size, shared_expert_gate)
        _, world = group_rank_and_size(group)
        if num_experts % world:
            raise ValueError(f"num_experts = {num_experts} must be divisible by the group size {world}")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.norm_topk_prob, self.backend, self.precision, self.group = norm_topk_prob, backend, precision, group
        self.recompute = recompute
        self.initializer_range = initializer_range
        factory = dict(device=device, dtype=dtype)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        # One rank holds the shared slices as its last experts (one experts call); a group replicates them.
        local = num_experts // world + (self.num_shared if group is None else 0)
        self.w13 = nn.Parameter(torch.empty(local, 2 * moe_intermediate_size, hidden_size, **factory))
        self.w2 = nn.Parameter(torch.empty(local, hidden_size, moe_intermediate_size, **factory))
        if self.num_shared and group is not None:
            self.shared_w13 = nn.Parameter(torch.empty(self.num_shared, 2 * moe_intermediate_size, hidden_size,
                                                       **factory))
            self.shared_w2 = nn.Parameter(torch.empty(self.num_shared, hidden_size, moe_intermediate_size, **factory))
        else:
            self.shared_w13 = self.shared_w2 = None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, **factory) if shared_expert_gate else None
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
        gates = (self.gate,) + ((self.shared_expert_gate,) if self.shared_expert_gate is not None else ())
        for weight in (*(g.weight for g in gates), self.w13, self.w2, self.shared_w13, self.shared_w2):
            if weight is not None:
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
        x = x.contiguous()
        experts = functools.partial(moe, backend=self.backend, precision=self.precision, recompute=self.recompute,
                                    activation=self.activation)
        topk_ids, topk_weights = routing.topk_ids, routing.topk_weights
        if self.num_shared and self.group is None:
            shared_ids, shared_weights = self._shared_routes(x, topk_ids, first=self.num_experts)
            topk_ids, topk_weights = torch.cat([topk_ids, shared_ids], 1), torch.cat([topk_weights, shared_weights], 1)
        y = experts(x, topk_ids, topk_weights, self.w13, self.w2, group=self.group)
        if self.num_shared and self.group is not None:
            shared_ids, shared_weights = (t.contiguous() for t in self._shared_routes(x, topk_ids, first=0))
            y = y + experts(x, shared_ids, shared_weights, self.shared_w13, self.shared_w2)
        return y.view(hidden_states.shape), routing.router_logits

    def _shared_routes(self, x: torch.Tensor, topk_ids: torch.Tensor, first: int):
        """Every token's routes to the S slices of the shared expert (experts first .. first + S - 1),
        weighted by its gate (1 without shared_expert_gate), in topk_ids' dtype and fp32, as expanded
        views."""
        tokens = x.shape[0]
        ids = torch.arange(first, first + self.num_shared, device=topk_ids.device, dtype=topk_ids.dtype)
        if self.shared_expert_gate is None:
            gate = torch.ones(tokens, 1, device=x.device, dtype=torch.float32)
        else:
            gate = torch.sigmoid(self.shared_expert_gate(x).float())
        return ids.expand(tokens, -1), gate.expand(-1, self.num_shared)

    @torch.no_grad()
    def load_shared_expert(self, gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
        """Copies a shared MLP in transformers' layout (gate_proj, up_proj [I_s, H], down_proj [H, I_s])
        into its slices of w13 / w2."""
        if not self.num_shared:
            raise RuntimeError("this MoELayer has no shared expert (construct it with shared_expert_intermediate_size)")
        inter, hidden = self.w2.shape[-1], self.hidden_size
        width = self.num_shared * inter
        for name, weight, shape in (("gate_proj", gate_proj, (width, hidden)), ("up_proj", up_proj, (width, hidden)),
                                    ("down_proj", down_proj, (hidden, width))):
            if tuple(weight.shape) != shape:
                raise ValueError(f"{name} must be {list(shape)} for this layer's shared expert, got "
                                 f"{list(weight.shape)}")
        if self.shared_w13 is None:
            first = self.w13.shape[0] - self.num_shared
            w13, w2 = self.w13[first:], self.w2[first:]
        else:
            w13, w2 = self.shared_w13, self.shared_w2
        w13[:, :inter].copy_(gate_proj.view(self.num_shared, inter, hidden))
        w13[:, inter:].copy_(up_proj.view(self.num_shared, inter, hidden))
        w2.copy_(down_proj.view(hidden, self.num_shared, inter).transpose(0, 1))

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
                f"recompute={self.recompute!r}, expert_bias={self.expert_bias is not None}, "
                f"shared_expert_slices={self.num_shared}, shared_expert_gate={self.shared_expert_gate is not None}")


def _shared_slices(width: int, inter: int, gate: bool) -> int:
    """How many expert-sized slices a shared expert of intermediate size `width` takes (0: none)."""
    if width == 0:
        if gate:
            raise ValueError("shared_expert_gate needs a shared expert (shared_expert_intermediate_size > 0)")
        return 0
    if width < 0 or width % inter:
        raise ValueError(f"shared_expert_intermediate_size must be a positive multiple of moe_intermediate_size = "
                         f"{inter} (it runs as slices of the experts' size), got {width}")
    return width // inter
