"""Drop-in for transformers' MoE models: their experts run through `megamoe.moe`.

transformers 5 dispatches every experts module's forward through a registry
(`ALL_EXPERTS_FUNCTIONS`, selected by `config._experts_implementation`) when its class carries the
`use_experts_implementation` decorator. Registering a megamoe entry and selecting it is the least
invasive patch: the router, the router logits the model records for its aux loss, shared experts and
the parameters (used in place) stay the model's own.

Experts modules are found by the decorator's flags, not by class name: every module with `has_gate`,
`is_concatenated`, `is_transposed` and `has_bias` is a candidate (Qwen2/3-MoE, Mixtral, OLMoE,
DeepSeek-V2/V3, GLM-4-MoE, ... in transformers 5), and megamoe serves those in its own layout
(docs/DESIGN.md): gate_up_proj [E, 2I, H] with gate rows then up rows, down_proj [E, H, I], no biases,
transformers' default gate act(gate) * up (or a gate of its own that computes the same, or SwiGLU clamped
at the module's limit as DeepSeek-V4 and HY-V4 do, as probed) with an activation megamoe computes. The
others keep their own implementation and are named in one warning. Experts that transformers' own
expert parallelism split keep its split (hf_expert_parallel.py).
"""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .activation import ACTIVATIONS, gated, swiglu_with_limit
from .functional import moe
from .hf_expert_parallel import exchange_tokens, split_by_transformers
from .validation import FLOAT_DTYPES, check_options, group_rank_and_size

# The decorator's flags that mark an experts module, with the values of megamoe's layout.
_EXPECTED_FLAGS = {"has_gate": True, "is_concatenated": True, "is_transposed": False, "has_bias": False}
# Flags of later transformers versions (absent means False); a True one changes the computation.
_UNSUPPORTED_FLAGS = {"has_post_expert_norm": "a norm after each expert"}
# transformers' activation names (ACT2CLS) -> megamoe's gated activation (megamoe.activation.ACTIVATIONS).
HF_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu_pytorch_tanh": "geglu", "gelu_new": "geglu"}
# An experts module's act_fn may be torch's function itself rather than ACT2FN's module (LFM2-MoE).
_FUNCTIONAL_ACTIVATIONS = {F.silu: "swiglu"}
_STATE = "_megamoe_activation"  # on a served experts module: the activation megamoe computes it with
_FALLBACK = "_megamoe_fallback"  # on every candidate: the experts implementation it had before megamoe
_SHARD = "_megamoe_shard"  # on a served experts module that holds one rank's experts: (rank, world)


def _require_transformers():
    try:
        from transformers.integrations import moe as hf_moe
    except ImportError as error:
        raise ImportError("megamoe.patch_hf_model needs transformers >= 5 (pip install 'megamoe[hf]')") from error
    return hf_moe


def experts_modules(model: nn.Module) -> tuple[list[tuple[str, nn.Module, str]], list[tuple[str, nn.Module, str]]]:
    """The experts modules of `model` (those of transformers' `use_experts_implementation`).

    Returns (served, refused): served as (name, module, megamoe activation) for the modules megamoe
    computes, refused as (name, module, reason) for the others.
    """
    _require_transformers()
    served, refused = [], []
    for name, module in model.named_modules():
        if not all(hasattr(module, flag) for flag in _EXPECTED_FLAGS):
            continue
        activation, reason = _served(module)
        if reason is None:
            served.append((name, module, activation))
        else:
            refused.append((name or type(module).__name__, module, reason))
    return served, refused


