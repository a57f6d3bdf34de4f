"""patch_hf_model against transformers' own, unpatched MoE models: same logits, loss, gradients and
loss curve, for every model family it serves; the experts modules it cannot serve are left alone."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import megamoe
from megamoe.activation import swiglu_with_limit
from megamoe.reference import relative_error

from conftest import requires_cuda

transformers = pytest.importorskip("transformers")

# fp32: the backends differ from transformers' experts only in summation order.
# bf16: every matmul output is rounded to 8 bits of mantissa (2^-9 relative), in a different order
# by each path, through the forward and the backward: a few 1e-3, bounded as test_backends does.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# In bf16 the rounding differences of one MoE layer can flip a near-tie top-k choice of the next
# layer's router, which changes that expert's gradient by O(1) without either side being wrong. The
# first MoE layer's router sees bit-identical inputs on both sides, so bf16 runs with one layer.
LAYERS = {torch.float32: 2, torch.bfloat16: 1}


def tiny_config(**overrides):
    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_experts=8, num_experts_per_tok=2, max_position_embeddings=64)
    return transformers.Qwen3MoeConfig(**{**sizes, **overrides})


def tiny_model(dtype=torch.float32, layers=2):
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(tiny_config(num_hidden_layers=layers)).to(dtype)


def loss_logits_and_grads(model, input_ids):
    model.zero_grad()
    out = model(input_ids=input_ids, labels=input_ids, output_router_logits=True, use_cache=False)
    out.loss.backward()  # includes router_aux_loss_coef · aux loss, from the model's own router logits
    return out, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["naive", "grouped"])
def test_patched_model_matches_unpatched(backend, dtype):
    model = tiny_model(dtype, LAYERS[dtype])
    patched = copy.deepcopy(model)
    weights_before = [e.gate_up_proj.data_ptr() for e in megamoe.hf.qwen3_moe_experts(patched)]
    assert megamoe.patch_hf_model(patched, backend=backend) is patched
    assert [e.gate_up_proj.data_ptr() for e in megamoe.hf.qwen3_moe_experts(patched)] == weights_before
    input_ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    want, want_grads = loss_logits_and_grads(model, input_ids)
    got, got_grads = loss_logits_and_grads(patched, input_ids)
    tolerance = TOLERANCE[dtype]
    assert relative_error(got.logits, want.logits) < tolerance
    assert relative_error(got.aux_loss, want.aux_loss) < tolerance
    assert got.loss.item() == pytest.approx(want.loss.item(), rel=tolerance)
    for name, grad in want_grads.items():
        assert relative_error(got_grads[name], grad) < tolerance, name


# Tiny random configs of each model family patch_hf_model serves. H = I = 128 (multiples of 8, so
# the fused kernels take them on a GPU), 8 experts, top-2; "moe_layer" names one MoE layer's experts.
COMMON = dict(vocab_size=128, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)
MODELS = {
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(  # a shared expert with a sigmoid gate
        intermediate_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=256, num_experts=8,
        num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        intermediate_size=256, moe_intermediate_size=128, head_dim=32, num_experts=8, num_experts_per_tok=2)),
    "qwen3_moe_geglu": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        intermediate_size=256, moe_intermediate_size=128, head_dim=32, num_experts=8, num_experts_per_tok=2,
        hidden_act="gelu_pytorch_tanh")),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(
        intermediate_size=128, num_local_experts=8, num_experts_per_tok=2)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(
        intermediate_size=128, num_experts=8, num_experts_per_tok=2, eos_token_id=2)),
    # A dense first layer, then MoE layers with a shared expert, group-limited routing and
    # routed_scaling_factor; multi-head latent attention.
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        intermediate_size=256, moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, n_shared_experts=1, kv_lora_rank=32, q_lora_rank=64,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32)),
    # Shared experts and group-limited routing after a dense first layer (GLM-4.5).
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig", dict(
        intermediate_size=256, moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, n_shared_experts=1)),
    "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(
        intermediate_size=256, moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=32)),
    # MoE from the second layer on, two shared experts.
    "ernie4_5_moe": ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", dict(
        intermediate_size=256, moe_intermediate_size=128, moe_num_experts=8, moe_k=2)),
    "dots1": ("Dots1ForCausalLM", "Dots1Config", dict(
        intermediate_size=256, moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1)),
    "hunyuan_v1_moe": ("HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Config", dict(
        intermediate_size=128, num_experts=8, moe_topk=2, head_dim=32)),
    # Linear-attention layers between full-attention ones; a shared expert with a sigmoid gate.
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", dict(
        intermediate_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=8,
        num_experts_per_tok=2, head_dim=32)),
    # Sparsemixer routing; its training-time jitter off, so both models route alike.
    "phimoe": ("PhimoeForCausalLM", "PhimoeConfig", dict(
        intermediate_size=128, num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0)),
}
DENSE_LAYERS = {"deepseek_v3": 1, "glm4_moe": 1, "ernie4_5_moe": 1}  # layers before the first MoE layer
# Models whose output carries the router's aux loss (DeepSeek-V3 and the others balance without one).
AUX_LOSS = {"qwen2_moe", "qwen3_moe", "qwen3_moe_geglu", "mixtral", "olmoe", "ernie4_5_moe", "qwen3_next", "phimoe"}
ACTIVATION = {"qwen3_moe_geglu": "geglu"}

# (backend, device) pairs: the baselines on the CPU, the fused kernels on a GPU (bf16 only).
BACKEND_DEVICES = [("naive", "cpu"), ("grouped", "cpu"), pytest.param("fused", "cuda", marks=requires_cuda)]


def family_model(family, dtype=torch.float32, moe_layers=2, device="cpu"):
    model_class, config_class, sizes = MODELS[family]
    if not hasattr(transformers, model_class):
        pytest.skip(f"this transformers has no {model_class}")
    config = getattr(transformers, config_class)(
        **COMMON, **sizes, num_hidden_layers=DENSE_LAYERS.get(family, 0) + moe_layers)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).to(device=device, dtype=dtype)
    # The reference: transformers' own per-expert loop, independent of any grouped GEMM.
    model.set_experts_implementation("eager")
    return model


def family_step(model, family, input_ids):
    """One forward and backward: (loss, logits, aux loss or None, {trainable parameter: gradient})."""
    model.zero_grad()
    router_logits = {"output_router_logits": True} if family in AUX_LOSS else {}
    out = model(input_ids=input_ids, labels=input_ids, use_cache=False, **router_logits)
    out.loss.backward()
    return (out.loss, out.logits, getattr(out, "aux_loss", None),
            {n: p.grad for n, p in model.named_parameters() if p.requires_grad})


def family_cases(test):
    """Runs `test(family, backend, device, dtype)` for every family, backend and dtype."""
    for mark in (pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"]),
                 pytest.mark.parametrize("backend,device", BACKEND_DEVICES),
                 pytest.mark.parametrize("family", MODELS)):
        test = mark(test)
    return test


def unpatched_and_patched(family, backend, device, dtype):
    if backend == "fused" and dtype != torch.bfloat16:
        pytest.skip("the fused kernels take bf16")
    model = family_model(family, dtype, LAYERS[dtype], device)
    patched = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every experts module is served: no warning
        megamoe.patch_hf_model(patched, backend=backend)
    return model, patched


@family_cases
def test_model_family_matches_unpatched(family, backend, device, dtype):
    model, patched = unpatched_and_patched(family, backend, device, dtype)
    served, refused = megamoe.hf.experts_modules(patched)
    assert len(served) == LAYERS[dtype] and not refused
    assert {activation for _, _, activation in served} == {ACTIVATION.get(family, "swiglu")}
    assert_same_step(model, patched, family, TOLERANCE[dtype], device)


def assert_same_step(model, patched, family, tolerance, device="cpu"):
    """Same loss, logits, aux loss and gradients of every parameter (routers, shared experts and
    their gates included) from `model` and `patched` on one batch."""
    input_ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1)).to(device)
    want_loss, want_logits, want_aux, want_grads = family_step(model, family, input_ids)
    got_loss, got_logits, got_aux, got_grads = family_step(patched, family, input_ids)
    assert relative_error(got_logits, want_logits) < tolerance
    assert got_loss.item() == pytest.approx(want_loss.item(), rel=tolerance)
    assert (got_aux is None) == (want_aux is None) == (family not in AUX_LOSS)
    if want_aux is not None:
        assert relative_error(got_aux, want_aux) < tolerance
    for name, grad in want_grads.items():
        assert grad is not None and got_grads[name] is not None, name
        assert relative_error(got_grads[name], grad) < tolerance, name


# Loss curves: 5 AdamW steps on one fixed batch. fp32 differs in summation order only; in bf16 the
# weights differ by roundings after the first step, which the routers may amplify (see LAYERS).
CURVE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@family_cases
def test_model_family_loss_curve_matches_unpatched(family, backend, device, dtype):
    model, patched = unpatched_and_patched(family, backend, device, dtype)
    input_ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(2)).to(device)
    curves = []
    for each in (model, patched):
        optimizer = torch.optim.AdamW(each.parameters(), lr=1e-3, weight_decay=0.1)
        curve = []
        for _ in range(5):
            loss = family_step(each, family, input_ids)[0]
            optimizer.step()
            curve.append(loss.item())
        curves.append(curve)
    want, got = curves
    assert want[-1] < want[0] - 0.05  # it trains
    assert got == pytest.approx(want, rel=CURVE_TOLERANCE[dtype])


# Every other MoE family of the installed transformers: a causal LM whose modeling file declares an
# experts class (`use_experts_implementation`), built from its default config shrunk by the common
# size names, since the flags, not a list of classes, decide what patch_hf_model serves. Two layers:
# the first dense where a family starts with dense layers, the second a MoE layer. A family the
# generic sizes cannot build or run is skipped (MODELS above carries hand-made configs instead).
GENERIC_SIZES = dict(vocab_size=128, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     max_position_embeddings=64, pad_token_id=0, first_k_dense_replace=1, num_dense_layers=1,
                     mlp_only_layers=[0], enable_moe_block=True, n_group=1, topk_group=1, router_jitter_noise=0.0,
                     input_jitter_noise=0.0, kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16,
                     v_head_dim=32, index_num_heads=1)
# Expert counts, set where the config's default is a count or None (no experts unless given).
GENERIC_EXPERTS = {8: ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
                   2: ("num_experts_per_tok", "moe_k", "moe_topk", "top_k", "top_k_experts")}
# Per-layer types that a family's config does not derive for two layers (its default is None).
LAYER_TYPES = {"lfm2_moe": ["conv", "full_attention"]}


def other_moe_families() -> dict[str, str]:
    """{model type: causal-LM class name} of the installed transformers' MoE families not in MODELS
    (text-only models: a multimodal one builds its default vision tower)."""
    import importlib.util

    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    families = {}  # one model type per class
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        module = model_type_to_module_name(model_type)
        spec = importlib.util.find_spec(f"transformers.models.{module}.modeling_{module}")
        if (model_type not in MODELS and class_name.endswith("ForCausalLM") and class_name not in families.values()
                and spec is not None and spec.origin is not None):
            with open(spec.origin) as source:
                if "@use_experts_implementation" in source.read():
                    families[model_type] = class_name
    return families


def generic_model(model_type: str, class_name: str, **overrides):
    """The family's model from its config's defaults, with every size name of GENERIC_SIZES and
    GENERIC_EXPERTS (then LAYER_TYPES' and `overrides`) that the config has given to its constructor
    (which derives per-layer types, and per-layer sizes in a config that varies them by layer). The
    config's names are its fields and what its defaults derive: reading a per-layer size from a whole
    config raises. A list of MLP types per layer becomes its first and last entries (dense, then MoE)."""
    import dataclasses

    model_class = getattr(transformers, class_name)
    fields = {field.name: field.default for field in dataclasses.fields(model_class.config_class)}
    defaults = vars(model_class.config_class())
    sizes = {name: value for name, value in GENERIC_SIZES.items() if name in fields.keys() | defaults.keys()}
    if isinstance(defaults.get("mlp_layer_types"), list):
        sizes["mlp_layer_types"] = [defaults["mlp_layer_types"][0], defaults["mlp_layer_types"][-1]]
    sizes |= {name: value for value, candidates in GENERIC_EXPERTS.items() for name in candidates
              if name in fields and (fields[name] is None or type(fields[name]) is int)}
    if "qk_rope_head_dim" in sizes:  # multi-head latent attention: its rotary part is the head_dim
        sizes["head_dim"] = sizes["qk_rope_head_dim"]
    if model_type in LAYER_TYPES:
        sizes["layer_types"] = LAYER_TYPES[model_type]
    torch.manual_seed(0)
    return model_class(model_class.config_class(**(sizes | overrides)))


@pytest.mark.parametrize("model_type,class_name", other_moe_families().items())
def test_other_moe_family_matches_unpatched(model_type, class_name):
    input_ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    # Grouped-query attention, or as many key-value heads as heads (multi-head latent attention), or
    # one expert per token (a family that routes to one).
    for overrides in ({}, {"num_key_value_heads": GENERIC_SIZES["num_attention_heads"]}, {"num_experts_per_tok": 1}):
        try:
            model = generic_model(model_type, class_name, **overrides)
        except Exception as error:  # noqa: BLE001 -- a config the common size names do not fit
            failure = f"does not build from generic sizes: {type(error).__name__}: {error}"
            continue
        served, refused = megamoe.hf.experts_modules(model)
        if not served:
            pytest.skip(f"nothing to serve in two layers of {class_name}: {[reason for *_, reason in refused]}")
        model.set_experts_implementation("eager")
        patched = copy.deepcopy(model)
        try:
            want = family_step(model, model_type, input_ids)
            break
        except Exception as error:  # noqa: BLE001 -- the unpatched model itself fails at these sizes
            failure = f"does not run at generic sizes: {type(error).__name__}: {error}"
    else:
        pytest.skip(f"{class_name} {failure}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # refused modules, if any, are named in a warning
        megamoe.patch_hf_model(patched, backend="grouped")
    got = family_step(patched, model_type, input_ids)
    tolerance = TOLERANCE[torch.float32]
    assert relative_error(got[1], want[1]) < tolerance
    assert got[0].item() == pytest.approx(want[0].item(), rel=tolerance)
    # Each gradient's error relative to its norm, or to 1e-3 of the largest for one so small that fp32
    # summation order shows in it (a router whose weights' gradient cancels to 1e-9 of the largest;
    # Qwen3.5-MoE's linear-attention A_log at 1e-4, 1.2e-5 from the unpatched model's).
    floor = 1e-3 * max(grad.norm() for grad in want[3].values() if grad is not None)
    for name, grad in want[3].items():
        assert (got[3][name] is None) == (grad is None), name  # e.g. a sparse attention's indexer has none
        if grad is not None:
            assert (got[3][name] - grad).norm() < tolerance * max(grad.norm(), floor), name


def test_activations_map_from_hidden_act(monkeypatch):
    for hidden_act, activation in [("silu", "swiglu"), ("swish", "swiglu"), ("gelu_pytorch_tanh", "geglu"),
                                   ("gelu_new", "geglu")]:
        model = megamoe.patch_hf_model(transformers.Qwen3MoeForCausalLM(tiny_config(hidden_act=hidden_act)),
                                       backend="naive")
        calls = []
        monkeypatch.setattr(megamoe.hf, "moe", lambda *args, **kwargs: calls.append(kwargs["activation"]) or args[0])
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
        assert calls == [activation] * 2, hidden_act
        monkeypatch.undo()


def test_unsupported_experts_module_is_left_alone_with_one_warning():
    from transformers.activations import ACT2FN

    model = family_model("mixtral", moe_layers=3)
    for layer in (1, 2):  # exact GELU: no megamoe activation
        model.model.layers[layer].mlp.experts.act_fn = ACT2FN["gelu"]
    patched = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        megamoe.patch_hf_model(patched, backend="grouped")
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "model.layers.1.mlp.experts, model.layers.2.mlp.experts: activation GELUActivation" in message
    assert "layers.0" not in message
    served, refused = megamoe.hf.experts_modules(patched)
    assert [name for name, _, _ in served] == ["model.layers.0.mlp.experts"]
    assert [name for name, _, _ in refused] == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    # The refused layers keep running transformers' implementation (eager here), the served one megamoe's.
    assert_same_step(model, patched, "mixtral", TOLERANCE[torch.float32])


def test_refused_module_of_another_registry_keeps_its_forward():
    """A refused experts class that dispatches through its own registry (as transformers' FP8 experts
    do) still finds the switched implementation's name, and runs its own forward."""
    from transformers.integrations.moe import ExpertsInterface, use_experts_implementation

    class OwnInterface(ExpertsInterface):
        _global_mapping = {}

    @use_experts_implementation(experts_interface=OwnInterface(), has_bias=True)
    class BiasedExperts(nn.Module):
        def __init__(self, config, experts):
            super().__init__()
            self.gate_up_proj, self.down_proj, self.act_fn = experts.gate_up_proj, experts.down_proj, experts.act_fn
            self.gate_up_proj_bias = nn.Parameter(0.1 * torch.randn(self.gate_up_proj.shape[:2]))
            self.down_proj_bias = nn.Parameter(0.1 * torch.randn(self.down_proj.shape[:2]))

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for k in range(top_k_index.shape[1]):
                ids = top_k_index[:, k]
                gate, up = (torch.einsum("th,tnh->tn", hidden_states, self.gate_up_proj[ids])
                            + self.gate_up_proj_bias[ids]).chunk(2, dim=-1)
                y = torch.einsum("ti,thi->th", self.act_fn(gate) * up, self.down_proj[ids]) + self.down_proj_bias[ids]
                out = out + top_k_weights[:, k, None] * y
            return out

    model = family_model("mixtral")
    mlp = model.model.layers[1].mlp
    mlp.experts = BiasedExperts(model.config, mlp.experts)
    patched = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"model\.layers\.1\.mlp\.experts: has_bias=True"):
        megamoe.patch_hf_model(patched, backend="grouped")
    assert_same_step(model, patched, "mixtral", TOLERANCE[torch.float32])


