import contextlib

import pytest
import torch

from megamoe import fp8
from megamoe.exchange import dispatch, dispatch_fp8
from megamoe.gemm import gated_backward_fp8, grouped_gemm_fp8, transpose_quantize, weight_grad_fp8
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


@requires_cuda
# An odd number of 128-column blocks (128, 384: a half lane group), one, several and a partial pass of 2048 columns.
@pytest.mark.parametrize("hidden", [128, 384, 256, 2048, 4096, 7168])
def test_the_fp8_dispatch_equals_quantising_then_dispatching(hidden):
    """One pass (megamoe_dispatch_fp8) gives the bytes of the row quantisation followed by the
    dispatch of the e4m3 rows and of their scales, padding rows (zeros, scale 0) included; a NaN
    keeps its whole 1 x 128 block non-finite, as the row kernel does. With the routes' weights it
    also gives each pool row's weight, as the bf16 dispatch does (0 on padding rows); asked for the
    token rows, the row quantisation's bytes too, and the pool the same."""
    tokens, experts = 300, 8
    ids, weights = make_routing(tokens, experts, 2, "skewed", generator=torch.Generator().manual_seed(3))
    ids[5, 1] = -1  # a masked route
    plan = build_routing(ids.cuda(), experts)
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    x[7] = 0  # an all-zero row: scale 1
    x[9, hidden - 3] = float("nan")
    pool, scales = dispatch_fp8(plan, x)
    q, token_scales = fp8.quantize_rows(x, token_major=True)
    want = dispatch(plan, q)
    want_scales = dispatch(plan, token_scales)[:, :hidden // fp8.BLOCK].t()
    live = int(plan.num_blocks) * 128
    assert torch.equal(pool[:live].view(torch.uint8), want[:live].view(torch.uint8))
    assert torch.equal(scales[:, :live].view(torch.int32), want_scales[:, :live].contiguous().view(torch.int32))
    pool_w, scales_w, p = dispatch_fp8(plan, x, weights.cuda())
    _, want_p = dispatch(plan, x, weights.cuda())
    assert torch.equal(pool_w[:live].view(torch.uint8), pool[:live].view(torch.uint8))
    assert torch.equal(scales_w[:, :live].view(torch.int32), scales[:, :live].view(torch.int32))
    assert torch.equal(p[:live], want_p[:live]) and (p[:live][plan.slot_to_route[:live] < 0] == 0).all()
    pool_r, scales_r, p_r, rows, row_scales = dispatch_fp8(plan, x, weights.cuda(), token_rows=True)
    q_rows, q_row_scales = fp8.quantize_rows(x)
    assert torch.equal(rows.view(torch.uint8), q_rows.view(torch.uint8))
    assert torch.equal(row_scales.view(torch.int32), q_row_scales.view(torch.int32))
    assert torch.equal(pool_r[:live].view(torch.uint8), pool[:live].view(torch.uint8))
    assert torch.equal(scales_r[:, :live].view(torch.int32), scales[:, :live].view(torch.int32))
    assert torch.equal(p_r[:live], p[:live])
    slot = int(plan.route_to_slot[9, 0])
    assert scales[-1, slot].isnan()
    if hidden > fp8.BLOCK:  # the NaN's block only: the row's first block is another one
        assert scales[0, slot].isfinite()


@requires_cuda
# BLOCK_N 256 (two 128-column blocks of dg and of du per tile), 128 (I = 384: one each), two tiles.
@pytest.mark.parametrize("inter", [256, 384, 512])
def test_dh_stores_dz_and_hp_in_e4m3_as_the_quantisations_would(inter):
    """The FP8 dh epilogue's e4m3 outputs are the bytes the quantisation ops make of its bf16 dz and hp:
    dz's rows as fp8.quantize_rows makes them, dz transposed as transpose_quantize makes it along the
    rows and hp transposed as it makes it in 128 x 128 blocks; padding rows (zeros, scale 1) and a
    token whose dy holds a NaN (non-finite dz blocks) included."""
    tokens, experts, hidden = 300, 8, 256
    ids, weights = make_routing(tokens, experts, 2, "skewed", generator=torch.Generator().manual_seed(5))
    plan = build_routing(ids.cuda(), experts)
    dy = torch.randn(tokens, hidden, device="cuda").bfloat16()
    dy[3, 5] = float("nan")
    _, p_pool = dispatch(plan, dy, weights.cuda())
    w2 = (torch.randn(experts, hidden, inter, device="cuda") / inter**0.5).bfloat16()
    w2t, w2t_scales = fp8.transposed_weight(w2)
    z = (torch.randn(plan.num_routes, 2 * inter, device="cuda") * 3).bfloat16()  # compact, as GEMM1 keeps it
    out = gated_backward_fp8(*dispatch_fp8(plan, dy), w2t, w2t_scales, z, p_pool, plan, bf16=True)
    live = int(plan.num_blocks) * 128
    nan_row = int(plan.route_to_slot[3, 0])

    # The live pool blocks of each output: (values, scales) of dz's rows, dz transposed, hp transposed.
    blocks = live // 128
    live_parts = {"dz_rows": (lambda v: v[:live], lambda s: s[:, :live]),
                  "dz_t": (lambda v: v[:, :live], lambda s: s[:blocks]),
                  "hp_t": (lambda v: v[:, :live], lambda s: s[:, :blocks])}

    def assert_bytes_equal(name, got, want):
        values, scales = live_parts[name]
        assert torch.equal(values(got[0]).view(torch.uint8), values(want[0]).view(torch.uint8))
        assert torch.equal(scales(got[1]).view(torch.int32), scales(want[1]).view(torch.int32))

    assert_bytes_equal("dz_rows", out.dz_rows, fp8.quantize_rows(out.dz))
    assert_bytes_equal("dz_t", out.dz_t, transpose_quantize(out.dz, plan, in_blocks=False))
    assert_bytes_equal("hp_t", out.hp_t, transpose_quantize(out.hp, plan, in_blocks=True))
    assert out.dz_rows[1][:, nan_row].isnan().any()
    assert out.dz_t[1][nan_row // 128].isnan().any()
    # Without the bf16 dz and hp (what the layer runs): the same e4m3 bytes.
    alone = gated_backward_fp8(*dispatch_fp8(plan, dy), w2t, w2t_scales, z, p_pool, plan)
    assert alone.dz is None and alone.hp is None
    for name in live_parts:
        assert_bytes_equal(name, getattr(alone, name), getattr(out, name))


# (tokens, columns): a few tiles, and enough that each CTA of the persistent pass takes several in turn.
TRANSPOSE_SIZES = [(700, 384), (16384, 1024)]


@requires_cuda
@pytest.mark.parametrize("in_blocks", [False, True])
@pytest.mark.parametrize("num_tokens, cols", TRANSPOSE_SIZES)
def test_the_transposed_quantisation_equals_quantising_the_transpose(in_blocks, num_tokens, cols):
    """The FP8 weight gradients' operands: the live pool rows transposed, then one scale per column and
    128 rows (the row quantisation of the transpose) or per 128 x 128 block (the weights' recipe)."""
    ids, _ = make_routing(num_tokens, 8, 2, "skewed", generator=torch.Generator().manual_seed(4))
    plan = build_routing(ids.cuda(), 8)
    pool = torch.randn(plan.slot_to_route.numel(), cols, device="cuda").bfloat16()
    pool[5, 7] = float("nan")
    q_t, scales = transpose_quantize(pool, plan, in_blocks)
    live = int(plan.num_blocks) * 128
    transposed = pool[:live].t().contiguous()
    if in_blocks:
        want, want_scales = fp8.quantize_blocks(transposed.unsqueeze(0))
        got_scales = scales[:, :live // 128]
        want, want_scales = want[0], want_scales[0]
    else:
        want, want_scales = fp8.quantize_rows(transposed)
        got_scales = scales[:live // 128]
    assert torch.equal(q_t[:, :live].view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got_scales.view(torch.int32), want_scales.view(torch.int32))


@requires_cuda
@pytest.mark.parametrize("in_blocks", [False, True])
@pytest.mark.parametrize("num_tokens, cols", TRANSPOSE_SIZES)
def test_the_transposed_quantisation_gathers_token_rows_as_the_dispatch_does(in_blocks, num_tokens, cols):
    """From token rows, the bytes it makes of the dispatched pool, padding rows included."""
    ids, _ = make_routing(num_tokens, 8, 2, "skewed", generator=torch.Generator().manual_seed(6))
    ids[3, 1] = -1
    plan = build_routing(ids.cuda(), 8)
    rows = torch.randn(num_tokens, cols, device="cuda").bfloat16()
    live = int(plan.num_blocks) * 128
    got = transpose_quantize(rows, plan, in_blocks, tokens=True)
    want = transpose_quantize(dispatch(plan, rows), plan, in_blocks)
    assert torch.equal(got[0][:, :live].view(torch.uint8), want[0][:, :live].view(torch.uint8))
    live_scales = (slice(None), slice(0, live // 128)) if in_blocks else (slice(0, live // 128),)
    assert torch.equal(got[1][live_scales], want[1][live_scales])


@requires_cuda
@pytest.mark.parametrize("in_blocks", [False, True])
@pytest.mark.parametrize("tokens", [False, True])
@pytest.mark.parametrize("num_tokens, cols", TRANSPOSE_SIZES)
def test_the_transposed_quantisation_of_e4m3_rows_dequantises_them_first(in_blocks, tokens, num_tokens, cols):
    """From e4m3 rows with their 1 x 128 scales (dz as dh quantised it for dx): the bytes it makes of
    those rows dequantised to bf16; a NaN block stays non-finite."""
    ids, _ = make_routing(num_tokens, 8, 2, "skewed", generator=torch.Generator().manual_seed(7))
    ids[3, 1] = -1
    plan = build_routing(ids.cuda(), 8)
    source_rows = num_tokens if tokens else plan.slot_to_route.numel()
    rows = (torch.randn(source_rows, cols, device="cuda") * 5).bfloat16()
    rows[5, 130] = float("nan")
    q, q_scales = fp8.quantize_rows(rows)
    got = transpose_quantize(q, plan, in_blocks, tokens=tokens, src_scales=q_scales)
    want = transpose_quantize(fp8.dequantize_rows(q, q_scales, torch.bfloat16), plan, in_blocks, tokens=tokens)
    live = int(plan.num_blocks) * 128
    assert torch.equal(got[0][:, :live].view(torch.uint8), want[0][:, :live].view(torch.uint8))
    live_scales = (slice(None), slice(0, live // 128)) if in_blocks else (slice(0, live // 128),)
    assert torch.equal(got[1][live_scales].view(torch.int32), want[1][live_scales].view(torch.int32))
    assert got[1][live_scales].isnan().any()  # row 5 (pool row, or token 5's routes) holds the NaN


@requires_cuda
@pytest.mark.parametrize("m, n", [(256, 384), (384, 256)])  # 256- and 128-wide tiles
def test_fp8_weight_gradients_match_the_dequantised_product(m, n):
    """out[e] = a[rows of e]ᵀ · b[rows of e] from the transposed FP8 operands, against fp64 on what
    they dequantise to: the kernel adds no error beyond its fp32 sums; fp32 out adds to main_grad;
    an expert without rows (3) gets zeros between experts with rows."""
    experts = 8
    ids, _ = make_routing(700, experts, 2, "skewed", generator=torch.Generator().manual_seed(5))
    ids[ids == 3] = -1
    plan = build_routing(ids.cuda(), experts)
    rows = plan.slot_to_route.numel()
    real = (plan.slot_to_route >= 0).unsqueeze(1)
    a = torch.where(real, torch.randn(rows, m, device="cuda"), 0).bfloat16()
    b = torch.where(real, torch.randn(rows, n, device="cuda"), 0).bfloat16()
    out = torch.full((experts, m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    weight_grad_fp8(a, b, plan, out)
    main_grad = torch.ones(experts, m, n, device="cuda")
    weight_grad_fp8(a, b, plan, main_grad)
    a_t, a_scales = transpose_quantize(a, plan, in_blocks=False)
    b_t, b_scales = transpose_quantize(b, plan, in_blocks=True)
    live = int(plan.num_blocks) * 128
    a_deq = fp8.dequantize_rows(a_t[:, :live].contiguous(), a_scales[:live // 128].contiguous()).double()
    b_deq = fp8.dequantize_blocks(b_t[:, :live].unsqueeze(0).contiguous(),
                                  b_scales[:, :live // 128].unsqueeze(0).contiguous()).double()[0]
    offsets = plan.expert_offsets.tolist()
    assert offsets[3] == offsets[4] and offsets[2] < offsets[3]
    for e in range(experts):
        begin, end = offsets[e], offsets[e + 1]
        want = a_deq[:, begin:end] @ b_deq[:, begin:end].t()
        if end == begin:
            assert torch.all(out[e] == 0) and torch.all(main_grad[e] == 1)
            continue
        assert relative_error(out[e].double(), want) < 1e-2, e
        assert relative_error(main_grad[e].double() - 1, want) < 1e-3, e  # FP8 wgmma sums, fp32 promotion


# --- The weight-quantisation cache ---------------------------------------------------------------

@pytest.fixture
def empty_cache():
    fp8.clear_weight_cache()
    yield
    fp8.clear_weight_cache()


def test_a_weight_is_quantised_once_and_reused_until_it_changes(empty_cache):
    w = torch.randn(2, 256, 384)
    first = fp8.quantized_weight(w)
    q, scales = fp8.quantize_blocks(w)
    assert torch.equal(first.q.float(), q.float()) and torch.equal(first.scales, scales)
    again = fp8.quantized_weight(w)
    assert again is first and again.q is first.q and again.scales is first.scales
    assert again.transposed() is first.transposed()  # the backward's copy is made once, too


def test_an_in_place_update_invalidates_the_copy(empty_cache):
    w = torch.randn(2, 128, 256)
    before = fp8.quantized_weight(w)
    before.transposed()
    w.add_(1)  # what optimizer.step() does: in place, bumping w._version
    after = fp8.quantized_weight(w)
    assert after is not before
    assert torch.equal(after.q.float(), fp8.quantize_blocks(w)[0].float())
    assert after._transposed is None  # made again only when asked
    with torch.no_grad():  # an update under no_grad (as optimizers do) bumps the version as well
        w.mul_(0.5)
    assert fp8.quantized_weight(w) is not after


@pytest.mark.parametrize("optimizer", [
    lambda w: torch.optim.SGD([w], lr=0.1),
    lambda w: torch.optim.AdamW([w], lr=0.1, foreach=True),
    lambda w: torch.optim.AdamW([w], lr=0.1, fused=True),  # updates w without bumping its version
])
def test_a_parameter_updated_by_an_optimizer_gets_a_new_copy(empty_cache, optimizer):
    w = torch.nn.Parameter(torch.randn(1, 128, 128))
    before = fp8.quantized_weight(w)
    w.grad = torch.ones_like(w)
    optimizer(w).step()
    after = fp8.quantized_weight(w)
    assert after is not before
    assert torch.equal(after.q.float(), fp8.quantize_blocks(w.detach())[0].float())


def test_an_alias_of_a_weight_shares_its_copy(empty_cache):
    """What activation checkpointing hands the backward: a detached alias of the parameter (another
    tensor object on the same memory). It gets the parameter's copy, made once per version; a tensor
    with other memory, or a slice of the weight, gets its own."""
    w = torch.nn.Parameter(torch.randn(2, 128, 256))
    first = fp8.quantized_weight(w)
    alias = w.detach()
    assert fp8.quantized_weight(alias) is first and fp8.cache_bytes() == first.nbytes()
    assert fp8.quantized_weight(alias).transposed() is first.transposed()
    assert fp8.quantized_weight(w[:1]) is not first
    with torch.no_grad():
        alias.add_(1)  # the shared version counter moves for both
    after = fp8.quantized_weight(alias)
    assert after is not first and fp8.quantized_weight(w) is after
    assert torch.equal(after.q.float(), fp8.quantize_blocks(w.detach())[0].float())


def test_a_whole_view_of_a_weight_keeps_its_copy_under_the_weight(empty_cache):
    """What DTensor.to_local() hands each forward under transformers' expert parallelism: a fresh view
    of the whole local weight. The copy lives as long as the weight, not the view."""
    w = torch.nn.Parameter(torch.randn(2, 128, 256))
    view = w.view_as(w)
    first = fp8.quantized_weight(view)
    del view
    assert fp8.quantized_weight(w.view_as(w)) is first and fp8.quantized_weight(w) is first
    assert fp8.cache_bytes() == first.nbytes()
    with torch.no_grad():
        w.add_(1)  # a view shares its base's version counter
    assert fp8.quantized_weight(w.view_as(w)) is not first


def test_each_weight_has_its_own_copy_and_a_freed_weight_frees_it(empty_cache):
    a, b = torch.randn(1, 128, 128), torch.randn(1, 128, 128)
    qa, qb = fp8.quantized_weight(a), fp8.quantized_weight(b)
    assert qa is not qb and not torch.equal(qa.q.float(), qb.q.float())
    assert fp8.quantized_weight(a.clone()) is not qa  # equal values, another tensor
    per_copy = 128 * 128 + 4  # e4m3 values and one fp32 scale
    assert fp8.cache_bytes() == 2 * per_copy
    del b, qb
    assert fp8.cache_bytes() == per_copy
    fp8.clear_weight_cache()
    assert fp8.cache_bytes() == 0


def test_the_transposed_copy_is_exactly_the_quantised_transpose(empty_cache):
    w = torch.randn(3, 256, 384) * torch.logspace(-2, 2, 384)  # blocks of very different magnitude
    qt, scales_t = fp8.quantized_weight(w).transposed()
    want_q, want_scales = fp8.quantize_blocks(w.transpose(1, 2))
    assert qt.shape == (3, 384, 256) and scales_t.shape == (3, 3, 2)
    assert qt.is_contiguous() and scales_t.is_contiguous()
    assert torch.equal(qt.view(torch.uint8), want_q.view(torch.uint8))  # bit for bit
    assert torch.equal(scales_t, want_scales)


def test_a_backward_without_a_forward_copy_quantises_straight_into_the_transpose(empty_cache):
    """fp8_bwd: the backward's copy made from w itself, no forward copy held; a later forward's copy
    joins the same entry, and the backward's is not made again."""
    w = torch.randn(2, 256, 384) * torch.logspace(-2, 2, 384)
    qt, scales_t = fp8.transposed_weight(w)
    want_q, want_scales = fp8.quantize_blocks(w.transpose(1, 2))
    assert torch.equal(qt.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scales_t, want_scales)
    assert fp8.cache_bytes() == w.numel() + 4 * (2 * 3 * 2)  # one copy: a byte per value, 4 per block
    assert fp8.cache_bytes("cpu") == fp8.cache_bytes() and fp8.cache_bytes("meta") == 0
    assert fp8.transposed_weight(w)[0] is qt
    forward = fp8.quantized_weight(w)
    assert torch.equal(forward.q.view(torch.uint8), fp8.quantize_blocks(w)[0].view(torch.uint8))
    assert forward.transposed()[0] is qt and fp8.cache_bytes() == 2 * (w.numel() + 4 * 12)
    w.add_(1)
    assert fp8.transposed_weight(w)[0] is not qt and fp8.cache_bytes() == w.numel() + 4 * 12


def test_the_memory_figure_counts_both_copies(empty_cache):
    w = torch.randn(4, 256, 512)
    quantized = fp8.quantized_weight(w)
    forward = w.numel() + 4 * (4 * 2 * 4)  # one byte per value, 4 bytes per 128x128 block
    assert quantized.nbytes() == fp8.cache_bytes() == forward
    quantized.transposed()
    assert fp8.cache_bytes() == 2 * forward
    assert fp8.cache_bytes("cpu") == 2 * forward and fp8.cache_bytes("meta") == 0


@contextlib.contextmanager
def _capture(monkeypatch, read_cached=True):
    """What the cache sees while a CUDA graph is captured, inside cached_weights_in_graphs() or not
    (capture itself needs a GPU: test_backends and test_fp8_layer replay real graphs)."""
    with monkeypatch.context() as capture:
        capture.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        capture.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with fp8.cached_weights_in_graphs() if read_cached else contextlib.nullcontext():
            yield


def _captured(monkeypatch, w, read_cached=True):
    """What a capture of the FP8 layer asks of the cache: both copies of w."""
    with _capture(monkeypatch, read_cached):
        return fp8.quantized_weight(w), fp8.transposed_weight(w)


@pytest.mark.parametrize("change", ["sgd", "fused_adamw", "clear", "in_place"])
def test_copies_a_captured_graph_reads_are_quantised_again_in_place(empty_cache, monkeypatch, change):
    w = torch.nn.Parameter(torch.randn(2, 256, 384) * torch.logspace(-2, 2, 384))
    made = fp8.quantized_weight(w)
    made_t = made.transposed()
    read, read_t = _captured(monkeypatch, w)
    assert read is made and read_t is made_t and made.held_by_graph
    addresses = [t.data_ptr() for t in (made.q, made.scales, *made_t)]
    w.grad = torch.randn_like(w)
    if change == "sgd":
        torch.optim.SGD([w], lr=1.0).step()
    elif change == "fused_adamw":
        torch.optim.AdamW([w], lr=1.0, fused=True).step()  # no version bump: the step's hook refreshes
    elif change == "clear":
        with torch.no_grad():
            w.data.mul_(3)  # no version bump either
        fp8.clear_weight_cache()
    else:
        with torch.no_grad():
            w.add_(1)
        assert fp8.quantized_weight(w) is made  # the eager call finds it stale and refreshes it
    assert [t.data_ptr() for t in (made.q, made.scales, *made_t)] == addresses
    want_q, want_scales = fp8.quantize_blocks(w.detach())
    want_qt, want_scales_t = fp8.quantize_blocks(w.detach().transpose(1, 2))
    assert torch.equal(made.q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(made.scales, want_scales)
    assert torch.equal(made_t[0].view(torch.uint8), want_qt.view(torch.uint8)) and torch.equal(made_t[1], want_scales_t)
    assert fp8.quantized_weight(w) is made and fp8.cache_bytes() == made.nbytes()


def test_a_captured_backward_only_copy_is_refreshed_alone(empty_cache, monkeypatch):
    """fp8_bwd: the graph reads the transposed copy alone; refreshed, it stays the only copy."""
    w = torch.nn.Parameter(torch.randn(1, 128, 256))
    made_t = fp8.transposed_weight(w)
    with _capture(monkeypatch):
        assert fp8.transposed_weight(w) is made_t
    w.grad = torch.ones_like(w)
    torch.optim.SGD([w], lr=1.0).step()
    assert torch.equal(made_t[0].view(torch.uint8), fp8.quantize_blocks(w.detach().transpose(1, 2))[0].view(torch.uint8))
    assert fp8.cache_bytes() == w.numel() + 4 * 2


def test_a_capture_that_quantises_in_the_graph_leaves_the_entry_unheld(empty_cache, monkeypatch):
    """An fp8 capture of a weight cached by fp8_bwd (the transposed copy alone): the graph quantises the
    forward's copy itself but reads the transposed one, so the entry is held only once that is asked for."""
    w = torch.nn.Parameter(torch.randn(1, 128, 256))
    made_t = fp8.transposed_weight(w)
    with _capture(monkeypatch):
        read = fp8.quantized_weight(w)
        assert read.q is not None and read._transposed is None and not fp8._cached(w).held_by_graph
        assert fp8.transposed_weight(w) is made_t and fp8._cached(w).held_by_graph


def test_a_capture_without_a_valid_copy_quantises_in_the_graph_and_caches_nothing(empty_cache, monkeypatch):
    """A replay then quantises the weight as it is at that replay: the graph holds the quantisation."""
    w = torch.randn(1, 128, 128)
    read, read_t = _captured(monkeypatch, w)
    assert torch.equal(read.q.view(torch.uint8), fp8.quantize_blocks(w)[0].view(torch.uint8))
    assert torch.equal(read_t[0].view(torch.uint8), fp8.quantize_blocks(w.transpose(1, 2))[0].view(torch.uint8))
    assert _captured(monkeypatch, w)[0] is not read
    assert not read.held_by_graph and fp8.cache_bytes() == 0
    stale = fp8.quantized_weight(w)
    w.add_(1)
    assert _captured(monkeypatch, w)[0] is not stale and not stale.held_by_graph
    valid = fp8.quantized_weight(w)  # valid, but a capture outside cached_weights_in_graphs() ignores it
    assert _captured(monkeypatch, w, read_cached=False)[0] is not valid and not valid.held_by_graph


def test_a_captured_copy_whose_weight_changes_shape_says_to_capture_again(empty_cache, monkeypatch):
    w = torch.nn.Parameter(torch.randn(1, 128, 128))
    fp8.quantized_weight(w)
    _captured(monkeypatch, w)
    w.data = torch.randn(1, 256, 128)
    with pytest.raises(RuntimeError, match="capture the graph again"):
        fp8.quantized_weight(w)


def test_nothing_is_cached_for_fake_tensors_or_under_compile(empty_cache, monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        w = torch.empty(1, 128, 128)
        quantized = fp8.quantized_weight(w)
    assert quantized.q.shape == (1, 128, 128) and fp8.cache_bytes() == 0
    real = torch.randn(1, 128, 128)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert fp8.quantized_weight(real) is not fp8.quantized_weight(real)
    assert fp8.transposed_weight(real)[0] is not fp8.transposed_weight(real)[0]
    assert fp8.cache_bytes() == 0


@requires_cuda
def test_row_quantization_kernel_equals_the_torch_ops():
    """megamoe_quantize_rows_fp8 / _dequantize_rows_fp8 (bf16 rows on a GPU) against the torch ops that
    quantise every other tensor: the same bits, a zero block, a NaN block and an inf block included."""
    a = (torch.randn(300, 640) * torch.logspace(-3, 3, 300).unsqueeze(1)).to(torch.bfloat16)
    a[5, :128] = 0
    a[6, 200] = float("nan")
    a[7, 300] = float("inf")
    for token_major in (False, True):
        q_gpu, s_gpu = fp8.quantize_rows(a.cuda(), token_major=token_major)
        q_cpu, s_cpu = fp8.quantize_rows(a, token_major=token_major)
        assert torch.equal(q_gpu.cpu().float().nan_to_num(7.0), q_cpu.float().nan_to_num(7.0))
        blocks = a.shape[1] // fp8.BLOCK  # token-major rows have padding columns past these
        s_gpu, s_cpu = (s[:, :blocks] if token_major else s for s in (s_gpu.cpu(), s_cpu))
        assert torch.equal(s_gpu.nan_to_num(7.0), s_cpu.nan_to_num(7.0))
    q, s = fp8.quantize_rows(a)
    back = fp8.dequantize_rows(q.cuda(), s.cuda(), torch.bfloat16).cpu()
    assert torch.equal(back.nan_to_num(7.0), fp8.dequantize_rows(q, s, torch.bfloat16).nan_to_num(7.0))


@requires_cuda
def test_block_quantization_kernel_equals_the_torch_ops():
    """megamoe_quantize_blocks_fp8 (bf16 weights on a GPU) against the torch ops: the same bits and
    scales, a zero block, a NaN block and an inf block included."""
    b = (torch.randn(3, 384, 256) * torch.logspace(-3, 3, 384).view(1, 384, 1)).to(torch.bfloat16)
    b[0, :128, :128] = 0
    b[1, 200, 10] = float("nan")
    b[2, 300, 250] = float("inf")
    q_gpu, s_gpu = fp8.quantize_blocks(b.cuda())
    q_cpu, s_cpu = fp8.quantize_blocks(b)
    assert torch.equal(q_gpu.cpu().float().nan_to_num(7.0), q_cpu.float().nan_to_num(7.0))
    assert torch.equal(s_gpu.cpu().nan_to_num(7.0), s_cpu.nan_to_num(7.0))


@requires_cuda
@pytest.mark.parametrize("from_forward_copy", [True, False])
def test_the_transposed_copy_on_a_gpu_is_the_transpose_bit_for_bit(empty_cache, from_forward_copy):
    """The backward's K-major weight copies against torch's transpose of the forward's copy: made by
    megamoe_transpose_fp8 from that copy, or by megamoe_quantize_blocks_transposed_fp8 from w (a zero
    block, a NaN block and an inf block included)."""
    w = (torch.randn(3, 256, 384) * torch.logspace(-2, 2, 384)).to(torch.bfloat16).cuda()
    w[0, :128, 128:256] = 0
    w[1, 200, 10] = float("nan")
    w[2, 100, 300] = float("inf")
    if from_forward_copy:
        fp8.quantized_weight(w)
    qt, scales_t = fp8.transposed_weight(w)
    q, scales = fp8.quantize_blocks(w)
    assert torch.equal(qt.view(torch.uint8), q.transpose(1, 2).contiguous().view(torch.uint8))
    assert torch.equal(scales_t.nan_to_num(7.0), scales.transpose(1, 2).contiguous().nan_to_num(7.0))
