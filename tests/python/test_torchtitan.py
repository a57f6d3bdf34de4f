"""megamoe as TorchTitan's routed experts (megamoe.torchtitan): the override on a MoE layer configured as
TorchTitan's Qwen3 MoE models configure theirs, the same layer output as TorchTitan's own experts from
the same weights, its checkpoints in TorchTitan's layout, expert parallelism over TorchTitan's EP mesh,
and the refusals. Skipped without torchtitan 0.3."""

import copy
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("torchtitan.config.override")  # torchtitan 0.3 (0.2: test_torchtitan_converter.py)

import spmd_types as spmd  # noqa: E402
from torchtitan.config.override import OverrideConfig, apply_overrides  # noqa: E402
from torchtitan.models.common.config_utils import (  # noqa: E402
    make_moe_config, make_routed_experts_config, make_router_config)
from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts  # noqa: E402

from megamoe.reference import relative_error  # noqa: E402
from megamoe.torchtitan_layout import local_part  # noqa: E402

from conftest import HAS_CUDA, requires_cuda  # noqa: E402
from fsdp_sharding import check_fully_shard, train_as_one_process  # noqa: E402

OVERRIDE = "megamoe.torchtitan.megamoe_experts"
NORMAL_INIT = partial(torch.nn.init.normal_, std=0.02)  # how TorchTitan's Qwen3 initialises w1, w3 and the gate
# The tensor-parallel placements of the experts' weights TorchTitan's Qwen3 declares (torchtitan.models.qwen3
# .sharding, whose package needs a PyTorch newer than the layer does).
EXPERTS_PARAM_LAYOUT = {"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)}


def _moe_config(num_experts=8, dim=64, hidden=32, top_k=2) -> MoE.Config:
    """A MoE layer as TorchTitan's Qwen3 MoE models configure theirs (softmax router with normalised
    top-k scores, SwiGLU GroupedExperts, no shared experts), from TorchTitan's common config builders."""
    router = make_router_config(dim=dim, num_experts=num_experts, top_k=top_k, score_func="softmax",
                                route_norm=True, gate_param_init={"weight": NORMAL_INIT})
    experts = make_routed_experts_config(dim=dim, hidden_dim=hidden, num_experts=num_experts, top_k=top_k,
                                         comm_backend="standard",
                                         param_init={"w1_EFD": NORMAL_INIT, "w3_EFD": NORMAL_INIT,
                                                     "w2_EDF": partial(torch.nn.init.normal_, std=0.01)})
    return make_moe_config(num_experts=num_experts, router=router, routed_experts=experts)


def _with_megamoe(cfg, **options):
    from megamoe import torchtitan as _  # registers the override  # noqa: F401
    replaced = copy.deepcopy(cfg)
    lines = apply_overrides(OverrideConfig(imports=[(OVERRIDE, options)]), replaced)
    assert len(lines) == 1 and "MegaMoERoutedExperts" in lines[0]
    return replaced


def test_override_replaces_the_routed_experts_and_keeps_torchtitans_checkpoint_layout():
    from megamoe.torchtitan import MegaMoEExperts, MegaMoERoutedExperts
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher
    cfg = _moe_config()
    native, fused = cfg.build(), _with_megamoe(cfg, backend="grouped").build()
    assert isinstance(fused.routed_experts, MegaMoERoutedExperts)
    expert_parallel = copy.deepcopy(cfg)  # as TorchTitan configures EP: megamoe exchanges instead
    expert_parallel.routed_experts.token_dispatcher = AllToAllTokenDispatcher.Config(num_experts=8, top_k=2)
    assert type(_with_megamoe(expert_parallel).routed_experts.token_dispatcher) is LocalTokenDispatcher.Config
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

    cfg = _moe_config()
    set_moe_sharding_config(cfg, enable_ep=enable_ep, enable_sp=False, expert_param_layout=EXPERTS_PARAM_LAYOUT)
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

    class TensorParallel:
        ep_enabled, tp_enabled = False, True
    with pytest.raises(ValueError, match="do not serve tensor parallelism of the experts' hidden dimension"):
        module.parallelize(TensorParallel())

    class ExpertParallel:
        ep_enabled, tp_enabled = True, False
    with pytest.raises(ValueError, match="expert parallelism runs megamoe's backend='fused'"):
        module.parallelize(ExpertParallel())
    assert isinstance(GroupedExperts.Config, type) and isinstance(RoutedExperts.Config, type)


def _overridden_layer() -> MoE:
    module = _with_megamoe(_moe_config(), backend="grouped").build()
    module.init_states()
    return module


def test_fully_shard_shards_megamoes_experts_as_torchtitans(tmp_path):
    """FSDP2 over 2 CPU processes on an overridden MoE layer: the same output and gradients as unsharded."""
    check_fully_shard(_overridden_layer, (2, 24, 64), tmp_path)


EP_WORLD = 2


def _exchange_on_the_cpu() -> None:
    """Where there is no GPU for the fused kernels, the EP region's megamoe call runs megamoe's
    all-to-all baseline over the same group (the same contract: each rank's tokens with global ids,
    its experts' weights), so the wiring is checked on the CPU too."""
    import megamoe.torchtitan as adapter
    from megamoe.backends.all_to_all import all_to_all_moe
    one_process = adapter.routed_experts

    def exchanged(x, topk_ids, topk_scores, w13, w2, group=None, **options):
        if group is None:
            return one_process(x, topk_ids, topk_scores, w13, w2, **options)
        dim, top_k = x.shape[-1], topk_ids.shape[-1]
        y = all_to_all_moe(x.reshape(-1, dim).bfloat16(), topk_ids.reshape(-1, top_k),
                           topk_scores.reshape(-1, top_k).float(), w13.bfloat16(), w2.bfloat16(), group)
        return y.view(x.shape).type_as(x)
    adapter.routed_experts = exchanged


# How the EP ranks hold the batch: each its own (EP over data-parallel ranks), all the same batch
# (EP over tensor-parallel ranks: TorchTitan splits the sequence for the experts), or each a part of
# the sequence (sequence parallelism). The tensor-parallel degree and whether the sequence is split.
EP_LAYOUTS = {"own batches": (1, False), "one batch": (EP_WORLD, False), "sequence parts": (EP_WORLD, True)}


def _rank_input(batches: torch.Tensor, rank: int, layout: str) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(this rank's input, the whole input in one process, the index of this rank's part of it)."""
    tp, split = EP_LAYOUTS[layout]
    if tp == 1:
        return batches[rank], batches.flatten(0, 1), (slice(2 * rank, 2 * rank + 2),)
    part = (slice(None), slice(12 * rank, 12 * rank + 12)) if split else (slice(None),)
    return batches[0][part], batches[0], part


class _Block(torch.nn.Module):
    moe_enabled = True

    def __init__(self, moe: torch.nn.Module):
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


class _Decoder(torch.nn.Module):
    """The one-block decoder TorchTitan's FSDP wrapping (apply_fsdp_to_decoder) walks; its units'
    gathers run when the block is called."""

    enable_weight_tying = False

    def __init__(self, moe: torch.nn.Module):
        super().__init__()
        self.tok_embeddings = self.norm = self.lm_head = None
        self.layers = torch.nn.ModuleDict({"0": _Block(moe)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers["0"](x)


def _fully_shard_as_torchtitan(layer: torch.nn.Module, parallel_dims) -> torch.nn.Module:
    """FSDP2 over the layer as TorchTitan's trainer applies it under EP: each block one unit, the
    experts' weights on the sparse (EP) mesh, the rest on the data-parallel mesh."""
    import torchtitan.distributed.fsdp as torchtitan_fsdp
    from torchtitan.distributed.full_dtensor import resolve_fsdp_mesh, resolve_sparse_fsdp_mesh

    torchtitan_fsdp.disable_fsdp_gradient_division = lambda model: None  # its PREMUL_SUM: not in gloo
    model = _Decoder(layer)
    (dp_mesh, dp_dims), (edp_mesh, edp_dims) = resolve_fsdp_mesh(parallel_dims), resolve_sparse_fsdp_mesh(parallel_dims)
    torchtitan_fsdp.apply_fsdp_to_decoder(model, dp_mesh, param_dtype=torch.float32, reduce_dtype=torch.float32,
                                          pp_enabled=False, cpu_offload=False, reshard_after_forward_policy="default",
                                          ep_degree=EP_WORLD, edp_mesh=edp_mesh, dp_mesh_dims=dp_dims,
                                          edp_mesh_dims=edp_dims, enable_symm_mem=False)
    return model


def _rank_matches_one_process(rank: int, store: str, spmd_backend: str, layout: str, device: str,
                              fsdp: bool = False) -> None:
    """This rank's part of a batch through the EP-parallelised layer against the whole batch through
    the same layer in one process: output, input gradient, this rank's experts' gradients, and the
    router's gradient summed over the ranks. With `fsdp`, under TorchTitan's FSDP: every expert's
    gradient, and the router's averaged over the data-parallel ranks as FSDP reduces it."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.utils import get_spmd_context, set_spmd_backend
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # one GPU may serve both ranks
    else:
        parallel_dims_module.device_type = "cpu"  # TorchTitan's meshes default to CUDA
        _exchange_on_the_cpu()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=EP_WORLD)
    set_spmd_backend(spmd_backend)
    tp, split = EP_LAYOUTS[layout]
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=EP_WORLD // tp, cp=1, tp=tp, pp=1, ep=EP_WORLD,
                                 world_size=EP_WORLD, spmd_backend=spmd_backend)
    cfg = _moe_config(dim=256, hidden=128)
    whole = _with_megamoe(cfg, backend="fused" if device == "cuda" else "grouped")
    set_moe_sharding_config(cfg, enable_ep=True, enable_sp=split, expert_param_layout=EXPERTS_PARAM_LAYOUT)
    sharded = _with_megamoe(cfg, backend="fused")
    torch.manual_seed(0)
    one_process = whole.build().to(device)
    one_process.init_states()
    layer = sharded.build().to(device)
    layer.load_state_dict(one_process.state_dict())
    layer.parallelize(parallel_dims)
    assert dist.get_process_group_ranks(layer.routed_experts.group) == list(range(EP_WORLD))
    model = _fully_shard_as_torchtitan(layer, parallel_dims) if fsdp else layer

    batches = torch.randn(EP_WORLD, 2, 24, 256, generator=torch.Generator().manual_seed(1)).to(device)
    rank_input, whole_input, part = _rank_input(batches, rank, layout)
    x = rank_input.clone().requires_grad_()
    layer_input = x
    if tp > 1 and spmd_backend != "spmd_types":  # the DTensor parallelisms take DTensors across the TP ranks
        layer_input = DTensor.from_local(x, parallel_dims.get_optional_mesh("tp"), [Shard(1) if split else Replicate()])
    with get_spmd_context(parallel_dims=parallel_dims)():  # as TorchTitan's trainer runs a step
        y = local_part(model(layer_input))
        y.float().square().sum().backward()
    x_all = whole_input.clone().requires_grad_()
    y_all = one_process(x_all)
    y_all.float().square().sum().backward()

    experts, want = layer.routed_experts.inner_experts, one_process.routed_experts.inner_experts
    if fsdp:
        own_experts = slice(None)  # full_tensor gathers every rank's experts
        w13_grad, w2_grad = experts.w13.grad.full_tensor(), experts.w2_EDF.grad.full_tensor()
        router_grad = layer.router.gate.weight.grad.full_tensor() * EP_WORLD
    else:
        share = experts.num_experts // EP_WORLD
        own_experts = slice(share * rank, share * (rank + 1))
        w13_grad, w2_grad = local_part(experts.w13.grad), local_part(experts.w2_EDF.grad)
        assert local_part(experts.w13).shape[0] == share
        router_grad = local_part(layer.router.gate.weight.grad).clone()
        dist.all_reduce(router_grad)
    pairs = {"output": (y, y_all[part]), "x grad": (x.grad, x_all.grad[part]),
             "w13 grad": (w13_grad, want.w13.grad[own_experts]), "w2 grad": (w2_grad, want.w2_EDF.grad[own_experts]),
             "router grad": (router_grad, one_process.router.gate.weight.grad)}
    for name, (got, expected) in pairs.items():
        assert relative_error(got, expected) < 1e-2, name  # bf16 operands either way
    dist.barrier()  # no rank tears its group down while a peer's exchanges are still in flight
    dist.destroy_process_group()


TORCH_2_11 = tuple(map(int, torch.__version__.split(".")[:2])) <= (2, 11)
EP_CASES = [pytest.param(backend, layout, marks=pytest.mark.skipif(
    backend == "partial_dtensor" and EP_LAYOUTS[layout][0] > 1 and TORCH_2_11,
    reason="under EP over TP ranks TorchTitan's router reshapes a sequence-sharded DTensor, which PyTorch 2.11 "
           "refuses"))
    for backend in ("spmd_types", "partial_dtensor") for layout in EP_LAYOUTS]


@pytest.mark.parametrize("spmd_backend, layout", EP_CASES)
def test_expert_parallel_layer_matches_one_process(spmd_backend, layout, tmp_path):
    """TorchTitan's EP (expert_parallel_degree = 2, over gloo): the EP mesh's group reaches
    megamoe.moe(..., group=), each rank computing its part of the tokens with its half of the experts.
    On a GPU megamoe's kernels exchange the tokens (both ranks may share one GPU)."""
    device = "cuda" if HAS_CUDA else "cpu"
    mp.spawn(_rank_matches_one_process, args=(str(tmp_path / "store"), spmd_backend, layout, device),
             nprocs=EP_WORLD, join=True)


def test_expert_parallel_layer_under_torchtitans_fsdp(tmp_path):
    """The EP layer wrapped by TorchTitan's own FSDP (apply_fsdp_to_decoder: the experts sharded on the
    EP mesh within each block's unit), which gathers the experts' weights for megamoe and reduces
    their gradients."""
    pytest.importorskip("torchtitan.distributed.fsdp", reason="TorchTitan's FSDP needs a PyTorch newer than 2.11",
                        exc_type=ImportError)
    device = "cuda" if HAS_CUDA else "cpu"
    mp.spawn(_rank_matches_one_process, args=(str(tmp_path / "store"), "spmd_types", "own batches", device, True),
             nprocs=EP_WORLD, join=True)


def _qwen3_debug_model(expert_parallel: bool) -> torch.nn.Module:
    """Two layers of TorchTitan's Qwen3 MoE debug model with megamoe's experts (fused where its EP
    exchange runs, the grouped baseline in one process), configured as TorchTitan's trainer configures
    it for EP or not, initialised from one seed. Attention is TorchTitan's causal SDPA: its flex
    attention has no backward on the CPU (one document per sequence, so the masks are the same)."""
    from megamoe import torchtitan as _  # registers the override  # noqa: F401
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    cfg = copy.deepcopy(model_registry("debugmodel_moe").model)
    cfg.layers = cfg.layers[:2]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_qwen3_sharding_config(cfg, enable_sp=False, enable_ep=expert_parallel)
    apply_overrides(OverrideConfig(imports=[(OVERRIDE, {"backend": "fused" if expert_parallel else "grouped"})]), cfg)
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    return model


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, positions=torch.arange(ids.shape[1]).expand(ids.shape[0], -1))


