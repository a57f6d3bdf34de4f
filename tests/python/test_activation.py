"""megamoe.activation: the gated activations every backend and the reference compute through."""

import pytest
import torch
import torch.nn.functional as F

from megamoe.activation import (ACTIVATIONS, activation_limit, check_activation, gated, native_activation,
                                swiglu_with_limit)


def test_swiglu_is_silu_of_the_gate_times_up():
    gate, up = torch.randn(7, 16, dtype=torch.float64), torch.randn(7, 16, dtype=torch.float64)
    expected = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(gated(torch.cat([gate, up], dim=-1), "swiglu"), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gated_keeps_the_dtype_and_halves_the_last_dim(activation, dtype):
    h = gated(torch.randn(2, 3, 10).to(dtype), activation)
    assert h.shape == (2, 3, 5) and h.dtype == dtype


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gate_columns_come_first_and_up_enters_linearly(activation):
    gate, up = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    ones = gated(torch.cat([gate, torch.ones_like(up)], dim=-1), activation)
    torch.testing.assert_close(gated(torch.cat([gate, up], dim=-1), activation), ones * up)
    assert not torch.allclose(gated(torch.cat([up, gate], dim=-1), activation), ones * up)


def test_activations_are_named_once():
    assert "swiglu" in ACTIVATIONS and len(set(ACTIVATIONS)) == len(ACTIVATIONS)
    for name in ACTIVATIONS:
        assert check_activation(name) == name


@pytest.mark.parametrize("bad", ["bogus", "silu", None, 1, "swiglu(limit=)", "geglu(limit=1)", "swiglu(limit=(1))"])
def test_unknown_activation_names_the_known_ones(bad):
    with pytest.raises(ValueError, match=r"activation must be one of \(.*'swiglu'.*\) or 'swiglu\(limit=L\)'"):
        check_activation(bad)


def test_clamped_swiglu_clamps_the_gate_above_and_up_on_both_sides():
    limit = 7.5
    gate = torch.tensor([-9.0, -7.5, 0.5, 7.5, 9.0, float("nan")], dtype=torch.float64)
    up = torch.tensor([9.0, -9.0, 2.0, -7.5, 7.0, 1.0], dtype=torch.float64)
    expected = F.silu(torch.tensor([-9.0, -7.5, 0.5, 7.5, 7.5, float("nan")], dtype=torch.float64)) * torch.tensor(
        [7.5, -7.5, 2.0, -7.5, 7.0, 1.0], dtype=torch.float64)
    got = gated(torch.cat([gate, up]), swiglu_with_limit(limit))
    torch.testing.assert_close(got, expected, equal_nan=True)


def test_clamped_swiglu_has_no_gradient_at_or_past_a_bound():
    """As the kernels differentiate it, with any torch version (2.11's clamp passes the gradient at a
    bound, 2.15's does not): the gate's gradient is 0 from the limit up, the up's from either bound
    out, and both at a NaN."""
    nan = float("nan")
    gate = torch.tensor([1.0, 2.0, 3.0, 1.0, 1.0, 1.0, 1.0, nan, 1.0], dtype=torch.float64, requires_grad=True)
    up = torch.tensor([1.0, 1.0, 1.0, 2.0, -2.0, 3.0, -1.5, 1.0, nan], dtype=torch.float64, requires_grad=True)
    gated(torch.cat([gate, up]), swiglu_with_limit(2.0)).sum().backward()
    assert gate.grad[1:3].eq(0).all() and gate.grad[0] != 0 and gate.grad[7] == 0
    assert up.grad[3:6].eq(0).all() and up.grad[6] != 0 and up.grad[0] != 0 and up.grad[8] == 0


def test_a_limit_is_held_in_fp32_and_must_be_positive_and_finite():
    assert swiglu_with_limit(7) == "swiglu(limit=7.0)"
    assert activation_limit(swiglu_with_limit(0.02)) == float(torch.tensor(0.02, dtype=torch.float32))
    assert check_activation("swiglu(limit=7)") == "swiglu(limit=7)" and activation_limit("swiglu(limit=7)") == 7.0
    assert native_activation("swiglu") == (0, 0.0)
    for bad in (0, -1.0, float("inf"), float("nan"), 1e39, "x"):
        with pytest.raises(ValueError, match="the SwiGLU limit must be a positive finite number"):
            swiglu_with_limit(bad)
        with pytest.raises(ValueError, match="the SwiGLU limit must be a positive finite number"):
            check_activation(f"swiglu(limit={bad})")