def test_experts_found_by_the_decorator_flags_not_the_class():
    from transformers.integrations.moe import use_experts_implementation

    class Experts(nn.Module):  # e.g. a custom model's experts, layout as transformers' standard one
        def __init__(self, config):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 2 * 16, 8))
            self.down_proj = nn.Parameter(torch.zeros(4, 8, 16))
            self.act_fn = nn.SiLU()

    config = transformers.PretrainedConfig()
    standard = use_experts_implementation(Experts)(config)
    biased = use_experts_implementation(has_bias=True)(type("BiasedExperts", (Experts,), {}))(config)
    ungated = use_experts_implementation(has_gate=False)(type("UpExperts", (Experts,), {}))(config)
    skewed = use_experts_implementation(type("SkewedExperts", (Experts,), {}))(config)
    skewed.down_proj = nn.Parameter(torch.zeros(4, 8, 32))
    model = nn.ModuleDict(dict(standard=standard, biased=biased, ungated=ungated, skewed=skewed, plain=nn.Linear(2, 2)))
    served, refused = megamoe.hf.experts_modules(model)
    assert [(name, activation) for name, _, activation in served] == [("standard", "swiglu")]
    assert {name: reason for name, _, reason in refused} == {
        "biased": "has_bias=True (megamoe needs has_bias=False)",
        "ungated": "has_gate=False (megamoe needs has_gate=True)",
        "skewed": "gate_up_proj (4, 32, 8) and down_proj (4, 8, 32) are not [E, 2I, H] and [E, H, I]"}


