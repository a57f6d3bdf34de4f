"""Input checks: a clear exception before any kernel runs. check_options checks the options of every
entry point (backend, precision, recompute, activation, group), check_moe_inputs the tensors of every backend;
check_fused_support, main_grad_of and IdRangeCheck (the fused op checks the ids' range on the GPU,
after its launches are queued) serve the fused kernels on one rank and over a process group."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch._C._functorch import is_functorch_wrapped_tensor

from .activation import check_activation

PRECISIONS = ("bf16", "fp8", "fp8_bwd", "mxfp8")
# What the fused kernels compute: bf16, block FP8 forward and backward, or a bf16 forward with an FP8 backward.
FUSED_PRECISIONS = ("bf16", "fp8", "fp8_bwd")
BACKENDS = ("fused", "grouped", "naive")
# What the fused op keeps for the backward: False the pool of x and z, "gather" z (x is gathered again
# in the backward), True only the inputs (x gathered again and z recomputed).
RECOMPUTE_MODES = (False, "gather", True)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def is_plain_tensor(t: torch.Tensor) -> bool:
    """t is a torch.Tensor or Parameter itself, with real storage behind it: not a subclass (fake or
    meta tensors under a tracer) nor one of functorch's wrappers."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and not is_functorch_wrapped_tensor(t)


class MoEProblem(NamedTuple):
    num_tokens: int  # T
    top_k: int  # K
    hidden_size: int  # H
    intermediate_size: int  # I
    num_local_experts: int  # E_local
    num_experts: int  # E = E_local * world size
    expert_begin: int  # first expert this rank owns


def group_rank_and_size(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    import torch.distributed as dist
    return dist.get_rank(group), dist.get_world_size(group)


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}"


def id_range_message(num_experts: int, got: str) -> str:
    return f"topk_ids must lie in [-1, {num_experts}) (-1 = masked route), got {got}"


