"""The training loop with [moe].expert_parallel = W: the launch and config checks, the split of the
Hugging Face model's experts over the ranks, and (GPU) W ranks on one GPU training as one process
does on the whole global batch."""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import requires_cuda
from test_expert_parallel import _sm90

pytest.importorskip("transformers")

from megamoe.hf import expert_parallel_parameters, patch_hf_model, qwen3_moe_experts  # noqa: E402
from megamoe.train import ConfigError, train  # noqa: E402
from megamoe.train.distributed import ExpertParallel, checkpoint_name  # noqa: E402
from megamoe.train.loop import _all_ranks_have  # noqa: E402
from megamoe.train.trainer import build_model  # noqa: E402
from test_train import tiny  # noqa: E402


def _spawn_as_torchrun(fn, world: int, *args) -> None:
    """Runs fn(rank, world, port, *args) in `world` processes that each look like a torchrun rank. As
    torchrun's agent does, this process serves the rendezvous store on a port the OS picked and the
    ranks join it as clients: a free port chosen here and bound later by rank 0 could be taken in
    between by another test's sockets."""
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    mp.spawn(fn, args=(world, store.port, *args), nprocs=world, join=True)


def _as_torchrun_rank(rank: int, world: int, port: int) -> None:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", NCCL_NVLS_ENABLE="0")


def test_expert_parallel_without_torchrun_says_how_to_launch(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = tiny(tmp_path, "moe.backend=fused", "moe.expert_parallel=2", "train.device=auto")
    with pytest.raises(ConfigError, match=r"launch with `torchrun --nproc-per-node 2 -m megamoe\.train"):
        train(config, progress=False)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_gathering_x_again_is_accepted_with_expert_parallelism(tmp_path):
    config = tiny(tmp_path, "moe.backend=fused", "moe.expert_parallel=2", "train.activation_checkpointing=moe-gather")
    assert (config.moe.expert_parallel, config.train.activation_checkpointing) == (2, "moe-gather")


def test_more_ranks_than_one_host_has_gpus_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"\[moe\]\.expert_parallel = 16: exceeds 8: expert parallelism runs over "
                                          r"the GPUs of one host"):
        tiny(tmp_path, "model.num_experts=32", "moe.backend=fused", "moe.expert_parallel=16")


def test_each_rank_has_a_checkpoint_of_its_own():
    assert checkpoint_name("checkpoint.pt", 0, 1) == "checkpoint.pt"
    assert checkpoint_name("checkpoint.pt", 1, 4) == "checkpoint.rank1-of-4.pt"


def _split_experts(rank, world, port, out_dir):
    _as_torchrun_rank(rank, world, port)
    dist.init_process_group("gloo")
    config = tiny(out_dir, "moe.backend=fused")
    model = build_model(config, torch.device("cpu"))
    whole = [(e.gate_up_proj.detach().clone(), e.down_proj.detach().clone()) for e in qwen3_moe_experts(model)]
    patch_hf_model(model, backend="fused", group=dist.group.WORLD)
    experts = qwen3_moe_experts(model)
    local = slice(rank * 4, rank * 4 + 4)  # 8 experts over 2 ranks
    for e, (gate_up, down) in zip(experts, whole):
        assert torch.equal(e.gate_up_proj, gate_up[local]) and torch.equal(e.down_proj, down[local])
        assert isinstance(e.gate_up_proj, torch.nn.Parameter) and e.gate_up_proj.requires_grad
    assert {id(p) for p in expert_parallel_parameters(model)} == {
        id(p) for e in experts for p in (e.gate_up_proj, e.down_proj)}
    assert {id(p) for p in model.parameters()} >= {id(p) for p in expert_parallel_parameters(model)}
    patch_hf_model(model, backend="fused", group=dist.group.WORLD)  # the same split again: nothing changes
    assert experts[0].gate_up_proj.shape[0] == 4
    with pytest.raises(ValueError, match=r"holds the experts of rank \d of 2 \(patched with a group before\)"):
        patch_hf_model(model, backend="fused")
    dist.destroy_process_group()


def test_a_group_splits_every_experts_module_over_the_ranks(tmp_path):
    _spawn_as_torchrun(_split_experts, 2, str(tmp_path))


