"""patch_hf_model on a model that transformers itself splits over expert-parallel ranks
(`DistributedConfig(ep_size=...)`): each rank's experts run through megamoe under the token exchange
transformers chose, with the same loss, logits and gradients as the unpatched distributed model.
Patched with the EP group, megamoe exchanges the tokens itself (backend "fused"). Two processes over a
gloo group, on the CPU, or on one GPU where transformers' accelerator is one."""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import megamoe
from megamoe.reference import relative_error
from test_hf_patch import LAYERS, TOLERANCE, loss_logits_and_grads, tiny_config, tiny_model

transformers = pytest.importorskip("transformers")
if not hasattr(pytest.importorskip("transformers.distributed.expert_parallel"), "EPImplementationInterface"):
    pytest.skip("transformers' EP implementations registry (5.23 on)", allow_module_level=True)
pytest.importorskip("accelerate", reason="transformers' distributed loading needs accelerate")

WORLD = 2
# The EP group shares one batch (transformers' TP ranks, no TP rule) and exchanges tokens all-to-all
# or masks other ranks' routes and sums; or each rank holds its own batch (FSDP over the same ranks).
LAYOUTS = {"shared batch, all_to_all": dict(ep_size=WORLD, tp_size=WORLD, tp_plan={}, ep_implementation="all_to_all"),
           "shared batch, all_reduce": dict(ep_size=WORLD, tp_size=WORLD, tp_plan={}, ep_implementation="all_reduce"),
           "own batches, FSDP": dict(ep_size=WORLD, fsdp_size=WORLD)}
ON_GPU = torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == "cuda"
# transformers' all-to-all (functional collectives) over gloo crashes the process where the model is
# on a GPU (SIGSEGV in either model, megamoe's or not): that exchange is checked on the CPU. The EP plan
# alone over the TP ranks (`tp_plan={}`) needs transformers 5.25.
TP_PLAN_MAY_BE_EMPTY = tuple(map(int, transformers.__version__.split(".")[:2])) >= (5, 25)


def _layout(name: str, transformers_exchange: bool = True):
    shared = name.startswith("shared batch")
    return pytest.param(name, marks=[
        pytest.mark.skipif(shared and not TP_PLAN_MAY_BE_EMPTY, reason="a shared batch needs transformers >= 5.25"),
        pytest.mark.skipif(transformers_exchange and ON_GPU and name == "shared batch, all_to_all",
                           reason="transformers' all-to-all over gloo on a GPU crashes")])


TRANSFORMERS_EXCHANGES = [_layout(name) for name in LAYOUTS]
# The baselines run wherever transformers puts the model; the fused kernels only on its GPU.
BACKENDS = ["grouped", pytest.param("fused", marks=pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU"))]


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if hasattr(t, "to_local") else t


def _init(rank: int, store: str) -> None:
    # One GPU serves both ranks (transformers binds LOCAL_RANK's device); several, one each.
    local_rank = rank if torch.cuda.device_count() >= WORLD else 0
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)


def _load(checkpoint: str, layout: dict, dtype=torch.float32):
    """The saved model under transformers' EP `layout`, without the Hub's kernels (which transformers
    would otherwise fetch for its GPU layers)."""
    config = transformers.distributed.DistributedConfig(**layout)
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=config, dtype=dtype,
                                                             use_kernels=False)


def _rank_matches_unpatched(rank, store, checkpoint, layout, backend, dtype, megamoe_exchange):
    """This rank's loss, logits and gradients, patched (megamoe_exchange: patched with the EP group, so
    megamoe moves the tokens) against the unpatched model under transformers' exchange."""
    _init(rank, store)
    model, patched = _load(checkpoint, layout, dtype), _load(checkpoint, layout, dtype)
    served, refused = megamoe.hf.experts_modules(patched)
    assert not refused and served and all(experts._is_expert_parallel for _, experts, _ in served)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every experts module is served
        megamoe.patch_hf_model(patched, backend=backend, group=dist.group.WORLD if megamoe_exchange else None)
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


def _save_tiny_model(tmp_path, dtype=torch.float32, **sizes) -> str:
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(tiny_config(**{"hidden_size": 128, "num_hidden_layers": LAYERS[dtype],
                                                            **sizes}))
    model.save_pretrained(tmp_path / "checkpoint")
    return str(tmp_path / "checkpoint")


