"""Every backend against the dense fp64 reference: outputs and all four gradients."""

import functools

import pytest
import torch

import megamoe
from megamoe.activation import ACTIVATIONS, swiglu_with_limit
from megamoe.reference import reference_moe, reference_moe_grads, relative_error
from megamoe.shapes import MoEShape

from conftest import requires_cuda

BASELINES = ["naive", "grouped"]
TOLERANCE = 1e-2  # bf16 operands, fp32 accumulation

# Whole 128-wide tiles in H and I (the FP8 tests reuse it; bf16 takes any multiple of 8).
SMALL = MoEShape(hidden_size=256, intermediate_size=128, num_experts=8, top_k=2)

# (backend, device) pairs: the baselines everywhere, the fused kernels on a GPU.
BACKEND_DEVICES = [(b, "cpu") for b in BASELINES] + [
    pytest.param(b, "cuda", marks=requires_cuda) for b in (*BASELINES, "fused")]


def poison_cuda_cache(gigabytes: float = 2.0) -> None:
    """Fills memory the caching allocator will hand out next with NaN, so outputs and
    intermediates of the next op that are never written show up as NaN."""
    if torch.cuda.is_available():
        torch.empty(int(gigabytes * 2**29), dtype=torch.float16, device="cuda").fill_(float("nan"))


# SwiGLU clamped at a half-integer limit: its gradient jumps at a bound, so it is tested on inputs
# whose z are integers (edge_case_inputs' exact_z), which every precision clamps alike.
CLAMPED = swiglu_with_limit(7.5)
TESTED_ACTIVATIONS = (*ACTIVATIONS, CLAMPED)


def edge_case_inputs(case: str, shape: MoEShape, device, seed=0, exact_z=False):
    """Routing edge cases (docs/DESIGN.md) on fresh random data; exact_z: x in {-1, 1} and w13 in
    {-1, 0, 1}, so z = x·w13ᵀ holds integers of magnitude <= H, exact in bf16 and e4m3 blocks (H <= 256)."""
    tokens = {"t1": 1, "t0": 0, "odd_t": 77}.get(case, 200)
    if case == "k1":
        shape = MoEShape(shape.hidden_size, shape.intermediate_size, shape.num_experts, 1)
    x, ids, weights, w13, w2 = megamoe.make_inputs(
        shape, tokens, "skewed" if case == "skewed" else "balanced", device=device, seed=seed)
    if exact_z:
        x, w13 = x.sign(), (w13.float() * shape.hidden_size**0.5).round().clamp(-1, 1).to(w13.dtype)
    if case == "masked":
        ids[::3, 0] = -1
    elif case == "one_expert":
        ids[:, 0] = 5  # every token hits expert 5 first; the other slot stays random
        ids[:, 1] = torch.where(ids[:, 1] == 5, 6, ids[:, 1])
    elif case == "empty_experts":
        ids = ids % 3  # experts 3.. get nothing (duplicates per token are legal)
    return x, ids, weights, w13, w2


CASES = ["balanced", "skewed", "masked", "one_expert", "empty_experts", "odd_t", "t1", "k1", "t0"]


def leaf(t, dtype=None):
    return t.detach().to(dtype or t.dtype).requires_grad_(True)