def check_options(backend: str, precision: str = "bf16", recompute: bool | str = False, activation: str = "swiglu",
                  group=None) -> None:
    """The options every entry point takes (megamoe.moe, MoELayer, patch_hf_model, the TorchTitan
    adapters), checked in one order with one set of messages, before any tensor is looked at."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "mxfp8":
        raise NotImplementedError(
            "precision='mxfp8' needs Blackwell (sm_100) block-scaled tensor cores, which megamoe's sm_90a kernels "
            "do not use; on Hopper use precision='fp8' (1x128 / 128x128 block scales)")
    check_activation(activation)
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    # recompute is the fused op's own activation checkpointing; the baselines have none.
    if recompute and backend != "fused":
        raise ValueError(
            f"recompute={recompute!r} needs backend='fused' (the fused backend's own recomputation), got "
            f"backend={backend!r}, which keeps what autograd saves: wrap it in torch.utils.checkpoint instead")
    # Block FP8 runs in the fused kernels on one rank; the baselines compute in bf16.
    if precision != "bf16" and backend != "fused":
        raise NotImplementedError(
            f"precision={precision!r} runs in backend='fused' (the block-FP8 kernels); backend={backend!r} "
            "computes in bf16: pass precision='bf16'")
    if group is not None and backend != "fused":
        raise NotImplementedError(
            f"expert parallelism over a process group runs backend='fused', got backend={backend!r}")


def check_fused_precision(precision: str) -> None:
    if precision not in FUSED_PRECISIONS:
        raise ValueError(f"the fused kernels compute precision {FUSED_PRECISIONS}, got {precision!r}")


def check_moe_inputs(x, topk_ids, topk_weights, w13, w2, *, group=None, check_id_range=True) -> MoEProblem:
    """Validates the layer's inputs (docs/DESIGN.md) and returns the problem sizes. Plain `if`s: every
    call of the layer pays for these checks on the host, and a small batch waits for them."""
    tensors = (x, topk_ids, topk_weights, w13, w2)
    names = ("x", "topk_ids", "topk_weights", "w13", "w2")
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {_describe(x)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must be [T, K] with T = {x.shape[0]} (rows of x), got {_describe(topk_ids)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, got "
                         f"{_describe(topk_weights)}")
    if w13.dim() != 3:
        raise ValueError(f"w13 must be [E_local, 2I, H], got {_describe(w13)}")
    if w2.dim() != 3:
        raise ValueError(f"w2 must be [E_local, H, I], got {_describe(w2)}")
    num_local, two_i, hidden = w13.shape
    if hidden != x.shape[1]:
        raise ValueError(f"w13 [E_local, 2I, H] has H = {hidden} but x has H = {x.shape[1]}")
    if two_i % 2 or two_i <= 0:
        raise ValueError(f"w13's second dim is 2I (gate rows then up rows), got {two_i}")
    if num_local <= 0:
        raise ValueError("w13 has no experts (E_local = 0)")
    intermediate = two_i // 2
    if w2.shape != (num_local, hidden, intermediate):
        raise ValueError(f"w2 must be [E_local, H, I] = {(num_local, hidden, intermediate)} to match w13, "
                         f"got {_describe(w2)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_weights.dtype not in (torch.float32, torch.bfloat16, torch.float64):
        raise TypeError(f"topk_weights must be float32 (bfloat16 accepted), got {topk_weights.dtype}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be a floating tensor (bfloat16), got {x.dtype}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise TypeError(f"x, w13 and w2 must share one dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    device = x.device
    if topk_ids.device != device or topk_weights.device != device or w13.device != device or w2.device != device:
        devices = sorted({str(t.device) for t in tensors})
        raise ValueError(f"all inputs must be on one device, got {devices}")
    for name, t in zip(names, tensors):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous()), got strides {t.stride()}")

    rank, world = group_rank_and_size(group)
    num_experts = num_local * world
    top_k = topk_ids.shape[1]
    if top_k < 1:
        raise ValueError("topk_ids must have K >= 1 columns")
    if top_k > num_experts:
        raise ValueError(f"top_k = {top_k} exceeds the number of experts {num_experts}")
    if check_id_range and topk_ids.numel() and not torch.compiler.is_compiling():
        low, high = torch.stack(torch.aminmax(topk_ids)).tolist()  # one sync; skipped under compile
        if low < -1 or high >= num_experts:
            raise ValueError(id_range_message(num_experts, f"values in [{low}, {high}]"))
    return MoEProblem(num_tokens=x.shape[0], top_k=top_k, hidden_size=hidden,
                      intermediate_size=intermediate, num_local_experts=num_local,
                      num_experts=num_experts, expert_begin=rank * num_local)


# Sizes the fused layer takes: H and I multiples of 8 (16-byte bf16 rows; the kernels' last tiles stop
# at H and I), in block FP8 multiples of 128 (whole 1 x 128 and 128 x 128 scale blocks); H up to the
# largest size the tests cover.
SIZE_MULTIPLE = 8
FP8_SIZE_MULTIPLE = 128
MAX_HIDDEN = 8192


@functools.cache
def _device_capability(device: torch.device) -> tuple[int, int]:
    """torch.cuda.get_device_capability, asked once per device (it builds the device's properties)."""
    return torch.cuda.get_device_capability(device)


def check_fused_support(x: torch.Tensor, hidden: int, intermediate: int, precision: str = "bf16") -> None:
    """Raises before any launch when the kernels cannot run this problem."""
    if x.device.type != "cuda":
        raise ValueError(f"backend='fused' runs on CUDA tensors, got {x.device}; use backend='grouped' on the CPU")
    major, minor = _device_capability(x.device)
    if (major, minor) != (9, 0):
        raise NotImplementedError(
            f"backend='fused' needs a Hopper GPU (sm_90, H100/H200), this is sm_{major}{minor}; "
            "use backend='grouped'")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"backend='fused' computes in bfloat16, got x, w13, w2 in {x.dtype}")
    if hidden % SIZE_MULTIPLE or intermediate % SIZE_MULTIPLE or hidden > MAX_HIDDEN:
        raise ValueError(
            f"backend='fused' needs H and I to be multiples of {SIZE_MULTIPLE} (16-byte bf16 rows) and "
            f"H <= {MAX_HIDDEN}; got H = {hidden}, I = {intermediate}. Use backend='grouped' for this shape")
    if precision != "bf16" and (hidden % FP8_SIZE_MULTIPLE or intermediate % FP8_SIZE_MULTIPLE):
        raise ValueError(
            f"precision={precision!r} needs H and I to be multiples of {FP8_SIZE_MULTIPLE} (whole 1 x 128 and "
            f"128 x 128 scale blocks); got H = {hidden}, I = {intermediate}. Use precision='bf16' for this shape")


