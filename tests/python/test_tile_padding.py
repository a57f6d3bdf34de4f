"""Sizes that are not multiples of the GEMM tile run zero-padded (megamoe/tile_padding.py): the padded
layer is the same function, its gradients the same gradients (fp64 reference, on the CPU), and a
weight with an fp32 main_grad is refused rather than left without its gradient."""

import pytest
import torch

import megamoe
from megamoe.reference import reference_moe
from megamoe.shapes import MoEShape
from megamoe.tile_padding import needs_padding, pad_to_tiles


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("hidden, inter", [(200, 72), (256, 72), (200, 128), (2880 // 8, 2880 // 8)])
def test_padded_layer_is_the_same_function_with_the_same_gradients(hidden, inter, activation):
    assert needs_padding(hidden, inter)
    shape = MoEShape(hidden_size=hidden, intermediate_size=inter, num_experts=6, top_k=2)
    x, ids, weights, w13, w2 = megamoe.make_inputs(shape, 40, "skewed", seed=1)
    exact = [t.double().requires_grad_() for t in (x, weights, w13, w2)]
    padded = [t.double().requires_grad_() for t in (x, weights, w13, w2)]
    xp, w13p, w2p = pad_to_tiles(padded[0], padded[2], padded[3])
    assert xp.shape[1] % 128 == 0 and w13p.shape[1] % 256 == 0 and w2p.shape[1:] == (xp.shape[1], w13p.shape[1] // 2)
    y = reference_moe(exact[0], ids, exact[1], exact[2], exact[3], activation=activation)
    yp = reference_moe(xp, ids, padded[1], w13p, w2p, activation=activation)
    assert torch.all(yp[:, hidden:] == 0)
    torch.testing.assert_close(yp[:, :hidden], y, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(y)
    y.backward(dy)
    yp[:, :hidden].backward(dy)
    for name, a, b in zip(("x", "topk_weights", "w13", "w2"), exact, padded):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_a_main_grad_is_refused_not_dropped():
    shape = MoEShape(hidden_size=200, intermediate_size=72, num_experts=4, top_k=2)
    x, _, _, w13, w2 = megamoe.make_inputs(shape, 8)
    w2.main_grad = torch.zeros(w2.shape)
    with pytest.raises(NotImplementedError, match="w2.main_grad.*zero-padded.*delete main_grad"):
        pad_to_tiles(x, w13, w2)