def test_a_gate_of_its_own_is_served_where_it_computes_act_gate_times_up():
    """An experts module's own _apply_gate is served where it computes act_fn(gate) * up (here in fp32,
    as BEAM's does), or SwiGLU clamped at the module's `limit` / `swiglu_limit` (DeepSeek-V4, HY-V4),
    and refused where it clamps or caps otherwise, however far out; an act_fn that is torch's function
    itself (LFM2-MoE's F.silu) maps as ACT2FN's module does."""
    from transformers.integrations.moe import use_experts_implementation

    class Experts(nn.Module):
        def __init__(self, config, act_fn=None):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 2 * 16, 8))
            self.down_proj = nn.Parameter(torch.zeros(4, 8, 16))
            self.act_fn = act_fn or nn.SiLU()

    def gate_of_its_own(name, gate, **attributes):
        def apply_gate(self, gate_up):
            g, u = gate_up.chunk(2, dim=-1)
            return gate(self, g, u)
        experts = use_experts_implementation(type(name, (Experts,), {"_apply_gate": apply_gate}))(config)
        for attribute, value in attributes.items():
            setattr(experts, attribute, value)
        return experts

    def swiglu_clamped(limit):
        return lambda self, g, u: self.act_fn(g.clamp(max=limit)) * u.clamp(min=-limit, max=limit)

    config = transformers.PretrainedConfig()
    model = nn.ModuleDict(dict(
        upcast=gate_of_its_own("Upcast", lambda self, g, u: (self.act_fn(g.float()) * u.float()).to(g.dtype)),
        functional=use_experts_implementation(Experts)(config, F.silu),
        limited=gate_of_its_own("Limited", swiglu_clamped(7.5), limit=7.5),
        swiglu_limited=gate_of_its_own("SwigluLimited", swiglu_clamped(0.02), swiglu_limit=0.02),
        clamped=gate_of_its_own("Clamped", lambda self, g, u: self.act_fn(g.clamp(max=1000.0)) * u),
        limited_elsewhere=gate_of_its_own("LimitedElsewhere", swiglu_clamped(15.0), limit=7.5),
        clamped_after=gate_of_its_own(
            "ClampedAfter", lambda self, g, u: self.act_fn(g).clamp(max=7.5) * u.clamp(min=-7.5, max=7.5), limit=7.5),
        capped=gate_of_its_own("Capped", lambda self, g, u: self.act_fn(g) * 5000.0 * torch.tanh(u / 5000.0)),
        other=gate_of_its_own("Other", lambda self, g, u: self.act_fn(u) * g)))
    served, refused = megamoe.hf.experts_modules(model)
    assert [(name, activation) for name, _, activation in served] == [
        ("upcast", "swiglu"), ("functional", "swiglu"), ("limited", swiglu_with_limit(7.5)),
        ("swiglu_limited", swiglu_with_limit(0.02))]
    assert {name: reason for name, _, reason in refused} == {
        name: f"a gate of its own ({cls}._apply_gate), not act(gate) * up nor SwiGLU clamped at its limit"
        for name, cls in (("clamped", "Clamped"), ("limited_elsewhere", "LimitedElsewhere"),
                          ("clamped_after", "ClampedAfter"), ("capped", "Capped"), ("other", "Other"))}


