"""Every validation rule of the public API: the bad input and the message a user sees."""

import re

import pytest
import torch

import megamoe
from megamoe.shapes import MoEShape
from megamoe.validation import IdRangeCheck

SHAPE = MoEShape(hidden_size=64, intermediate_size=32, num_experts=4, top_k=2)


def good_inputs():
    return list(megamoe.make_inputs(SHAPE, 16))


def replaced(index, value):
    inputs = good_inputs()
    inputs[index] = value(inputs) if callable(value) else value
    return inputs


X, IDS, WEIGHTS, W13, W2 = range(5)

BAD_INPUTS = {
    "x_not_tensor": (replaced(X, [[1.0]]), TypeError, "x must be a torch.Tensor"),
    "x_rank": (replaced(X, lambda i: i[X][None]), ValueError, r"x must be \[T, H\]"),
    "x_dtype": (replaced(X, lambda i: i[X].to(torch.int32)), TypeError, "x must be a floating tensor"),
    "ids_rows": (replaced(IDS, lambda i: i[IDS][:-1]), ValueError, r"topk_ids must be \[T, K\] with T = 16"),
    "ids_not_tensor": (replaced(IDS, lambda i: i[IDS].tolist()), TypeError, "topk_ids must be a torch.Tensor"),
    "ids_dtype": (replaced(IDS, lambda i: i[IDS].float()), TypeError, "topk_ids must be int32 or int64"),
    "ids_too_large": (replaced(IDS, lambda i: i[IDS].masked_fill(i[IDS] == i[IDS][0, 0], 4)), ValueError,
                      r"topk_ids must lie in \[-1, 4\)"),
    "ids_below_minus_one": (replaced(IDS, lambda i: i[IDS].masked_fill(i[IDS] == i[IDS][0, 0], -2)),
                            ValueError, r"topk_ids must lie in \[-1, 4\)"),
    "weights_shape": (replaced(WEIGHTS, lambda i: i[WEIGHTS][:, :1]), ValueError,
                      "topk_weights must have topk_ids' shape"),
    "weights_dtype": (replaced(WEIGHTS, lambda i: i[WEIGHTS].half()), TypeError,
                      "topk_weights must be float32"),
    "w13_rank": (replaced(W13, lambda i: i[W13][0]), ValueError, r"w13 must be \[E_local, 2I, H\]"),
    "w13_hidden": (replaced(W13, lambda i: i[W13][..., :32]), ValueError, "has H = 32 but x has H = 64"),
    "w13_odd": (replaced(W13, lambda i: i[W13][:, :63]), ValueError, "second dim is 2I"),
    "w2_shape": (replaced(W2, lambda i: i[W2][:, :, :16]), ValueError, r"w2 must be \[E_local, H, I\]"),
    "w2_experts": (replaced(W2, lambda i: i[W2][:3]), ValueError, r"w2 must be \[E_local, H, I\]"),
    "dtype_mismatch": (replaced(W2, lambda i: i[W2].float()), TypeError, "must share one dtype"),
    "non_contiguous": (replaced(X, lambda i: i[X].t().contiguous().t()), ValueError, "x must be contiguous"),
    "non_contiguous_weights": (replaced(W13, lambda i: i[W13].transpose(1, 2).contiguous().transpose(1, 2)),
                               ValueError, "w13 must be contiguous"),
    "no_experts": (replaced(W13, lambda i: i[W13][:0]), ValueError, "no experts"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
@pytest.mark.parametrize("backend", ["naive", "grouped", "fused"])
def test_bad_input_raises_clear_error(case, backend):
    inputs, error, message = BAD_INPUTS[case]
    with pytest.raises(error, match=message):
        megamoe.moe(*inputs, backend=backend)


def test_top_k_larger_than_experts():
    x, _, _, w13, w2 = good_inputs()
    ids = torch.zeros(16, 5, dtype=torch.int32)
    with pytest.raises(ValueError, match="top_k = 5 exceeds the number of experts 4"):
        megamoe.moe(x, ids, torch.ones(16, 5), w13, w2, backend="grouped")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mixed_devices():
    inputs = good_inputs()
    inputs[X] = inputs[X].cuda()
    with pytest.raises(ValueError, match="all inputs must be on one device"):
        megamoe.moe(*inputs, backend="grouped")


BAD_OPTIONS = {
    "backend": (dict(backend="magic"), ValueError, "backend must be one of"),
    "precision": (dict(backend="grouped", precision="int4"), ValueError, "precision must be one of"),
    "mxfp8": (dict(backend="fused", precision="mxfp8"), NotImplementedError, "on Hopper use precision='fp8'"),
    "activation": (dict(backend="grouped", activation="bogus"), ValueError, "activation must be one of"),
    "recompute": (dict(backend="grouped", recompute=True), ValueError, "recompute=True needs backend='fused'"),
    "recompute_gather": (dict(backend="naive", recompute="gather"), ValueError,
                         "recompute='gather' needs backend='fused'"),
    "recompute_mode": (dict(backend="fused", recompute="pool"), ValueError, "recompute must be one of"),
    "fp8_baseline": (dict(backend="naive", precision="fp8"), NotImplementedError, "runs in backend='fused'"),
}


@pytest.mark.parametrize("case", BAD_OPTIONS)
def test_every_entry_point_refuses_bad_options_alike(case):
    """megamoe.moe and MoELayer (and, in their own tests, patch_hf_model and the TorchTitan adapters) check
    the options through one function: the same exception and message from each."""
    options, error, message = BAD_OPTIONS[case]
    with pytest.raises(error, match=re.escape(message)):
        megamoe.moe(*good_inputs(), **options)
    with pytest.raises(error, match=re.escape(message)):
        megamoe.MoELayer(SHAPE.hidden_size, SHAPE.intermediate_size, SHAPE.num_experts, SHAPE.top_k, **options)


@pytest.mark.parametrize("precision", ["fp8", "fp8_bwd"])
@pytest.mark.parametrize("backend", ["naive", "grouped"])
def test_fp8_names_the_fused_backend(backend, precision):
    with pytest.raises(NotImplementedError, match="runs in backend='fused'"):
        megamoe.moe(*good_inputs(), backend=backend, precision=precision)


def test_fused_on_cpu_names_the_alternative():
    with pytest.raises(ValueError, match="use backend='grouped' on the CPU"):
        megamoe.fused_moe(*good_inputs())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_rejects_unsupported_sizes():
    shape = MoEShape(hidden_size=196, intermediate_size=128, num_experts=4, top_k=2)
    with pytest.raises(ValueError, match=r"multiples of 8 \(16-byte bf16 rows\).*got H = 196"):
        megamoe.fused_moe(*megamoe.make_inputs(shape, 16, device="cuda"))
    with pytest.raises(TypeError, match="computes in bfloat16"):
        megamoe.fused_moe(*megamoe.make_inputs(SHAPE, 16, device="cuda", dtype=torch.float16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiled", [False, True])
# int64 ids beyond int32's range would wrap around onto expert 1 if they were cast as they are.
@pytest.mark.parametrize("ids_dtype,bad_id", [(torch.int32, -2), (torch.int32, 4), (torch.int64, 2**32 + 1),
                                              (torch.int64, -2**32 + 1)])
def test_fused_raises_for_ids_out_of_range_counted_on_the_gpu(ids_dtype, bad_id, compiled):
    shape = MoEShape(hidden_size=128, intermediate_size=128, num_experts=4, top_k=2)
    inputs = list(megamoe.make_inputs(shape, 16, device="cuda"))
    inputs[IDS] = inputs[IDS].to(ids_dtype)
    good_ids = inputs[IDS].clone()
    inputs[IDS][3, 1] = bad_id
    fn = torch.compile(megamoe.fused_moe, fullgraph=True) if compiled else megamoe.fused_moe
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[-1, 4\) \(-1 = masked route\), got 1 ids outside"):
        fn(*inputs)
    inputs[IDS] = good_ids  # nothing sticks: the next call with good ids runs
    torch.testing.assert_close(fn(*inputs), megamoe.moe(*inputs, backend="grouped"), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_id_check_copies_the_count_where_host_memory_was_not_written():
    plan = megamoe.build_routing(torch.tensor([[0, 7], [1, 2]], dtype=torch.int32, device="cuda"), 4)
    torch.cuda.synchronize()
    plan.num_invalid_host.value = -1  # as where the device cannot write pinned memory
    with pytest.raises(ValueError, match="got 1 ids outside"):
        IdRangeCheck(plan, 4).raise_if_any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_forward_can_be_captured_in_a_cuda_graph():
    """The device-side id check must not make the host wait inside a capture."""
    shape = MoEShape(hidden_size=128, intermediate_size=128, num_experts=4, top_k=2)
    inputs = megamoe.make_inputs(shape, 16, device="cuda")
    with torch.no_grad():
        eager = megamoe.fused_moe(*inputs)  # also the warm-up: one-time setup stays out of the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = megamoe.fused_moe(*inputs)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)



def _entry_points():
    """Every function that takes an activation, called with good CPU inputs and activation='bogus'."""
    import virtual_ranks
    from megamoe import backends, expert_parallel_group, gemm
    from megamoe.fused import fused_moe_backward, fused_moe_forward

    def bf16():
        return [t.to(torch.bfloat16) if t.is_floating_point() else t for t in good_inputs()]

    def fused_backward():
        x, ids, weights, w13, w2 = good_inputs()
        empty, no_plan = x.new_empty(0), ids.new_empty(0, dtype=torch.int32)
        return fused_moe_backward(x, x, ids, weights, w13, w2, "bogus", "bf16", empty, empty, no_plan, False, True,
                                  True, True, True, None, None)

    def virtual(fn, with_dys=False):
        x, ids, weights, w13, w2 = bf16()
        return fn(*([[x]] if with_dys else []), [x], [ids], [weights], [w13], [w2], activation="bogus")

    return {
        **{f"moe[{b}]": (lambda b=b: megamoe.moe(*good_inputs(), backend=b, activation="bogus"))
           for b in ("naive", "grouped", "fused")},
        "fused_moe": lambda: megamoe.fused_moe(*good_inputs(), activation="bogus"),
        "reference_moe": lambda: megamoe.reference_moe(*good_inputs(), activation="bogus"),
        "grouped_moe": lambda: backends.grouped_moe(*good_inputs(), activation="bogus"),
        "naive_moe": lambda: backends.naive_moe(*good_inputs(), activation="bogus"),
        "MoELayer": lambda: megamoe.MoELayer(64, 32, 4, 2, backend="grouped", activation="bogus"),
        "fused_moe_forward": lambda: fused_moe_forward(*good_inputs(), "bogus", "bf16", False, False, False),
        "fused_moe_backward": fused_backward,
        "group_moe": lambda: expert_parallel_group.group_moe(*bf16(), None, "bogus"),
        "gated_gemm": lambda: gemm.gated_gemm(bf16()[X], bf16()[W13], None, "bogus"),
        "gated_backward": lambda: gemm.gated_backward(bf16()[X], bf16()[W2], bf16()[X], None, None, "bogus"),
        "forward_virtual_ranks": lambda: virtual(virtual_ranks.forward_virtual_ranks),
        "backward_virtual_ranks": lambda: virtual(virtual_ranks.backward_virtual_ranks, with_dys=True),
    }


@pytest.mark.parametrize("entry_point", sorted(_entry_points()))
def test_unknown_activation_raises_from_every_entry_point(entry_point):
    from megamoe.activation import ACTIVATIONS

    message = f"activation must be one of {ACTIVATIONS} or 'swiglu(limit=L)' (L > 0), got 'bogus'"
    with pytest.raises(ValueError, match=re.escape(message)):
        _entry_points()[entry_point]()