class IdRangeCheck:
    """Ids outside [-1, E): the routing kernels count them (plan.num_invalid) and route them nowhere,
    so no kernel reads out of bounds. Made right after the routing launches, it marks where they end
    on the compute stream (an event); raise_if_any, called once all the layer's kernels are queued,
    waits for that mark and raises if the count is not zero: the host waits for this layer's routing,
    not for the whole queue ahead of it, and the caller gets the exception instead of an output. The
    build wrote the count to pinned host memory as well (plan.num_invalid_host), so reading it costs
    no copy; where that memory was not written (-1: pinned memory the device cannot write), the count
    is copied on a stream of its own that waits for the mark (a copy between the compute stream's
    kernels would cost two ~5 µs switches there).
    Not while a CUDA graph is being captured, where the host may not wait: there bad ids only stay
    masked (routed nowhere), as they were before this check existed whenever the host check was
    skipped (torch.compile)."""

    _copy_streams: dict = {}

    def __init__(self, plan, num_experts: int):
        self.plan, self.num_experts = plan, num_experts
        self.active = not torch.cuda.is_current_stream_capturing()
        if self.active:
            self.routed = torch.cuda.Event()
            self.routed.record(torch.cuda.current_stream(plan.buffer.device))

    def raise_if_any(self) -> None:
        if not self.active:
            return
        count = -1
        if self.plan.num_invalid_host is not None:
            self.routed.synchronize()
            count = self.plan.num_invalid_host.value
        if count < 0:
            count = self._copied_count()
        if count:
            raise ValueError(id_range_message(self.num_experts, f"{count} ids outside it"))

    def _copied_count(self) -> int:
        device = self.plan.buffer.device
        if device not in self._copy_streams:
            self._copy_streams[device] = torch.cuda.Stream(device)
        copy_stream = self._copy_streams[device]
        copy_stream.wait_event(self.routed)
        with torch.cuda.stream(copy_stream):
            return int(self.plan.num_invalid.item())  # waits for this copy only


def main_grad_of(weight: torch.Tensor, name: str) -> torch.Tensor | None:
    """The weight's fp32 gradient buffer (`weight.main_grad`, the Megatron-LM convention), checked,
    or None. With one, the fused backward adds the weight gradient into it in fp32 and leaves
    `.grad` alone: no bf16 rounding of the gradient and no separate accumulation pass."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        return None
    if (not isinstance(main_grad, torch.Tensor) or main_grad.dtype != torch.float32
            or main_grad.shape != weight.shape or main_grad.device != weight.device
            or not main_grad.is_contiguous()):
        got = (f"{main_grad.dtype} {tuple(main_grad.shape)} on {main_grad.device}"
               if isinstance(main_grad, torch.Tensor) else type(main_grad).__name__)
        raise ValueError(
            f"{name}.main_grad must be a contiguous float32 tensor of shape {tuple(weight.shape)} on "
            f"{weight.device}, got {got}; delete the attribute to get a bf16 .grad instead")
    return main_grad