@pytest.mark.parametrize("activation", TESTED_ACTIVATIONS)
@pytest.mark.parametrize("backend,device", BACKEND_DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_forward_and_gradients_match_reference(backend, case, device, activation):
    x, ids, weights, w13, w2 = edge_case_inputs(case, SMALL, device, exact_z=activation == CLAMPED)
    inputs = [leaf(t) for t in (x, weights, w13, w2)]
    ref_inputs = [leaf(t, torch.float64) for t in (x, weights, w13, w2)]
    poison_cuda_cache()
    y = megamoe.moe(inputs[0], ids, inputs[1], inputs[2], inputs[3], backend=backend, activation=activation)
    ref = reference_moe(ref_inputs[0], ids, ref_inputs[1], ref_inputs[2], ref_inputs[3], activation=activation)
    assert y.shape == x.shape and y.dtype == x.dtype
    if x.shape[0] == 0:
        return
    assert relative_error(y, ref) < TOLERANCE
    dy = torch.randn_like(ref)
    y.backward(dy.to(y.dtype))
    ref.backward(dy)
    for name, got, want in zip(("dx", "dtopk_weights", "dw13", "dw2"), inputs, ref_inputs):
        # Experts that no token reaches have an all-zero reference gradient.
        if want.grad.abs().max() == 0:
            assert got.grad.abs().max() == 0, name
            continue
        if name == "dtopk_weights" and case == "t1":
            continue  # two dot products, which may cancel: held to the bound below instead
        assert relative_error(got.grad, want.grad) < TOLERANCE, name
    # d topk_weights[t, k] = <dy[t], o[t, k]> (o: the route's expert output), a dot product whose bf16
    # error scales with ||dy[t]|| ||o[t, k]||, not with its value; masked routes must give exactly 0.
    routes = torch.stack([reference_moe(ref_inputs[0], ids[:, k:k + 1], torch.ones_like(ref_inputs[1][:, :1]),
                                        ref_inputs[2], ref_inputs[3], activation=activation)
                          for k in range(ids.shape[1])], dim=1)
    scale = dy.norm(dim=-1, keepdim=True) * routes.norm(dim=-1)
    error = (inputs[1].grad.double() - ref_inputs[1].grad).abs()
    assert torch.all(error <= TOLERANCE * scale), (error / scale).max().item()


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES)
@pytest.mark.parametrize("case", ["t0", "all_masked"])
def test_no_routed_tokens_give_zero_gradients(backend, case, device):
    """Nothing routed (no tokens, or every route masked): the output still depends on every input,
    so backward() runs and gives zero gradients of the inputs' shapes."""
    x, ids, weights, w13, w2 = edge_case_inputs("t0" if case == "t0" else "balanced", SMALL, device)
    ids.fill_(-1)
    inputs = [leaf(t) for t in (x, weights, w13, w2)]
    y = megamoe.moe(inputs[0], ids, inputs[1], inputs[2], inputs[3], backend=backend)
    assert torch.all(y == 0)
    y.float().sum().backward()
    for name, t in zip(("dx", "dtopk_weights", "dw13", "dw2"), inputs):
        assert t.grad is not None and t.grad.shape == t.shape and torch.all(t.grad == 0), name


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES)
def test_masked_routes_contribute_nothing(backend, device):
    x, ids, weights, w13, w2 = edge_case_inputs("balanced", SMALL, device)
    ids[:10] = -1
    xg = leaf(x)
    y = megamoe.moe(xg, ids, weights, w13, w2, backend=backend)
    assert torch.all(y[:10] == 0)
    y.float().square().sum().backward()
    assert torch.all(xg.grad[:10] == 0)


@requires_cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("preset,tokens", [("qwen3-30b-a3b", 1000), ("qwen3-235b-a22b", 300)])
@pytest.mark.parametrize("routing", ["balanced", "skewed"])
def test_backends_at_model_shapes(preset, tokens, routing, activation):
    x, ids, weights, w13, w2 = megamoe.make_inputs(megamoe.PRESETS[preset], tokens, routing,
                                                   device="cuda", seed=3)
    ref = reference_moe(x, ids, weights, w13, w2, activation=activation)
    for backend in ("fused", *BASELINES):
        poison_cuda_cache()
        y = megamoe.moe(x, ids, weights, w13, w2, backend=backend, activation=activation)
        assert relative_error(y, ref) < TOLERANCE, backend


@requires_cuda
@pytest.mark.parametrize("backend", ["fused", "grouped"])
def test_bitwise_deterministic(backend):
    x, ids, weights, w13, w2 = megamoe.make_inputs(megamoe.PRESETS["qwen3-30b-a3b"], 2048, "skewed",
                                                   device="cuda")
    first = megamoe.moe(x, ids, weights, w13, w2, backend=backend)
    poison_cuda_cache()
    second = megamoe.moe(x, ids, weights, w13, w2, backend=backend)
    assert torch.equal(first, second)


@requires_cuda
def test_fused_under_torch_compile_fullgraph():
    x, ids, weights, w13, w2 = edge_case_inputs("masked", SMALL, "cuda")
    xg, wg = leaf(x), leaf(weights)
    compiled = torch.compile(lambda *a: megamoe.moe(*a, backend="fused"), fullgraph=True)
    y = compiled(xg, ids, wg, w13, w2)
    assert torch.equal(y, megamoe.moe(x, ids, weights, w13, w2, backend="fused"))
    y.float().sum().backward()
    assert xg.grad is not None and wg.grad is not None


def test_grouped_traces_whole_under_torch_compile():
    """No data-dependent shapes or host syncs: fullgraph=True fails on any graph break."""
    x, ids, weights, w13, w2 = edge_case_inputs("masked", SMALL, "cpu")
    xg = leaf(x)
    compiled = torch.compile(lambda *a: megamoe.moe(*a, backend="grouped"), fullgraph=True)
    y = compiled(xg, ids, weights, w13, w2)
    ref = reference_moe(x, ids, weights, w13, w2)
    assert relative_error(y, ref) < TOLERANCE
    y.float().sum().backward()
    assert torch.isfinite(xg.grad).all()


