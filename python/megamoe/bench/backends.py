"""The implementations being compared, each as fn(x, topk_ids, topk_weights, w13, w2) -> y."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable

import torch

import megamoe
from megamoe import fp8
from megamoe.shapes import MoEShape
from megamoe.validation import BACKENDS as MOE_BACKENDS

MoEFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# megamoe.moe's own backends, fused keeping z alone (recompute="gather") and only its inputs
# (recompute=True) for the backward, fused replayed from CUDA graphs (forward and backward each a
# graph, or both in one: a training step's capture), then what users run today: grouped-fp8 is
# TorchTitan's FP8 MoE path on Hopper (--precision fp8 only).
BACKENDS = (*MOE_BACKENDS, "fused-recompute-gather", "fused-recompute", "fused-graphed", "fused-step-graphed",
            "grouped-compiled", "hf-grouped_mm", "grouped-fp8")
# The backends whose buffers come from CUDA graph pools, allocated at capture before the measured run:
# their peak and kept-for-backward figures would not be comparable, so none are recorded.
GRAPHED_BACKENDS = ("fused-graphed", "fused-step-graphed")
# The backends that take a precision other than bf16 (the others are recorded as skipped there).
LOW_PRECISION_BACKENDS = ("fused", "fused-recompute-gather", "fused-recompute", *GRAPHED_BACKENDS, "grouped-fp8")


# torch.compile keeps at most `recompile_limit` (default 8) specialisations of a function and then
# silently runs it eagerly; a sweep needs one per preset, token count and grad mode.
RECOMPILE_LIMIT = 1024


def sweep_settings():
    """Context for a whole benchmark sweep (process-wide torch settings, restored on exit)."""
    return torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT)


class Unavailable(Exception):
    """The backend cannot run in this environment; the message says why."""


def build(name: str, shape: MoEShape, precision: str, device: torch.device | None = None) -> MoEFn:
    """The backend `name` at `precision`, or Unavailable saying why it cannot run (device: where it will
    run; None: the current CUDA device if there is one)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose from {BACKENDS}")
    if name == "grouped-fp8":
        return _grouped_fp8(precision, device)
    if precision != "bf16" and name not in LOW_PRECISION_BACKENDS:
        counterpart = " (FP8 counterpart: grouped-fp8)" if name.startswith("grouped") else ""
        raise Unavailable(f"{name} runs bf16 only{counterpart}, not precision={precision!r}")
    if name in MOE_BACKENDS:
        return functools.partial(megamoe.moe, backend=name, precision=precision)
    if name in GRAPHED_BACKENDS:
        fused = functools.partial(megamoe.moe, backend="fused", precision=precision)
        graphed = _graphed(fused, device)
        return graphed if name == "fused-graphed" else StepGraphed(graphed, fused)
    if name.startswith("fused-recompute"):
        recompute = "gather" if name == "fused-recompute-gather" else True
        return functools.partial(megamoe.moe, backend="fused", precision=precision, recompute=recompute)
    if name == "grouped-compiled":
        # dynamic=False: a training run sees one shape and gets kernels specialised for it; the
        # default would switch to dynamic shapes once the benchmark's second token count appears.
        return torch.compile(functools.partial(megamoe.moe, backend="grouped", precision=precision),
                             dynamic=False)
    return _hf_grouped_mm(shape, precision)


def _graphed(fn: MoEFn, device: torch.device | None) -> MoEFn:
    """fn replayed from CUDA graphs, the way a small batch sheds its host and launch time: a forward
    graph per input shape under no_grad, torch.cuda.make_graphed_callables' forward and backward graphs
    with grad. Each call copies its x, ids and weights into the graph's own inputs (w13 and w2 are the
    graph's: the benchmark's sets share them). In block FP8 the graphs read the weights' cached copies,
    made by the eager warm-up calls before capture (megamoe.fp8.cached_weights_in_graphs). Weights with
    fp32 `main_grad` buffers get their gradients added there, so autograd sees none for them: unused
    inputs to make_graphed_callables."""
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if device is None or device.type != "cuda":
        raise Unavailable("fused-graphed needs a CUDA GPU (CUDA graphs)")
    graphs = {}

    def run(x, topk_ids, topk_weights, w13, w2):
        args = (x, topk_ids, topk_weights, w13, w2)
        key = (torch.is_grad_enabled(), w13.data_ptr(), w2.data_ptr(),
               tuple((a.shape, a.dtype, a.requires_grad) for a in args))
        if key not in graphs:
            static = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args[:3]) + (w13, w2)
            if torch.is_grad_enabled():
                _free_earlier_graphs()
                with fp8.cached_weights_in_graphs():
                    graphs[key] = torch.cuda.make_graphed_callables(fn, static, allow_unused_input=True)
            else:
                graphs[key] = _forward_graph(fn, static)
        return graphs[key](*args)
    return run


def _forward_graph(fn: MoEFn, static: tuple) -> MoEFn:
    """fn(*static) captured in a CUDA graph (_capture); replay(*args) copies args into static where they
    differ and returns the graph's output tensor."""
    graph, out = _capture(lambda: fn(*static))

    def replay(*args):
        _copy_into(static, args)
        graph.replay()
        return out
    return replay


def _free_earlier_graphs() -> None:
    """Graphs of earlier captures that only a garbage collection frees (the callables PyTorch makes are
    cyclic) go before a capture: one destroyed while the capture runs would invalidate it."""
    gc.collect()


