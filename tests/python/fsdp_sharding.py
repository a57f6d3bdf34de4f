"""FSDP2 (`fully_shard`) on a module with megamoe's experts, over W CPU processes (gloo): the sharded
module's output and parameter gradients equal the unsharded module's. Every rank runs the same batch,
so the gradient FSDP averages over the ranks is the one-process gradient. Also the helpers the
TorchTitan tests share to train a parallelised model against one process."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from megamoe.reference import relative_error


def _sum_gradients_as_torchtitan(model: torch.nn.Module) -> None:
    """TorchTitan's FSDP sums the gradients (divide factor 1; its trainer divides the loss by the
    global token count) through PREMUL_SUM(1.0), which gloo lacks: the same sum through SUM."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's whole gradient by name (a sharded one gathered)."""
    return {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            for name, p in model.named_parameters()}


def _check_gradients(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], bound: float = 1e-2) -> None:
    assert got.keys() == want.keys()
    for name, grad in got.items():
        assert relative_error(grad, want[name]) < bound, name


def train_as_one_process(parallel: torch.nn.Module, one_process: torch.nn.Module, rank: int, world: int,
                         steps: int, vocab: int, loss_rel: float,
                         logits: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = lambda m, ids: m(ids),
                         context: Callable = contextlib.nullcontext) -> None:
    """AdamW steps of a language model parallelised over `world` ranks (this rank's two sequences of each
    batch, run under `context`) and of the same model in one process (the whole batch): each step's
    loss summed over the ranks equals the one-process loss within loss_rel, and at the first step every
    parameter's summed gradient equals its one-process gradient. As TorchTitan's trainer has it, FSDP
    sums the gradients and each rank's loss is its tokens' summed cross entropy over the global token
    count."""
    _sum_gradients_as_torchtitan(parallel)
    models = (parallel, one_process)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    batches = torch.randint(0, vocab, (steps, 2 * world, 33), generator=torch.Generator().manual_seed(5))
    for step, batch in enumerate(batches):
        losses, grads = [], []
        for m, optimizer, ids, ctx in zip(models, optimizers, (batch[2 * rank:2 * rank + 2], batch),
                                          (context, contextlib.nullcontext)):
            with ctx():
                loss = F.cross_entropy(logits(m, ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten(),
                                       reduction="sum")
                loss = loss / batch[:, 1:].numel()
                loss.backward()
            grads.append(_gradients(m))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        dist.all_reduce(losses[0])
        assert losses[0].item() == pytest.approx(losses[1].item(), rel=loss_rel), f"step {step}"
        if step == 0:  # every parameter's summed gradient, the experts' included, from the same weights
            _check_gradients(*grads)


def _sharded_matches_unsharded(rank: int, world: int, store: str, build: Callable[[], torch.nn.Module],
                               input_shape: tuple[int, ...]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    module = build()
    unsharded = copy.deepcopy(module)
    fully_shard(module, mesh=init_device_mesh("cpu", (world,)))
    x = torch.randn(input_shape)
    outputs = {}
    for name, m in (("sharded", module), ("unsharded", unsharded)):
        y = m(x)
        y.float().square().mean().backward()
        outputs[name] = (y, _gradients(m))
    assert torch.equal(outputs["sharded"][0], outputs["unsharded"][0])
    assert outputs["sharded"][1].keys() == outputs["unsharded"][1].keys()
    for key, grad in outputs["unsharded"][1].items():
        torch.testing.assert_close(outputs["sharded"][1][key], grad, rtol=1e-5, atol=1e-7, msg=key)
    dist.barrier()  # no rank tears its group down while a peer's exchanges are still in flight
    dist.destroy_process_group()


def check_fully_shard(build: Callable[[], torch.nn.Module], input_shape: tuple[int, ...], tmp_path, world: int = 2):
    """build(): the module, on the CPU (a module-level function, so the spawned processes can import it)."""
    mp.spawn(_sharded_matches_unsharded, args=(world, str(tmp_path / "store"), build, input_shape), nprocs=world,
             join=True)
