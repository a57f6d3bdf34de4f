"""megamoe as TorchTitan 0.2's MoE experts (megamoe.torchtitan_converter): a converted MoE layer gives
TorchTitan's own layer output and gradients from the same weights (on a GPU), checkpoints in
TorchTitan's layout, initialises as TorchTitan does, and the refusals. Skipped without torchtitan 0.2
(0.3 has no torchtitan.models.moe; test_torchtitan.py covers it)."""

import copy

import pytest
import torch

pytest.importorskip("torchtitan.models.moe.moe")

from torchtitan.models.moe.moe import MoE, MoEArgs  # noqa: E402

from megamoe.reference import relative_error  # noqa: E402

from conftest import requires_cuda  # noqa: E402
from fsdp_sharding import check_fully_shard  # noqa: E402
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
        ep, tp = 2, 1
    with pytest.raises(ValueError, match="do not serve expert parallelism.*torchtitan 0.3"):
        MegaMoEConverter(None, Dims())


def _converted_layer() -> MoE:
    torch.histc = lambda ids, bins, min, max: torch.bincount(ids, minlength=bins)  # no int64 CPU histc
    layer = _layer(shared=1)
    convert_moe_layers(layer, backend="grouped")
    return layer


def test_fully_shard_shards_megamoes_experts_as_torchtitans(tmp_path):
    """FSDP2 over 2 CPU processes on a converted layer: the same output and gradients as unsharded."""
    check_fully_shard(_converted_layer, (2, 24, 128), tmp_path)
