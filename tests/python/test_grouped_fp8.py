"""`grouped-fp8`, the TorchTitan-style FP8 baseline of the benchmark: against the fp64 reference (on an
sm_90 GPU with torch._scaled_grouped_mm, on the CPU with an emulation of that op), and the benchmark's
refusals where it cannot run."""

import pytest
import torch

from megamoe.backends import grouped_fp8
from megamoe.bench import backends as bench_backends
from megamoe.reference import reference_moe, relative_error
from megamoe.shapes import PRESETS

from conftest import HAS_CUDA
from test_backends import CASES, SMALL, edge_case_inputs, leaf

# e4m3 keeps 3 mantissa bits: each operand value is off by up to 2^-4 relative after rowwise scaling,
# and the forward's two FP8 GEMMs (and the backward's FP8 dA GEMMs, which every gradient but the
# output's goes through) compound that. With the emulation below the worst error over these cases and
# six seeds is 0.078 (0.055-0.07 typically), so 0.1 holds the quantisation error while a wrong scale,
# layout or group (errors of order 1) fails.
TOLERANCE = 0.1

IS_SM90 = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)


def emulated_scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
    """torch._scaled_grouped_mm (2D x 3D, rowwise scales) in fp32 on the CPU. Its meta function runs
    first, on tensors of the same sizes and strides, so the layout and scale checks of the real op apply."""
    def meta(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    torch._scaled_grouped_mm(meta(mat_a), meta(mat_b), meta(scale_a), meta(scale_b), offs=meta(offs),
                             out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    a = mat_a.float() * scale_a[:, None]
    b = mat_b.float() * scale_b[:, None, :]
    out = torch.zeros(a.shape[0], b.shape[2])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ b[e]
        start = end
    return out.to(out_dtype)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not IS_SM90, reason="needs an sm_90 GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [c for c in CASES if c != "t0"])
def test_forward_and_gradients_match_the_reference_within_fp8_error(case, device, monkeypatch):
    if device == "cpu":
        monkeypatch.setattr(grouped_fp8, "_scaled_grouped_mm", emulated_scaled_grouped_mm)
    x, ids, weights, w13, w2 = edge_case_inputs(case, SMALL, device)
    inputs = [leaf(t) for t in (x, weights, w13, w2)]
    ref_inputs = [leaf(t, torch.float64) for t in (x, weights, w13, w2)]
    y = grouped_fp8.grouped_fp8_moe(inputs[0], ids, *inputs[1:])
    ref = reference_moe(ref_inputs[0], ids, *ref_inputs[1:])
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert relative_error(y, ref) < TOLERANCE
    dy = torch.randn_like(ref)
    y.backward(dy.to(y.dtype))
    ref.backward(dy)
    for name, got, want in zip(("dx", "dtopk_weights", "dw13", "dw2"), inputs, ref_inputs):
        if want.grad.abs().max() == 0:  # experts no token reaches
            assert got.grad.abs().max() == 0, name
            continue
        if name == "dtopk_weights" and case == "t1":
            continue  # two dot products, which may cancel (as in test_backends)
        assert relative_error(got.grad, want.grad) < TOLERANCE, name


def test_rowwise_quantisation_uses_power_of_two_scales_and_keeps_e4m3_precision():
    a = torch.randn(64, 256) * torch.logspace(-3, 3, 64)[:, None]
    a[3] = 0
    q, scales = grouped_fp8.quantize_rowwise(a)
    assert q.dtype == torch.float8_e4m3fn and q.is_contiguous() and scales.shape == (64,)
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)  # powers of two
    assert scales[3] == 1 and not q[3].float().any()
    # Power-of-two scales: a row's amax lands in [224, 448].
    assert (q.float().abs().amax(dim=1)[a.abs().amax(dim=1) > 0] >= grouped_fp8.E4M3_MAX / 2).all()
    assert relative_error(q.float() * scales[:, None], a) < 0.04


def test_groups_are_aligned_to_16_rows(monkeypatch):
    seen = []

    def record(mat_a, mat_b, scale_a, scale_b, offs=None, **kwargs):
        seen.append(offs.clone())
        return emulated_scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=offs, **kwargs)

    monkeypatch.setattr(grouped_fp8, "_scaled_grouped_mm", record)
    x, ids, weights, w13, w2 = edge_case_inputs("skewed", SMALL, "cpu")
    grouped_fp8.grouped_fp8_moe(x, ids, weights, w13, w2)
    assert seen and all((offs[:-1] % grouped_fp8.ALIGN_M == 0).all() for offs in seen)


def test_inputs_it_cannot_take_are_refused():
    x, ids, weights, w13, w2 = edge_case_inputs("balanced", SMALL, "cpu")
    with pytest.raises(TypeError, match="bf16"):
        grouped_fp8.grouped_fp8_moe(x.float(), ids, weights, w13.float(), w2.float())
    with pytest.raises(ValueError, match="divisible by 16"):
        grouped_fp8.grouped_fp8_moe(x[:, :200].contiguous(), ids, weights, w13[:, :, :200].contiguous(),
                                    w2[:, :200].contiguous())


def test_the_benchmark_runs_it_only_at_fp8():
    with pytest.raises(bench_backends.Unavailable, match=r"--precision fp8"):
        bench_backends.build("grouped-fp8", PRESETS["tiny"], "bf16")


@pytest.mark.skipif(IS_SM90, reason="checks the refusal off an sm_90 GPU")
def test_the_benchmark_refuses_it_off_an_sm90_gpu():
    with pytest.raises(bench_backends.Unavailable, match="sm_90"):
        bench_backends.build("grouped-fp8", PRESETS["tiny"], "fp8")
    with pytest.raises(bench_backends.Unavailable, match="sm_90"):
        bench_backends.build("grouped-fp8", PRESETS["tiny"], "fp8", device=torch.device("cpu"))
