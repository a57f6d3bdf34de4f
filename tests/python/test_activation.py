"""megamoe.activation: the gated activations every backend and the reference compute through."""

import pytest
import torch

from megamoe.activation import ACTIVATIONS, check_activation, gated


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


@pytest.mark.parametrize("bad", ["bogus", "silu", None, 1])
def test_unknown_activation_names_the_known_ones(bad):
    with pytest.raises(ValueError, match=r"activation must be one of \(.*'swiglu'.*\), got"):
        check_activation(bad)
