"""Loads the C++/CUDA core (libmegamoe.so) through its C ABI.

The core has no PyTorch types, so one native build serves every PyTorch version; tensors cross
as raw pointers plus the current CUDA stream.
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

_LIBRARY_NAME = "libmegamoe.so"


def _candidates() -> list[Path]:
    here = Path(__file__).resolve().parent
    found = []
    if os.environ.get("MEGAMOE_LIBRARY"):
        found.append(Path(os.environ["MEGAMOE_LIBRARY"]))
    found.append(here / "lib" / _LIBRARY_NAME)  # installed by `pip install .`
    found.append(here.parents[1] / "build" / _LIBRARY_NAME)  # a source checkout built with CMake
    return found


class RoutingShape(ctypes.Structure):
    _fields_ = [("num_tokens", ctypes.c_int64), ("top_k", ctypes.c_int32),
                ("num_experts", ctypes.c_int32), ("expert_begin", ctypes.c_int32),
                ("num_local_experts", ctypes.c_int32)]


class RoutingPlanPointers(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "expert_counts", "expert_offsets", "route_to_slot", "slot_to_route", "block_expert",
        "num_blocks", "num_invalid", "workspace")]


_SIGNATURES = {
    "megamoe_last_error": (ctypes.c_char_p, []),
    "megamoe_routing_capacity": (ctypes.c_int64, [ctypes.POINTER(RoutingShape)]),
    "megamoe_routing_max_blocks": (ctypes.c_int64, [ctypes.POINTER(RoutingShape)]),
    "megamoe_routing_workspace_bytes": (ctypes.c_size_t, [ctypes.POINTER(RoutingShape)]),
    "megamoe_build_routing_cuda": (ctypes.c_int, [
        ctypes.c_void_p, ctypes.POINTER(RoutingShape), ctypes.POINTER(RoutingPlanPointers),
        ctypes.c_void_p]),
    "megamoe_build_routing_host": (ctypes.c_int, [
        ctypes.c_void_p, ctypes.POINTER(RoutingShape), ctypes.POINTER(RoutingPlanPointers)]),
    "megamoe_grouped_gemm_bf16": (ctypes.c_int, [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p]),
    "megamoe_grouped_gemm_fp8": (ctypes.c_int, [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p]),
    "megamoe_grouped_gemm_swiglu_bf16": (ctypes.c_int, [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p]),
    "megamoe_grouped_gemm_scatter_bf16": (ctypes.c_int, [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
        ctypes.c_int64, ctypes.c_void_p]),
    "megamoe_grouped_gemm_scatter_mn_bf16": (ctypes.c_int, [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
        ctypes.c_int64, ctypes.c_void_p]),
    "megamoe_grouped_gemm_swiglu_backward_bf16": (ctypes.c_int, [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p]),
    "megamoe_dp_reduce": (ctypes.c_int, [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32,
        ctypes.c_int64, ctypes.c_void_p]),
    "megamoe_grouped_weight_grad_bf16": (ctypes.c_int, [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
        ctypes.c_void_p]),
    "megamoe_dispatch_bf16": (ctypes.c_int, [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p]),
    "megamoe_combine_bf16": (ctypes.c_int, [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p]),
    "megamoe_dispatch_peers_bf16": (ctypes.c_int, [
        ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64), ctypes.c_int32, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_void_p]),
    "megamoe_barrier": (ctypes.c_int, [
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]),
    "megamoe_barrier_check": (ctypes.c_int, [ctypes.POINTER(ctypes.c_int32), ctypes.c_int32, ctypes.c_int64]),
    "megamoe_enable_peer_access": (ctypes.c_int, [ctypes.c_int32]),
    "megamoe_shared_alloc": (ctypes.c_int, [ctypes.c_int32, ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p),
                                            ctypes.c_char_p]),
    "megamoe_shared_free": (ctypes.c_int, [ctypes.c_int32, ctypes.c_void_p]),
    "megamoe_shared_open": (ctypes.c_int, [ctypes.c_int32, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]),
    "megamoe_shared_close": (ctypes.c_int, [ctypes.c_int32, ctypes.c_void_p]),
    "megamoe_copy_async": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]),
    "megamoe_combine_peers_bf16": (ctypes.c_int, [
        ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p]),
}


class NativeLibraryError(RuntimeError):
    pass


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded core; raises with build instructions when it is missing."""
    for path in _candidates():
        if path.is_file():
            lib = ctypes.CDLL(str(path))
            missing = [name for name in _SIGNATURES if not hasattr(lib, name)]
            if missing:
                raise NativeLibraryError(
                    f"{path} is older than this Python package (it lacks {', '.join(missing)}): "
                    "rebuild it (`pip install .`, or `cmake --build build`)")
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
            return lib
    searched = ", ".join(str(p) for p in _candidates())
    raise NativeLibraryError(
        f"megamoe's native library ({_LIBRARY_NAME}) was not found (searched: {searched}). "
        "Install the package with `pip install .`, or build it with `cmake -S . -B build && "
        "cmake --build build`, or point MEGAMOE_LIBRARY at the .so.")


def stream(device: torch.device) -> int:
    """The handle of the current CUDA stream of `device`, which every kernel of the core is queued on."""
    return torch.cuda.current_stream(device).cuda_stream


def check(status: int, what: str) -> None:
    if status != MEGAMOE_OK:
        message = library().megamoe_last_error().decode(errors="replace")
        error = {1: ValueError, 3: TimeoutError}.get(status, RuntimeError)
        raise error(f"{what}: {message}")