def test_patch_runs_the_megamoe_backend(monkeypatch):
    model = megamoe.patch_hf_model(tiny_model(), backend="naive")
    calls = []
    monkeypatch.setattr(megamoe.hf, "moe", lambda *args, **kwargs: calls.append(kwargs) or args[0] * 0)
    model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    want = {"backend": "naive", "precision": "bf16", "recompute": False, "activation": "swiglu", "group": None}
    assert calls == [want] * 2  # one per MoE layer


def test_patch_with_recompute_asks_the_fused_op_for_it(monkeypatch):
    model = megamoe.patch_hf_model(tiny_model(), backend="fused", recompute=True)
    assert model.config._experts_implementation == "megamoe_fused_bf16_recompute"
    calls = []
    monkeypatch.setattr(megamoe.hf, "moe", lambda *args, **kwargs: calls.append(kwargs) or args[0] * 0)
    model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    assert calls == [{"backend": "fused", "precision": "bf16", "recompute": True, "activation": "swiglu",
                      "group": None}] * 2
    with pytest.raises(ValueError, match="recompute=True needs backend='fused'"):
        megamoe.patch_hf_model(model, backend="grouped", recompute=True)
    assert megamoe.patch_hf_model(model, backend="fused", recompute="gather").config._experts_implementation == \
        "megamoe_fused_bf16_recompute_gather"


