"""Experts that transformers' own expert parallelism splits (`DistributedConfig(ep_size=W)`, 5.24 on).

transformers keeps each rank's experts (`MoEParamShard`, which sets `_is_expert_parallel`) and brings
them their tokens through an `EPImplementation` of its registry. Patched without a group, those
modules keep transformers' exchange (hf.py masks its off-rank routes). Patched with the EP group,
their tokens travel through `megamoe.moe(..., group=)` instead: `MegamoeExchange`, installed by
transformers' own `EpDispatchExpertsParallel`, hands the experts' forward (megamoe's, patched with the
group) this rank's rows with global ids. Ranks of a TP group share one batch, so each sends only its
slice, and the slices are gathered back, by c10d all-gathers (functional collectives over gloo crash
where the tensors are on a GPU).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .validation import group_rank_and_size

# On an experts module whose tokens megamoe exchanges over transformers' EP ranks: (rank, world).
_EXCHANGE = "_megamoe_exchange"


def split_by_transformers(experts: nn.Module) -> bool:
    """Whether transformers' expert parallelism keeps only this rank's experts in `experts`."""
    return getattr(experts, "_is_expert_parallel", False)


def exchange_tokens(name: str, experts: nn.Module, group, model: nn.Module) -> None:
    """Makes megamoe exchange the tokens of `experts`, which transformers split over its EP mesh, over
    `group` (nothing for group None: transformers' exchange stays), once: a module megamoe already
    exchanges for must be patched with the same group."""
    shard = None if group is None else group_rank_and_size(group)
    held = vars(experts).get(_EXCHANGE)
    if held == shard:
        return
    if held is not None:
        raise ValueError(f"{name} exchanges its tokens over megamoe's group of rank {held[0]} of {held[1]} (patched "
                         "with a group before); patch a freshly loaded model to change that")
    import torch.distributed as dist
    try:
        from transformers.distributed.expert_parallel import EpDispatchExpertsParallel, EPImplementationInterface
    except ImportError as error:
        raise ValueError(f"{name} is split by an earlier form of transformers' expert parallelism: megamoe exchanges "
                         "its tokens through transformers' EPImplementationInterface (5.23 on); patch without group= "
                         "to keep transformers' exchange") from error
    meshes = getattr(model, "_mesh_manager", None)
    if meshes is None:
        raise ValueError(f"{name} is split over expert-parallel ranks, but {type(model).__name__} has no device "
                         "meshes of transformers: load it with from_pretrained(..., distributed_config=...)")
    ep_mesh, tp_mesh = meshes.get_mesh("ep"), meshes.get_mesh("tp")
    ep_ranks = dist.get_process_group_ranks(ep_mesh.get_group())
    if dist.get_process_group_ranks(group) != ep_ranks:
        raise ValueError(f"transformers split the experts of {name} over the ranks {ep_ranks} (its EP mesh): group= "
                         "must hold those ranks in that order (dist.group.WORLD where ep_size is the world size), or "
                         "patch without group= to keep transformers' token exchange")
    EPImplementationInterface.register("megamoe", _megamoe_exchange())
    EpDispatchExpertsParallel().install_forward(experts, ep_mesh, tp_mesh=tp_mesh, ep_implementation="megamoe")
    setattr(experts, _EXCHANGE, shard)


@functools.cache
def _megamoe_exchange() -> type:
    """transformers' EPImplementation whose tokens megamoe.moe(..., group=) exchanges."""
    from transformers.distributed.expert_parallel import EPImplementation

    class MegamoeExchange(EPImplementation):
        """This rank's rows, with global expert ids and the routing weights, to the experts' forward:
        where its TP ranks share the batch, its slice of it (padded with masked routes to an equal
        share), the slices gathered back after."""

        def __init__(self, experts, ep_mesh, tp_mesh):
            super().__init__(experts, ep_mesh, tp_mesh)
            self.experts = experts

        def __call__(self, hidden_states, top_k_index, top_k_weights):
            if vars(self.experts).get(_EXCHANGE) is None:  # e.g. named at loading, after an earlier patch registered it
                raise RuntimeError("ep_implementation 'megamoe' runs experts that megamoe.patch_hf_model(model, "
                                   "group=...) serves: load the model with another ep_implementation and patch it")
            if self.tp_mesh.size() == 1:  # this rank's own batch
                return type(self.experts).forward(self.experts, hidden_states, top_k_index, top_k_weights)
            tp_group, num_tokens = self.tp_mesh.get_group(), hidden_states.shape[0]
            hidden_states = _OwnRows.apply(hidden_states, tp_group)
            top_k_weights = _OwnRows.apply(top_k_weights, tp_group)
            top_k_index = _own_rows(top_k_index, tp_group, fill=-1)
            output = type(self.experts).forward(self.experts, hidden_states, top_k_index, top_k_weights)
            return _AllRows.apply(output, tp_group, num_tokens)

    return MegamoeExchange


def _share(rows: int, group) -> tuple[int, int]:
    """(this rank's first row, rows per rank) of a batch of `rows` split evenly over `group`."""
    rank, world = group_rank_and_size(group)
    share = -(-rows // world)
    return rank * share, share


def _own_rows(t: torch.Tensor, group, fill=0) -> torch.Tensor:
    """This rank's share of the rows of `t`, padded with `fill` to the share's size."""
    start, share = _share(t.shape[0], group)
    rows = t[start:start + share]
    padding = share - rows.shape[0]
    return F.pad(rows, (0, 0) * (t.dim() - 1) + (0, padding), value=fill) if padding else rows


def _all_rows(t: torch.Tensor, group, rows: int) -> torch.Tensor:
    """Every rank's share `t` of a batch of `rows`, in rank order."""
    import torch.distributed as dist

    gathered = t.new_empty((group_rank_and_size(group)[1] * t.shape[0], *t.shape[1:]))
    dist.all_gather_into_tensor(gathered, t.contiguous(), group=group)
    return gathered[:rows]


class _OwnRows(torch.autograd.Function):
    """This rank's share of a batch every rank of the group holds; its gradient is every rank's."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group, ctx.rows = group, t.shape[0]
        return _own_rows(t, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_rows(grad, ctx.group, ctx.rows), None


class _AllRows(torch.autograd.Function):
    """The batch from every rank's share; the gradient of a share is its rows of the batch's."""

    @staticmethod
    def forward(ctx, t, group, rows):
        ctx.group = group
        return _all_rows(t, group, rows)

    @staticmethod
    def backward(ctx, grad):
        return _own_rows(grad, ctx.group), None, None
