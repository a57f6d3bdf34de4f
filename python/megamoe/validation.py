"""Input checks shared by every backend: a clear exception before any kernel runs (the fused op
checks the ids' range on the GPU instead: fused.py)."""

from __future__ import annotations

import dataclasses

import torch

PRECISIONS = ("bf16", "fp8", "fp8_bwd", "mxfp8")
BACKENDS = ("fused", "grouped", "naive")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclasses.dataclass(frozen=True)
class MoEProblem:
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


def _require(condition: bool, message: str, error=ValueError) -> None:
    if not condition:
        raise error(message)


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}"


def id_range_message(num_experts: int, got: str) -> str:
    return f"topk_ids must lie in [-1, {num_experts}) (-1 = masked route), got {got}"


def check_recompute(backend: str, recompute: bool) -> None:
    """recompute is the fused op's own activation checkpointing; the baselines have none."""
    _require(not recompute or backend == "fused",
             f"recompute=True needs backend='fused' (the fused backend's own recomputation), got "
             f"backend={backend!r}, which keeps what autograd saves: wrap it in torch.utils.checkpoint instead")


def check_precision(precision: str, device: torch.device) -> None:
    _require(precision in PRECISIONS, f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "mxfp8":
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        _require(capability is not None and capability[0] >= 10,
                 "precision='mxfp8' needs Blackwell (sm_100) block-scaled tensor cores; "
                 "on Hopper use precision='fp8' (1x128 / 128x128 block scales)", NotImplementedError)


def check_moe_inputs(x, topk_ids, topk_weights, w13, w2, *, group=None, check_id_range=True) -> MoEProblem:
    """Validates the layer's inputs (DESIGN.md §2) and returns the problem sizes."""
    names = ("x", "topk_ids", "topk_weights", "w13", "w2")
    for name, t in zip(names, (x, topk_ids, topk_weights, w13, w2)):
        _require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}",
                 TypeError)
    _require(x.dim() == 2, f"x must be [T, H], got {_describe(x)}")
    _require(topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0],
             f"topk_ids must be [T, K] with T = {x.shape[0]} (rows of x), got {_describe(topk_ids)}")
    _require(topk_weights.shape == topk_ids.shape,
             f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, got {_describe(topk_weights)}")
    _require(w13.dim() == 3, f"w13 must be [E_local, 2I, H], got {_describe(w13)}")
    _require(w2.dim() == 3, f"w2 must be [E_local, H, I], got {_describe(w2)}")
    num_local, two_i, hidden = w13.shape
    _require(hidden == x.shape[1], f"w13 [E_local, 2I, H] has H = {hidden} but x has H = {x.shape[1]}")
    _require(two_i % 2 == 0 and two_i > 0, f"w13's second dim is 2I (gate rows then up rows), got {two_i}")
    _require(num_local > 0, "w13 has no experts (E_local = 0)")
    intermediate = two_i // 2
    _require(w2.shape == (num_local, hidden, intermediate),
             f"w2 must be [E_local, H, I] = {(num_local, hidden, intermediate)} to match w13, got {_describe(w2)}")
    _require(topk_ids.dtype in (torch.int32, torch.int64),
             f"topk_ids must be int32 or int64, got {topk_ids.dtype}", TypeError)
    _require(topk_weights.dtype in (torch.float32, torch.bfloat16, torch.float64),
             f"topk_weights must be float32 (bfloat16 accepted), got {topk_weights.dtype}", TypeError)
    _require(x.dtype in FLOAT_DTYPES, f"x must be a floating tensor (bfloat16), got {x.dtype}", TypeError)
    _require(w13.dtype == x.dtype and w2.dtype == x.dtype,
             f"x, w13 and w2 must share one dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}", TypeError)
    devices = {t.device for t in (x, topk_ids, topk_weights, w13, w2)}
    _require(len(devices) == 1, f"all inputs must be on one device, got {sorted(map(str, devices))}")
    for name, t in zip(names, (x, topk_ids, topk_weights, w13, w2)):
        _require(t.is_contiguous(), f"{name} must be contiguous (call .contiguous()), got strides {t.stride()}")

    rank, world = group_rank_and_size(group)
    num_experts = num_local * world
    top_k = topk_ids.shape[1]
    _require(top_k >= 1, "topk_ids must have K >= 1 columns")
    _require(top_k <= num_experts, f"top_k = {top_k} exceeds the number of experts {num_experts}")
    if check_id_range and topk_ids.numel() and not torch.compiler.is_compiling():
        low, high = torch.stack(torch.aminmax(topk_ids)).tolist()  # one sync; skipped under compile
        _require(low >= -1 and high < num_experts, id_range_message(num_experts, f"values in [{low}, {high}]"))
    return MoEProblem(num_tokens=x.shape[0], top_k=top_k, hidden_size=hidden,
                      intermediate_size=intermediate, num_local_experts=num_local,
                      num_experts=num_experts, expert_begin=rank * num_local)