def test_patch_can_switch_backend():
    model = megamoe.patch_hf_model(tiny_model(), backend="naive")
    megamoe.patch_hf_model(model, backend="grouped")
    assert model.config._experts_implementation == "megamoe_grouped_bf16"


def test_fused_patch_on_the_cpu_raises_megamoe_error():
    model = megamoe.patch_hf_model(tiny_model(torch.bfloat16), backend="fused")
    with pytest.raises((NotImplementedError, ValueError), match="fused"):
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))


def test_unknown_model_raises():
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(TypeError, match="Qwen2/3-MoE.*LlamaForCausalLM has none; it has no experts module"):
        megamoe.patch_hf_model(llama, backend="naive")


def test_unexpected_layout_warns_and_is_left_alone():
    model = tiny_model()
    model.model.layers[1].mlp.experts.is_transposed = True
    with pytest.warns(UserWarning, match=r"left 1 experts module.*\n  model\.layers\.1\.mlp\.experts: "
                                         r"is_transposed=True \(megamoe needs is_transposed=False\)"):
        megamoe.patch_hf_model(model, backend="naive")
    assert "_megamoe_activation" in vars(model.model.layers[0].mlp.experts)
    assert "_megamoe_activation" not in vars(model.model.layers[1].mlp.experts)


def test_model_with_nothing_to_serve_raises():
    with pytest.raises(TypeError, match=r"Qwen3MoeForCausalLM has none; model\.layers\.0\.mlp\.experts: activation "
                                        r"GELUActivation \(hidden_act='gelu'\)"):
        megamoe.patch_hf_model(transformers.Qwen3MoeForCausalLM(tiny_config(hidden_act="gelu")), backend="naive")
    gpt_oss = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=2))
    with pytest.raises(TypeError, match=r"GptOssForCausalLM has none; model\.layers\.0\.mlp\.experts: "
                                        "is_concatenated=False"):
        megamoe.patch_hf_model(gpt_oss, backend="naive")


def test_qwen3_moe_experts():
    model = tiny_model()
    assert megamoe.hf.qwen3_moe_experts(model) == [layer.mlp.experts for layer in model.model.layers]
    model.model.layers[1].mlp.experts.is_transposed = True
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts: is_transposed=True"):
        megamoe.hf.qwen3_moe_experts(model)
    with pytest.raises(TypeError, match="MixtralForCausalLM has no Qwen3MoeExperts"):
        megamoe.hf.qwen3_moe_experts(family_model("mixtral"))


def test_bad_backend_or_precision_raises():
    with pytest.raises(ValueError, match="backend"):
        megamoe.patch_hf_model(tiny_model(), backend="fast")
    with pytest.raises(ValueError, match="precision"):
        megamoe.patch_hf_model(tiny_model(), backend="naive", precision="fp4")
