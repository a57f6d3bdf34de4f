"""MoELayer: the Qwen3 router, transformers' aux loss, and the layer through naive and grouped."""

import functools
import gc

import pytest
import torch
import torch.nn.functional as F

import megamoe
from megamoe import fp8
from megamoe.activation import ACTIVATIONS
from megamoe.reference import reference_moe, relative_error
from megamoe.router import route

from conftest import requires_cuda

BF16_TOLERANCE = 1e-2  # bf16 operands, fp32 accumulation (as test_backends)


def qwen3_router(hidden_states, gate_weight, top_k, norm_topk_prob):
    """transformers' Qwen3MoeTopKRouter.forward, written out (weights kept in fp32)."""
    router_logits = F.linear(hidden_states, gate_weight)
    probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
    values, indices = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        values /= values.sum(dim=-1, keepdim=True)
    return router_logits, values, indices


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_matches_qwen3(norm_topk_prob, dtype):
    x = torch.randn(100, 64, dtype=dtype)
    gate = (torch.randn(16, 64) * 0.1).to(dtype)
    logits, weights, ids = qwen3_router(x, gate, 4, norm_topk_prob)
    routing = route(x, gate, 4, norm_topk_prob)
    assert torch.equal(routing.router_logits, logits)
    assert torch.equal(routing.topk_ids, ids)
    assert torch.equal(routing.topk_weights, weights) and routing.topk_weights.dtype == torch.float32


