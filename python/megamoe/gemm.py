"""The core's persistent grouped GEMM over a routing plan's pool (csrc/kernels/grouped_gemm)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _native
from .activation import native_activation
from .routing import RoutingPlan

FP8Pair = tuple[torch.Tensor, torch.Tensor]  # e4m3 values and their fp32 scales


def _check_pool_operands(name: str, a: torch.Tensor, b: torch.Tensor, plan: RoutingPlan, dtype: torch.dtype) -> int:
    """The checks both pool GEMMs make of a [pool rows, K] and b [E_local, N, K]; returns the pool rows."""
    rows = plan.pool_rows
    if a.dtype != dtype or b.dtype != dtype:
        raise TypeError(f"{name} takes {str(dtype).removeprefix('torch.')} operands, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or a.shape[0] != rows or b.dim() != 3 or b.shape[2] != a.shape[1]:
        raise ValueError(f"a must be [{rows}, K] and b [E_local, N, K]; got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if not (a.is_cuda and b.is_cuda and a.is_contiguous() and b.is_contiguous()):
        raise ValueError(f"{name} needs contiguous CUDA tensors")
    return rows


def _output(out: torch.Tensor | None, rows: int, n: int, device: torch.device) -> torch.Tensor:
    """out checked as a pool GEMM's c [rows, N] bf16, or a new one for None."""
    c = torch.empty(rows, n, dtype=torch.bfloat16, device=device) if out is None else out
    if c.shape != (rows, n) or c.dtype != torch.bfloat16 or c.device != device or not c.is_contiguous():
        raise ValueError(f"out must be a contiguous bfloat16 [{rows}, {n}] on {device}, got {c.dtype} "
                         f"{tuple(c.shape)} on {c.device}")
    return c


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, plan: RoutingPlan, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """c [rows, N] with c[block] = a[block] · b[expert of block]ᵀ for the plan's live blocks.

    a: [max_blocks * 128, K] bf16 pool rows; b: [E_local, N, K] bf16; out: where to write c (a
    contiguous bf16 [rows, N]), or None for a new tensor. Rows past the live blocks are left unwritten.
    """
    rows = _check_pool_operands("grouped_gemm", a, b, plan, torch.bfloat16)
    num_local, n, k = b.shape
    c = _output(out, rows, n, a.device)
    _native.call("megamoe_grouped_gemm_bf16", "grouped_gemm", plan.native(),
                 _native.GemmArgs(a.data_ptr(), b.data_ptr(), c.data_ptr(), n, k), _native.stream(a.device))
    return c


