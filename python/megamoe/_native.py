"""Loads the C++/CUDA core (libmegamoe.so) through its C ABI.

The core has no PyTorch types, so one native build serves every PyTorch version; tensors cross
as raw pointers plus the current CUDA stream. This module mirrors csrc/include/megamoe/megamoe.h:
its argument structs and function signatures are declared here once, and a test checks them
against the header.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

MEGAMOE_OK = 0
BLOCK_M = 128
MAX_PEERS = 8  # MEGAMOE_MAX_PEERS: ranks in one expert-parallel group
IPC_HANDLE_BYTES = 64  # MEGAMOE_IPC_HANDLE_BYTES
B_N_BY_K, B_K_BY_N = 0, 1  # MEGAMOE_B_*: the layout of a scatter GEMM's B
GRAD_BF16, GRAD_FP32, GRAD_FP32_ADD = 0, 1, 2  # MEGAMOE_GRAD_*: a weight gradient's output
FP8_ALONG_ROWS, FP8_IN_BLOCKS = 0, 1  # MEGAMOE_FP8_*: the scale blocks of a transposed FP8 operand
ROWS_POOL, ROWS_TOKENS = 0, 1  # MEGAMOE_ROWS_*: an operand given as the pool, or as token rows to gather
SRC_BF16, SRC_E4M3 = 0, 1  # MEGAMOE_SRC_*: a transposed FP8 operand's source, bf16 or e4m3 rows with scales

_LIBRARY_NAME = "libmegamoe.so"

_i32, _i64, _f32, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def _candidates() -> list[Path]:
    here = Path(__file__).resolve().parent
    found = []
    if os.environ.get("MEGAMOE_LIBRARY"):
        found.append(Path(os.environ["MEGAMOE_LIBRARY"]))
    found.append(here / "lib" / _LIBRARY_NAME)  # installed by `pip install .`
    found.append(here.parents[1] / "build" / _LIBRARY_NAME)  # a source checkout built with CMake
    return found


def _struct(name: str, *fields: tuple[str, type]) -> type[ctypes.Structure]:
    return type(name, (ctypes.Structure,), {"_fields_": list(fields)})


RoutingShape = _struct("megamoe_routing_shape", ("num_tokens", _i64), ("top_k", _i32), ("num_experts", _i32),
                       ("expert_begin", _i32), ("num_local_experts", _i32))
RoutingPlan = _struct("megamoe_routing_plan", *((name, _ptr) for name in (
    "expert_counts", "expert_offsets", "compact_offsets", "route_to_slot", "slot_to_route", "block_expert",
    "num_blocks", "num_invalid", "workspace")), ("shape", RoutingShape), ("num_invalid_host", _ptr))
DispatchFp8Args = _struct("megamoe_dispatch_fp8_args", ("x", _ptr), ("pool", _ptr), ("pool_scales", _ptr),
                          ("hidden", _i32), ("weights", _ptr), ("weights_pool", _ptr), ("rows", _ptr),
                          ("row_scales", _ptr))
DispatchArgs = _struct("megamoe_dispatch_args", ("x", _ptr), ("pool", _ptr), ("weights", _ptr),
                       ("weights_pool", _ptr), ("row_bytes", _i32), ("x_stride", _i32))
CombineArgs = _struct("megamoe_combine_args", ("routed", _ptr), ("topk_weights", _ptr), ("y", _ptr),
                      ("hidden", _i32))
DispatchPeersArgs = _struct("megamoe_dispatch_peers_args", ("x_peers", _ptr), ("route_offsets", _ptr),
                            ("weights_peers", _ptr), ("pool", _ptr), ("weights_pool", _ptr), ("world", _i32),
                            ("row_bytes", _i32))
CombinePeersArgs = _struct("megamoe_combine_peers_args", ("out_peers", _ptr), ("route_to_slot_peers", _ptr),
                           ("topk_weights", _ptr), ("y", _ptr), ("route_offset", _i64), ("num_tokens", _i64),
                           ("top_k", _i32), ("world", _i32), ("hidden", _i32))
GemmArgs = _struct("megamoe_gemm_args", ("a", _ptr), ("b", _ptr), ("c", _ptr), ("n", _i32), ("k", _i32))
GemmFp8Args = _struct("megamoe_gemm_fp8_args", ("a", _ptr), ("a_scales", _ptr), ("b", _ptr), ("b_scales", _ptr),
                      ("c", _ptr), ("n", _i32), ("k", _i32))
QuantizeFp8Args = _struct("megamoe_quantize_fp8_args", ("a", _ptr), ("q", _ptr), ("scales", _ptr), ("rows", _i64),
                          ("k", _i32), ("scales_ld", _i32))
DequantizeFp8Args = _struct("megamoe_dequantize_fp8_args", ("q", _ptr), ("scales", _ptr), ("a", _ptr),
                            ("rows", _i64), ("k", _i32))
QuantizeBlocksTransposedFp8Args = _struct("megamoe_quantize_blocks_transposed_fp8_args", ("w", _ptr), ("q_t", _ptr),
                                          ("scales_t", _ptr), ("batches", _i64), ("n", _i32), ("k", _i32))
TransposeFp8Args = _struct("megamoe_transpose_fp8_args", ("in", _ptr), ("out", _ptr), ("batches", _i64),
                           ("rows", _i32), ("cols", _i32))
GatedGemmFp8Args = _struct("megamoe_gated_gemm_fp8_args", ("a", _ptr), ("a_scales", _ptr), ("w13", _ptr),
                           ("w13_scales", _ptr), ("h", _ptr), ("h_scales", _ptr), ("z", _ptr),
                           ("intermediate", _i32), ("hidden", _i32), ("activation", _i32), ("activation_limit", _f32))
ScatterGemmFp8Args = _struct("megamoe_scatter_gemm_fp8_args", ("a", _ptr), ("a_scales", _ptr), ("b", _ptr),
                             ("b_scales", _ptr), ("out_rows", _ptr), ("row_of_slot", _ptr), ("num_out_rows", _i64),
                             ("n", _i32), ("k", _i32))
GatedBackwardFp8Args = _struct("megamoe_gated_backward_fp8_args", ("dy_pool", _ptr), ("dy_scales", _ptr),
                               ("w2t", _ptr), ("w2t_scales", _ptr), ("z", _ptr), ("p_pool", _ptr), ("dz", _ptr),
                               ("hp", _ptr), ("dp_partial", _ptr), ("dz_q", _ptr), ("dz_scales", _ptr), ("dz_t", _ptr),
                               ("dz_t_scales", _ptr), ("hp_t", _ptr), ("hp_t_scales", _ptr), ("intermediate", _i32),
                               ("hidden", _i32), ("activation", _i32), ("activation_limit", _f32))
GatedGemmArgs = _struct("megamoe_gated_gemm_args", ("a", _ptr), ("w13", _ptr), ("h", _ptr), ("z", _ptr),
                        ("intermediate", _i32), ("hidden", _i32), ("activation", _i32), ("activation_limit", _f32),
                        ("gather_a", _i32))
ScatterGemmArgs = _struct("megamoe_scatter_gemm_args", ("a", _ptr), ("b", _ptr), ("out_rows", _ptr),
                          ("row_of_slot", _ptr), ("num_out_rows", _i64), ("n", _i32), ("k", _i32),
                          ("b_layout", _i32))
GatedBackwardArgs = _struct("megamoe_gated_backward_args", ("dy_pool", _ptr), ("w2", _ptr), ("z", _ptr),
                            ("p_pool", _ptr), ("dz", _ptr), ("hp", _ptr), ("dp_partial", _ptr),
                            ("intermediate", _i32), ("hidden", _i32), ("activation", _i32), ("activation_limit", _f32),
                            ("gather_a", _i32))
DpReduceArgs = _struct("megamoe_dp_reduce_args", ("dp_partial", _ptr), ("dp", _ptr), ("intermediate", _i32))
WeightGradFp8Args = _struct("megamoe_weight_grad_fp8_args", ("a_t", _ptr), ("a_scales", _ptr), ("b_t", _ptr),
                            ("b_scales", _ptr), ("out", _ptr), ("m", _i32), ("n", _i32), ("output", _i32))
TransposeQuantizeFp8Args = _struct("megamoe_transpose_quantize_fp8_args", ("src", _ptr), ("q_t", _ptr),
                                   ("scales", _ptr), ("cols", _i32), ("blocks", _i32), ("src_rows", _i32),
                                   ("src_dtype", _i32), ("src_scales", _ptr))
WeightGradArgs = _struct("megamoe_weight_grad_args", ("a_pool", _ptr), ("b_pool", _ptr), ("out", _ptr),
                         ("m", _i32), ("n", _i32), ("output", _i32), ("out_ld", _i32), ("gather_b", _i32),
                         ("gather_a", _i32))

STRUCTS = (RoutingShape, RoutingPlan, DispatchArgs, DispatchFp8Args, CombineArgs, DispatchPeersArgs, CombinePeersArgs,
           GemmArgs, GemmFp8Args, QuantizeFp8Args, DequantizeFp8Args, QuantizeBlocksTransposedFp8Args, TransposeFp8Args,
           GatedGemmArgs, GatedGemmFp8Args, ScatterGemmArgs, ScatterGemmFp8Args, GatedBackwardArgs, GatedBackwardFp8Args,
           DpReduceArgs, WeightGradArgs, WeightGradFp8Args, TransposeQuantizeFp8Args)


def _p(struct: type[ctypes.Structure]):
    return ctypes.POINTER(struct)


def _plan_op(args: type[ctypes.Structure]):
    """(status, [plan, args, stream]): the shape of every plan-consuming entry point."""
    return ctypes.c_int, [_p(RoutingPlan), _p(args), _ptr]


SIGNATURES = {
    "megamoe_last_error": (ctypes.c_char_p, []),
    "megamoe_routing_capacity": (_i64, [_p(RoutingShape)]),
    "megamoe_routing_max_blocks": (_i64, [_p(RoutingShape)]),
    "megamoe_routing_workspace_bytes": (ctypes.c_size_t, [_p(RoutingShape)]),
    "megamoe_build_routing_cuda": (ctypes.c_int, [_ptr, _i32, _p(RoutingPlan), _ptr]),
    "megamoe_build_routing_host": (ctypes.c_int, [_ptr, _i32, _p(RoutingPlan)]),
    "megamoe_dispatch_bf16": _plan_op(DispatchArgs),
    "megamoe_dispatch_fp8": _plan_op(DispatchFp8Args),
    "megamoe_combine_bf16": _plan_op(CombineArgs),
    "megamoe_dispatch_peers_bf16": _plan_op(DispatchPeersArgs),
    "megamoe_combine_peers_bf16": (ctypes.c_int, [_p(CombinePeersArgs), _ptr]),
    "megamoe_barrier": (ctypes.c_int, [ctypes.POINTER(_ptr), _i32, _i32, _i32, _i32, _i64, _ptr, _ptr]),
    "megamoe_barrier_check": (ctypes.c_int, [ctypes.POINTER(_i32), _i32, _i64]),
    "megamoe_enable_peer_access": (ctypes.c_int, [_i32]),
    "megamoe_shared_alloc": (ctypes.c_int, [_i32, _i64, ctypes.POINTER(_ptr), ctypes.c_char_p]),
    "megamoe_shared_free": (ctypes.c_int, [_i32, _ptr]),
    "megamoe_shared_open": (ctypes.c_int, [_i32, ctypes.c_char_p, ctypes.POINTER(_ptr)]),
    "megamoe_shared_close": (ctypes.c_int, [_i32, _ptr]),
    "megamoe_copy_async": (ctypes.c_int, [_ptr, _ptr, _i64, _ptr]),
    "megamoe_quantize_rows_fp8": (ctypes.c_int, [_p(QuantizeFp8Args), _ptr]),
    "megamoe_dequantize_rows_fp8": (ctypes.c_int, [_p(DequantizeFp8Args), _ptr]),
    "megamoe_quantize_blocks_fp8": (ctypes.c_int, [_p(QuantizeFp8Args), _ptr]),
    "megamoe_quantize_blocks_transposed_fp8": (ctypes.c_int, [_p(QuantizeBlocksTransposedFp8Args), _ptr]),
    "megamoe_transpose_fp8": (ctypes.c_int, [_p(TransposeFp8Args), _ptr]),
    "megamoe_grouped_gemm_bf16": _plan_op(GemmArgs),
    "megamoe_grouped_gemm_fp8": _plan_op(GemmFp8Args),
    "megamoe_grouped_gemm_gated_bf16": _plan_op(GatedGemmArgs),
    "megamoe_grouped_gemm_gated_fp8": _plan_op(GatedGemmFp8Args),
    "megamoe_grouped_gemm_scatter_bf16": _plan_op(ScatterGemmArgs),
    "megamoe_grouped_gemm_scatter_fp8": _plan_op(ScatterGemmFp8Args),
    "megamoe_grouped_gemm_gated_backward_bf16": _plan_op(GatedBackwardArgs),
    "megamoe_grouped_gemm_gated_backward_fp8": _plan_op(GatedBackwardFp8Args),
    "megamoe_dp_reduce": _plan_op(DpReduceArgs),
    "megamoe_grouped_weight_grad_bf16": _plan_op(WeightGradArgs),
    "megamoe_grouped_weight_grad_fp8": _plan_op(WeightGradFp8Args),
    "megamoe_transpose_quantize_fp8": _plan_op(TransposeQuantizeFp8Args),
}


class NativeLibraryError(RuntimeError):
    pass


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded core; raises with build instructions when it is missing."""
    for path in _candidates():
        if path.is_file():
            lib = ctypes.CDLL(str(path))
            missing = [name for name in SIGNATURES if not hasattr(lib, name)]
            if missing:
                raise NativeLibraryError(
                    f"{path} is older than this Python package (it lacks {', '.join(missing)}): "
                    "rebuild it (`pip install .`, or `cmake --build build`)")
            for name, (restype, argtypes) in SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
            return lib
    searched = ", ".join(str(p) for p in _candidates())
    raise NativeLibraryError(
        f"megamoe's native library ({_LIBRARY_NAME}) was not found (searched: {searched}). "
        "Install the package with `pip install .`, or build it with `cmake -S . -B build && "
        "cmake --build build`, or point MEGAMOE_LIBRARY at the .so.")