def _served(experts: nn.Module) -> tuple[str | None, str | None]:
    """(activation, None) when megamoe computes `experts` (megamoe's activation name), (None, why) when not."""
    for flag, expected in _EXPECTED_FLAGS.items():
        if getattr(experts, flag) != expected:
            return None, f"{flag}={getattr(experts, flag)} (megamoe needs {flag}={expected})"
    for flag, what in _UNSUPPORTED_FLAGS.items():
        if getattr(experts, flag, False):
            return None, f"{flag}=True: {what}"
    activation = _activation(experts)  # a gate of its own is probed: once per module
    if activation is None and not _default_gate(experts):
        return None, (f"a gate of its own ({type(experts).__name__}._apply_gate), not act(gate) * up nor SwiGLU "
                      "clamped at its limit")
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == down.dim() == 3):
        return None, "no 3-D gate_up_proj and down_proj"
    if gate_up.dtype not in FLOAT_DTYPES or down.dtype != gate_up.dtype:
        return None, (f"{gate_up.dtype} / {down.dtype} weights (e.g. a quantized checkpoint's); megamoe takes one "
                      "float dtype")
    num_experts, hidden, intermediate = down.shape
    if tuple(gate_up.shape) != (num_experts, 2 * intermediate, hidden):
        return None, (f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
                      "[E, 2I, H] and [E, H, I]")
    if activation is None:
        config_act = getattr(getattr(experts, "config", None), "hidden_act", None)
        act_fn = type(getattr(experts, "act_fn", None)).__name__
        return None, (f"activation {act_fn} (hidden_act={config_act!r}); megamoe computes "
                      f"{', '.join(f'{k}->{v}' for k, v in HF_ACTIVATIONS.items())}")
    return activation, None


def _default_gate(experts: nn.Module) -> bool:
    """Whether `experts` computes transformers' default gate, act_fn(gate) * up."""
    return getattr(type(experts), "_apply_gate", None) is _require_transformers()._default_apply_gate


def _activation(experts: nn.Module) -> str | None:
    """megamoe's name for what `experts` computes: for the default gate, the activation of its
    `act_fn` (an ACT2FN module matched by class, or torch's function itself); for a gate of its own,
    the same if the gate computes act_fn(gate) * up, or SwiGLU clamped at the module's limit if it
    computes that (_gate_computes). A gate of its own without an act_fn (HY-V4's calls F.silu) is
    probed with each activation megamoe computes."""
    from transformers.activations import ACT2FN

    act_fn = getattr(experts, "act_fn", None)
    activation = _FUNCTIONAL_ACTIVATIONS.get(act_fn) if inspect.isfunction(act_fn) else None
    for name, candidate in HF_ACTIVATIONS.items():
        if type(act_fn) is type(ACT2FN[name]):
            activation = candidate
    if _default_gate(experts):
        return activation
    candidates = [activation] if activation is not None else list(ACTIVATIONS) if act_fn is None else []
    for candidate in candidates:
        limited = _swiglu_limit(experts) if candidate == "swiglu" else None
        for computed in (candidate, limited):
            if computed is not None and _gate_computes(experts, computed):
                return computed
    return None


