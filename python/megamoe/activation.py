"""The experts' gated activations: z = x·w13ᵀ = [..., 2I], gate columns then up columns, becomes
h = act(gate) · up (docs/DESIGN.md). The fp64 reference and the `grouped` and `naive` backends compute
h with `gated`; the fused kernels take the activation's name (gemm.gated_gemm / gated_backward).

Adding an activation, on the Python side, is adding its gate function to _GATES: ACTIVATIONS, the
checks of every entry point and the tests parametrized over ACTIVATIONS follow from it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# name -> act, applied to the gate half of z; in the order of the C API's MEGAMOE_ACTIVATION_* ids.
_GATES = {
    "swiglu": F.silu,
    "geglu": lambda gate: F.gelu(gate, approximate="tanh"),
}

ACTIVATIONS = tuple(_GATES)


def check_activation(activation) -> str:
    """activation, if it names one of ACTIVATIONS; a ValueError naming them otherwise."""
    if not isinstance(activation, str) or activation not in _GATES:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return activation


def activation_id(activation: str) -> int:
    """The C API's MEGAMOE_ACTIVATION_* value of an activation's name."""
    return ACTIVATIONS.index(check_activation(activation))


def gated(z: torch.Tensor, activation: str = "swiglu") -> torch.Tensor:
    """h [..., I] = act(z[..., :I]) · z[..., I:] for z [..., 2I] (gate | up), in z's dtype."""
    gate = _GATES[check_activation(activation)]
    intermediate = z.shape[-1] // 2
    return gate(z[..., :intermediate]) * z[..., intermediate:]
