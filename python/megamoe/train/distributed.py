"""Expert parallelism in the training loop ([moe].expert_parallel = W): one process per rank, launched
by torchrun. Every MoE layer's experts are split over the ranks (megamoe.patch_hf_model with the
group), everything else is replicated and trained data parallel: each rank takes its slice of the
global batch, the replicated parameters' gradients are averaged over the ranks, and each rank's
experts, whose expert-parallel backward already sums every rank's contribution, are divided by W, so
every parameter gets the gradient of the mean loss over the global batch, as one process training on
all of it would.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .config import Config, ConfigError


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    group: dist.ProcessGroup
    rank: int
    world: int

    def batch_slice(self, global_batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the global batch [W · batch_size, seq_len]."""
        rows = global_batch.shape[0] // self.world
        return global_batch[self.rank * rows:(self.rank + 1) * rows]

    def reduce_gradients(self, model: torch.nn.Module, experts: list[torch.nn.Parameter]) -> None:
        """The gradients of the mean loss over every rank's tokens: the replicated parameters' averaged
        over the ranks (summed in fp32), the experts' (this rank's own) divided by W."""
        expert_ids = {id(p) for p in experts}
        replicated = [p for p in model.parameters() if p.requires_grad and id(p) not in expert_ids]
        # The same tensors on every rank: those with a gradient on any rank (zeros where this one has none).
        device = replicated[0].device
        has_grad = self._sum(torch.tensor([float(p.grad is not None) for p in replicated], device=device))
        replicated = [p for p, count in zip(replicated, has_grad.tolist()) if count > 0]
        for p in replicated:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in replicated]
        total = _flatten_dense_tensors([g.float() for g in grads])
        for g, reduced in zip(grads, _unflatten_dense_tensors(self._sum(total) / self.world, grads)):
            g.copy_(reduced)
        for p in experts:
            if p.grad is not None:
                p.grad.div_(self.world)

    def grad_norm(self, model: torch.nn.Module, experts: list[torch.nn.Parameter]) -> torch.Tensor:
        """The global gradient norm (fp32): the replicated gradients counted once, every rank's experts."""
        expert_ids = {id(p) for p in experts}
        device = next(model.parameters()).device

        def sum_of_squares(params) -> torch.Tensor:
            norms = [p.grad.float().norm() for p in params if p.grad is not None]
            return torch.stack(norms).square().sum() if norms else torch.zeros((), device=device)

        replicated = sum_of_squares(p for p in model.parameters() if id(p) not in expert_ids)
        return (replicated + self._sum(sum_of_squares(experts))).sqrt()

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """values averaged over the ranks."""
        return self._sum(values.float()) / self.world

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the ranks, on t's device: reduced on the host for gloo (which serves ranks that
        share a GPU, and the CPU), on this rank's GPU otherwise."""
        on_host = dist.get_backend(self.group) == "gloo"
        device = torch.device("cpu") if on_host else torch.device("cuda", torch.cuda.current_device())
        reduced = t.to(device, copy=True)
        dist.all_reduce(reduced, group=self.group)
        return reduced.to(t.device)


def start(config: Config) -> ExpertParallel | None:
    """The expert-parallel group of this process (None for [moe].expert_parallel = 1): torchrun's
    environment must hold W processes. With a GPU per rank the group is NCCL's; ranks that share GPUs
    (fewer GPUs than ranks, e.g. for tests) go through gloo, which megamoe's expert parallelism serves
    too."""
    world = config.moe.expert_parallel
    if world == 1:
        return None
    launched = os.environ.get("WORLD_SIZE")
    if launched is None or int(launched) != world:
        raise ConfigError(f"[moe].expert_parallel = {world} runs one process per rank: launch with "
                          f"`torchrun --nproc-per-node {world} -m megamoe.train ...` (WORLD_SIZE is "
                          f"{launched or 'not set'})")
    if not torch.cuda.is_available():
        raise ConfigError("[moe].expert_parallel > 1 runs the fused experts, which need CUDA GPUs")
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.device_count() >= world else "gloo")
    return ExpertParallel(dist.group.WORLD, dist.get_rank(), dist.get_world_size())


def checkpoint_name(name: str, rank: int, world: int) -> str:
    """The checkpoint file of `rank` of `world`: `name` itself on one rank, else with the rank in it
    (each rank saves its own experts and optimizer state)."""
    if world == 1:
        return name
    stem, dot, suffix = name.rpartition(".")
    return f"{stem}.rank{rank}-of-{world}{dot}{suffix}"