def _train_rank(rank, world, port, out_dir, overrides):
    _as_torchrun_rank(rank, world, port)
    train(tiny(out_dir, "train.device=cuda", "moe.backend=fused", f"moe.expert_parallel={world}", *overrides),
          progress=False)


@requires_cuda
@pytest.mark.skipif(not _sm90(), reason="the fused kernels need sm_90")
@pytest.mark.parametrize("setting", ["train.activation_checkpointing=none", "train.activation_checkpointing=moe-gather",
                                     "train.micro_batches=2"], ids=["none", "moe-gather", "micro-batches"])
def test_two_ranks_on_one_gpu_train_as_one_process_on_the_global_batch(tmp_path, setting):
    """With micro-batches only the ranks accumulate (one sequence each per pass), against one pass of
    the whole global batch in one process; the held-out loss is the global batches' too."""
    steps = ("train.steps=4", "output.checkpoint_every=4", "train.eval_every=4")
    _spawn_as_torchrun(_train_rank, 2, str(tmp_path / "ep"), ["train.batch_size=2", setting, *steps])
    one_setting = () if "micro_batches" in setting else (setting,)
    one = train(tiny(tmp_path / "one", "train.device=cuda", "moe.backend=fused", "train.batch_size=4", *one_setting,
                     *steps), progress=False)
    ep = [json.loads(line) for line in (tmp_path / "ep" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ep] == [1, 2, 3, 4] and {r["expert_parallel"] for r in ep} == {2}
    # The same global batch and the same mean loss; only the order of the gradient sums differs.
    assert [r["loss"] for r in ep] == pytest.approx([r["loss"] for r in one], rel=1e-2)
    assert [r["grad_norm"] for r in ep] == pytest.approx([r["grad_norm"] for r in one], rel=5e-2)
    assert ep[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-3)  # before any update: the same model
    assert ep[-1]["eval_loss"] == pytest.approx(one[-1]["eval_loss"], rel=1e-2)
    assert all(r["peak_memory_gb"] > 0 for r in ep)
    assert sorted(p.name for p in (tmp_path / "ep").glob("checkpoint*.pt")) == [
        "checkpoint.rank0-of-2.pt", "checkpoint.rank1-of-2.pt"]


def _reduce_on_cpu(rank, world, port, out_dir):
    _as_torchrun_rank(rank, world, port)
    dist.init_process_group("gloo")
    ep = ExpertParallel(dist.group.WORLD, rank, world)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    shared, own, unused = model[0].weight, model[1].weight, model[1].bias
    shared.grad = torch.full_like(shared, float(rank + 1))  # ranks 1 and 2: mean 1.5
    own.grad = torch.full_like(own, 4.0)
    model[0].bias.grad = torch.ones_like(model[0].bias) if rank == 0 else None  # one rank has it
    assert unused.grad is None
    ep.reduce_gradients(model, [own])
    assert torch.equal(shared.grad, torch.full_like(shared, 1.5))
    assert torch.equal(model[0].bias.grad, torch.full_like(model[0].bias, 0.5))
    assert unused.grad is None  # no rank has one: the optimizer skips it, as in one process
    assert torch.equal(own.grad, torch.full_like(own, 2.0))  # this rank's experts, divided by W
    # Replicated gradients once, both ranks' experts: 16 · 1.5² + 4 · 0.5² + 2 ranks · 8 · 2².
    assert ep.grad_norm(model, [own]).item() == pytest.approx((16 * 1.5 ** 2 + 4 * 0.25 + 2 * 8 * 4.0) ** 0.5)
    assert ep.mean(torch.tensor([float(rank)])).item() == 0.5
    assert torch.equal(ep.batch_slice(torch.arange(8).view(4, 2)), torch.arange(8).view(4, 2)[2 * rank:2 * rank + 2])
    checkpoint = Path(out_dir) / checkpoint_name("checkpoint.pt", rank, world)
    assert not _all_ranks_have(checkpoint, ep)
    if rank == 0:
        checkpoint.write_bytes(b"")
    with pytest.raises(ConfigError, match="only some ranks have their checkpoint"):
        _all_ranks_have(checkpoint, ep)
    dist.destroy_process_group()


def test_gradients_norm_and_losses_are_the_global_batchs(tmp_path):
    _spawn_as_torchrun(_reduce_on_cpu, 2, str(tmp_path))