@requires_cuda
@pytest.mark.parametrize("backend", ["fused-graphed", "fused-step-graphed"])
@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp8_bwd"])
def test_fused_replayed_from_cuda_graphs_equals_eager(precision, backend):
    """The fused layer has no host sync and fixed-size buffers, so CUDA graphs capture its forward
    and backward, each in a graph of its own (the benchmark's fused-graphed) or both in one, as a
    training step's capture takes them (fused-step-graphed): replays on new inputs give the eager
    output and gradients bit for bit, also after an optimizer step has changed the weights (in block
    FP8 the graphs read the weights' cached copies, which the step's hook quantises again in place).
    The eager side runs on clones of the weights, so it quantises them afresh."""
    from megamoe.bench import backends
    shape = megamoe.PRESETS["qwen3-30b-a3b"]
    graphed = backends.build(backend, shape, precision, torch.device("cuda"))
    _, _, _, w13, w2 = megamoe.make_inputs(shape, 1, device="cuda")
    w13, w2 = leaf(w13), leaf(w2)
    optimizer = torch.optim.SGD([w13, w2], lr=1e-2)
    for seed in range(4):  # the first call captures, the later ones replay on other inputs
        if seed == 2:
            w13.grad, w2.grad = torch.randn_like(w13), torch.randn_like(w2)
            optimizer.step()
            optimizer.zero_grad()
        x, ids, weights, _, _ = megamoe.make_inputs(shape, 256, "skewed", device="cuda", seed=seed)
        eager_weights = [leaf(w13.detach().clone()), leaf(w2.detach().clone())]
        with torch.no_grad():
            assert torch.equal(graphed(x, ids, weights, w13, w2),
                               megamoe.moe(x, ids, weights, *eager_weights, precision=precision))
        dy = torch.randn_like(x)
        runs = []
        for fn, ws in ((graphed, (w13, w2)), (functools.partial(megamoe.moe, precision=precision), eager_weights)):
            leaves = [leaf(x), leaf(weights)]
            if isinstance(fn, backends.StepGraphed):
                runs.append([t.clone() for t in fn.step(x, ids, weights, *ws, dy)])
                continue
            y = fn(leaves[0], ids, leaves[1], *ws)
            y.backward(dy)
            runs.append([y.detach().clone(), *(t.grad.clone() for t in (*leaves, *ws))])
            w13.grad = w2.grad = None
        for name, got, want in zip(("y", "dx", "dtopk_weights", "dw13", "dw2"), *runs):
            assert torch.equal(got, want), name


@requires_cuda
@pytest.mark.parametrize("backend", ["fused-graphed", "fused-step-graphed"])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_fused_replayed_from_cuda_graphs_adds_into_main_grad_as_eager(precision, backend):
    """With fp32 main_grad buffers autograd sees no gradient for w13 and w2 (the backward adds them
    there): the graphs still capture, and each replay adds into main_grad what an eager call adds,
    with the eager dx, bit for bit. The first call's warm-ups add as well, so the buffers are zeroed
    after it."""
    from megamoe.bench import backends
    shape = megamoe.PRESETS["qwen3-30b-a3b"]
    graphed = backends.build(backend, shape, precision, torch.device("cuda"))
    _, _, _, w13, w2 = megamoe.make_inputs(shape, 1, device="cuda")
    sides = []
    for _ in ("graphed", "eager"):
        ws = [leaf(w13.detach().clone()), leaf(w2.detach().clone())]
        for w in ws:
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device="cuda")
        sides.append(ws)
    for seed in range(3):
        x, ids, weights, _, _ = megamoe.make_inputs(shape, 256, "skewed", device="cuda", seed=seed)
        dy = torch.randn_like(x)
        dxs = []
        for fn, ws in ((graphed, sides[0]), (functools.partial(megamoe.moe, precision=precision), sides[1])):
            if isinstance(fn, backends.StepGraphed):
                dxs.append(fn.step(x, ids, weights, *ws, dy)[1].clone())
            else:
                xg = leaf(x)
                fn(xg, ids, leaf(weights), *ws).backward(dy)
                dxs.append(xg.grad)
            assert all(w.grad is None for w in ws)
        if seed == 0:
            for w in (*sides[0], *sides[1]):
                w.main_grad.zero_()
        assert torch.equal(*dxs)
    for got, want in zip(*sides):
        assert want.main_grad.abs().sum() > 0 and torch.equal(got.main_grad, want.main_grad)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_fused_runs_on_its_tensors_gpu_whichever_is_current(precision):
    """A layer on cuda:1 while cuda:0 is current (one process, a model spread over GPUs) gives what
    it gives with cuda:1 current, forward and backward."""
    inputs = megamoe.make_inputs(megamoe.PRESETS["qwen3-30b-a3b"], 512, "skewed", device="cuda:1")
    dy = torch.randn_like(inputs[0])
    results = []
    for current in (1, 0):
        with torch.cuda.device(current):
            x, weights, w13, w2 = (leaf(inputs[i]) for i in (0, 2, 3, 4))
            y = megamoe.moe(x, inputs[1], weights, w13, w2, backend="fused", precision=precision)
            y.backward(dy)
            results.append([y] + [t.grad for t in (x, weights, w13, w2)])
    for name, there, here in zip(("y", "dx", "dtopk_weights", "dw13", "dw2"), *results):
        assert there.device == torch.device("cuda:1") and torch.equal(there, here), name


