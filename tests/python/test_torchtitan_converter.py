"""megamoe as TorchTitan 0.2's MoE experts (megamoe.torchtitan_converter): a converted MoE layer gives
TorchTitan's own layer output and gradients from the same weights (on a GPU), checkpoints in
TorchTitan's layout, initialises as TorchTitan does, trains under TorchTitan's expert parallelism as in
one process, and the refusals. Skipped without torchtitan 0.2
(0.3 has no torchtitan.models.moe; test_torchtitan.py covers it)."""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("torchtitan.models.moe.moe")

from torchtitan.models.moe.moe import MoE, MoEArgs  # noqa: E402

from megamoe.reference import relative_error  # noqa: E402

from conftest import requires_cuda  # noqa: E402
from fsdp_sharding import check_fully_shard, train_as_one_process  # noqa: E402
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


@pytest.mark.parametrize("backend, device", [("grouped", "cpu"), pytest.param("fused", "cuda", marks=requires_cuda)])
def test_experts_module_computes_torchtitans_grouped_experts(backend, device):
    """The converted experts module on rows grouped by expert with padding rows after them (what 0.2's
    ExpertParallel hands it): TorchTitan's GroupedExperts' output and gradients, zeros for the padding."""
    native = _layer(shared=0).experts.to(device)
    converted = MegaMoEGroupedExperts(copy.deepcopy(native))
    converted.megamoe_options = {"backend": backend}
    counts = torch.tensor([5, 0, 16, 3, 8, 1, 0, 7], device=device)
    routed = int(counts.sum())
    rows = torch.randn(routed + 6, 128, device=device)  # 6 padding rows
    results = {}
    for name, experts in (("native", native), ("megamoe", converted)):
        x = rows.clone().requires_grad_()
        y = experts(x, counts)
        y[:routed].float().square().sum().backward()
        w13_grad = experts.w13.grad if name == "megamoe" else torch.cat([experts.w1.grad, experts.w3.grad], dim=1)
        results[name] = (y[:routed], x.grad[:routed], w13_grad, experts.w2.grad)
    assert not y[routed:].any()
    for got, want in zip(results["megamoe"], results["native"]):
        assert relative_error(got, want) < 2e-2  # two bf16 computations, each within 1e-2 of exact


EP_WORLD = 2


def _qwen3() -> torch.nn.Module:
    """TorchTitan 0.2's Qwen3 debug MoE model with megamoe's experts, two layers of 8 experts,
    initialised as TorchTitan does."""
    from torchtitan.models.qwen3 import Qwen3Model, qwen3_args
    args = copy.deepcopy(qwen3_args["debugmodel_moe"])
    args.n_layers, args.moe_args.num_experts, args.moe_inter_dim = 2, 8, 128
    args.moe_args.use_grouped_mm = False
    with torch.device("meta"):
        model = Qwen3Model(args)
    convert_moe_layers(model, backend="grouped")
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def _rank_trains_as_one_process(rank: int, store: str, steps: int) -> None:
    """This rank's half of each batch through the model parallelised by TorchTitan's parallelize_qwen3
    (EP 2 over dp_shard 2, FSDP), AdamW steps, against the model trained in one process on whole
    batches (fsdp_sharding.train_as_one_process: losses, and every gradient at the first step)."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.models.moe.utils as moe_utils
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.qwen3.infra.parallelize import parallelize_qwen3

    # TorchTitan on the CPU: its meshes default to CUDA, its EP permutation to a Triton kernel, histc has
    # no int64 kernel.
    parallel_dims_module.device_type = "cpu"
    moe_utils.generate_permute_indices = functools.partial(moe_utils.generate_permute_indices, use_cpu=True)
    torch.histc = lambda ids, bins, min, max: torch.bincount(ids, minlength=bins)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=EP_WORLD)
    job = JobConfig()
    job.parallelism.data_parallel_shard_degree = job.parallelism.expert_parallel_degree = EP_WORLD
    job.training.seq_len, job.training.mixed_precision_param = 32, "float32"
    job.activation_checkpoint.mode = "none"
    dims = ParallelDims(dp_replicate=1, dp_shard=EP_WORLD, cp=1, tp=1, pp=1, ep=EP_WORLD, etp=1, world_size=EP_WORLD)
    model = parallelize_qwen3(_qwen3(), dims, job)
    train_as_one_process(model, _qwen3(), rank, EP_WORLD, steps, vocab=2000, loss_rel=1e-5)
    dist.barrier()
    dist.destroy_process_group()


def test_trains_under_torchtitans_expert_parallelism_as_one_process(tmp_path):
    """TorchTitan 0.2's EP (its all-to-alls around the experts module, the experts' own FSDP unit) with
    megamoe computing each rank's experts, over 2 CPU processes (gloo)."""
    mp.spawn(_rank_trains_as_one_process, args=(str(tmp_path / "store"), 3), nprocs=EP_WORLD, join=True)
