"""The fused layer in block FP8 (precision "fp8" and "fp8_bwd") against the same recipe in fp64
(megamoe.reference.reference_moe_grads): the kernels add no error of their own beyond the recipe's."""

import pytest
import torch

import megamoe
from megamoe.reference import reference_moe, reference_moe_grads, relative_error
from megamoe.shapes import MoEShape

from conftest import requires_cuda
from test_backends import (CASES, CLAMPED, SMALL, TESTED_ACTIVATIONS, TOLERANCE, edge_case_inputs, leaf,
                           poison_cuda_cache)

FP8_PRECISIONS = ["fp8", "fp8_bwd"]
GRADIENTS = ("dx", "dtopk_weights", "dw13", "dw2")


@pytest.mark.parametrize("activation", TESTED_ACTIVATIONS)
def test_recipe_reference_in_bf16_is_the_autograd_reference(activation):
    x, ids, weights, w13, w2 = edge_case_inputs("masked", SMALL, "cpu", exact_z=activation == CLAMPED)
    leaves = [leaf(t, torch.float64) for t in (x, weights, w13, w2)]
    ref = reference_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], activation=activation)
    dy = torch.randn_like(ref)
    ref.backward(dy)
    got = reference_moe_grads(x, ids, weights, w13, w2, dy, activation=activation, precision="bf16")
    assert relative_error(got[0], ref) < 1e-12
    for name, grad, want in zip(GRADIENTS, got[1:], leaves):
        assert relative_error(grad, want.grad) < 1e-12, name


@pytest.mark.parametrize("precision", FP8_PRECISIONS)
def test_recipe_error_against_exact_fp64_is_the_e4m3_error(precision):
    """The recipe's own error (reported, and bounded: e4m3 keeps 3 mantissa bits, 2^-4 relative per
    value at most; products of two quantised operands and a quantised h stay below ~10%)."""
    x, ids, weights, w13, w2 = edge_case_inputs("balanced", SMALL, "cpu")
    dy = torch.randn(x.shape, dtype=torch.float64)
    exact = reference_moe_grads(x, ids, weights, w13, w2, dy)
    recipe = reference_moe_grads(x, ids, weights, w13, w2, dy, precision=precision)
    errors = {name: relative_error(r, e) for name, r, e in zip(("y", *GRADIENTS), recipe, exact)}
    print(f"{precision} recipe vs exact fp64: " + ", ".join(f"{n} {v:.3f}" for n, v in errors.items()))
    assert all(v < 0.1 for v in errors.values()), errors
    assert (errors["y"] == 0) == (precision == "fp8_bwd")  # fp8_bwd's forward is bf16


def _fused(precision, activation, inputs, ids, recompute=False):
    return megamoe.moe(inputs[0], ids, inputs[1], inputs[2], inputs[3], backend="fused", precision=precision,
                       activation=activation, recompute=recompute)


@requires_cuda
@pytest.mark.parametrize("activation", TESTED_ACTIVATIONS)
@pytest.mark.parametrize("precision", FP8_PRECISIONS)
@pytest.mark.parametrize("case", CASES)
def test_fused_fp8_matches_the_recipe(case, precision, activation):
    _check_against_the_recipe(case, precision, activation, SMALL)


@requires_cuda
@pytest.mark.parametrize("precision", FP8_PRECISIONS)
def test_fused_fp8_at_a_wider_hidden_size_matches_the_recipe(precision):
    """H = 640: dW13 in two column halves (512 and 128 wide), each from a pool of x that wide."""
    _check_against_the_recipe("balanced", precision, "swiglu",
                              MoEShape(hidden_size=640, intermediate_size=256, num_experts=8, top_k=2))