def _swiglu_limit(experts: nn.Module) -> str | None:
    """SwiGLU clamped at the experts' `limit` or `swiglu_limit` (DeepSeek-V4, HY-V4), if it has a usable one."""
    for name in ("limit", "swiglu_limit"):
        value = getattr(experts, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return swiglu_with_limit(value)
            except ValueError:
                return None
    return None


def _gate_computes(experts: nn.Module, activation: str) -> bool:
    """Whether the experts' own `_apply_gate` computes gated(·, activation) (a gate that only changes
    the precision it computes in, say): checked in fp64 on values from 1e-3 to 1e4 of either sign, so
    that a clamp or softcap anywhere in that range shows, within fp32's precision."""
    magnitudes = torch.logspace(-3, 4, 48, dtype=torch.float64)
    values = torch.cat([-magnitudes.flip(0), torch.zeros(1, dtype=torch.float64), magnitudes])
    probe = torch.stack([torch.cat([values, values.flip(0)]), torch.cat([values.flip(0), values])])  # gate | up
    try:
        with torch.no_grad():
            computed = experts._apply_gate(probe)
    except (RuntimeError, TypeError, ValueError):  # e.g. a gate that needs more than gate_up
        return False
    return (isinstance(computed, torch.Tensor) and computed.shape == (2, values.numel())
            and torch.allclose(computed.double(), gated(probe, activation), rtol=1e-6, atol=1e-12))


def qwen3_moe_experts(model: nn.Module) -> list[nn.Module]:
    """The Qwen3-MoE experts modules of `model`, checked to have the layout megamoe computes.

    Raises TypeError for models without them and ValueError for an unexpected layout.
    """
    _require_transformers()
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    found = [(name, m) for name, m in model.named_modules() if isinstance(m, Qwen3MoeExperts)]
    if not found:
        raise TypeError(f"{type(model).__name__} has no Qwen3MoeExperts module (transformers' Qwen3-MoE experts)")
    for name, experts in found:
        _, reason = _served(experts)
        if reason is not None:
            raise ValueError(f"{name}: {reason}; this Qwen3-MoE's experts are not in the layout megamoe computes")
    return [experts for _, experts in found]


def patch_hf_model(model: nn.Module, backend: str = "fused", precision: str = "bf16",
                   recompute: bool | str = False, group=None) -> nn.Module:
    """Makes transformers MoE `model` run its experts through `megamoe.moe(backend, precision)`.

    Serves every experts module of transformers' `use_experts_implementation` in megamoe's layout
    (gate_up_proj [E, 2I, H], down_proj [E, H, I], no biases, hidden_act silu -> "swiglu",
    gelu_pytorch_tanh / gelu_new -> "geglu"): Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3, ....
    Experts modules in another layout keep their own implementation, listed in one warning; a model
    with none megamoe can serve raises TypeError.

    recompute (fused only): what the experts keep for the backward, as in `megamoe.moe` (True: only
    their inputs, activation checkpointing by the fused op itself; "gather": z but not the pool of x).

    The experts' own `gate_up_proj` / `down_proj` are used in place (no copies); the model keeps
    computing its router logits, aux loss and shared experts itself. Patching again switches the
    backend. Returns model.

    group (expert parallelism, backend "fused"): a torch.distributed group of W ranks, each running this
    model on its own tokens. Every served experts module keeps only this rank's E/W experts, [r E/W,
    (r + 1) E/W): its gate_up_proj and down_proj become Parameters of those experts (the others' memory
    is freed; expert_parallel_parameters lists them), and the router's global ids reach their owners
    through `megamoe.moe(..., group=group)`. A module megamoe leaves alone keeps all its experts.
    Experts that transformers itself splits over its EP mesh (`DistributedConfig(ep_size=...)`) keep
    its split. Without a group they run under the token exchange of transformers' `ep_implementation`;
    with group (the mesh's ranks in order: dist.group.WORLD where ep_size is the world size, backend
    "fused") megamoe exchanges their tokens instead, each rank sending its slice of a batch that its TP
    ranks share.
    """
    check_options(backend, precision, recompute, group=group)
    served, refused = experts_modules(model)
    if not served:
        why = "".join(f"; {name}: {reason}" for name, _, reason in refused) or "; it has no experts module"
        raise TypeError(f"megamoe.patch_hf_model serves transformers MoE models whose experts have megamoe's layout "
                        f"(Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3, ...); {type(model).__name__} has none{why}")
    if not hasattr(model, "set_experts_implementation"):
        raise TypeError(f"pass the transformers model itself (a PreTrainedModel), not a {type(model).__name__}")
    for name, experts, _ in served:
        if split_by_transformers(experts):
            exchange_tokens(name, experts, group, model)
        else:
            _keep_local_experts(name, experts, group)
    implementation = _register(backend, precision, recompute, group)
    for _, experts, _ in served + refused:  # what a module megamoe leaves alone keeps running
        if _FALLBACK not in vars(experts):
            current = getattr(getattr(experts, "config", None), "_experts_implementation", None)
            setattr(experts, _FALLBACK, "eager" if current is None or current.startswith("megamoe_") else current)
        vars(experts).pop(_STATE, None)
    for _, experts, activation in served:
        setattr(experts, _STATE, activation)
    model.set_experts_implementation(implementation)
    unpatched = [name for name, e, _ in served if e.config._experts_implementation != implementation]
    if unpatched:  # e.g. an experts module whose config is not the model's
        raise RuntimeError(f"{len(unpatched)} of {len(served)} experts modules did not switch to "
                           f"{implementation!r}: {', '.join(unpatched)}")
    if refused:
        warnings.warn(_refused_message(refused, type(model).__name__), stacklevel=2)
    return model


def _refused_message(refused: list[tuple[str, nn.Module, str]], model_name: str) -> str:
    by_reason: dict[str, list[str]] = {}
    for name, _, reason in refused:
        by_reason.setdefault(reason, []).append(name)
    lines = "".join(f"\n  {', '.join(names)}: {reason}" for reason, names in by_reason.items())
    return (f"megamoe.patch_hf_model left {len(refused)} experts module(s) of {model_name} on their own "
            f"implementation:{lines}")


def _keep_local_experts(name: str, experts: nn.Module, group) -> None:
    """Makes `experts` hold this rank's E/W experts of `group` (nothing for group None), once: a module
    already split must be patched with a group of the same rank and size."""
    shard = (0, 1) if group is None else group_rank_and_size(group)
    held = vars(experts).get(_SHARD, (0, 1))
    if held == shard:
        return
    if held != (0, 1):
        raise ValueError(f"{name} holds the experts of rank {held[0]} of {held[1]} (patched with a group before); "
                         f"it cannot be patched for rank {shard[0]} of {shard[1]}: patch a freshly loaded model")
    rank, world = shard
    num_experts = experts.gate_up_proj.shape[0]
    if num_experts % world:
        raise ValueError(f"{name} has {num_experts} experts, which {world} ranks cannot split evenly")
    local = slice(rank * num_experts // world, (rank + 1) * num_experts // world)
    for attr in ("gate_up_proj", "down_proj"):
        weight = getattr(experts, attr)
        setattr(experts, attr, nn.Parameter(weight.detach()[local].clone(), requires_grad=weight.requires_grad))
    setattr(experts, _SHARD, shard)


def expert_parallel_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of `model` that hold one rank's experts (patch_hf_model with a group): what each
    rank trains alone, where every other parameter is replicated across the ranks."""
    return [getattr(module, attr) for module in model.modules() if vars(module).get(_SHARD, (0, 1))[1] > 1
            for attr in ("gate_up_proj", "down_proj")]


def _register(backend: str, precision: str, recompute: bool | str, group) -> str:
    hf_moe = _require_transformers()

    def experts_forward(experts, hidden_states, top_k_index, top_k_weights):
        activation = vars(experts).get(_STATE)
        if activation is None:  # a module patch_hf_model left alone (it shares the model's config)
            interface, original = _dispatch_of(type(experts), hf_moe)
            fallback = interface.get_interface(vars(experts).get(_FALLBACK, "eager"), original)
            return fallback(experts, hidden_states, top_k_index, top_k_weights)
        if group is None and split_by_transformers(experts):
            # Under transformers' token exchange the ids are this rank's experts, and a route to another
            # rank's expert carries the id num_experts (the local count) with weight 0.
            top_k_index = top_k_index.masked_fill(top_k_index >= experts.gate_up_proj.shape[0], -1)
        return moe(hidden_states.contiguous(), top_k_index, top_k_weights, experts.gate_up_proj,
                   experts.down_proj, backend=backend, precision=precision, recompute=recompute,
                   activation=activation, group=group)

    # The registry is global and keyed by name: a group's entry is named after that group object.
    implementation = (f"megamoe_{backend}_{precision}" + ("_recompute" if recompute else "")
                      + ("_gather" if recompute == "gather" else "")
                      + ("" if group is None else f"_group{id(group):x}"))
    # Experts classes may dispatch through a subclass of the registry with a mapping of its own (e.g.
    # transformers' FP8 experts): every module of a switched config must find the entry.
    interfaces, pending = [], [hf_moe.ExpertsInterface]
    while pending:
        interfaces.append(pending.pop())
        pending.extend(interfaces[-1].__subclasses__())
    for interface in interfaces:
        interface.register(implementation, experts_forward)
    return implementation


def _dispatch_of(experts_class: type, hf_moe) -> tuple:
    """(the registry, the class's own forward) that `use_experts_implementation`'s forward closes over."""
    forward = experts_class.forward
    captured = inspect.getclosurevars(forward).nonlocals
    return (captured.get("experts_interface", hf_moe.ALL_EXPERTS_FUNCTIONS),
            captured.get("original_forward", getattr(forward, "__wrapped__", forward)))