def address(t: torch.Tensor | None) -> int | None:
    """A tensor's device address for a pointer field of the C API, or None (null) for no tensor."""
    return None if t is None else t.data_ptr()


def stream(device: torch.device) -> int:
    """The handle of the current CUDA stream of `device`, which every kernel of the core is queued on
    (torch's raw accessor: torch.cuda.current_stream would build a Stream object per launch)."""
    return torch._C._cuda_getCurrentRawStream(torch.cuda.current_device() if device.index is None else device.index)


def on_the_tensors_gpu(fn):
    """fn(first, ...) with first's GPU as the current device: the core launches on the current device,
    and a layer placed on another GPU than the current one (one process driving several GPUs, as a
    model spread over them by device_map="auto") must run on its own."""
    @functools.wraps(fn)
    def on_device(first: torch.Tensor, *args, **kwargs):
        device = first.device
        if device.type != "cuda" or device.index == torch.cuda.current_device():
            return fn(first, *args, **kwargs)
        with torch.cuda.device(device):
            return fn(first, *args, **kwargs)
    return on_device


def check(status: int, what: str) -> None:
    if status != MEGAMOE_OK:
        message = library().megamoe_last_error().decode(errors="replace")
        error = {1: ValueError, 3: TimeoutError}.get(status, RuntimeError)
        raise error(f"{what}: {message}")


def call(name: str, what: str, *args) -> None:
    """library().name(*args), ctypes structs passed by reference; raises with `what` on an error status."""
    check(getattr(library(), name)(*(ctypes.byref(a) if isinstance(a, ctypes.Structure) else a for a in args)),
          what)
