"""The all-to-all expert-parallel baseline (megamoe/backends/all_to_all.py) over W CPU processes
(gloo): each rank's output and the four gradients equal the one-process grouped layer's on the whole
problem, ranks without tokens included; and the baseline keeps no reference to the group once its
output is gone (a group still alive when the interpreter exits can abort the process in gloo's
teardown)."""

import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import megamoe
from megamoe.backends.all_to_all import all_to_all_moe
from megamoe.reference import relative_error
from megamoe.shapes import MoEShape

SHAPE = MoEShape(hidden_size=128, intermediate_size=64, num_experts=6, top_k=2)
TOLERANCE = 1e-2  # bf16 operands, the two paths sum in different orders


def _rank_matches_one_process(rank, world, store, tokens_per_rank):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    group = dist.group.WORLD
    references = sys.getrefcount(group)
    torch.manual_seed(0)  # the same problem in every process
    x, ids, weights, w13, w2 = megamoe.make_inputs(SHAPE, sum(tokens_per_rank), "skewed", seed=3)
    ids[::7, 1] = -1  # masked routes
    dy = torch.randn_like(x)
    whole = [t.clone().requires_grad_() for t in (x, weights, w13, w2)]
    y1 = megamoe.moe(whole[0], ids, whole[1], whole[2], whole[3], backend="grouped")
    y1.backward(dy)
    tokens = slice(sum(tokens_per_rank[:rank]), sum(tokens_per_rank[:rank + 1]))
    local = SHAPE.num_experts // world
    experts = slice(rank * local, (rank + 1) * local)
    mine = [t[part].clone().requires_grad_() for t, part in ((x, tokens), (weights, tokens), (w13, experts),
                                                             (w2, experts))]
    y = all_to_all_moe(mine[0], ids[tokens], mine[1], mine[2], mine[3], group)
    y.backward(dy[tokens])
    assert y.shape == (tokens_per_rank[rank], SHAPE.hidden_size)
    for name, got, want in (("y", y, y1[tokens]), ("dx", mine[0].grad, whole[0].grad[tokens]),
                            ("d topk_weights", mine[1].grad, whole[1].grad[tokens]),
                            ("dw13", mine[2].grad, whole[2].grad[experts]), ("dw2", mine[3].grad, whole[3].grad[experts])):
        if want.numel():
            assert relative_error(got, want) < TOLERANCE, f"rank {rank}: {name}"
    del y  # its graph holds the group
    assert sys.getrefcount(group) == references, f"rank {rank}: the baseline still refers to its group"
    dist.barrier()  # no rank tears its group down while a peer's exchanges are still in flight
    dist.destroy_process_group()


@pytest.mark.parametrize("tokens_per_rank", [[40, 24], [30, 0, 17]])
def test_all_to_all_baseline_equals_one_process(tmp_path, tokens_per_rank):
    mp.spawn(_rank_matches_one_process, args=(len(tokens_per_rank), str(tmp_path / "store"), tokens_per_rank),
             nprocs=len(tokens_per_rank), join=True)