@requires_cuda
def test_fused_gradients_are_bitwise_deterministic():
    x, ids, weights, w13, w2 = megamoe.make_inputs(megamoe.PRESETS["qwen3-30b-a3b"], 1024, "skewed",
                                                   device="cuda")
    dy = torch.randn_like(x)
    grads = []
    for _ in range(2):
        leaves = [leaf(t) for t in (x, weights, w13, w2)]
        megamoe.moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], backend="fused").backward(dy)
        grads.append([t.grad for t in leaves])
        poison_cuda_cache()
    for name, first, second in zip(("dx", "dtopk_weights", "dw13", "dw2"), *grads):
        assert torch.equal(first, second), name


@requires_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_fused_backward_through_a_kept_graph_twice_gives_the_same_gradients(precision):
    """With retain_graph the first backward keeps z (it gives z's memory back otherwise), so the
    second still reads the forward's z."""
    x, ids, weights, w13, w2 = megamoe.make_inputs(SMALL, 300, device="cuda")
    leaves = [leaf(t) for t in (x, weights, w13, w2)]
    y = megamoe.moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], backend="fused", precision=precision)
    dy = torch.randn_like(x)
    grads = []
    for retain in (True, False):
        y.backward(dy, retain_graph=retain)
        grads.append([t.grad.clone() for t in leaves])
        for t in leaves:
            t.grad = None
    for name, first, second in zip(("dx", "dtopk_weights", "dw13", "dw2"), *grads):
        assert torch.equal(first, second), name


@requires_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("recompute", [False, "gather", True])
def test_fused_eager_path_equals_the_op(precision, recompute, monkeypatch):
    """Run eagerly, the layer goes through a torch.autograd.Function; traced, through the
    torch.library ops. Both run the same functions: the same bits."""
    import megamoe.fused

    x, ids, weights, w13, w2 = megamoe.make_inputs(SMALL, 300, "skewed", device="cuda")
    dy = torch.randn_like(x)
    results = []
    for eager in (True, False):
        monkeypatch.setattr(megamoe.fused, "_runs_eagerly", lambda *tensors, eager=eager: eager)
        leaves = [leaf(t) for t in (x, weights, w13, w2)]
        y = megamoe.moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], backend="fused", precision=precision,
                        recompute=recompute)
        y.backward(dy)
        results.append([y.detach()] + [t.grad for t in leaves])
    for name, eager, op in zip(("y", "dx", "dtopk_weights", "dw13", "dw2"), *results):
        assert torch.equal(eager, op), name


def test_the_eager_path_is_not_taken_for_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megamoe.fused import _runs_eagerly

    assert _runs_eagerly(torch.ones(2), torch.nn.Parameter(torch.ones(2)))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.ones(2))
        assert not _runs_eagerly(fake, torch.ones(2))


@requires_cuda
@pytest.mark.parametrize("activation", TESTED_ACTIVATIONS)
@pytest.mark.parametrize("wanted", ["x", "topk_weights", "w13", "w2"])
def test_fused_computes_only_the_gradients_asked_for(wanted, activation):
    x, ids, weights, w13, w2 = edge_case_inputs("masked", SMALL, "cuda", exact_z=activation == CLAMPED)
    names = ("x", "topk_weights", "w13", "w2")
    inputs = [leaf(t) if n == wanted else t for n, t in zip(names, (x, weights, w13, w2))]
    ref_inputs = [leaf(t, torch.float64) for t in (x, weights, w13, w2)]
    dy = torch.randn_like(x)
    megamoe.moe(inputs[0], ids, inputs[1], inputs[2], inputs[3], backend="fused", activation=activation).backward(dy)
    reference_moe(ref_inputs[0], ids, ref_inputs[1], ref_inputs[2], ref_inputs[3],
                  activation=activation).backward(dy.double())
    for n, got, want in zip(names, inputs, ref_inputs):
        if n == wanted:
            assert relative_error(got.grad, want.grad) < TOLERANCE, n
        else:
            assert got.grad is None, n