def _check_against_the_recipe(case, precision, activation, shape):
    x, ids, weights, w13, w2 = edge_case_inputs(case, shape, "cuda", exact_z=activation == CLAMPED)
    inputs = [leaf(t) for t in (x, weights, w13, w2)]
    poison_cuda_cache()
    y = _fused(precision, activation, inputs, ids)
    assert y.shape == x.shape and y.dtype == x.dtype
    if x.shape[0] == 0:
        return
    # dy from its own seed, not from whatever the tests before left in the global generator: with
    # one token, one e4m3 rounding of dz that fp32 and fp64 take apart moves dx by about 1%.
    dy = torch.randn(x.shape, dtype=torch.float64, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    y.backward(dy.to(y.dtype))
    ref = reference_moe_grads(x, ids, weights, w13, w2, dy.to(torch.bfloat16), activation=activation,
                              precision=precision)
    assert relative_error(y, ref[0]) < TOLERANCE
    for name, got, want in zip(GRADIENTS, inputs, ref[1:]):
        if want.abs().max() == 0:
            assert got.grad.abs().max() == 0, name
        elif name != "dtopk_weights" or case != "t1":  # t1: two dot products that may cancel
            assert relative_error(got.grad, want) < TOLERANCE, name


@requires_cuda
@pytest.mark.parametrize("precision", FP8_PRECISIONS)
def test_fused_fp8_is_deterministic_and_recompute_keeps_the_gradients(precision):
    x, ids, weights, w13, w2 = edge_case_inputs("skewed", SMALL, "cuda")
    dy = torch.randn_like(x)
    runs = []
    for recompute in (False, False, True):
        inputs = [leaf(t) for t in (x, weights, w13, w2)]
        y = _fused(precision, "swiglu", inputs, ids, recompute)
        y.backward(dy)
        runs.append([y] + [t.grad for t in inputs])
    for a, b in zip(runs[0], runs[1]):
        assert torch.equal(a, b)
    for a, b in zip(runs[0], runs[2]):
        assert relative_error(b, a) < 1e-3


@requires_cuda
@pytest.mark.parametrize("precision", FP8_PRECISIONS)
def test_fp8_dw2_is_the_same_from_dys_token_rows_and_from_its_pool(precision, monkeypatch):
    """dW2's transposed dy is gathered from dy's e4m3 token rows where they fit in L2, else made from
    its pool: the same bytes either way, so every output and gradient is bitwise the same."""
    x, ids, weights, w13, w2 = edge_case_inputs("skewed", SMALL, "cuda")
    dy = torch.randn_like(x)
    runs = []
    for fits in (True, False):
        monkeypatch.setattr(megamoe.fused, "_fits_in_l2", lambda nbytes, device, fits=fits: fits)
        inputs = [leaf(t) for t in (x, weights, w13, w2)]
        y = _fused(precision, "swiglu", inputs, ids, False)
        y.backward(dy)
        runs.append([y] + [t.grad for t in inputs])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@requires_cuda
def test_fused_fp8_non_finite_rows_stay_in_their_rows():
    x, ids, weights, w13, w2 = edge_case_inputs("balanced", SMALL, "cuda")
    x[7, 3] = float("nan")
    dy = torch.randn_like(x)
    dy[11, 5] = float("inf")
    inputs = [leaf(t) for t in (x, weights, w13, w2)]
    y = _fused("fp8", "swiglu", inputs, ids)
    y.backward(dy)
    rows = torch.arange(x.shape[0], device="cuda")
    assert torch.equal(~y.isfinite().all(dim=1), rows == 7)
    # x[7] reaches dx[7] through z, dy[11] reaches dx[11]; no other token's row.
    assert torch.equal(~inputs[0].grad.isfinite().all(dim=1), (rows == 7) | (rows == 11))


@requires_cuda
def test_a_captured_fp8_forward_quantises_the_weights_as_they_are_at_replay():
    """A capture outside fp8.cached_weights_in_graphs() bypasses the weight cache: the graph holds the
    quantisation, so a replay after any in-place update computes with the new weights, as an eager
    call does."""
    x, ids, weights, w13, w2 = megamoe.make_inputs(SMALL, 64, device="cuda")
    with torch.no_grad():
        megamoe.fused_moe(x, ids, weights, w13, w2, precision="fp8")  # warm-up, and a cached copy of w13
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = megamoe.fused_moe(x, ids, weights, w13, w2, precision="fp8")
        w13.mul_(0.5)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, megamoe.fused_moe(x, ids, weights, w13, w2, precision="fp8"))