def _rank_model_trains_as_one_process(rank: int, store: str, dump_folder: str, steps: int) -> None:
    """This rank's half of each batch through the model parallelised by TorchTitan's parallelize_qwen3
    (EP 2 over dp_shard 2, FSDP, spmd_types), AdamW steps, against the model trained in one process on
    whole batches (fsdp_sharding.train_as_one_process: losses, and every gradient at the first step)."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config.configs import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.utils import get_spmd_context, set_spmd_backend
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    parallel_dims_module.device_type = "cpu"  # TorchTitan's meshes default to CUDA
    _exchange_on_the_cpu()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=EP_WORLD)
    set_spmd_backend("spmd_types")
    parallelism = ParallelismConfig(data_parallel_shard_degree=EP_WORLD, expert_parallel_degree=EP_WORLD,
                                    spmd_backend="spmd_types")
    parallel_dims = ParallelDims.from_config(parallelism, EP_WORLD)
    model = parallelize_qwen3(_qwen3_debug_model(expert_parallel=True), parallel_dims=parallel_dims,
                              training=TrainingConfig(mixed_precision_param="float32"), parallelism=parallelism,
                              compile_config=CompileConfig(), ac_config=None, dump_folder=dump_folder)
    train_as_one_process(model, _qwen3_debug_model(expert_parallel=False), rank, EP_WORLD, steps, vocab=2048,
                         loss_rel=1e-4, logits=_logits, context=get_spmd_context(parallel_dims=parallel_dims))
    dist.barrier()
    dist.destroy_process_group()


def test_model_parallelised_by_torchtitan_trains_as_one_process(tmp_path):
    """TorchTitan's own parallelize_qwen3 with expert_parallel_degree = 2 on a model with megamoe's
    experts (2 CPU processes over gloo, the all-to-all baseline standing in for megamoe's exchange),
    three training steps: the EP mesh's group reaches the override through TorchTitan's real
    configuration path, and FSDP gathers and reduces the experts' weights and gradients."""
    pytest.importorskip("torchtitan.models.qwen3", reason="TorchTitan's models need a PyTorch newer than 2.11",
                        exc_type=ImportError)
    mp.spawn(_rank_model_trains_as_one_process, args=(str(tmp_path / "store"), str(tmp_path), 3),
             nprocs=EP_WORLD, join=True)