@requires_cuda
@pytest.mark.parametrize("shape", [SMALL, MoEShape(hidden_size=640, intermediate_size=128, num_experts=8, top_k=2)],
                         ids=["h256", "h640"])
@pytest.mark.parametrize("case", ["masked", "one_expert", "odd_t", "t1"])
def test_fused_recompute_gives_the_kept_activations_gradients(case, shape, monkeypatch):
    """recompute="gather" gathers the same pool of x again (at H = 640 in two column halves for dW13,
    512 and 128 wide): the same bits; recompute=True recomputes z with the plain GEMM: within its
    rounding. The pool paths, as above T·K = 128·E (the gathered ones: the test below)."""
    from megamoe import fused

    monkeypatch.setattr(fused, "_gathers_rows", lambda routes, local: False)
    x, ids, weights, w13, w2 = edge_case_inputs(case, shape, "cuda")
    dy = torch.randn_like(x)
    grads = {}
    for recompute in (False, "gather", True):
        leaves = [leaf(t) for t in (x, weights, w13, w2)]
        poison_cuda_cache()
        megamoe.moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], backend="fused",
                    recompute=recompute).backward(dy)
        grads[recompute] = [t.grad for t in leaves]
    for name, kept, gathered, recomputed in zip(("dx", "dtopk_weights", "dw13", "dw2"), *grads.values()):
        assert torch.equal(gathered, kept), name
        assert relative_error(recomputed, kept) < 1e-3, name


@requires_cuda
@pytest.mark.parametrize("shape", [SMALL, MoEShape(hidden_size=200, intermediate_size=136, num_experts=8, top_k=2)],
                         ids=["h256", "h200"])
@pytest.mark.parametrize("case", ["masked", "one_expert", "odd_t", "t1"])
@pytest.mark.parametrize("recompute", [False, "gather"])
def test_fused_small_batch_gathers_rows_the_pools_bits(case, shape, recompute, monkeypatch):
    """At small batches GEMM1 and dW13 read x's token rows by route instead of a dispatched pool, and dh
    and dW2 dy's: the output and every gradient bit for bit those of the pool path."""
    from megamoe import fused

    x, ids, weights, w13, w2 = edge_case_inputs(case, shape, "cuda")
    assert fused._gathers_rows(ids.numel(), shape.num_experts)
    dy = torch.randn_like(x)
    results = []
    for gathers in (True, False):
        monkeypatch.setattr(fused, "_gathers_rows", lambda routes, local, gathers=gathers: gathers)
        leaves = [leaf(t) for t in (x, weights, w13, w2)]
        poison_cuda_cache()
        y = megamoe.moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], backend="fused", recompute=recompute)
        y.backward(dy)
        results.append([y.detach()] + [t.grad for t in leaves])
    for name, gathered, pooled in zip(("y", "dx", "dtopk_weights", "dw13", "dw2"), *results):
        assert torch.equal(gathered, pooled), name


