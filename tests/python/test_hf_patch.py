"""patch_hf_model against transformers' own, unpatched Qwen3-MoE: same logits, loss and gradients."""

import copy

import pytest
import torch

import megamoe
from megamoe.reference import relative_error

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


def test_patch_runs_the_megamoe_backend(monkeypatch):
    model = megamoe.patch_hf_model(tiny_model(), backend="naive")
    calls = []
    monkeypatch.setattr(megamoe.hf, "moe", lambda *args, **kwargs: calls.append(kwargs) or args[0] * 0)
    model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    assert calls == [{"backend": "naive", "precision": "bf16", "recompute": False}] * 2  # one per MoE layer


def test_patch_with_recompute_asks_the_fused_op_for_it(monkeypatch):
    model = megamoe.patch_hf_model(tiny_model(), backend="fused", recompute=True)
    assert model.config._experts_implementation == "megamoe_fused_bf16_recompute"
    calls = []
    monkeypatch.setattr(megamoe.hf, "moe", lambda *args, **kwargs: calls.append(kwargs) or args[0] * 0)
    model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    assert calls == [{"backend": "fused", "precision": "bf16", "recompute": True}] * 2
    with pytest.raises(ValueError, match="recompute=True needs backend='fused'"):
        megamoe.patch_hf_model(model, backend="grouped", recompute=True)


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
    with pytest.raises(TypeError, match="Qwen3-MoE.*LlamaForCausalLM"):
        megamoe.patch_hf_model(llama, backend="naive")


def test_unexpected_layout_raises():
    model = tiny_model()
    model.model.layers[1].mlp.experts.is_transposed = True
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts.*is_transposed"):
        megamoe.patch_hf_model(model, backend="naive")
    with pytest.raises(ValueError, match="SwiGLU"):
        megamoe.patch_hf_model(transformers.Qwen3MoeForCausalLM(tiny_config(hidden_act="gelu")), backend="naive")


def test_bad_backend_or_precision_raises():
    with pytest.raises(ValueError, match="backend"):
        megamoe.patch_hf_model(tiny_model(), backend="fast")
    with pytest.raises(ValueError, match="precision"):
        megamoe.patch_hf_model(tiny_model(), backend="naive", precision="fp4")
