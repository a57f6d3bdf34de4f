"""patch_hf_model on a model that transformers itself splits over expert-parallel ranks
(`DistributedConfig(ep_size=...)`): each rank's experts run through megamoe under the token exchange
transformers chose, with the same loss, logits and gradients as the unpatched distributed model.
Two processes over a gloo group, on the CPU, or on one GPU where transformers' accelerator is one."""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import megamoe
from megamoe.reference import relative_error
from test_hf_patch import LAYERS, TOLERANCE, loss_logits_and_grads, tiny_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.distributed.expert_parallel", reason="transformers' EP plan needs transformers >= 5.25")
pytest.importorskip("accelerate", reason="transformers' distributed loading needs accelerate")

WORLD = 2
# The EP group shares one batch (transformers' TP ranks, no TP rule) and exchanges tokens all-to-all
# or masks other ranks' routes and sums; or each rank holds its own batch (FSDP over the same ranks).
LAYOUTS = {"shared batch, all_to_all": dict(ep_size=WORLD, tp_size=WORLD, tp_plan={}, ep_implementation="all_to_all"),
           "shared batch, all_reduce": dict(ep_size=WORLD, tp_size=WORLD, tp_plan={}, ep_implementation="all_reduce"),
           "own batches, FSDP": dict(ep_size=WORLD, fsdp_size=WORLD)}
ON_GPU = torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == "cuda"
# The baselines run wherever transformers puts the model; the fused kernels only on its GPU.
BACKENDS = ["grouped", pytest.param("fused", marks=pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU"))]


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if hasattr(t, "to_local") else t


def _rank_matches_unpatched(rank, store, checkpoint, layout, backend, dtype):
    # One GPU serves both ranks (transformers binds LOCAL_RANK's device); several, one each.
    local_rank = rank if torch.cuda.device_count() >= WORLD else 0
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    config = transformers.distributed.DistributedConfig(**layout)

    def load():  # without the Hub's kernels, which transformers would otherwise fetch for its GPU layers
        return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=config, dtype=dtype,
                                                                 use_kernels=False)

    model, patched = load(), load()
    served, refused = megamoe.hf.experts_modules(patched)
    assert not refused and served and all(experts._is_expert_parallel for _, experts, _ in served)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every experts module is served
        megamoe.patch_hf_model(patched, backend=backend)
    own_batch = "fsdp_size" in layout
    input_ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1 + rank * own_batch))
    input_ids = input_ids.to(model.device)
    want, want_grads = loss_logits_and_grads(model, input_ids)
    got, got_grads = loss_logits_and_grads(patched, input_ids)
    tolerance = TOLERANCE[dtype]
    assert relative_error(got.logits, want.logits) < tolerance
    assert got.loss.item() == pytest.approx(want.loss.item(), rel=tolerance)
    for name, grad in want_grads.items():
        assert relative_error(_local(got_grads[name]), _local(grad)) < tolerance, name
    dist.destroy_process_group()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_split_by_transformers_match_unpatched(layout, backend, tmp_path):
    dtype = torch.bfloat16 if backend == "fused" else torch.float32
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(tiny_config(hidden_size=128, num_hidden_layers=LAYERS[dtype]))
    model.save_pretrained(tmp_path / "checkpoint")
    mp.spawn(_rank_matches_unpatched, nprocs=WORLD,
             args=(str(tmp_path / "store"), str(tmp_path / "checkpoint"), LAYOUTS[layout], backend, dtype))


def _group_on_split_experts_raises(rank, store, checkpoint):
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    config = transformers.distributed.DistributedConfig(**LAYOUTS["shared batch, all_to_all"])
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=config, use_kernels=False)
    with pytest.raises(ValueError, match="split by transformers' expert parallelism"):
        megamoe.patch_hf_model(model, backend="fused", group=dist.group.WORLD)
    dist.destroy_process_group()


def test_megamoe_group_on_experts_split_by_transformers_raises(tmp_path):
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(tiny_config(num_hidden_layers=1)).save_pretrained(tmp_path / "checkpoint")
    mp.spawn(_group_on_split_experts_raises, nprocs=WORLD, args=(str(tmp_path / "store"), str(tmp_path / "checkpoint")))