@pytest.mark.parametrize("layout", TRANSFORMERS_EXCHANGES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_split_by_transformers_match_unpatched(layout, backend, tmp_path):
    dtype = torch.bfloat16 if backend == "fused" else torch.float32
    mp.spawn(_rank_matches_unpatched, nprocs=WORLD, args=(str(tmp_path / "store"), _save_tiny_model(tmp_path, dtype),
                                                          LAYOUTS[layout], backend, dtype, False))


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", [_layout(name, False) for name in ("shared batch, all_reduce", "own batches, FSDP")])
def test_tokens_exchanged_by_megamoe_match_unpatched(layout, tmp_path):
    mp.spawn(_rank_matches_unpatched, nprocs=WORLD, args=(str(tmp_path / "store"), _save_tiny_model(
        tmp_path, torch.bfloat16), LAYOUTS[layout], "fused", torch.bfloat16, True))


def _bad_groups_raise(rank, store, checkpoint):
    _init(rank, store)
    own_rank = [dist.new_group([r]) for r in range(WORLD)][rank]  # every rank makes every group
    model = _load(checkpoint, LAYOUTS["own batches, FSDP"])
    with pytest.raises(ValueError, match=r"over the ranks \[0, 1\] \(its EP mesh\): group= must hold those ranks"):
        megamoe.patch_hf_model(model, backend="fused", group=own_rank)
    megamoe.patch_hf_model(model, backend="fused", group=dist.group.WORLD)
    megamoe.patch_hf_model(model, backend="fused", group=dist.group.WORLD)  # the same group again
    with pytest.raises(ValueError, match="patched with a group before"):
        megamoe.patch_hf_model(model, backend="fused")
    # The exchange patch_hf_model registered, named at loading: the experts are megamoe's only once patched.
    unpatched = _load(checkpoint, LAYOUTS["own batches, FSDP"] | {"ep_implementation": "megamoe"})
    with pytest.raises(RuntimeError, match="runs experts that megamoe.patch_hf_model"):
        unpatched(input_ids=torch.zeros(1, 4, dtype=torch.long))
    dist.destroy_process_group()


def test_group_other_than_the_ep_mesh_or_changed_raises(tmp_path):
    mp.spawn(_bad_groups_raise, nprocs=WORLD, args=(str(tmp_path / "store"), _save_tiny_model(tmp_path)))


def test_experts_split_without_transformers_meshes_raise(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = tiny_model()
        for experts in megamoe.hf.qwen3_moe_experts(model):
            experts._is_expert_parallel = True  # split, as far as the module says, but not loaded by transformers
        with pytest.raises(ValueError, match="has no device meshes of transformers"):
            megamoe.patch_hf_model(model, group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def _fp8_copies_across_forwards(rank, store, checkpoint):
    """The block-FP8 copies of each rank's expert weights that megamoe would use, asked for in each of
    two forwards: the same copies, though transformers hands every forward fresh views of its shards."""
    _init(rank, store)
    from megamoe import fp8

    model = megamoe.patch_hf_model(_load(checkpoint, LAYOUTS["shared batch, all_reduce"]), backend="grouped")
    copies, moe = [], megamoe.hf.moe

    def moe_asking_for_fp8_copies(x, ids, weights, w13, w2, **options):
        copies.append((fp8.quantized_weight(w13), fp8.quantized_weight(w2)))
        return moe(x, ids, weights, w13, w2, **options)

    megamoe.hf.moe = moe_asking_for_fp8_copies
    input_ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1)).to(model.device)
    for _ in range(2):
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    assert len(copies) == 2 and all(a is b for a, b in zip(*copies))
    dist.destroy_process_group()


# (Under FSDP the experts' weights are gathered again for every forward, so their copies are made again.)
@pytest.mark.skipif(not TP_PLAN_MAY_BE_EMPTY, reason="a shared batch needs transformers >= 5.25")
def test_fp8_copies_of_experts_split_by_transformers_outlive_the_forward(tmp_path):
    checkpoint = _save_tiny_model(tmp_path, num_hidden_layers=1, moe_intermediate_size=128)  # FP8 blocks: 128
    mp.spawn(_fp8_copies_across_forwards, nprocs=WORLD, args=(str(tmp_path / "store"), checkpoint))


def _rows_split_and_gathered(rank, store):
    _init(rank, store)
    from megamoe.hf_expert_parallel import _AllRows, _OwnRows, _own_rows

    batch = torch.arange(15.0).view(5, 3).requires_grad_()  # 5 rows: shares of 3 and 2 (+ 1 padding)
    share = _OwnRows.apply(batch, dist.group.WORLD)
    assert share.tolist() == (batch[:3] if rank == 0 else torch.cat([batch[3:], torch.zeros(1, 3)])).tolist()
    assert _own_rows(torch.arange(5), dist.group.WORLD, fill=-1).tolist() == ([0, 1, 2] if rank == 0 else [3, 4, -1])
    gathered = _AllRows.apply(share * (rank + 2), dist.group.WORLD, 5)
    assert gathered.tolist() == (batch * torch.tensor([2.0] * 3 + [3.0] * 2)[:, None]).tolist()
    gathered.sum().backward()  # each rank's share back, its gradient to every rank
    assert batch.grad.tolist() == [[2.0] * 3] * 3 + [[3.0] * 3] * 2
    dist.destroy_process_group()


def test_a_shared_batch_is_split_and_gathered_by_rows(tmp_path):
    mp.spawn(_rows_split_and_gathered, nprocs=WORLD, args=(str(tmp_path / "store"),))