def test_fused_ops_fake_implementations_give_gradient_shapes():
    """What torch.compile sees of the fused ops (shapes and dtypes only, no kernel runs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megamoe.fused import fused_moe_backward, fused_moe_forward

    from megamoe.routing import build_routing

    x, ids, weights, w13, w2 = megamoe.make_inputs(SMALL, 1024)  # T·K > 128·E: GEMM1 reads a pool of x
    small = megamoe.make_inputs(SMALL, 512)  # T·K <= 128·E: GEMM1 gathers x's rows, no pool
    pool_rows = build_routing(ids, SMALL.num_experts).slot_to_route.numel()
    with FakeTensorMode(allow_non_fake_inputs=True):
        y, x_pool, z, plan = fused_moe_forward(x, ids, weights, w13, w2, "swiglu", "bf16", True, True, True)
        _, small_x_pool, small_z, _ = fused_moe_forward(*small, "swiglu", "bf16", True, True, True)
        _, no_x_pool, no_z, no_plan = fused_moe_forward(x, ids, weights, w13, w2, "swiglu", "bf16", False, False,
                                                        False)
        _, z_alone_x_pool, z_alone, _ = fused_moe_forward(x, ids, weights, w13, w2, "swiglu", "bf16", True, False,
                                                          True)
        fp8_kept = [fused_moe_forward(x, ids, weights, w13, w2, "swiglu", precision, True, True, True)[1:3]
                    for precision in ("fp8", "fp8_bwd")]
        grads = fused_moe_backward(y, x, ids, weights, w13, w2, "swiglu", "bf16", x_pool, z, plan, False, True,
                                   False, True, True, None, None)
    assert (y.shape, y.dtype) == (x.shape, x.dtype)
    assert x_pool.shape == (pool_rows, SMALL.hidden_size) and z.shape == (ids.numel(), 2 * SMALL.intermediate_size)
    assert (plan.shape, plan.dtype) == (build_routing(ids, SMALL.num_experts).buffer.shape, torch.int32)
    assert no_x_pool.numel() == 0 and no_z.numel() == 0 and no_plan.numel() == 0
    assert z_alone_x_pool.numel() == 0 and z_alone.shape == z.shape  # recompute="gather"
    assert small_x_pool.numel() == 0 and small_z.shape == (small[1].numel(), 2 * SMALL.intermediate_size)
    for fp8_x_pool, fp8_z in fp8_kept:  # z only: the FP8 weight gradients read x's token rows
        assert fp8_x_pool.numel() == 0 and fp8_z.shape == z.shape
    expected = [(x.shape, x.dtype), ((0,), weights.dtype), (w13.shape, w13.dtype), (w2.shape, w2.dtype)]
    assert [(g.shape, g.dtype) for g in grads] == expected


@pytest.mark.parametrize("activation", TESTED_ACTIVATIONS)
@pytest.mark.parametrize("recompute", [False, "gather", True])
def test_fused_op_autograd_gives_gradient_shapes_under_fake_tensors(recompute, activation):
    """The op's autograd registration (what its backward is handed and returns), without a kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megamoe.fused import fused_moe_autograd

    x, ids, weights, w13, w2 = megamoe.make_inputs(SMALL, 64)
    with FakeTensorMode(allow_non_fake_inputs=True):
        leaves = [leaf(t) for t in (x, weights, w13, w2)]
        fused_moe_autograd(leaves[0], ids, *leaves[1:], recompute, activation).sum().backward()
        assert [(t.grad.shape, t.grad.dtype) for t in leaves] == [(t.shape, t.dtype) for t in leaves]


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES)
def test_activation_checkpointing_gives_the_same_gradients(backend, device):
    x, ids, weights, w13, w2 = edge_case_inputs("masked", SMALL, device)
    dy = torch.randn_like(x)
    grads = []
    for checkpointed in (False, True):
        leaves = [leaf(t) for t in (x, weights, w13, w2)]

        def layer(xx, ww, a, b):
            return megamoe.moe(xx, ids, ww, a, b, backend=backend)

        y = (torch.utils.checkpoint.checkpoint(layer, *leaves, use_reentrant=False) if checkpointed
             else layer(*leaves))
        y.backward(dy)
        grads.append([t.grad for t in leaves])
    for name, plain, checkpointed in zip(("dx", "dtopk_weights", "dw13", "dw2"), *grads):
        assert torch.equal(plain, checkpointed), name


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES)
def test_gradients_accumulate_across_micro_batches(backend, device):
    """Two micro-batches into the same weight .grad equal the sum of their separate gradients."""
    batches = [edge_case_inputs("balanced", SMALL, device, seed=s) for s in (1, 2)]
    w13, w2 = (leaf(t) for t in batches[0][3:])
    separate = []
    for x, ids, weights, _, _ in batches:
        megamoe.moe(x, ids, weights, w13, w2, backend=backend).float().square().sum().backward()
        separate.append((w13.grad.clone(), w2.grad.clone()))
        w13.grad = w2.grad = None
    for x, ids, weights, _, _ in batches:
        megamoe.moe(x, ids, weights, w13, w2, backend=backend).float().square().sum().backward()
    for got, first, second in zip((w13.grad, w2.grad), *separate):
        assert relative_error(got, first.float() + second.float()) < 1e-2


