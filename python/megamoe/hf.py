"""Drop-in for transformers' Qwen3-MoE models: their experts run through `megamoe.moe`.

transformers 5 dispatches every experts module's forward through a registry
(`ALL_EXPERTS_FUNCTIONS`, selected by `config._experts_implementation`). Registering a megamoe entry
and selecting it is the least invasive patch: the router, the router logits the model records for
its aux loss, and the parameters (used in place) stay the model's own.
"""

from __future__ import annotations

from torch import nn

from .functional import moe
from .validation import BACKENDS, check_precision, check_recompute

# The layout megamoe.moe takes (docs/DESIGN.md), as flags of transformers' `use_experts_implementation`:
# w13 = gate_up_proj [E, 2I, H] with gate rows then up rows, w2 = down_proj [E, H, I], no biases.
_EXPECTED_FLAGS = {"has_gate": True, "is_concatenated": True, "is_transposed": False, "has_bias": False}


def qwen3_moe_experts(model: nn.Module) -> list[nn.Module]:
    """The Qwen3-MoE experts modules of `model`, checked to have the layout megamoe computes.

    Raises TypeError for models without them and ValueError for an unexpected layout.
    """
    try:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    except ImportError as error:
        raise ImportError("megamoe.patch_hf_model needs transformers >= 5 (pip install 'megamoe[hf]')") from error
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, Qwen3MoeExperts)]
    if not found:
        raise TypeError(f"megamoe.patch_hf_model supports transformers' Qwen3-MoE models (Qwen3MoeForCausalLM "
                        f"and its relatives); {type(model).__name__} has no Qwen3MoeExperts module")
    for name, experts in found:
        _check_layout(name, experts)
    return [experts for _, experts in found]


def _check_layout(name: str, experts: nn.Module) -> None:
    for flag, expected in _EXPECTED_FLAGS.items():
        if getattr(experts, flag, None) != expected:
            got = getattr(experts, flag, "missing")
            raise ValueError(f"{name}: expected {flag}={expected} (gate_up_proj [E, 2I, H] with gate rows then "
                             f"up rows, down_proj [E, H, I], no bias), got {got}; this transformers version's "
                             "Qwen3-MoE layout is not the one megamoe computes")
    activation = getattr(experts.config, "hidden_act", None)
    if activation != "silu":
        raise ValueError(f"{name}: megamoe computes SwiGLU experts (hidden_act='silu'), got {activation!r}")
    num_experts, hidden, intermediate = experts.num_experts, experts.hidden_dim, experts.intermediate_dim
    shapes = {"gate_up_proj": (num_experts, 2 * intermediate, hidden),
              "down_proj": (num_experts, hidden, intermediate)}
    for weight, shape in shapes.items():
        got = tuple(getattr(experts, weight).shape)
        if got != shape:
            raise ValueError(f"{name}.{weight}: expected shape {shape} (E, ...), got {got}")


def patch_hf_model(model: nn.Module, backend: str = "fused", precision: str = "bf16",
                   recompute: bool = False) -> nn.Module:
    """Makes transformers' Qwen3-MoE `model` run its experts through `megamoe.moe(backend, precision)`.

    recompute (fused only): the experts keep only their inputs for the backward (activation
    checkpointing of the experts by the fused op itself, see `megamoe.moe`).

    The experts' own `gate_up_proj` / `down_proj` are used in place (no copies); the model keeps
    computing its router logits and aux loss itself. Patching again switches the backend. Returns model.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_recompute(backend, recompute)
    experts = qwen3_moe_experts(model)
    if not hasattr(model, "set_experts_implementation"):
        raise TypeError(f"pass the transformers model itself (a PreTrainedModel), not a {type(model).__name__}")
    check_precision(precision, experts[0].gate_up_proj.device)
    implementation = _register(backend, precision, recompute)
    model.set_experts_implementation(implementation)
    unpatched = [e for e in experts if e.config._experts_implementation != implementation]
    if unpatched:  # e.g. an experts module whose config is not the model's
        raise RuntimeError(f"{len(unpatched)} of {len(experts)} experts modules did not switch to "
                           f"{implementation!r}")
    return model


def _register(backend: str, precision: str, recompute: bool) -> str:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    def experts_forward(experts, hidden_states, top_k_index, top_k_weights):
        return moe(hidden_states.contiguous(), top_k_index, top_k_weights, experts.gate_up_proj,
                   experts.down_proj, backend=backend, precision=precision, recompute=recompute)

    implementation = f"megamoe_{backend}_{precision}" + ("_recompute" if recompute else "")
    ALL_EXPERTS_FUNCTIONS.register(implementation, experts_forward)
    return implementation
