"""Expert parallelism's data path on W virtual ranks of one GPU (virtual_ranks.py): the same
layer split over ranks gives, forward and backward, bit for bit what one rank holding every expert
gives (which the fused tests hold against the fp64 reference; the forward is checked against it here
too)."""

import pytest
import torch

import virtual_ranks
from conftest import requires_cuda
from megamoe.fused import fused_moe_backward, fused_moe_forward
from megamoe.reference import reference_moe, relative_error
from megamoe.shapes import make_routing
from test_backends import TESTED_ACTIVATIONS

HIDDEN, INTER, TOP_K = 256, 256, 4


def _problem(tokens_per_rank, num_experts, device):
    """Per-rank inputs plus the whole layer's weights; ~5% of routes masked, expert 1 unused."""
    world, total = len(tokens_per_rank), sum(tokens_per_rank)
    ids, weights = make_routing(total, num_experts, TOP_K, device=device)
    ids = torch.where(ids == 1, 0, ids)  # expert 1 gets no routes (expert 0 may then repeat in a row)
    ids = torch.where(torch.rand(ids.shape, device=device) < 0.05, -1, ids)
    x = torch.randn(total, HIDDEN, device=device).to(torch.bfloat16)
    w13 = (torch.randn(num_experts, 2 * INTER, HIDDEN, device=device) / HIDDEN**0.5).to(torch.bfloat16)
    w2 = (torch.randn(num_experts, HIDDEN, INTER, device=device) / INTER**0.5).to(torch.bfloat16)
    local = num_experts // world
    return (list(x.split(tokens_per_rank)), list(ids.split(tokens_per_rank)), list(weights.split(tokens_per_rank)),
            list(w13.split(local)), list(w2.split(local)), (x, ids, weights, w13, w2))


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@requires_cuda
@pytest.mark.skipif(not _sm90(), reason="the fused kernels need sm_90")
@pytest.mark.parametrize("activation", TESTED_ACTIVATIONS)
@pytest.mark.parametrize("tokens_per_rank,num_experts", [([300, 200], 8), ([257, 0, 64, 1], 16), ([130], 8)])
def test_virtual_ranks_equal_one_rank_bitwise(tokens_per_rank, num_experts, activation):
    xs, ids, weights, w13s, w2s, whole = _problem(tokens_per_rank, num_experts, "cuda")
    ys = virtual_ranks.forward_virtual_ranks(xs, ids, weights, w13s, w2s, activation)
    y_one = fused_moe_forward(*whole, activation, "bf16", False, False, False)[0]
    for r, (y, expected) in enumerate(zip(ys, y_one.split(tokens_per_rank))):
        assert y.shape == expected.shape
        assert torch.equal(y, expected), f"rank {r} differs from the single-rank output"
    y_all = torch.cat(ys)
    assert relative_error(y_all.double(), reference_moe(*whole, activation=activation)) <= 1e-2


@requires_cuda
@pytest.mark.skipif(not _sm90(), reason="the fused kernels need sm_90")
@pytest.mark.parametrize("activation", TESTED_ACTIVATIONS)
@pytest.mark.parametrize("tokens_per_rank,num_experts", [([300, 200], 8), ([257, 0, 64, 1], 16)])
def test_virtual_ranks_backward_equals_one_rank_bitwise(tokens_per_rank, num_experts, activation):
    xs, ids, weights, w13s, w2s, whole = _problem(tokens_per_rank, num_experts, "cuda")
    dy = torch.randn_like(whole[0])
    dxs, dweights, dw13s, dw2s = virtual_ranks.backward_virtual_ranks(
        list(dy.split(tokens_per_rank)), xs, ids, weights, w13s, w2s, activation)
    empty = whole[0].new_empty(0)
    dx, dweight, dw13, dw2 = fused_moe_backward(dy, *whole, activation, "bf16", empty, empty, whole[1].new_empty(0),
                                                False, True, True, True, True, None, None)
    assert torch.equal(torch.cat(dxs), dx)
    assert torch.equal(torch.cat(dweights), dweight)
    assert torch.equal(torch.cat(dw13s), dw13)
    assert torch.equal(torch.cat(dw2s), dw2)


@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.__setitem__("xs", a["xs"] * 9), "1 to 8 ranks"),
    (lambda a: a.__setitem__("w2s", a["w2s"][:1]), "one entry per rank"),
    (lambda a: a["w13s"].__setitem__(1, a["w13s"][1][:1]), "as many experts of the same shape"),
    (lambda a: a["topk_ids"].__setitem__(1, a["topk_ids"][1][:, :2]), "same K on every rank"),
    (lambda a: a["xs"].__setitem__(0, a["xs"][0].float()), "contiguous bfloat16"),
])
def test_rejects_inconsistent_ranks(mutate, match):
    xs, ids, weights, w13s, w2s, _ = _problem([6, 5], 4, "cpu")
    args = {"xs": xs, "topk_ids": ids, "topk_weights": weights, "w13s": w13s, "w2s": w2s}
    mutate(args)
    with pytest.raises((ValueError, TypeError), match=match):
        virtual_ranks.forward_virtual_ranks(**args)


def test_backward_rejects_a_mismatched_dy():
    xs, ids, weights, w13s, w2s, _ = _problem([6, 5], 4, "cpu")
    dys = [xs[0], xs[1][:2]]
    with pytest.raises(ValueError, match="dy of rank 1 must be"):
        virtual_ranks.backward_virtual_ranks(dys, xs, ids, weights, w13s, w2s)


def test_cpu_tensors_are_refused_with_the_alternative():
    xs, ids, weights, w13s, w2s, _ = _problem([6, 5], 4, "cpu")
    with pytest.raises(ValueError, match="CUDA tensors"):
        virtual_ranks.forward_virtual_ranks(xs, ids, weights, w13s, w2s)
