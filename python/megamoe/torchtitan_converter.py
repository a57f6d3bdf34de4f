"""megamoe as the experts of TorchTitan's MoE layers, torchtitan 0.2 (the release that runs on
PyTorch 2.9 - 2.11; torchtitan 0.3 is served by megamoe/torchtitan.py). TorchTitan 0.2 modifies models
through registered model converters; this module registers three, one per precision:

    --experimental.custom_import megamoe.torchtitan_converter --model.converters megamoe
    (or megamoe_fp8, megamoe_fp8_bwd)

Each MoE layer (`torchtitan.models.moe.MoE`) keeps its router, shared experts and load-balancing
state; its token reordering, grouped experts and unpermute run as one `megamoe.moe` call on the
router's ids and scores. The experts' gate and up weights become one `w13 [E, 2F, D]`, checkpointed
as TorchTitan's `w1` / `w3` (torchtitan_layout.py). Under expert parallelism 0.2's `ExpertParallel`
moves the tokens with its all-to-alls around the experts module (and gives the experts an FSDP unit
of their own, which gathers their weights when that module is called): there the layer runs
TorchTitan's own MoE forward and megamoe computes each rank's experts on the rows they receive.
Refused when converting: a model without MoE layers, experts scored before the MLP
(`score_before_experts`, not the same function for a gated MLP), tensor parallelism.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.models.moe.moe import GroupedExperts, MoE
from torchtitan.models.utils import trunc_normal_
from torchtitan.protocols.model_converter import register_model_converter

from .torchtitan_layout import checkpoint_split, local_part, routed_experts
from .validation import check_options

__all__ = ["MegaMoEConverter", "MegaMoEGroupedExperts", "MegaMoELayer", "convert_moe_layers"]


class MegaMoEGroupedExperts(nn.Module):
    """TorchTitan 0.2's GroupedExperts with gate and up in one weight, `w13 [E, 2F, D]`."""

    megamoe_options: dict

    def __init__(self, experts: GroupedExperts):
        super().__init__()
        self.num_experts = experts.num_experts
        with torch.no_grad():  # also on the meta device, where TorchTitan converts before init_weights
            self.w13 = nn.Parameter(torch.cat([experts.w1, experts.w3], dim=1))
        self.w2 = experts.w2
        checkpoint_split(self, "w1", "w3")

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Each row of x [R, D] through its expert, as TorchTitan's GroupedExperts computes it: the rows
        come grouped by expert, num_tokens_per_expert [E_local] of each, padding rows after them (zero
        out). The layer calls this under expert parallelism, where ExpertParallel's all-to-alls hand
        this module each rank's rows."""
        ends = num_tokens_per_expert.cumsum(0)
        expert = torch.searchsorted(ends, torch.arange(x.shape[0], device=x.device), right=True)
        expert = torch.where(expert < ends.numel(), expert, -1)  # padding rows: masked routes
        ones = torch.ones(x.shape[0], 1, device=x.device)
        return routed_experts(x, expert[:, None], ones, local_part(self.w13), local_part(self.w2),
                              **self.megamoe_options)

    def init_weights(self, init_std: float) -> None:
        """As GroupedExperts.init_weights: w1 (the gate rows) at std 0.02, w2 and w3 at init_std."""
        inter = self.w13.shape[1] // 2
        trunc_normal_(self.w13[:, :inter], mean=0.0, std=0.02)
        trunc_normal_(self.w2, mean=0.0, std=init_std)
        trunc_normal_(self.w13[:, inter:], mean=0.0, std=init_std)


class MegaMoELayer(MoE):
    """TorchTitan 0.2's MoE layer with the routed experts through megamoe (the class of a converted MoE)."""

    megamoe_options: dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _split_over_ep(self.experts):  # TorchTitan's all-to-alls move the rows; megamoe runs the experts
            return super().forward(x)
        bs, slen, dim = x.shape
        tokens = x.view(-1, dim)
        top_scores, selected_experts_indices, num_tokens_per_expert = self.router(tokens, self.expert_bias)
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert)
        out = routed_experts(tokens, selected_experts_indices, top_scores, self.experts.w13, self.experts.w2,
                             **self.megamoe_options)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.reshape(bs, slen, dim)


def _split_over_ep(experts: MegaMoEGroupedExperts) -> bool:
    """Whether TorchTitan's ExpertParallel split these experts over its EP mesh (as TorchTitan's own
    GroupedExperts tells)."""
    return isinstance(experts.w13, DTensor) and "ep" in (experts.w13.device_mesh.mesh_dim_names or ())


def convert_moe_layers(model: nn.Module, **options) -> int:
    """Converts every TorchTitan MoE layer of `model` in place; options: megamoe.moe's backend,
    precision, recompute, activation. Returns how many layers it converted."""
    check_options(**{"backend": "fused", **options})
    layers = [m for m in model.modules() if type(m) is MoE]
    if not layers:
        raise ValueError("megamoe found no torchtitan.models.moe.MoE layer in this model; leave the megamoe "
                         "converter out of --model.converters for it")
    for layer in layers:
        if layer.score_before_experts:
            raise ValueError("megamoe computes Σ score · expert(x); this MoE scores tokens before its experts "
                             "(score_before_experts=True), which is another function of a gated MLP")
        if type(layer.experts) is not GroupedExperts:
            raise ValueError(f"megamoe serves TorchTitan's GroupedExperts, not {type(layer.experts).__qualname__}")
        layer.experts = MegaMoEGroupedExperts(layer.experts)
        layer.__class__ = MegaMoELayer
        layer.megamoe_options = layer.experts.megamoe_options = dict(options)
    return len(layers)


class MegaMoEConverter:
    """TorchTitan 0.2 model converter (bf16); MegaMoEFp8Converter and MegaMoEFp8BwdConverter set the
    precision."""

    precision = "bf16"

    def __init__(self, job_config, parallel_dims):
        if parallel_dims.tp > 1:  # its MoE plan splits the routed tokens over the TP ranks in the reorderer
            raise ValueError(f"megamoe's TorchTitan 0.2 experts do not serve tensor parallelism (degree "
                             f"{parallel_dims.tp}); expert parallelism, FSDP and data parallelism are served")

    def convert(self, model: nn.Module) -> None:
        convert_moe_layers(model, precision=self.precision)

    def post_optimizer_hook(self, model) -> None:
        pass


class MegaMoEFp8Converter(MegaMoEConverter):
    precision = "fp8"


class MegaMoEFp8BwdConverter(MegaMoEConverter):
    precision = "fp8_bwd"


register_model_converter(MegaMoEConverter, "megamoe")
register_model_converter(MegaMoEFp8Converter, "megamoe_fp8")
register_model_converter(MegaMoEFp8BwdConverter, "megamoe_fp8_bwd")
