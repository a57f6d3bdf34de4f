"""megamoe as TorchTitan's routed experts (megamoe.torchtitan): the override on TorchTitan's Qwen3 MoE
debug configuration, the same layer output as TorchTitan's own experts from the same weights, its
checkpoints in TorchTitan's layout, and the refusals. Skipped without torchtitan 0.3."""

import copy

import pytest
import torch

pytest.importorskip("torchtitan.config.override")  # torchtitan 0.3 (0.2: test_torchtitan_converter.py)

from torchtitan.config.override import OverrideConfig, apply_overrides  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts  # noqa: E402
from torchtitan.models.qwen3 import model_registry  # noqa: E402

from megamoe.reference import relative_error  # noqa: E402

from conftest import requires_cuda  # noqa: E402
from fsdp_sharding import check_fully_shard  # noqa: E402

OVERRIDE = "megamoe.torchtitan.megamoe_experts"


def _moe_config(num_experts=8, dim=64, hidden=32, top_k=2) -> MoE.Config:
    """Layer 0's MoE of TorchTitan's Qwen3 MoE debug model, made small."""
    cfg = copy.deepcopy(model_registry("debugmodel_moe").model.layers[0].moe)
    cfg.num_experts = cfg.router.num_experts = num_experts
    cfg.router.top_k = top_k
    cfg.router.gate.in_features, cfg.router.gate.out_features = dim, num_experts
    inner = cfg.routed_experts.inner_experts
    inner.dim, inner.hidden_dim, inner.num_experts = dim, hidden, num_experts
    cfg.routed_experts.token_dispatcher.num_experts, cfg.routed_experts.token_dispatcher.top_k = num_experts, top_k
    if cfg.shared_experts is not None:
        cfg.shared_experts = None
    return cfg


def _with_megamoe(cfg, **options):
    from megamoe import torchtitan as _  # registers the override  # noqa: F401
    replaced = copy.deepcopy(cfg)
    lines = apply_overrides(OverrideConfig(imports=[(OVERRIDE, options)]), replaced)
    assert len(lines) == 1 and "MegaMoERoutedExperts" in lines[0]
    return replaced


def test_override_replaces_the_routed_experts_and_keeps_torchtitans_checkpoint_layout():
    from megamoe.torchtitan import MegaMoEExperts, MegaMoERoutedExperts
    cfg = _moe_config()
    native, fused = cfg.build(), _with_megamoe(cfg, backend="grouped").build()
    assert isinstance(fused.routed_experts, MegaMoERoutedExperts)
    assert isinstance(fused.routed_experts.inner_experts, MegaMoEExperts)
    assert fused.routed_experts.inner_experts.w13.shape == (8, 64, 64)
    for module in (native, fused):
        module.init_states()
    fused.load_state_dict(native.state_dict())  # TorchTitan's w1_EFD / w3_EFD merged into w13
    assert fused.state_dict().keys() == native.state_dict().keys()
    for key, value in native.state_dict().items():
        assert torch.equal(fused.state_dict()[key], value), key


@pytest.mark.parametrize("backend, device", [("grouped", "cpu"), ("naive", "cpu"),
                                             pytest.param("fused", "cuda", marks=requires_cuda)])
def test_megamoe_layer_matches_torchtitans_experts(backend, device):
    """The same MoE layer, TorchTitan's experts vs megamoe's, from the same weights: output and gradients."""
    torch.manual_seed(0)
    cfg = _moe_config(dim=256, hidden=128) if backend == "fused" else _moe_config()
    native, fused = cfg.build().to(device), _with_megamoe(cfg, backend=backend).build().to(device)
    native.init_states()
    fused.load_state_dict(native.state_dict())
    x = torch.randn(2, 24, native.router.gate.weight.shape[1], device=device)
    outputs = {}
    for name, module in (("native", native), ("megamoe", fused)):
        xg = x.clone().requires_grad_()
        y = module(xg)
        y.float().square().mean().backward()
        experts = module.routed_experts.inner_experts
        w13_grad = (experts.w13.grad if name == "megamoe"
                    else torch.cat([experts.w1_EFD.grad, experts.w3_EFD.grad], dim=1))
        outputs[name] = (y, xg.grad, w13_grad, experts.w2_EDF.grad, module.router.gate.weight.grad)
    for got, want in zip(outputs["megamoe"], outputs["native"]):
        assert relative_error(got, want) < 1e-2  # both bf16 operands, fp32 accumulation


@pytest.mark.parametrize("enable_ep", [False, True])
def test_sharding_config_places_w13_as_torchtitan_places_w1(enable_ep):
    """TorchTitan fills the sharding configs before overrides apply (Trainer: update_from_config, then
    apply_overrides): the replaced experts' w13 takes w1_EFD's placement, and w1/w3 are gone."""
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config
    from torchtitan.models.qwen3.sharding import _GROUPED_EXPERTS_PARAM_LAYOUT

    cfg = _moe_config()
    set_moe_sharding_config(cfg, enable_ep=enable_ep, enable_sp=False,
                            expert_param_layout=_GROUPED_EXPERTS_PARAM_LAYOUT)
    native = cfg.routed_experts.inner_experts.sharding_config.state_shardings
    replaced = _with_megamoe(cfg).routed_experts.inner_experts.sharding_config.state_shardings
    assert set(replaced) == set(native) - {"w1_EFD", "w3_EFD"} | {"w13"}
    assert replaced["w13"] == native["w1_EFD"] and replaced["w2_EDF"] == native["w2_EDF"]


def test_parameters_initialise_as_torchtitans():
    from megamoe.torchtitan import megamoe_experts
    cfg = _moe_config().routed_experts
    replaced = megamoe_experts(cfg)
    assert set(replaced.inner_experts.param_init) == {"w13", "w2_EDF"}
    experts = replaced.inner_experts.build()
    experts.init_states()
    inter = experts.w13.shape[1] // 2
    for half in (experts.w13[:, :inter], experts.w13[:, inter:]):  # TorchTitan's std for w1 and w3: 0.02
        assert 0.015 < half.std().item() < 0.025


def test_refusals():
    from megamoe.torchtitan import MegaMoERoutedExperts, megamoe_experts
    cfg = _moe_config().routed_experts
    other = copy.deepcopy(cfg)
    other.inner_experts = megamoe_experts(cfg).inner_experts  # already replaced: not TorchTitan's GroupedExperts
    with pytest.raises(ValueError, match="megamoe serves TorchTitan's SwiGLU GroupedExperts"):
        megamoe_experts(other)
    with pytest.raises(ValueError, match="backend must be one of"):
        megamoe_experts(cfg, backend="fast")
    with pytest.raises(NotImplementedError, match="computes in bf16"):
        megamoe_experts(cfg, backend="grouped", precision="fp8")
    module = megamoe_experts(cfg, backend="grouped").build()
    assert isinstance(module, MegaMoERoutedExperts)

    class Dims:
        ep_enabled, tp_enabled = True, False
    with pytest.raises(ValueError, match="do not serve EP parallelism"):
        module.parallelize(Dims())
    assert isinstance(GroupedExperts.Config, type) and isinstance(RoutedExperts.Config, type)


def _overridden_layer() -> MoE:
    module = _with_megamoe(_moe_config(), backend="grouped").build()
    module.init_states()
    return module


def test_fully_shard_shards_megamoes_experts_as_torchtitans(tmp_path):
    """FSDP2 over 2 CPU processes on an overridden MoE layer: the same output and gradients as unsharded."""
    check_fully_shard(_overridden_layer, (2, 24, 64), tmp_path)