@requires_cuda
def test_fused_keeps_no_more_for_the_backward_than_grouped():
    import functools

    from megamoe.bench.runner import Operands, saved_for_backward_gb

    def saved_at(tokens):
        x, ids, weights, w13, w2 = megamoe.make_inputs(megamoe.PRESETS["qwen3-30b-a3b"], tokens, device="cuda")
        operands = Operands(leaf(x), ids, leaf(weights), leaf(w13), leaf(w2))
        return {name: saved_for_backward_gb(functools.partial(megamoe.moe, **kwargs), operands)
                for name, kwargs in (("fused", dict(backend="fused")),
                                     ("gather", dict(backend="fused", recompute="gather")),
                                     ("recompute", dict(backend="fused", recompute=True)),
                                     ("grouped", dict(backend="grouped")))}

    saved = saved_at(4096)  # GEMM1 reads a pool of x, which the default keeps
    assert saved["recompute"] < saved["gather"] < saved["fused"] <= saved["grouped"], saved
    saved = saved_at(1024)  # GEMM1 gathers x's rows: no pool, the default keeps what "gather" keeps
    assert saved["recompute"] < saved["gather"] == saved["fused"] <= saved["grouped"], saved


@requires_cuda
@pytest.mark.parametrize("hidden, inter", [(256, 128), (200, 72)])  # whole tiles; tiles cut at H and I
def test_fused_accumulates_weight_gradients_into_fp32_main_grad(hidden, inter):
    """Megatron-style main_grad: two micro-batches add their fp32 weight gradients, .grad stays None."""
    shape = MoEShape(hidden_size=hidden, intermediate_size=inter, num_experts=SMALL.num_experts, top_k=SMALL.top_k)
    x, ids, weights, w13, w2 = edge_case_inputs("masked", shape, "cuda")
    w13g, w2g = leaf(w13), leaf(w2)
    w13g.main_grad = torch.zeros_like(w13, dtype=torch.float32)
    w2g.main_grad = torch.zeros_like(w2, dtype=torch.float32)
    ref13, ref2 = leaf(w13, torch.float64), leaf(w2, torch.float64)
    dys = [torch.randn_like(x) for _ in range(2)]
    for dy in dys:
        megamoe.moe(x, ids, weights, w13g, w2g, backend="fused").backward(dy)
        reference_moe(x.double(), ids, weights.double(), ref13, ref2).backward(dy.double())
    assert w13g.grad is None and w2g.grad is None
    assert relative_error(w13g.main_grad, ref13.grad) < TOLERANCE
    assert relative_error(w2g.main_grad, ref2.grad) < TOLERANCE


@requires_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp8_bwd"])
@pytest.mark.parametrize("recompute", [False, "gather", True], ids=["kept", "gather", "recomputed"])
def test_main_grad_takes_the_weight_gradients_at_every_precision_and_recompute(precision, recompute):
    """fp32 main_grad buffers get the weight gradients .grad would get (within its bf16 rounding) at
    every precision and whatever is kept for the backward; dx and d topk_weights are bitwise unchanged."""
    x, ids, weights, w13, w2 = edge_case_inputs("masked", SMALL, "cuda")
    dy = torch.randn_like(x)
    runs = []
    for main_grad in (False, True):
        inputs = [leaf(t) for t in (x, weights, w13, w2)]
        for w in inputs[2:] if main_grad else ():
            w.main_grad = torch.zeros_like(w, dtype=torch.float32)
        megamoe.moe(inputs[0], ids, inputs[1], inputs[2], inputs[3], backend="fused", precision=precision,
                    recompute=recompute).backward(dy)
        runs.append([t.grad for t in inputs] + [getattr(w, "main_grad", None) for w in inputs[2:]])
    (dx, dp, dw13, dw2, _, _), (dx_m, dp_m, grad13, grad2, main13, main2) = runs
    assert torch.equal(dx_m, dx) and torch.equal(dp_m, dp)
    assert grad13 is None and grad2 is None
    # The bf16 gradients are the same fp32 sums rounded, each by at most 2^-9 of itself.
    assert relative_error(main13, dw13.float()) < 4e-3 and relative_error(main2, dw2.float()) < 4e-3


@pytest.mark.parametrize("main_grad,message", [
    (torch.zeros(2, 4, 3), "w2.main_grad must be a contiguous float32 tensor of shape \\(2, 3, 4\\)"),
    (torch.zeros(2, 3, 4, dtype=torch.bfloat16), "got torch.bfloat16"),
    ("buffer", "got str"),
])
def test_main_grad_must_be_an_fp32_buffer_of_the_weights_shape(main_grad, message):
    from megamoe.validation import main_grad_of

    weight = torch.zeros(2, 3, 4, dtype=torch.bfloat16)
    assert main_grad_of(weight, "w2") is None
    weight.main_grad = main_grad
    with pytest.raises(ValueError, match=message):
        main_grad_of(weight, "w2")


