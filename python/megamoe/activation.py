"""The experts' gated activations: z = x·w13ᵀ = [..., 2I], gate columns then up columns, becomes
h = act(gate) · up (docs/DESIGN.md). The fp64 reference and the `grouped` and `naive` backends compute
h with `gated`; the fused kernels take the activation's C API id and limit (gemm.gated_gemm /
gated_backward).

An activation is named by a string: one of ACTIVATIONS, or SwiGLU clamped at a limit L,
"swiglu(limit=L)" (swiglu_with_limit): h = silu(min(gate, L)) · clamp(up, -L, L), DeepSeek-V4's
experts' swiglu_limit, with no gradient at or past a bound, nor at a NaN.

Adding an activation, on the Python side, is adding its gate function to _GATES: ACTIVATIONS, the
checks of every entry point and the tests parametrized over ACTIVATIONS follow from it.
"""

from __future__ import annotations

import math
import re
import struct

import torch
import torch.nn.functional as F

# name -> act, applied to the gate half of z; in the order of the C API's MEGAMOE_ACTIVATION_* ids.
_GATES = {
    "swiglu": F.silu,
    "geglu": lambda gate: F.gelu(gate, approximate="tanh"),
}

ACTIVATIONS = tuple(_GATES)

_LIMITED = re.compile(r"swiglu\(limit=([^()]+)\)")
_LIMITED_ID = len(_GATES)  # MEGAMOE_ACTIVATION_SWIGLU_LIMIT


def _fp32_limit(limit) -> float:
    """limit rounded to fp32 (to nearest), as the kernels hold it; a ValueError unless it is positive and
    finite. Rounded by struct, not through a tensor, which a fake-tensor trace (torch.compile) may not
    read back."""
    try:
        value = struct.unpack("f", struct.pack("f", float(limit)))[0]
    except (TypeError, ValueError, OverflowError):  # OverflowError: past the largest fp32
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"the SwiGLU limit must be a positive finite number (held in fp32), got {limit!r}")
    return value


def swiglu_with_limit(limit: float) -> str:
    """The name of SwiGLU clamped at `limit` (rounded to fp32): "swiglu(limit=L)"."""
    return f"swiglu(limit={_fp32_limit(limit)!r})"


def _parse(activation) -> tuple[str, float]:
    """(activation, its limit in fp32: 0 for ACTIVATIONS) if it names an activation; a ValueError
    naming them otherwise."""
    if isinstance(activation, str):
        if activation in _GATES:
            return activation, 0.0
        limited = _LIMITED.fullmatch(activation)
        if limited is not None:
            return activation, _fp32_limit(limited.group(1))
    raise ValueError(f"activation must be one of {ACTIVATIONS} or 'swiglu(limit=L)' (L > 0), got {activation!r}")


def check_activation(activation) -> str:
    """activation, if it names an activation; a ValueError naming them otherwise."""
    return _parse(activation)[0]


def activation_limit(activation: str) -> float:
    """The L of "swiglu(limit=L)" in fp32 (the C API's activation_limit); 0 for the other activations."""
    return _parse(activation)[1]


def native_activation(activation: str) -> tuple[int, float]:
    """(MEGAMOE_ACTIVATION_* value, activation_limit) as the C API's gated GEMMs take them."""
    name, limit = _parse(activation)
    return (_LIMITED_ID if limit else ACTIVATIONS.index(name)), limit


def gated(z: torch.Tensor, activation: str = "swiglu") -> torch.Tensor:
    """h [..., I] = act(z[..., :I]) · z[..., I:] for z [..., 2I] (gate | up), in z's dtype."""
    limit = activation_limit(activation)
    intermediate = z.shape[-1] // 2
    gate, up = z[..., :intermediate], z[..., intermediate:]
    if limit:
        # torch.where passes the gradient only to the side it takes: none at or past a bound, nor at a
        # NaN (as the kernels do), where torch's clamp passes it at a bound in some versions (2.11)
        # and not in others (2.15). The clamped side is detached; clamp keeps a NaN a NaN.
        gate = torch.where(gate < limit, gate, gate.detach().clamp(max=limit))
        up = torch.where(up.abs() < limit, up, up.detach().clamp(min=-limit, max=limit))
        return F.silu(gate) * up
    return _GATES[activation](gate) * up