def _capture(run: Callable[[], object], reset: Callable[[], None] = lambda: None) -> tuple:
    """(graph, what run() returned while captured): run() captured in a CUDA graph after three warm-up
    runs on a side stream, as capture needs, each followed by reset() (in block FP8 the warm-ups make
    the weights' cached copies, which the graph reads: fp8.cached_weights_in_graphs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
            reset()
    torch.cuda.current_stream().wait_stream(side)
    _free_earlier_graphs()
    graph = torch.cuda.CUDAGraph()
    with fp8.cached_weights_in_graphs(), torch.cuda.graph(graph):
        out = run()
    return graph, out


def _copy_into(static: tuple, given: tuple) -> None:
    """Each given input copied into the graph's own where it is another tensor (without autograd: the
    graph's x and topk_weights may be leaves that require grad)."""
    with torch.no_grad():
        for held, value in zip(static, given):
            if held.data_ptr() != value.data_ptr():
                held.copy_(value)


class StepGraphed:
    """fn with its forward and backward captured in one CUDA graph, as a training step's capture takes
    them (PyTorch's whole-network capture): step(x, topk_ids, topk_weights, w13, w2, dy) copies its
    inputs into the graph's own and replays y = fn(...); y.backward(dy), returning the graph's
    (y, dx, dtopk_weights, dw13, dw2), which the next replay overwrites. A graph per input shape
    (w13 and w2 are the graph's: the benchmark's sets share them); the weights' gradients land in the
    graph's tensors, or are added to their fp32 `main_grad` buffers. Called as fn(...), it is the
    fused-graphed backend (its forward alone: a forward graph)."""

    def __init__(self, graphed: MoEFn, fn: MoEFn):
        self._graphed, self._fn, self._steps = graphed, fn, {}

    def __call__(self, *args):
        return self._graphed(*args)

    def step(self, x, topk_ids, topk_weights, w13, w2, dy):
        args = (x, topk_ids, topk_weights, dy)
        key = (w13.data_ptr(), w2.data_ptr(), tuple((a.shape, a.dtype) for a in args))
        if key not in self._steps:
            self._steps[key] = self._capture(args, w13, w2)
        static, graph, outputs = self._steps[key]
        _copy_into(static, args)
        graph.replay()
        return outputs

    def _capture(self, args, w13, w2):
        x, ids, weights, dy = (a.detach().clone() for a in args)
        x.requires_grad_(), weights.requires_grad_()

        def run():
            y = self._fn(x, ids, weights, w13, w2)
            y.backward(dy)
            return y

        def clear_grads():
            x.grad = weights.grad = w13.grad = w2.grad = None
        graph, y = _capture(run, clear_grads)
        outputs = (y, x.grad, weights.grad, w13.grad, w2.grad)
        clear_grads()  # the graph's gradient tensors live on in `outputs` (and in its memory pool)
        return (x, ids, weights, dy), graph, outputs


def _grouped_fp8(precision: str, device: torch.device | None) -> MoEFn:
    """The grouped path with torch._scaled_grouped_mm rowwise-FP8 expert GEMMs (TorchTitan on Hopper)."""
    if precision != "fp8":
        raise Unavailable(f"grouped-fp8 is the FP8 baseline: it runs with --precision fp8 only, "
                          f"not {precision!r}")
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if device is None or device.type != "cuda":
        raise Unavailable(f"grouped-fp8 needs an sm_90 GPU (torch._scaled_grouped_mm with rowwise scales on "
                          f"Hopper), this run is on the {'cpu' if device is None else device.type}")
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        raise Unavailable(f"grouped-fp8 needs an sm_90 GPU (torch._scaled_grouped_mm with rowwise scales on "
                          f"Hopper), this is sm_{capability[0]}{capability[1]}")
    from megamoe.backends import grouped_fp8
    if grouped_fp8._scaled_grouped_mm is None:
        raise Unavailable(f"grouped-fp8 needs torch._scaled_grouped_mm, which torch {torch.__version__} lacks")
    return grouped_fp8.grouped_fp8_moe


def _hf_grouped_mm(shape: MoEShape, precision: str) -> MoEFn:
    """transformers' own Qwen3-MoE experts module with its `grouped_mm` experts implementation."""
    if precision != "bf16":
        raise Unavailable("transformers' experts run in bf16 only")
    try:
        from transformers import Qwen3MoeConfig
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except ImportError as error:
        raise Unavailable(f"transformers with Qwen3-MoE experts implementations not importable: {error}") from error
    if "grouped_mm" not in ALL_EXPERTS_FUNCTIONS:
        raise Unavailable("this transformers has no 'grouped_mm' experts implementation")

    config = Qwen3MoeConfig(hidden_size=shape.hidden_size, moe_intermediate_size=shape.intermediate_size,
                            num_experts=shape.num_experts, num_experts_per_tok=shape.top_k,
                            num_hidden_layers=1, experts_implementation="grouped_mm")
    # The experts module reads its implementation from config._experts_implementation at every call.
    config._experts_implementation = "grouped_mm"
    # On the meta device: the module's own parameters are never allocated; functional_call runs it
    # on our w13/w2 instead, so it sees the same weights, the gradients land on them, and its
    # memory figure is not inflated by a second copy of the weights.
    with torch.device("meta"):
        experts = Qwen3MoeSparseMoeBlock(config).experts

    def forward(x, topk_ids, topk_weights, w13, w2):
        # As its router would hand them over: int64 ids, weights in the activations' dtype.
        return torch.func.functional_call(experts, {"gate_up_proj": w13, "down_proj": w2},
                                          (x, topk_ids.long(), topk_weights.to(x.dtype)))

    return forward