@requires_cuda
@pytest.mark.parametrize("recompute", [False, True])  # recompute dispatches x again: rows of 14 / 16 KB
@pytest.mark.parametrize("hidden, experts, top_k, tokens, routing", [
    (256, 1024, 16, 300, "skewed"), (256, 512, 10, 300, "skewed"),  # E up to 1024, K up to 16
    (7168, 8, 2, 200, "balanced"), (8192, 8, 2, 200, "balanced"),  # the largest H: DeepSeek-V3 class, 8192
])
def test_fused_at_the_largest_sizes(hidden, experts, top_k, tokens, routing, recompute):
    """The largest H, E and K the fused layer takes: forward and the four gradients against fp64."""
    shape = MoEShape(hidden_size=hidden, intermediate_size=128 * (1 + hidden // 4096), num_experts=experts,
                     top_k=top_k)
    check_fused_against_fp64(shape, tokens, routing, recompute=recompute)


@requires_cuda
@pytest.mark.parametrize("tokens", [1, 17, 512])
@pytest.mark.parametrize("hidden, inter, experts, top_k", [
    (7168, 2048, 48, 8),  # DeepSeek-V3 class, one rank of 8
    (6144, 16384, 8, 2),  # few large experts
    (2880, 2880, 32, 4),  # sizes that are not multiples of 128 (gpt-oss): the last tiles stop at them
    (2048, 512, 512, 10),  # many small experts
])
def test_fused_at_each_model_class(hidden, inter, experts, top_k, tokens):
    """The model classes the presets stand for, from one token up: forward and four gradients against fp64."""
    shape = MoEShape(hidden_size=hidden, intermediate_size=inter, num_experts=experts, top_k=top_k)
    check_fused_against_fp64(shape, tokens, "balanced")


def check_fused_against_fp64(shape: MoEShape, tokens: int, routing: str, **options) -> None:
    """Against the reference's explicit formulas (what autograd gives for reference_moe: test_fp8_layer):
    one fp64 copy of each weight and of its gradient. Autograd's weight-sized gradient per expert and
    the comparison's fp64 copies took more than an 80 GB H100 has at H 6144 / I 16384."""
    x, ids, weights, w13, w2 = megamoe.make_inputs(shape, tokens, routing, device="cuda", seed=5)
    inputs = [leaf(t) for t in (x, weights, w13, w2)]
    y = megamoe.moe(*inputs[:1], ids, *inputs[1:], backend="fused", **options)
    dy = torch.randn(y.shape, dtype=torch.float64, device=y.device)
    y.backward(dy.to(y.dtype))
    ref, *ref_grads = reference_moe_grads(x, ids, weights, w13, w2, dy)
    assert relative_error(y, ref) < TOLERANCE
    for name, got, want in zip(("dx", "dtopk_weights", "dw13", "dw2"), inputs, ref_grads):
        assert relative_error(got.grad, want) < TOLERANCE, name


@requires_cuda
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("hidden, inter", [(200, 72), (136, 200), (264, 328)])
def test_fused_at_sizes_that_are_not_tile_multiples(hidden, inter, recompute):
    """H and I multiples of 8 only: every GEMM's last tile and k-block reach past them (tiles of 128 and
    256 columns, k-blocks of 64) and must neither read nor write past them."""
    shape = MoEShape(hidden_size=hidden, intermediate_size=inter, num_experts=6, top_k=2)
    for routing in ("balanced", "skewed"):
        check_fused_against_fp64(shape, 300, routing, recompute=recompute)


def test_fp8_refuses_sizes_that_are_not_whole_scale_blocks(monkeypatch):
    """Block FP8 needs whole 128-wide scale blocks: checked before any launch (no GPU needed here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megamoe import validation
    from megamoe.validation import check_fused_support

    monkeypatch.setattr(validation, "_device_capability", lambda device: (9, 0))
    with FakeTensorMode():
        x = torch.empty(4, 200, dtype=torch.bfloat16, device="cuda")
    check_fused_support(x, 200, 72)  # bf16 takes them
    for precision in ("fp8", "fp8_bwd"):
        with pytest.raises(ValueError, match=f"precision='{precision}' needs H and I to be multiples of 128.*"
                                             "got H = 200, I = 72"):
            check_fused_support(x, 200, 72, precision)


@requires_cuda
def test_fused_refuses_hidden_sizes_above_8192():
    shape = MoEShape(hidden_size=8320, intermediate_size=128, num_experts=4, top_k=2)
    with pytest.raises(ValueError, match="H <= 8192"):
        megamoe.fused_moe(*megamoe.make_inputs(shape, 16, device="cuda"))
