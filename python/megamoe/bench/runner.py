"""Runs every backend on the same inputs, case by case, and turns the measurements into records."""

from __future__ import annotations

import dataclasses
import itertools
import sys
import traceback
from collections.abc import Callable, Sequence

import torch

from megamoe.shapes import PRESETS, MoEShape, make_inputs, make_routing

from . import backends
from .record import Record
from .timing import Budget, Device, Measurement, measure

try:
    from tqdm import tqdm
except ImportError:  # progress display is optional
    tqdm = None

# Rotating input sets keeps a backend from being timed on activations still in L2 from the last
# iteration. The sets differ in x and routing and share w13/w2: the weights (≥ 1.2 GB for the Qwen3
# presets) stream through L2 every iteration anyway, so one draw per preset saves memory.
INPUT_SETS = 2
DY_SEED = 12345  # dy is fixed random data, the same for every backend


@dataclasses.dataclass
class Operands:
    """One input set of a case; x and topk_weights are leaves of their own, w13/w2 are shared."""

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.x, self.topk_ids, self.topk_weights, self.w13, self.w2

    def clear_grads(self) -> None:
        for t in (self.x, self.topk_weights, self.w13, self.w2):
            t.grad = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.args())


@dataclasses.dataclass(frozen=True)
class Plan:
    presets: Sequence[str]
    tokens: Sequence[int]
    routings: Sequence[str]
    backends: Sequence[str]
    precisions: Sequence[str]
    modes: Sequence[str]
    budget: Budget
    skewed_tokens: Sequence[int] = ()  # those of `tokens` also measured with skewed routing
    main_grad: bool = False  # w13 and w2 get fp32 main_grad buffers (fused adds its weight gradients there)
    id_dtype: torch.dtype = torch.int32  # topk_ids' dtype

    def cases(self) -> list[tuple[int, str]]:
        """(tokens, routing) pairs in the order they run."""
        cases = list(itertools.product(self.tokens, self.routings))
        cases += [(t, "skewed") for t in self.skewed_tokens
                  if t in self.tokens and (t, "skewed") not in cases]
        return sorted(cases, key=lambda case: case[0])


def run_plan(plan: Plan, device: Device) -> list[Record]:
    with backends.sweep_settings():
        return _run_plan(plan, device)


def _run_plan(plan: Plan, device: Device) -> list[Record]:
    records = []
    total = len(plan.presets) * len(plan.cases()) * len(plan.precisions) * len(plan.backends)
    progress = tqdm(total=total, desc="megamoe.bench", unit="run", file=sys.stderr) if tqdm else None
    for preset in plan.presets:
        shape = PRESETS[preset]
        _describe(progress, f"{preset}: generating inputs")
        x_all, w13, w2 = _preset_inputs(shape, max(t for t, _ in plan.cases()), device.device, plan.main_grad)
        for tokens, routing in plan.cases():
            sets = _operand_sets(shape, tokens, routing, x_all, w13, w2, plan.id_dtype)
            dy = torch.randn(tokens, shape.hidden_size, generator=torch.Generator().manual_seed(DY_SEED))
            dy = dy.to(device.device, torch.bfloat16)
            for precision, name in itertools.product(plan.precisions, plan.backends):
                _describe(progress, f"{preset} T={tokens} {routing} {name} {precision}")
                record = Record(preset, tokens, routing, name, precision, routes=_routes(sets))
                _measure_backend(record, shape, sets, dy, plan, device)
                records.append(record)
                if progress:
                    progress.update()
            del sets, dy
        del x_all, w13, w2
        device.release_cached_memory()
    if progress:
        progress.close()
    return records


def _describe(progress, text: str) -> None:
    if progress:
        progress.set_postfix_str(text)


def _preset_inputs(shape: MoEShape, max_tokens: int, device: torch.device, main_grad: bool = False):
    """x rows for every input set of the largest case (set s of a case with T tokens takes rows
    [s·max_tokens, s·max_tokens + T)), w13 and w2 (with main_grad, each with an fp32 `main_grad`
    buffer): one make_inputs call per preset."""
    x_all, _, _, w13, w2 = make_inputs(shape, INPUT_SETS * max_tokens, device=device)
    for w in (w13, w2) if main_grad else ():
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=device)
    return x_all, w13.requires_grad_(), w2.requires_grad_()


def _operand_sets(shape: MoEShape, tokens: int, routing: str, x_all: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, id_dtype: torch.dtype = torch.int32) -> list[Operands]:
    max_tokens = x_all.shape[0] // INPUT_SETS
    sets = []
    for seed in range(INPUT_SETS):
        x = x_all[seed * max_tokens:][:tokens].detach().requires_grad_()
        ids, weights = make_routing(tokens, shape.num_experts, shape.top_k, routing, device=x.device,
                                    generator=torch.Generator().manual_seed(seed))
        sets.append(Operands(x, ids.to(id_dtype), weights.requires_grad_(), w13, w2))
    return sets


