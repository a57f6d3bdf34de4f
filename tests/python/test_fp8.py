import pytest
import torch

from megamoe import fp8
from megamoe.gemm import grouped_gemm_fp8
from megamoe.reference import relative_error
from megamoe.routing import build_routing
from megamoe.shapes import make_routing

from conftest import requires_cuda


def test_row_quantization_keeps_e4m3_precision_per_128_values():
    a = torch.randn(256, 512) * torch.logspace(-3, 3, 256).unsqueeze(1)  # rows of very different magnitude
    q, scales = fp8.quantize_rows(a)
    assert q.dtype == torch.float8_e4m3fn and q.shape == a.shape
    assert scales.shape == (4, 256) and scales.is_contiguous()  # k-block major
    back = fp8.dequantize_rows(q, scales)
    assert relative_error(back, a) < 0.04  # e4m3 keeps 3 mantissa bits: <= 2^-4 per value
    # Each block's largest magnitude lands on e4m3's largest finite value.
    blocks = (a.view(256, 4, 128).abs().amax(dim=2) / scales.t())
    torch.testing.assert_close(blocks, torch.full_like(blocks, fp8.E4M3_MAX))


def test_block_quantization_scales_every_128_by_128_block():
    b = torch.randn(3, 256, 384)
    b[1, :128, 128:256] *= 1e4
    q, scales = fp8.quantize_blocks(b)
    assert scales.shape == (3, 2, 3)
    assert scales[1, 0, 1] > 1e3 * scales[1, 1, 1]
    assert relative_error(fp8.dequantize_blocks(q, scales), b) < 0.04


def test_an_all_zero_block_quantizes_to_zero_with_scale_one():
    q, scales = fp8.quantize_rows(torch.zeros(2, 128))
    assert torch.equal(scales, torch.ones(1, 2)) and not q.float().any()


def test_k_that_is_not_a_multiple_of_128_is_refused():
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8.quantize_rows(torch.zeros(4, 96))
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8.quantize_blocks(torch.zeros(1, 128, 200))


@requires_cuda
def test_grouped_gemm_fp8_matches_the_dequantized_product():
    ids, _ = make_routing(700, 8, 2, "skewed", generator=torch.Generator().manual_seed(1))
    plan = build_routing(ids.cuda(), 8)
    rows, n, k = plan.slot_to_route.numel(), 256, 384
    a = torch.randn(rows, k, device="cuda")
    b = torch.randn(8, n, k, device="cuda") / k**0.5
    (aq, a_scales), (bq, b_scales) = fp8.quantize_rows(a), fp8.quantize_blocks(b)
    c = grouped_gemm_fp8(aq, a_scales, bq, b_scales, plan)
    a_deq, b_deq = fp8.dequantize_rows(aq, a_scales), fp8.dequantize_blocks(bq, b_scales)
    live = int(plan.expert_offsets[-1])
    want = torch.cat([a_deq[128 * i:128 * (i + 1)] @ b_deq[e].t()
                      for i, e in enumerate(plan.block_expert[:live // 128].tolist())])
    real = plan.slot_to_route[:live] >= 0
    assert relative_error(c[:live][real].float(), want[real]) < 1e-2
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        grouped_gemm_fp8(a.bfloat16(), a_scales, bq, b_scales, plan)