def test_expert_bias_changes_selection_not_weights():
    x, gate = torch.randn(50, 32), torch.randn(8, 32)
    bias = torch.zeros(8)
    bias[3] = 10.0  # expert 3 always selected
    routing = route(x, gate, 2, norm_topk_prob=False, expert_bias=bias)
    assert (routing.topk_ids == 3).any(dim=-1).all()
    probs = torch.softmax(x @ gate.T, dim=-1)
    assert torch.equal(routing.topk_weights, probs.gather(-1, routing.topk_ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_matches_transformers(masked, dtype):
    modeling = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    batch, seq, experts, top_k = 3, 20, 16, 4
    logits = tuple(torch.randn(batch * seq, experts, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = (torch.rand(batch, seq) > 0.3).long() if masked else None
    want = modeling.load_balancing_loss_func(logits, experts, top_k, mask)
    got = megamoe.load_balancing_loss(logits, top_k, mask)
    torch.testing.assert_close(got, want)
    grads_want = torch.autograd.grad(want, logits)
    grads_got = torch.autograd.grad(got, logits)
    for g, w in zip(grads_got, grads_want):
        torch.testing.assert_close(g, w)


def test_load_balancing_loss_is_top_k_for_uniform_routing():
    assert megamoe.load_balancing_loss(torch.zeros(10, 8), top_k=2).item() == pytest.approx(2.0)


def make_layer(backend, **kwargs):
    torch.manual_seed(0)
    return megamoe.MoELayer(64, 32, num_experts=8, top_k=2, backend=backend, dtype=torch.bfloat16, **kwargs)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_layer_naive_and_grouped_agree(activation):
    layers = {backend: make_layer(backend, activation=activation) for backend in ("naive", "grouped")}
    x = torch.randn(2, 50, 64, dtype=torch.bfloat16)
    outputs, grads = {}, {}
    for backend, layer in layers.items():
        xg = x.clone().requires_grad_(True)
        y, router_logits = layer(xg)
        assert y.shape == x.shape and y.dtype == x.dtype and router_logits.shape == (100, 8)
        loss = y.float().square().mean() + 0.01 * megamoe.load_balancing_loss(router_logits, top_k=2)
        loss.backward()
        outputs[backend] = y
        grads[backend] = {"x": xg.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    assert relative_error(outputs["grouped"], outputs["naive"]) < BF16_TOLERANCE
    for name in grads["naive"]:
        assert relative_error(grads["grouped"][name], grads["naive"][name]) < BF16_TOLERANCE, name


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("backend", ["naive", "grouped"])
def test_layer_experts_match_the_reference(backend, activation):
    """The layer's output and expert weight gradients against the fp64 reference on its routing."""
    layer = make_layer(backend, activation=activation)
    x = torch.randn(100, 64, dtype=torch.bfloat16)
    y, _ = layer(x)
    routing = route(x, layer.gate.weight.detach(), 2)
    w13, w2 = (p.detach().double().requires_grad_() for p in (layer.w13, layer.w2))
    ref = reference_moe(x, routing.topk_ids, routing.topk_weights, w13, w2, activation=activation)
    assert relative_error(y, ref) < BF16_TOLERANCE
    dy = torch.randn_like(ref)
    y.backward(dy.to(y.dtype))
    ref.backward(dy)
    assert relative_error(layer.w13.grad, w13.grad) < BF16_TOLERANCE
    assert relative_error(layer.w2.grad, w2.grad) < BF16_TOLERANCE
    assert f"activation={activation!r}" in repr(layer)


def test_layer_parameters_and_init():
    layer = megamoe.MoELayer(64, 32, num_experts=8, top_k=2, backend="naive")
    assert dict((n, tuple(p.shape)) for n, p in layer.named_parameters()) == {
        "gate.weight": (8, 64), "w13": (8, 64, 64), "w2": (8, 64, 32)}
    assert layer.w13.std().item() == pytest.approx(0.02, rel=0.1)
    assert layer.expert_bias is None


def test_expert_bias_update_moves_towards_balance():
    layer = make_layer("naive", use_expert_bias=True)
    with torch.no_grad():
        layer.gate.weight[5] += 1.0  # expert 5 overloaded
    x = torch.randn(200, 64, dtype=torch.bfloat16) + 1.0
    layer(x)
    load = layer.expert_load.clone()
    assert load.sum() == 200 * 2 and load.argmax() == 5
    layer.update_expert_bias(rate=0.1)
    assert layer.expert_bias[5] == pytest.approx(-0.1)
    assert "expert_bias" in layer.state_dict() and "expert_load" not in layer.state_dict()


def test_layer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        megamoe.MoELayer(64, 32, 8, 2, backend="fast")
    with pytest.raises(ValueError, match="top_k"):
        megamoe.MoELayer(64, 32, 8, 9)
    with pytest.raises(RuntimeError, match="use_expert_bias"):
        make_layer("naive").update_expert_bias()



def test_layer_recompute_reaches_the_fused_op(monkeypatch):
    layer = megamoe.MoELayer(64, 32, 4, 2, backend="fused", recompute=True)
    calls = []
    monkeypatch.setattr(megamoe.layer, "moe", lambda x, *args, **kwargs: calls.append(kwargs) or x * 0)
    layer(torch.randn(8, 64, dtype=torch.bfloat16))
    assert calls[0]["recompute"] is True and "recompute=True" in repr(layer)
    with pytest.raises(ValueError, match="recompute=True needs backend='fused'"):
        megamoe.MoELayer(64, 32, 4, 2, backend="grouped", recompute=True)
    with pytest.raises(ValueError, match="fused backend's own recomputation"):
        megamoe.moe(*megamoe.make_inputs(megamoe.shapes.MoEShape(64, 32, 4, 2), 8), backend="grouped", recompute=True)


def test_layer_defaults_to_bfloat16_parameters_and_runs_bfloat16_input():
    """The README's usage: a layer built without dtype takes bf16 hidden states."""
    layer = megamoe.MoELayer(64, 32, num_experts=8, top_k=2, backend="grouped")
    assert {p.dtype for p in layer.parameters()} == {torch.bfloat16}
    y, router_logits = layer(torch.randn(2, 5, 64, dtype=torch.bfloat16))
    assert y.shape == (2, 5, 64) and y.dtype == torch.bfloat16 and router_logits.shape == (10, 8)


def test_layer_names_the_dtype_mismatch_and_the_fix():
    layer = megamoe.MoELayer(64, 32, num_experts=8, top_k=2, backend="grouped")
    with pytest.raises(TypeError, match=r"torch\.float32.*torch\.bfloat16.*\.to\(torch\.bfloat16\).*dtype="):
        layer(torch.randn(10, 64))
    fp32 = megamoe.MoELayer(64, 32, num_experts=8, top_k=2, backend="grouped", dtype=torch.float32)
    assert fp32(torch.randn(10, 64))[0].dtype == torch.float32


def shared_expert_reference(layer, x, gate_proj, up_proj, down_proj, activation="swiglu"):
    """fp64: the routed experts on the layer's routing plus the shared MLP, gated as the layer gates it;
    differentiable w.r.t. x and every weight passed (the routed experts' are the layer's, detached)."""
    from megamoe.activation import gated
    xd = x.double()
    routing = route(xd, layer.gate.weight.detach().double(), layer.top_k)
    experts = layer.w13.shape[0] - layer.num_shared
    w13, w2 = (p.detach()[:experts].double().requires_grad_() for p in (layer.w13, layer.w2))
    routed = reference_moe(xd, routing.topk_ids, routing.topk_weights, w13, w2, activation=activation)
    shared = gated(xd @ torch.cat([gate_proj, up_proj]).T, activation) @ down_proj.T
    gate = None
    if layer.shared_expert_gate is not None:
        gate = layer.shared_expert_gate.weight.detach().double().requires_grad_()
        shared = shared * torch.sigmoid(xd @ gate.T)
    return routed + shared, (w13, w2, gate)


@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("slices", [1, 3])
def test_shared_expert_matches_a_separate_mlp(slices, gate):
    """The shared expert as S slices routed to by every token: output and gradients of the shared MLP's
    weights, its gate and x against fp64, the MLP loaded from transformers' layout."""
    torch.manual_seed(0)
    layer = megamoe.MoELayer(64, 32, num_experts=8, top_k=2, backend="naive", dtype=torch.float64,
                             shared_expert_intermediate_size=32 * slices, shared_expert_gate=gate)
    assert layer.w13.shape == (8 + slices, 64, 64) and f"shared_expert_slices={slices}" in repr(layer)
    gate_proj, up_proj = torch.randn(32 * slices, 64, dtype=torch.float64) / 8, torch.randn(32 * slices, 64) / 8
    down_proj = torch.randn(64, 32 * slices, dtype=torch.float64) / 8
    layer.load_shared_expert(gate_proj, up_proj.double(), down_proj)
    x = torch.randn(100, 64, dtype=torch.float64, requires_grad=True)
    y, _ = layer(x)
    shared = [t.double().clone().requires_grad_() for t in (gate_proj, up_proj, down_proj)]
    xr = x.detach().clone().requires_grad_()
    ref, (_, _, gate_weight) = shared_expert_reference(layer, xr, *shared)
    # naive sums the experts' outputs in fp32
    close = functools.partial(torch.testing.assert_close, rtol=1e-5, atol=1e-6)
    close(y, ref)
    dy = torch.randn_like(ref)
    y.backward(dy)
    ref.backward(dy)
    close(x.grad, xr.grad)
    inter = 32
    dw13, dw2 = layer.w13.grad[8:], layer.w2.grad[8:]
    close(dw13[:, :inter].reshape(-1, 64), shared[0].grad)
    close(dw13[:, inter:].reshape(-1, 64), shared[1].grad)
    close(dw2.transpose(0, 1).reshape(64, -1), shared[2].grad)
    if gate:
        close(layer.shared_expert_gate.weight.grad, gate_weight.grad)


@requires_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_fused_shared_expert_matches_fp64(precision):
    """backend='fused' with a gated shared expert of two slices: output and gradients against fp64."""
    torch.manual_seed(0)
    layer = megamoe.MoELayer(256, 128, num_experts=8, top_k=2, backend="fused", precision=precision,
                             shared_expert_intermediate_size=256, shared_expert_gate=True, device="cuda")
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y, _ = layer(x)
    shared = [p.detach()[8:].double() for p in (layer.w13, layer.w2)]
    mlp = [t.clone().requires_grad_() for t in (shared[0][:, :128].reshape(-1, 256),
                                                 shared[0][:, 128:].reshape(-1, 256),
                                                 shared[1].transpose(0, 1).reshape(256, -1))]
    xr = x.detach().double().requires_grad_()
    ref, (w13, w2, gate_weight) = shared_expert_reference(layer, xr, *mlp)
    tolerance = BF16_TOLERANCE if precision == "bf16" else 0.1  # the recipe's own error (docs/PERFORMANCE.md)
    assert relative_error(y, ref) < tolerance
    dy = torch.randn_like(ref)
    y.backward(dy.to(y.dtype))
    ref.backward(dy)
    assert relative_error(x.grad, xr.grad) < tolerance
    assert relative_error(layer.w13.grad[:8], w13.grad) < tolerance
    assert relative_error(layer.w2.grad[:8], w2.grad) < tolerance
    assert relative_error(layer.shared_expert_gate.weight.grad, gate_weight.grad) < tolerance
    dw13, dw2 = layer.w13.grad[8:], layer.w2.grad[8:]
    assert relative_error(dw13[:, :128].reshape(-1, 256), mlp[0].grad) < tolerance
    assert relative_error(dw13[:, 128:].reshape(-1, 256), mlp[1].grad) < tolerance
    assert relative_error(dw2.transpose(0, 1).reshape(256, -1), mlp[2].grad) < tolerance


@pytest.mark.parametrize("kwargs, error, match", [
    ({"shared_expert_intermediate_size": 48}, ValueError, "positive multiple of moe_intermediate_size = 32"),
    ({"shared_expert_gate": True}, ValueError, "shared_expert_gate needs a shared expert"),
])
def test_shared_expert_refusals(kwargs, error, match):
    with pytest.raises(error, match=match):
        megamoe.MoELayer(64, 32, num_experts=8, top_k=2, backend="naive", **kwargs)


def test_load_shared_expert_checks_shapes():
    layer = megamoe.MoELayer(64, 32, 8, 2, backend="naive", shared_expert_intermediate_size=64)
    with pytest.raises(ValueError, match=r"up_proj must be \[64, 64\]"):
        layer.load_shared_expert(torch.zeros(64, 64), torch.zeros(32, 64), torch.zeros(64, 64))
    with pytest.raises(RuntimeError, match="no shared expert"):
        megamoe.MoELayer(64, 32, 8, 2, backend="naive").load_shared_expert(*[torch.zeros(1, 1)] * 3)


@requires_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp8_bwd"])
def test_layer_replayed_from_cuda_graphs_trains_like_eager(precision):
    """MoELayer captured by torch.cuda.make_graphed_callables inside fp8.cached_weights_in_graphs():
    three SGD steps give bitwise the outputs, gradients and weights of the same steps run eagerly
    (the graphs read the cached FP8 copies that each optimizer step refreshes in place)."""
    def make_layer():
        torch.manual_seed(0)
        return megamoe.MoELayer(256, 128, num_experts=8, top_k=2, precision=precision, device="cuda")

    # Graphs of earlier tests that only a garbage collection frees (a module graphed by PyTorch 2.11
    # refers to itself) must go before this capture: one destroyed while it runs would invalidate it.
    gc.collect()
    torch.manual_seed(1)
    steps = [(torch.randn(192, 256, device="cuda", dtype=torch.bfloat16),
              torch.randn(192, 256, device="cuda", dtype=torch.bfloat16)) for _ in range(3)]
    eager, graphed = make_layer(), make_layer()
    sample = steps[0][0].clone().requires_grad_()
    with fp8.cached_weights_in_graphs():
        torch.cuda.make_graphed_callables(graphed, (sample,))  # graphed.forward now replays the graphs
    runs = []
    for layer in (eager, graphed):
        layer.zero_grad(set_to_none=True)  # the warm-up calls of the capture left gradients behind
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.01)
        seen = {}
        for step, (x, dy) in enumerate(steps):
            x = x.clone().requires_grad_()
            y, logits = layer(x)
            loss = (y.float() * dy.float()).sum() + logits.float().square().mean()
            loss.backward()
            seen.update({(step, "y"): y.detach().clone(), (step, "logits"): logits.detach().clone(),
                         (step, "dx"): x.grad.clone(), (step, "dw13"): layer.w13.grad.clone(),
                         (step, "dw2"): layer.w2.grad.clone(), (step, "dgate"): layer.gate.weight.grad.clone()})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        runs.append(seen | {name: p.detach().clone() for name, p in layer.named_parameters()})
    assert all(t.isfinite().all() for t in runs[0].values())
    differ = [name for name, a in runs[0].items() if not torch.equal(a, runs[1][name])]
    assert not differ, f"replayed differs from eager in {differ}"
    assert not torch.equal(graphed.w13, make_layer().w13)  # the steps moved the weights the graphs read
