"""megamoe as the experts of TorchTitan's MoE layers (torchtitan 0.3, `pip install ".[torchtitan]"`).

TorchTitan swaps model components through its override mechanism; this module registers one,
`megamoe.torchtitan.megamoe_experts`, for the routed experts (`RoutedExperts`: dispatch, the
grouped GEMMs, combine). Switch it on from TorchTitan's own configuration:

    --override.imports 'megamoe.torchtitan.megamoe_experts={"precision": "fp8"}'

(or `OverrideConfig(imports=[("megamoe.torchtitan.megamoe_experts", {...})])` in a config
function). Options: backend ("fused", or a baseline), precision ("bf16", "fp8", "fp8_bwd"),
recompute, activation as in `megamoe.moe`. The router, the shared experts, the load-balancing
state and everything else stay TorchTitan's; FSDP2 (`fully_shard`), activation checkpointing and
`torch.compile` apply to the replaced module as to the native one.

The experts' gate and up weights live in one parameter `w13 [E, 2F, D]`, `w2_EDF [E, D, F]` as
TorchTitan has it; checkpoints keep TorchTitan's `w1_EFD` / `w3_EFD` (torchtitan_layout.py).
torchtitan 0.2 (which runs on older PyTorch) is served by megamoe/torchtitan_converter.py instead.
Under expert parallelism (`expert_parallel_degree` > 1) megamoe's kernels exchange the tokens over
TorchTitan's EP mesh (`megamoe.moe(..., group=)`), in place of TorchTitan's token dispatcher.
Refused at configuration time: experts other than TorchTitan's SwiGLU `GroupedExperts`; at
parallelisation: tensor parallelism of the experts without EP, and EP with a baseline backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from torchtitan.config import derive, override
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

from .torchtitan_layout import checkpoint_split, local_part, routed_experts
from .validation import check_options

__all__ = ["MegaMoEExperts", "MegaMoERoutedExperts", "megamoe_experts"]


class MegaMoEExperts(GroupedExperts):
    """TorchTitan's grouped experts with gate and up in one weight, `w13 [E, 2F, D]`."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        del self.w1_EFD, self.w3_EFD
        self.w13 = nn.Parameter(torch.empty(config.num_experts, 2 * config.hidden_dim, config.dim))
        checkpoint_split(self, "w1_EFD", "w3_EFD")

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("MegaMoEExperts runs inside MegaMoERoutedExperts, which hands megamoe.moe the routing "
                           "itself; it is not called on dispatched tokens")


class MegaMoERoutedExperts(RoutedExperts):
    """TorchTitan's routed experts (dispatch, experts, combine) as one `megamoe.moe` call."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        backend: str = "fused"
        precision: str = "bf16"
        recompute: bool = False
        activation: str = "swiglu"

    def __init__(self, config: Config):
        super().__init__(config)
        self.backend, self.precision = config.backend, config.precision
        self.recompute, self.activation = config.recompute, config.activation
        self.group = None  # the EP mesh's process group once parallelised with expert parallelism

    def forward(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor, topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        experts = self.inner_experts
        return routed_experts(x_BLD, topk_expert_ids_BLK, topk_scores_BLK, local_part(experts.w13),
                              local_part(experts.w2_EDF), backend=self.backend, precision=self.precision,
                              recompute=self.recompute, activation=self.activation, group=self.group)

    def parallelize(self, parallel_dims) -> None:
        """Under expert parallelism TorchTitan hands this module each rank's share of the tokens with
        global expert ids and keeps this rank's experts (dim 0 of the weights, in EP-rank order): what
        megamoe.moe(..., group=) takes, so megamoe's kernels exchange the tokens over the EP mesh's group
        instead of TorchTitan's token dispatcher."""
        ep = getattr(parallel_dims, "ep_enabled", False)
        if getattr(parallel_dims, "tp_enabled", False) and not ep:
            raise ValueError("megamoe's TorchTitan experts do not serve tensor parallelism of the experts' hidden "
                             "dimension; set expert_parallel_degree > 1 (the experts then split over ranks whole) or "
                             "tensor_parallel_degree = 1")
        if ep and self.backend != "fused":
            raise ValueError(f"expert parallelism runs megamoe's backend='fused' (its kernels exchange the tokens), "
                             f"got backend={self.backend!r}")
        super().parallelize(parallel_dims)
        if ep:
            self.group = parallel_dims.get_optional_mesh("ep").get_group()


def _fused_init(gate: Callable | None, up: Callable | None) -> Callable | None:
    """The initialiser of w13 from those of w1 (gate rows) and w3 (up rows)."""
    if gate is None or up is None:
        return None

    def init(w13: torch.Tensor) -> None:
        inter = w13.shape[1] // 2
        gate(w13[:, :inter])
        up(w13[:, inter:])
    return init


@override(target=RoutedExperts.Config, description="megamoe: dispatch, grouped GEMMs and combine in fused kernels")
def megamoe_experts(cfg: RoutedExperts.Config, *, backend: str = "fused", precision: str = "bf16",
                    recompute: bool = False, activation: str = "swiglu") -> MegaMoERoutedExperts.Config:
    """TorchTitan override factory: cfg's routed experts through megamoe (options as megamoe.moe's)."""
    if type(cfg) is not RoutedExperts.Config or type(cfg.inner_experts) is not GroupedExperts.Config:
        raise ValueError(f"megamoe serves TorchTitan's SwiGLU GroupedExperts inside RoutedExperts; this model's "
                         f"experts are {type(cfg).__qualname__} with {type(cfg.inner_experts).__qualname__}. "
                         "Leave megamoe.torchtitan.megamoe_experts out of --override.imports for it")
    check_options(backend, precision, recompute, activation)
    inner = cfg.inner_experts
    param_init = inner.param_init
    if param_init is not None:
        param_init = {k: v for k, v in param_init.items() if k not in ("w1_EFD", "w3_EFD")}
        param_init["w13"] = _fused_init(inner.param_init.get("w1_EFD"), inner.param_init.get("w3_EFD"))
    fused = derive(inner, MegaMoEExperts.Config, param_init=param_init)
    if inner.sharding_config is not None:  # set by TorchTitan before overrides apply: w13 is placed as w1 was
        shardings = dict(inner.sharding_config.state_shardings)
        if "w1_EFD" in shardings:
            shardings["w13"] = shardings.pop("w1_EFD")
        shardings.pop("w3_EFD", None)
        fused.sharding_config = dataclasses.replace(inner.sharding_config, state_shardings=shardings)
    # megamoe moves the tokens itself: the dispatcher TorchTitan chose (all-to-all, DeepEP, ...) would
    # only hold communication buffers, so the module keeps the local one, which holds none.
    dispatcher = LocalTokenDispatcher.Config(num_experts=cfg.token_dispatcher.num_experts,
                                             top_k=cfg.token_dispatcher.top_k)
    return derive(cfg, MegaMoERoutedExperts.Config, inner_experts=fused, token_dispatcher=dispatcher,
                  backend=backend, precision=precision, recompute=recompute, activation=activation)