def _routes(sets: list[Operands]) -> int:
    """Non-masked routes of a case, averaged over its input sets (the ones the times are over)."""
    return round(sum(int((s.topk_ids >= 0).sum()) for s in sets) / len(sets))


def _measure_backend(record: Record, shape: MoEShape, sets: list[Operands], dy: torch.Tensor,
                     plan: Plan, device: Device) -> None:
    try:
        fn = backends.build(record.backend, shape, record.precision, device.device)
    except backends.Unavailable as why:
        record.skipped = str(why)
        return
    reasons = {}
    measures_memory = record.backend not in backends.GRAPHED_BACKENDS
    for mode in plan.modes:
        result = _measure_mode(fn, mode, sets, dy, plan.budget, device)
        if isinstance(result, str):
            reasons[mode] = result
            continue
        setattr(record, f"{mode}_ms", result.median_ms)
        setattr(record, f"{mode}_repeats", result.repeats)
        setattr(record, f"{mode}_sm_mhz", result.sm_clock_mhz)
        setattr(record, f"{mode}_power_w", result.power_w)
        setattr(record, f"{mode}_single_ms", result.single_call_ms)
        if result.peak_extra_bytes is not None and measures_memory:
            operand_bytes = sets[0].nbytes() + (dy.numel() * dy.element_size() if mode == "fwdbwd" else 0)
            # The last mode wins, so fwdbwd's figure is kept when both ran.
            record.peak_mem_gb = (result.peak_extra_bytes + operand_bytes) / 1e9
        if mode == "fwdbwd" and measures_memory:
            record.saved_gb = saved_for_backward_gb(fn, sets[0])
    if reasons:
        distinct = set(reasons.values())
        if len(distinct) == 1 and len(reasons) == len(plan.modes):
            record.skipped = distinct.pop()
        else:
            record.skipped = "; ".join(f"{mode}: {why}" for mode, why in reasons.items())


def _measure_mode(fn: backends.MoEFn, mode: str, sets: list[Operands], dy: torch.Tensor, budget: Budget,
                  device: Device) -> Measurement | str:
    """The measurement, or why there is none."""
    run = step(fn, mode, sets, dy)

    def reset():
        for s in sets:
            s.clear_grads()

    try:
        return measure(run, reset, device, budget)
    except torch.OutOfMemoryError as error:
        reason = f"out of memory ({_first_line(error)})"
    except (NotImplementedError, ValueError) as error:  # unsupported precision, shape or hardware
        reason = f"{type(error).__name__}: {_first_line(error)}"
    except Exception as error:  # keep the other results of a long run; report loudly
        traceback.print_exc(file=sys.stderr)
        reason = f"error: {type(error).__name__}: {_first_line(error)}"
    # Outside the except blocks, so the traceback no longer pins the failed run's tensors.
    reset()
    device.release_cached_memory()
    return reason


def saved_for_backward_gb(fn: backends.MoEFn, operands: Operands) -> float | None:
    """Bytes of the tensors one forward saves for its backward, each counted once, w13/w2 excluded."""
    weights = {operands.w13.data_ptr(), operands.w2.data_ptr()}
    saved = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in weights:
            saved[(t.data_ptr(), t.numel(), t.dtype)] = t.numel() * t.element_size()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(*operands.args())
    except Exception:  # e.g. a compiled graph that will not run under the hooks: no figure
        return None
    finally:
        operands.clear_grads()
    return sum(saved.values()) / 1e9


def _first_line(error: BaseException, limit: int = 300) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:limit] if lines else ""


def step(fn: backends.MoEFn, mode: str, sets: list[Operands], dy: torch.Tensor) -> Callable[[int], None]:
    """run(i): one timed iteration of `mode` on input set i (mod the number of sets). fwd runs under
    no_grad; fwdbwd runs y.backward(dy), leaving the gradients for the caller to clear, or a backend's
    own step (backends.StepGraphed: forward and backward replayed from one graph)."""
    if mode == "fwd":
        def run(i: int) -> None:
            with torch.no_grad():
                fn(*sets[i % len(sets)].args())
    elif isinstance(fn, backends.StepGraphed):
        def run(i: int) -> None:
            fn.step(*sets[i % len(sets)].args(), dy)
    else:
        def run(i: int) -> None:
            fn(*sets[i % len(sets)].args()).backward(dy)
    return run
