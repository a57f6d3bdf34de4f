"""megamoe as TorchTitan 0.2's MoE experts (megamoe.torchtitan_converter): a converted MoE layer gives
TorchTitan's own layer output and gradients from the same weights (on a GPU), checkpoints in
TorchTitan's layout, initialises as TorchTitan does, serves TorchTitan's expert parallelism, and the
refusals. Skipped without torchtitan 0.2
(0.3 has no torchtitan.models.moe; test_torchtitan.py covers it)."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("torchtitan.models.moe.moe")

from torchtitan.models.moe.moe import MoE, MoEArgs  # noqa: E402

from megamoe.reference import relative_error  # noqa: E402

from conftest import HAS_CUDA, requires_cuda  # noqa: E402
from fsdp_sharding import check_fully_shard  # noqa: E402
from torchtitan_exchange import exchange_on_the_cpu  # noqa: E402
from megamoe.torchtitan_converter import (MegaMoEConverter, MegaMoEGroupedExperts, MegaMoELayer,  # noqa: E402
                                          convert_moe_layers)


def _layer(shared: int = 1, score_before_experts: bool = False) -> MoE:
    torch.manual_seed(0)
    args = MoEArgs(num_experts=8, num_shared_experts=shared, score_func="softmax", route_norm=True, top_k=2,
                   score_before_experts=score_before_experts, use_grouped_mm=False)
    layer = MoE(args, dim=128, hidden_dim=128)  # tile multiples: the fused kernels' sizes
    with torch.no_grad():  # as TorchTitan's trainer initialises
        layer.init_weights(0.02, buffer_device=torch.device("cpu"))
    return layer


@pytest.mark.parametrize("shared", [0, 1])
def test_conversion_keeps_torchtitans_checkpoint_layout(shared):
    native = _layer(shared)
    converted = copy.deepcopy(native)
    assert convert_moe_layers(converted, backend="grouped") == 1
    assert type(converted) is MegaMoELayer and isinstance(converted.experts, MegaMoEGroupedExperts)
    assert converted.state_dict().keys() == native.state_dict().keys()  # w13 saved as TorchTitan's w1 / w3
    for key, value in native.state_dict().items():
        assert torch.equal(converted.state_dict()[key], value), key
    converted.load_state_dict(native.state_dict())


@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("backend, device", [("grouped", "cpu"), ("naive", "cpu"),
                                             pytest.param("fused", "cuda", marks=requires_cuda)])
def test_converted_layer_matches_torchtitans(backend, device, shared, monkeypatch):
    if device == "cpu":  # TorchTitan 0.2 counts tokens with torch.histc, which has no CPU kernel for int64
        monkeypatch.setattr(torch, "histc", lambda ids, bins, min, max: torch.bincount(ids, minlength=bins))
    native = _layer(shared).to(device)
    converted = copy.deepcopy(native)
    convert_moe_layers(converted, backend=backend)
    x = torch.randn(2, 24, 128, device=device)
    results = {}
    for name, layer in (("native", native), ("megamoe", converted)):
        xg = x.clone().requires_grad_()
        y = layer(xg)
        y.float().square().mean().backward()
        w13_grad = (layer.experts.w13.grad if name == "megamoe"
                    else torch.cat([layer.experts.w1.grad, layer.experts.w3.grad], dim=1))
        results[name] = (y, xg.grad, w13_grad, layer.experts.w2.grad, layer.router.gate.weight.grad)
    for got, want in zip(results["megamoe"], results["native"]):
        assert relative_error(got, want) < 2e-2  # two bf16 computations, each within 1e-2 of exact
    assert torch.equal(converted.tokens_per_expert, native.tokens_per_expert)


def test_init_weights_keeps_torchtitans_scales():
    layer = _layer(shared=0)
    convert_moe_layers(layer)
    with torch.no_grad():
        layer.experts.init_weights(0.005)
    inter = layer.experts.w13.shape[1] // 2
    assert 0.015 < layer.experts.w13[:, :inter].std().item() < 0.025  # w1 (gate): 0.02 as TorchTitan
    assert layer.experts.w13[:, inter:].std().item() < 0.007  # w3: init_std


def test_refusals():
    with pytest.raises(ValueError, match="found no torchtitan.models.moe.MoE layer"):
        convert_moe_layers(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="score_before_experts=True"):
        convert_moe_layers(_layer(score_before_experts=True))

    class Dims:
        ep, tp = 2, 2
    with pytest.raises(ValueError, match="do not serve tensor parallelism"):
        MegaMoEConverter(None, Dims())


def _converted_layer() -> MoE:
    torch.histc = lambda ids, bins, min, max: torch.bincount(ids, minlength=bins)  # no int64 CPU histc
    layer = _layer(shared=1)
    convert_moe_layers(layer, backend="grouped")
    return layer


def test_fully_shard_shards_megamoes_experts_as_torchtitans(tmp_path):
    """FSDP2 over 2 CPU processes on a converted layer: the same output and gradients as unsharded."""
    check_fully_shard(_converted_layer, (2, 24, 128), tmp_path)


EP_WORLD = 2


def _rank_matches_one_process(rank: int, store: str, device: str) -> None:
    """This rank's own batch through a converted layer whose experts TorchTitan's ExpertParallel split
    over the ranks, against both ranks' batches through the layer in one process: output, input
    gradient, this rank's experts' gradients, and the router's and shared expert's gradients summed
    over the ranks (the data-parallel reduction)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import ExpertParallel

    import megamoe.torchtitan_converter as adapter
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # one GPU may serve both ranks
    else:
        exchange_on_the_cpu(adapter)
        torch.histc = lambda ids, bins, min, max: torch.bincount(ids, minlength=bins)  # no int64 CPU histc
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=EP_WORLD)
    one_process = _layer(shared=1).to(device)
    layer = copy.deepcopy(one_process)
    convert_moe_layers(one_process, backend="fused" if device == "cuda" else "grouped")
    convert_moe_layers(layer, backend="fused")
    parallelize_module(layer.experts, init_device_mesh(device, (EP_WORLD,)), ExpertParallel())  # as TorchTitan's plan
    assert isinstance(layer.experts.w13, DTensor)

    batches = torch.randn(EP_WORLD, 2, 24, 128, generator=torch.Generator().manual_seed(1)).to(device)
    x = batches[rank].clone().requires_grad_()
    y = layer(x)
    y.float().square().sum().backward()
    x_all = batches.flatten(0, 1).clone().requires_grad_()
    y_all = one_process(x_all)
    y_all.float().square().sum().backward()

    own_tokens, share = slice(2 * rank, 2 * rank + 2), layer.experts.num_experts // EP_WORLD
    own_experts = slice(share * rank, share * (rank + 1))
    pairs = {"output": (y, y_all[own_tokens]), "x grad": (x.grad, x_all.grad[own_tokens]),
             "w13 grad": (layer.experts.w13.grad.to_local(), one_process.experts.w13.grad[own_experts]),
             "w2 grad": (layer.experts.w2.grad.to_local(), one_process.experts.w2.grad[own_experts])}
    for name in ("router.gate.weight", "shared_experts.w1.weight"):
        grad = layer.get_parameter(name).grad.clone()
        dist.all_reduce(grad)
        pairs[name] = (grad, one_process.get_parameter(name).grad)
    for name, (got, expected) in pairs.items():
        assert relative_error(got, expected) < 1e-2, name  # bf16 operands either way
    dist.barrier()  # no rank tears its group down while a peer's exchanges are still in flight
    dist.destroy_process_group()


def test_expert_parallel_layer_matches_one_process(tmp_path):
    """TorchTitan 0.2's ExpertParallel over 2 processes (gloo): the converted layer takes the EP group
    from its experts' weights and megamoe exchanges the tokens (on a GPU in its kernels, both ranks may
    share one GPU)."""
    device = "cuda" if HAS_CUDA else "cpu"
    mp.spawn(_rank_matches_one_process, args=(str(tmp_path / "store"), device), nprocs=EP_WORLD, join=True)