def grouped_gemm_fp8(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                     plan: RoutingPlan, out: torch.Tensor | None = None) -> torch.Tensor:
    """Block-FP8 grouped_gemm: c [rows, N] bf16 (written to out, as in grouped_gemm) from e4m3 a
    [rows, K] with a_scales [K / 128, rows] and e4m3 b [E_local, N, K] with b_scales
    [E_local, N / 128, K / 128] (megamoe.fp8 makes both)."""
    rows = _check_pool_operands("grouped_gemm_fp8", a, b, plan, torch.float8_e4m3fn)
    num_local, n, k = b.shape
    for name, t, shape in (("a_scales", a_scales, (k // 128, rows)),
                           ("b_scales", b_scales, (num_local, n // 128, k // 128))):
        if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 {shape}, got {t.dtype} {tuple(t.shape)}")
    c = _output(out, rows, n, a.device)
    _native.call("megamoe_grouped_gemm_fp8", "grouped_gemm_fp8", plan.native(),
                 _native.GemmFp8Args(a.data_ptr(), a_scales.data_ptr(), b.data_ptr(), b_scales.data_ptr(),
                                     c.data_ptr(), n, k), _native.stream(a.device))
    return c


# The pool GEMMs of the fused layer, shared by its single-rank op (fused.py) and expert parallelism.
# Their callers validate the layer's inputs; the C API checks every argument.

def _check_token_rows(what: str, rows: torch.Tensor, plan: RoutingPlan, width: int) -> None:
    """An operand a GEMM's producer reads by route from its token rows instead of a pool must be those
    rows, [T, width] and contiguous."""
    if tuple(rows.shape) != (plan.shape.num_tokens, width) or not rows.is_contiguous():
        raise ValueError(f"{what} reads the token rows [T={plan.shape.num_tokens}, {width}] contiguous, got "
                         f"{tuple(rows.shape)} with strides {rows.stride()}")


def empty_z(plan: RoutingPlan, w13: torch.Tensor) -> torch.Tensor:
    """z [T·K, 2I] bf16 for GEMM1 to write: compact, one row per route of the plan's local experts
    without the pool's padding rows (megamoe.h), so the backward keeps T·K rows of it."""
    return torch.empty(plan.num_routes, w13.shape[1], dtype=torch.bfloat16, device=w13.device)


def gated_gemm(a: torch.Tensor, w13: torch.Tensor, plan: RoutingPlan, activation: str = "swiglu",
               z: torch.Tensor | None = None, gather: bool = False) -> torch.Tensor:
    """h [pool rows, I] = act(gate) · up of a[block] · w13[e]ᵀ (gate | up rows of w13 [E_local, 2I, H]);
    with z (empty_z), the gate | up pre-activations are written there too (the backward's z). a is the
    plan's pool of x, or with gather the token rows x [T, H] themselves, which GEMM1 then reads by route
    (the same h and z, no pool)."""
    act = native_activation(activation)
    num_local, two_i, hidden = w13.shape
    if gather:
        _check_token_rows("gather", a, plan, hidden)
    h = a.new_empty(plan.pool_rows if gather else a.shape[0], two_i // 2)
    _native.call("megamoe_grouped_gemm_gated_bf16", f"GEMM1 with {activation}", plan.native(),
                 _native.GatedGemmArgs(a.data_ptr(), w13.data_ptr(), h.data_ptr(), _native.address(z),
                                       two_i // 2, hidden, *act, int(gather)), _native.stream(a.device))
    return h


def gated_gemm_fp8(a: torch.Tensor, a_scales: torch.Tensor, w13: torch.Tensor, w13_scales: torch.Tensor,
                   plan: RoutingPlan, activation: str = "swiglu", z: torch.Tensor | None = None
                   ) -> FP8Pair:
    """Block-FP8 gated_gemm: (h e4m3 [rows, I], h_scales [I / 128, rows]) from e4m3 a [rows, H] with
    a_scales [H / 128, rows] and e4m3 w13 [E_local, 2I, H] with w13_scales [E_local, 2I / 128, H / 128];
    h = act(gate) · up quantised per row and 128 columns; z as in gated_gemm."""
    act = native_activation(activation)
    num_local, two_i, hidden = w13.shape
    h = torch.empty(a.shape[0], two_i // 2, dtype=torch.float8_e4m3fn, device=a.device)
    h_scales = torch.empty(two_i // 2 // 128, a.shape[0], dtype=torch.float32, device=a.device)
    args = _native.GatedGemmFp8Args(a.data_ptr(), a_scales.data_ptr(), w13.data_ptr(), w13_scales.data_ptr(),
                                    h.data_ptr(), h_scales.data_ptr(), _native.address(z),
                                    two_i // 2, hidden, *act)
    _native.call("megamoe_grouped_gemm_gated_fp8", f"FP8 GEMM1 with {activation}", plan.native(), args,
                 _native.stream(a.device))
    return h, h_scales


def grouped_gemm_scatter_fp8(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                             plan: RoutingPlan, out: torch.Tensor) -> None:
    """Block-FP8 grouped_gemm_scatter: out[slot_to_route[s]] = a[s] · b[e]ᵀ, a [rows, K] e4m3 with
    a_scales [K / 128, rows], b [E_local, N, K] e4m3 with b_scales [E_local, N / 128, K / 128]."""
    args = _native.ScatterGemmFp8Args(a.data_ptr(), a_scales.data_ptr(), b.data_ptr(), b_scales.data_ptr(),
                                      out.data_ptr(), 0, out.shape[0], out.shape[1], a.shape[1])
    _native.call("megamoe_grouped_gemm_scatter_fp8", "FP8 grouped GEMM with scattered rows", plan.native(), args,
                 _native.stream(a.device))


def grouped_gemm_scatter(a: torch.Tensor, b: torch.Tensor, plan: RoutingPlan, row_of_slot: torch.Tensor | None,
                         out: torch.Tensor, b_is_k_by_n: bool = False) -> None:
    """out[row_of_slot[s]] = a[s] · B[e] for every live pool row s (rows mapped to -1 or past out are
    not written; row_of_slot None: the plan's slot_to_route): B[e] = b[e]ᵀ for b [E_local, N, K] (w2 in
    GEMM2), or b[e] itself for b [E_local, K, N] with b_is_k_by_n (w13 in the backward's dx)."""
    args = _native.ScatterGemmArgs(a.data_ptr(), b.data_ptr(), out.data_ptr(),
                                   _native.address(row_of_slot), out.shape[0],
                                   out.shape[1], a.shape[1], _native.B_K_BY_N if b_is_k_by_n else _native.B_N_BY_K)
    _native.call("megamoe_grouped_gemm_scatter_bf16", "grouped GEMM with scattered rows", plan.native(), args,
                 _native.stream(a.device))


def recompute_z(a: torch.Tensor, w13: torch.Tensor, plan: RoutingPlan, activation: str,
                a_scales: torch.Tensor | None = None, w13_scales: torch.Tensor | None = None) -> torch.Tensor:
    """z as GEMM1 keeps it, for a backward that did not keep it: GEMM1 on the pool a, its h dropped;
    bf16, or block FP8 with a_scales and w13 / w13_scales the weight's block copy."""
    z = empty_z(plan, w13)
    if a_scales is None:
        gated_gemm(a, w13, plan, activation, z)
    else:
        gated_gemm_fp8(a, a_scales, w13, w13_scales, plan, activation, z)
    return z


def _backward_outputs(plan: RoutingPlan, z: torch.Tensor, inter: int, bf16: bool = True
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """The dh epilogue's outputs in pool order: dz [rows, 2I] and hp [rows, I] bf16 (None without
    bf16), dp partials [rows, I / 128 rounded up] fp32 (MEGAMOE_DP_PARTIAL_COLS)."""
    rows = plan.pool_rows
    return (z.new_empty(rows, 2 * inter) if bf16 else None, z.new_empty(rows, inter) if bf16 else None,
            torch.empty(rows, -(-inter // 128), dtype=torch.float32, device=z.device))


class Fp8DhOutputs(NamedTuple):
    """What the FP8 dh leaves for the rest of the backward (gated_backward_fp8)."""
    dz_rows: FP8Pair  # dz [rows, 2I] e4m3, scales [2I / 128, rows]: fp8.quantize_rows of the bf16 dz (dx)
    dz_t: FP8Pair  # dz transposed [2I, rows], scales [rows / 128, 2I]: transpose_quantize along the rows (dW13)
    hp_t: FP8Pair  # hp transposed [I, rows], scales [I / 128, rows / 128]: transpose_quantize in blocks (dW2)
    dp_partial: torch.Tensor  # [rows, I / 128 rounded up] fp32
    dz: torch.Tensor | None  # the bf16 dz and hp, when asked for
    hp: torch.Tensor | None


def gated_backward(dy_pool: torch.Tensor, w2: torch.Tensor, z: torch.Tensor, p_pool: torch.Tensor,
                   plan: RoutingPlan, activation: str = "swiglu", gather: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dz [rows, 2I], hp [rows, I], dp partials [rows, I / 128] fp32): dh = dy_pool · w2[e] through
    the activation's backward at z (GEMM1's, compact), with p_pool [rows] each row's topk weight
    (hp = p · h, dp = ⟨h, dh⟩). dy_pool is the pool of dy, or with gather dy's token rows [T, H]
    themselves, read by route (the same bits, no pool)."""
    act = native_activation(activation)
    num_local, hidden, inter = w2.shape
    if gather:
        _check_token_rows("gather", dy_pool, plan, hidden)
    dz, hp, dp_partial = _backward_outputs(plan, z, inter)
    args = _native.GatedBackwardArgs(dy_pool.data_ptr(), w2.data_ptr(), z.data_ptr(), p_pool.data_ptr(),
                                     dz.data_ptr(), hp.data_ptr(), dp_partial.data_ptr(), inter, hidden, *act,
                                     int(gather))
    _native.call("megamoe_grouped_gemm_gated_backward_bf16", f"dh with the {activation} backward", plan.native(),
                 args, _native.stream(dy_pool.device))
    return dz, hp, dp_partial


def gated_backward_fp8(dy_pool: torch.Tensor, dy_scales: torch.Tensor, w2t: torch.Tensor, w2t_scales: torch.Tensor,
                       z: torch.Tensor, p_pool: torch.Tensor, plan: RoutingPlan, activation: str = "swiglu",
                       bf16: bool = False) -> Fp8DhOutputs:
    """gated_backward with dh in block FP8: dy_pool [rows, H] e4m3 with dy_scales [H / 128, rows], w2t
    [E_local, I, H] e4m3 (w2 transposed) with w2t_scales [E_local, I / 128, H / 128]; dz in e4m3 for dx
    and transposed for dW13, hp transposed for dW2 (Fp8DhOutputs); with bf16 the bf16 dz and hp too."""
    act = native_activation(activation)
    num_local, inter, hidden = w2t.shape
    rows = plan.pool_rows
    dz, hp, dp_partial = _backward_outputs(plan, z, inter, bf16)

    def e4m3(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float8_e4m3fn, device=z.device)

    def scales(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32, device=z.device)

    dz_rows = e4m3(rows, 2 * inter), scales(2 * inter // 128, rows)
    dz_t = e4m3(2 * inter, rows), scales(rows // 128, 2 * inter)
    hp_t = e4m3(inter, rows), scales(inter // 128, rows // 128)

    args = _native.GatedBackwardFp8Args(dy_pool.data_ptr(), dy_scales.data_ptr(), w2t.data_ptr(),
                                        w2t_scales.data_ptr(), z.data_ptr(), p_pool.data_ptr(), _native.address(dz),
                                        _native.address(hp), dp_partial.data_ptr(),
                                        *(t.data_ptr() for t in (*dz_rows, *dz_t, *hp_t)), inter, hidden, *act)
    _native.call("megamoe_grouped_gemm_gated_backward_fp8", f"FP8 dh with the {activation} backward", plan.native(),
                 args, _native.stream(dy_pool.device))
    return Fp8DhOutputs(dz_rows, dz_t, hp_t, dp_partial, dz, hp)


def reduce_dp(dp_partial: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """dp [T * K] fp32 for the plan's routes: each routed route's partials summed in a fixed order (0
    for routes without a slot in this plan)."""
    dp = torch.empty(plan.num_routes, dtype=torch.float32, device=dp_partial.device)
    _native.call("megamoe_dp_reduce", "dp reduce", plan.native(),
                 _native.DpReduceArgs(dp_partial.data_ptr(), dp.data_ptr(), dp_partial.shape[1] * 128),
                 _native.stream(dp_partial.device))
    return dp


def weight_grad(a: torch.Tensor, b: torch.Tensor, plan: RoutingPlan, out: torch.Tensor,
                gather_a: bool = False, gather_b: bool = False) -> None:
    """out[e] = a[rows of e]ᵀ · b[rows of e] for every local expert; out [E_local, M, N] bf16 is
    written, fp32 is added to (a main_grad). out may be a slice of columns of a wider gradient
    (out.stride(1) elements between rows). a and b are pools, or one of them (gather_a: a [T, M],
    gather_b: b [T, N]) the token rows the pool's rows are read from by route (the same bits, no
    pool)."""
    output = _native.GRAD_FP32_ADD if out.dtype == torch.float32 else _native.GRAD_BF16
    _, m, n = out.shape
    if out.stride(2) != 1 or out.stride(0) != m * out.stride(1):
        raise ValueError(f"out must be [E, M, N] with rows of unit stride, planes back to back; strides {out.stride()}")
    if gather_a and gather_b:
        raise ValueError("weight_grad gathers one operand at most: gather_a or gather_b, not both")
    if gather_a:
        _check_token_rows("gather_a", a, plan, m)
    if gather_b:
        _check_token_rows("gather_b", b, plan, n)
    _native.call("megamoe_grouped_weight_grad_bf16", "weight gradient", plan.native(),
                 _native.WeightGradArgs(a.data_ptr(), b.data_ptr(), out.data_ptr(), m, n, output, out.stride(1),
                                        int(gather_b), int(gather_a)), _native.stream(a.device))


def transpose_quantize(src: torch.Tensor, plan: RoutingPlan, in_blocks: bool, tokens: bool = False,
                       src_scales: torch.Tensor | None = None) -> FP8Pair:
    """The plan's pool of src, [rows, C] -> (e4m3 [C, rows], scales) transposed and quantised along the
    rows (the weight gradients' K), over the plan's live blocks: one scale per column and 128 rows,
    scales [rows / 128, C]; with in_blocks one per 128 x 128 block, scales [C / 128, rows / 128]. src is
    the pool, or with tokens the token rows [T, C] the dispatch would make it of (not made here); bf16,
    or e4m3 with src_scales [C / 128, src rows] (fp8.quantize_rows' layout), dequantised to bf16 first
    (fp8.dequantize_rows in bf16)."""
    rows, cols = plan.pool_rows, src.shape[1]
    q_t = torch.empty(cols, rows, dtype=torch.float8_e4m3fn, device=src.device)
    shape = (cols // 128, rows // 128) if in_blocks else (rows // 128, cols)
    scales = torch.empty(shape, dtype=torch.float32, device=src.device)
    args = _native.TransposeQuantizeFp8Args(src.data_ptr(), q_t.data_ptr(), scales.data_ptr(), cols,
                                            _native.FP8_IN_BLOCKS if in_blocks else _native.FP8_ALONG_ROWS,
                                            _native.ROWS_TOKENS if tokens else _native.ROWS_POOL,
                                            _native.SRC_BF16 if src_scales is None else _native.SRC_E4M3,
                                            0 if src_scales is None else src_scales.data_ptr())
    _native.call("megamoe_transpose_quantize_fp8", "FP8 transpose", plan.native(), args, _native.stream(src.device))
    return q_t, scales


def weight_grad_fp8(a: torch.Tensor | FP8Pair, b: torch.Tensor | FP8Pair, plan: RoutingPlan,
                    out: torch.Tensor, b_tokens: bool = False) -> None:
    """weight_grad in block FP8: a [rows, M] in 1 x 128 blocks along the rows (one scale per column
    and 128 rows: dy, dz), b [rows, N] in 128 x 128 blocks (p·h, x), each transposed for the K-major
    FP8 tensor cores (transpose_quantize; b_tokens: b is token rows, gathered by the plan; a or b may
    also be given as the pair transpose_quantize makes of it: dz and hp as dh makes them, dy from its
    e4m3 rows); fp32 sums of each 128-deep k-block's products."""
    a_t, a_scales = a if isinstance(a, tuple) else transpose_quantize(a, plan, in_blocks=False)
    b_t, b_scales = b if isinstance(b, tuple) else transpose_quantize(b, plan, in_blocks=True, tokens=b_tokens)
    output = _native.GRAD_FP32_ADD if out.dtype == torch.float32 else _native.GRAD_BF16
    _native.call("megamoe_grouped_weight_grad_fp8", "FP8 weight gradient", plan.native(),
                 _native.WeightGradFp8Args(a_t.data_ptr(), a_scales.data_ptr(), b_t.data_ptr(), b_scales.data_ptr(),
                                           out.data_ptr(), out.shape[1], out.shape[2], output),
                 _native.stream(out.device))
