"""megamoe.moe(..., group=g): expert parallelism over a torch.distributed process group.

Every rank of g runs the same MoE calls in the same order (SPMD). Rank r holds its tokens x_r
[T_r, H] with (topk_ids_r, topk_weights_r) over all E = W * E_local experts, and the weights of its
experts [r E_local, (r + 1) E_local). The data path is the pull model of megamoe.exchange: the
ranks are processes, the peer tables point into the other ranks' memory, and barriers
(megamoe_barrier, a GPU kernel that times out instead of hanging) order the phases:

  metadata     all-gather of (T_r, K, H, 2I, E_local), read by the host, then of topk_ids (once per forward)
  publish      rank r copies its rows (x, or dy and its topk weights) into its shared buffer
  barrier 1
  own plan     each owner writes its routing plan's route -> slot table into its shared buffer
  dispatch     each owner pulls its routes' rows from every rank's shared rows (for K >= 2 W, from
               whole copies of them made here first)
  experts      the single-rank kernels on the owner's pool; GEMM2 (or dx) into its shared out pool
  barrier 2
  combine      rank r pulls its routes' rows from their owners' out pools, fixed-order sum

Shared buffers are written only where no peer can still read them: the rows before barrier 1 (peers
read them before barrier 2 of the previous call), the plan table and the out pool after barrier 1
(peers read them after barrier 2 of the previous call). Each shared buffer is a cudaMalloc of its
own (megamoe_shared_alloc), mapped into every peer through its CUDA IPC handle, opened on the peer's
own GPU; the buffers grow, never shrink, at a point where no kernel of any rank is in
flight. Ranks on different GPUs need peer access between them (NVLink or PCIe P2P) and processes
that see every GPU of the group under the same numbering; W processes may also share one GPU.

The backward keeps the owner's pool of x and the plans from the forward and recomputes z (with
recompute=True it keeps only x and the plans: x is published beside dy and its pool pulled again;
with recompute="gather" also the owner's z, which it then does not recompute; z is sized for every
route of the group, as the owner's pools are), and uses the same two-barrier call for dy: owners
compute dh, dp, dx per route (into the shared out pool) and their own experts' weight gradients;
ranks pull dx rows and dp values back. It has no host
collective, so a rank that skips it makes its peers time out, not hang. (The forward's metadata
all-gather is a host collective: a rank that never arrives there is caught by the process group's
own timeout, `init_process_group(timeout=...)`.)

Block FP8 (precision "fp8" / "fp8_bwd", the single-rank op's recipe, megamoe/fused.py): each rank
quantises its own rows once per token (1 x 128 scales), and the e4m3 rows and their scales travel
instead of bf16 x in the forward ("fp8") and beside bf16 dy (the weight gradients read bf16 dy):
half the bytes for x. In "fp8" the backward pulls x's bf16 rows too, for dW13. The owners run the
single-rank FP8 kernels on the pulled pools, so every rank's output and gradients are bit for bit
those of one rank holding every expert.

Under torch.compile the layer is one custom op forward (megamoe::group_moe_forward) and one backward:
the forward returns what its backward needs (the plan's buffer, every rank's token count, the pool of
x) as tensors, whose sizes its fake implementation leaves unbacked, since only the all-gather knows
the group's token total. The process group travels as its name.

The host never waits for the whole queue: the metadata all-gather runs on a stream of its own (it
waits for the previous call's collectives only, not for the kernels queued on the compute stream),
and each call ends by waiting for its own first barrier and routing only (later kernels keep
running while Python queues the next layer). That wait reads the barrier status from pinned memory:
this call's barrier 1 and the previous call's barrier 2 (stream order puts that one first), so a
peer missing at barrier 2 raises at this rank's next expert-parallel call.
"""

from __future__ import annotations

import ctypes
import itertools
import os

import torch

from . import _native, fp8
from .activation import check_activation
from .exchange import combine_from_owners, pointer_table, pool_scales, pull_rows
from .fused import autograd_backward
from .gemm import (empty_z, gated_backward, gated_backward_fp8, gated_gemm, gated_gemm_fp8, grouped_gemm,
                   grouped_gemm_fp8, grouped_gemm_scatter, recompute_z, reduce_dp, transpose_quantize, weight_grad,
                   weight_grad_fp8)
from .routing import RoutingPlan, build_routing, pool_capacity
from .validation import IdRangeCheck, check_fused_precision

_PHASES = ("dispatch", "combine")
_GROWTH = 1.25  # headroom when a shared buffer grows, so a slowly rising T does not regrow every call


def _timeout_ns() -> int:
    return int(float(os.environ.get("MEGAMOE_EP_TIMEOUT_S", "120")) * 1e9)


class _SharedBuffer:
    """Memory of this rank that its peers map (megamoe_shared_alloc: a cudaMalloc of its own, with a
    CUDA IPC handle), seen by torch through the CUDA array interface; freed with the last tensor
    that views it."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device, self.ptr = device.index, ctypes.c_void_p()
        self.handle = ctypes.create_string_buffer(_native.IPC_HANDLE_BYTES)
        # Held by the buffer, so a buffer collected at interpreter exit, after this module's globals, can free itself.
        self._free = _native.library().megamoe_shared_free
        _native.check(_native.library().megamoe_shared_alloc(self.device, nbytes, ctypes.byref(self.ptr),
                                                             self.handle), "expert-parallel shared buffer")
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (self.ptr.value, False),
                                         "strides": None, "stream": None, "version": 3}

    def __del__(self):
        self._free(self.device, self.ptr)


class _Workspace:
    """One process group's shared buffers, their peers' mappings and the barrier's signals."""

    def __init__(self, group, device: torch.device):
        import torch.distributed as dist
        self.dist, self.group, self.device = dist, group, device
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if self.world > _native.MAX_PEERS:
            raise ValueError(f"expert parallelism runs up to {_native.MAX_PEERS} ranks per group, this group has "
                             f"{self.world}")
        self.buffers: dict[str, tuple[torch.Tensor, list[int]]] = {}
        self.signals, signal_ptrs = self._share(self.world, torch.int32, zero=True)
        self.signal_table = pointer_table(signal_ptrs)
        self.status = torch.zeros(2 * len(_PHASES), dtype=torch.int32, device=device)
        self.status_host = torch.zeros_like(self.status, device="cpu").pin_memory()
        self.status_read = torch.cuda.Event()
        self.epoch = 0
        self.metadata_stream = torch.cuda.Stream(device)

    def _share(self, numel: int, dtype: torch.dtype, zero: bool = False) -> tuple[torch.Tensor, list[int]]:
        """(a new buffer of this rank, every rank's buffer as a pointer valid here): a collective."""
        buffer = _SharedBuffer(numel * dtype.itemsize, self.device)
        mine = (buffer.handle.raw, self.device.index)
        local = torch.as_tensor(buffer, device=self.device).view(dtype)
        if zero:  # before any peer can write into it
            local.zero_()
            torch.cuda.synchronize(self.device)
        shared = [None] * self.world
        self.dist.all_gather_object(shared, mine, group=self.group)
        ptrs = []
        for r, (handle, peer_device) in enumerate(shared):
            if r == self.rank:
                ptrs.append(local.data_ptr())
                continue
            self._enable_peer_access(peer_device)
            ptr = ctypes.c_void_p()
            _native.check(_native.library().megamoe_shared_open(self.device.index, handle, ctypes.byref(ptr)),
                          f"expert parallelism: mapping rank {r}'s memory on cuda:{self.device.index}")
            ptrs.append(ptr.value)
        return local, ptrs

    def _unmap(self, name: str) -> None:
        """Closes this rank's mappings of the peers' buffer `name` and drops its own."""
        _, ptrs = self.buffers.pop(name)
        for r, ptr in enumerate(ptrs):
            if r != self.rank:
                _native.check(_native.library().megamoe_shared_close(self.device.index, ptr),
                              f"expert parallelism: unmapping rank {r}'s memory")

    def _enable_peer_access(self, peer_device: int) -> None:
        """Checks that this GPU can reach the peer's, with a clear error if not (a no-op once it can)."""
        with torch.cuda.device(self.device):
            _native.check(_native.library().megamoe_enable_peer_access(peer_device),
                          f"expert parallelism between cuda:{self.device.index} and cuda:{peer_device}")

    def reserve(self, sizes: dict[str, tuple[int, torch.dtype]]) -> None:
        """Makes every buffer hold at least its size. Every rank passes the same sizes (they follow from
        the gathered metadata), so every rank grows the same buffers in the same collective."""
        grow = {name: (numel, dtype) for name, (numel, dtype) in sizes.items()
                if name not in self.buffers or self.buffers[name][0].numel() < numel}
        if not grow:
            return
        # Nothing of this rank, then of any rank, may still read a buffer that is replaced.
        torch.cuda.synchronize(self.device)
        self.dist.barrier(group=self.group)
        for name, (numel, dtype) in sorted(grow.items()):
            if name in self.buffers:
                self._unmap(name)
            self.buffers[name] = self._share(max(1, int(numel * _GROWTH)), dtype)

    def local(self, name: str, numel: int) -> torch.Tensor:
        return self.buffers[name][0][:numel]

    def table(self, name: str):
        return pointer_table(self.buffers[name][1])

    def copy_from_peer(self, out: torch.Tensor, name: str, r: int, offset: int) -> None:
        """out = rank r's buffer `name` from element `offset` on, queued on the current stream."""
        itemsize = out.element_size()
        _native.check(_native.library().megamoe_copy_async(
            out.data_ptr(), self.buffers[name][1][r] + offset * itemsize, out.numel() * itemsize,
            _native.stream(self.device)), f"expert parallelism: reading rank {r}'s {name}")

    def barrier(self, phase: int) -> None:
        """Phase 1 or 2 of the current call, queued on the current stream."""
        self.epoch += 1
        _native.check(_native.library().megamoe_barrier(
            self.signal_table, self.world, self.rank,
            self.epoch, phase, _timeout_ns(), self.status[2 * (phase - 1):].data_ptr(),
            _native.stream(self.device)), "expert-parallel barrier")

    def read_status(self) -> None:
        """Queues the copy of the barrier status to the host: right behind barrier 1, it holds this
        call's phase 1 and the previous call's phase 2."""
        self.status_host.copy_(self.status, non_blocking=True)
        self.status_read.record()

    def raise_if_timed_out(self) -> None:
        """Waits for read_status's copy (not for the kernels queued after it), then raises if this
        call's barrier 1 or the previous call's barrier 2 timed out."""
        self.status_read.synchronize()
        lib = _native.library()
        for phase in range(len(_PHASES)):
            pair = (ctypes.c_int32 * 2)(*self.status_host[2 * phase:2 * phase + 2].tolist())
            _native.check(lib.megamoe_barrier_check(pair, self.rank, _timeout_ns()),
                          f"expert-parallel {_PHASES[phase]} (rank {self.rank} of {self.world})")


_WORKSPACES: dict = {}


def _workspace(group, device: torch.device) -> _Workspace:
    key = (group, device)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = _Workspace(group, device)
    return _WORKSPACES[key]


class _Meta:
    """Every rank's token count, the routes' global numbering and this rank's plan over all routes:
    what the forward learns from the metadata all-gather (gather) and the backward gets back from what
    the forward kept, the plan's buffer and the token counts (kept)."""

    def __init__(self, ws: _Workspace, tokens: list[int], top_k: int, num_local: int):
        self.tokens, self.top_k, self.num_local = tokens, top_k, num_local
        self.num_experts = num_local * ws.world
        self.route_offsets = list(itertools.accumulate((t * top_k for t in tokens), initial=0))
        self.offsets = (ctypes.c_int64 * (ws.world + 1))(*self.route_offsets)
        self.total_routes = self.route_offsets[-1]
        self.plan = self.id_range = None

    @classmethod
    def gather(cls, ws: _Workspace, x: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, precision: str,
               recompute: bool, keep_z: bool) -> _Meta:
        """The metadata all-gather, the plan, and the shared buffers grown to this call's sizes."""
        num_local, two_i, hidden = w13.shape
        top_k = topk_ids.shape[1]
        shape = (x.shape[0], top_k, hidden, two_i, num_local)
        with torch.cuda.stream(ws.metadata_stream):  # not behind the compute stream's queue
            shapes = [tuple(s) for s in torch.stack(
                _all_gather(ws, torch.tensor(shape, dtype=torch.int64))).tolist()]
        for r, other in enumerate(shapes):
            if other[1:] != shape[1:]:
                raise ValueError(f"every rank of the group needs the same K, H, 2I and E_local: rank {r} has "
                                 f"{other[1:]}, rank {ws.rank} {shape[1:]}")
        meta = cls(ws, [s[0] for s in shapes], top_k, num_local)
        if meta.total_routes == 0:  # no rank has tokens: nothing to exchange (every rank sees it)
            return meta
        ids_all = meta._gather_ids(ws, topk_ids)
        meta.plan = build_routing(ids_all, meta.num_experts, ws.rank * num_local, num_local)
        meta.id_range = IdRangeCheck(meta.plan, meta.num_experts)
        ws.reserve(meta._buffer_sizes(hidden, precision, recompute, keep_z))
        return meta

    @classmethod
    def kept(cls, ws: _Workspace, tokens: torch.Tensor, plan_buffer: torch.Tensor, top_k: int,
             num_local: int) -> _Meta:
        """The forward's metadata from its token counts and plan buffer (the shared buffers already
        have its sizes)."""
        meta = cls(ws, tokens.tolist(), top_k, num_local)
        if meta.total_routes:
            meta.plan = RoutingPlan.from_buffer(plan_buffer, sum(meta.tokens), top_k, num_local, meta.num_experts,
                                                ws.rank * num_local)
        return meta

    def _buffer_sizes(self, hidden: int, precision: str, recompute: bool,
                      keep_z: bool) -> dict[str, tuple[int, torch.dtype]]:
        max_tokens, top_k = max(self.tokens), self.top_k
        sizes = {"rows": (max_tokens * hidden, torch.bfloat16), "weights": (max_tokens * top_k, torch.float32),
                 "route_to_slot": (self.total_routes, torch.int32),
                 "out": (pool_capacity(self.total_routes, self.num_local) * hidden, torch.bfloat16),
                 "dp": (self.total_routes, torch.float32)}
        fp8_rows = {"rows_fp8": (max_tokens * hidden, torch.uint8),  # e4m3 rows, token-major scales
                    "scales": (max_tokens * fp8.token_scale_columns(hidden), torch.float32)}
        if precision != "bf16":
            sizes |= fp8_rows
        if recompute and not keep_z and precision == "fp8":  # the backward publishes x again, in e4m3 for z
            sizes |= {f"x_{name}": size for name, size in fp8_rows.items()}
        if recompute or precision == "fp8":  # and in bf16 for dW13 (and z in bf16)
            sizes |= {"x_rows": sizes["rows"]}
        return sizes

    def _gather_ids(self, ws: _Workspace, ids: torch.Tensor) -> torch.Tensor:
        """Every rank's topk_ids, rank by rank [Σ T_r, K] on this device, in int64 whichever dtype each
        rank passed (the gather needs one dtype on every rank; the routing kernels read int64 as it is)."""
        padded = torch.full((max(self.tokens), self.top_k), -1, dtype=torch.int64, device=ids.device)
        padded[:ids.shape[0]] = ids
        parts = _all_gather(ws, padded)
        return torch.cat([p[:t] for p, t in zip(parts, self.tokens)]).to(ids.device).contiguous()


def _all_gather(ws: _Workspace, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's `tensor` (of one shape on every rank): on this GPU, or on the host for gloo."""
    tensor = tensor.to("cpu" if ws.dist.get_backend(ws.group) == "gloo" else ws.device)
    parts = [torch.empty_like(tensor) for _ in range(ws.world)]
    ws.dist.all_gather(parts, tensor, group=ws.group)
    return parts


def _publish_and_pull(ws: _Workspace, meta: _Meta, plan: RoutingPlan, rows: dict[str, torch.Tensor],
                      weights: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Publish this rank's rows (shared buffer name -> [T_r, row] tensor of its dtype) and weights,
    barrier 1, publish the plan's route -> slot table, and pull this owner's pool of each rows tensor
    (by the same names) and its rows' weights (with the first rows; None without weights)."""
    for name, part in rows.items():
        ws.local(name, part.numel()).copy_(part.reshape(-1))
    if weights is not None:
        ws.local("weights", weights.numel()).copy_(weights.reshape(-1))
    ws.barrier(1)
    ws.read_status()
    ws.local("route_to_slot", meta.total_routes).copy_(plan.route_to_slot.reshape(-1))
    pools, weights_pool = {}, None
    for name, part in rows.items():
        weights_table = None if weights is None or weights_pool is not None else ws.table("weights")
        if meta.top_k < 2 * ws.world:
            pool = pull_rows(plan, ws.table(name), meta.offsets, part, weights_table)
        else:
            staged, rows_table = _staged_rows(ws, meta, name, part)
            # staged is freed only once the pull that reads it is queued: freed earlier, the caching
            # allocator could hand its memory to the pull's own pool.
            pool = pull_rows(plan, rows_table, meta.offsets, part, weights_table)
            del staged
        if weights_table is not None:
            pool, weights_pool = pool
        pools[name] = pool
    return pools, weights_pool


def _staged_rows(ws: _Workspace, meta: _Meta, name: str, rows: torch.Tensor):
    """(every peer's shared rows `name` copied here whole by the copy engine, on the current stream;
    the pointer table of this rank's rows and those copies). The pull reads a row once per route, so
    a token with K / W routes per rank crosses the link about K / W times when read in place; copied
    whole, once (every token has a route here but for a few when K >= 2 W)."""
    staged = rows.new_empty(sum(meta.tokens) - meta.tokens[ws.rank], rows.shape[1])
    pointers, first = [], 0
    for r, tokens in enumerate(meta.tokens):
        if r == ws.rank:
            pointers.append(rows.data_ptr())
            continue
        part = staged[first:first + tokens]
        if tokens:
            ws.copy_from_peer(part, name, r, 0)
        pointers.append(part.data_ptr())
        first += tokens
    return staged, pointer_table(pointers)


def _fp8_rows(rows: torch.Tensor, prefix: str = "") -> dict[str, torch.Tensor]:
    """rows [T_r, H] quantised once per token, as the shared buffers `prefix`rows_fp8 and `prefix`scales
    hold them: e4m3 bytes, token-major scales."""
    q, token_scales = fp8.quantize_rows(rows, token_major=True)
    return {f"{prefix}rows_fp8": q.view(torch.uint8), f"{prefix}scales": token_scales}


def _fp8_pool(pools: dict[str, torch.Tensor], hidden: int, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """The pulled e4m3 rows and token-major scales (of _fp8_rows' names) as the FP8 GEMMs read them:
    (pool, scales [H / 128, rows])."""
    return pools[f"{prefix}rows_fp8"].view(torch.float8_e4m3fn), pool_scales(pools[f"{prefix}scales"], hidden)


def owner_backward(x_pool, dy_pool, p_pool, w13, w2, plan, dx_pool, dw13, dw2, activation: str = "swiglu",
                   x_scales: torch.Tensor | None = None, dy_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
                   x_bf16: torch.Tensor | None = None, z: torch.Tensor | None = None) -> torch.Tensor:
    """The experts' owner's part of the backward, on its pools of x, dy and p (each row's topk weight):
    z recomputed, dh through the activation's backward, dx per route in pool order into dx_pool, its
    experts' weight gradients into dw13 / dw2 (bf16 written, fp32 added to); returns dp over the
    plan's routes (every rank's) in fp32, 0 for the routes it does not own (the tests' virtual ranks run
    it too). In block FP8 as the single-rank op (megamoe/fused.py): dy_fp8, the e4m3 pool of dy with
    its scales, makes dh, dx and the weight gradients FP8 GEMMs; with x_scales the pool of x is e4m3
    ("fp8": z recomputed in FP8, dW13 on x_bf16, the pool of x's bf16 rows), without it bf16
    ("fp8_bwd", and x_bf16 is x_pool). With z (the forward's, kept), none is recomputed and x_pool is
    bf16 in every precision."""
    if z is not None:
        x_bf16 = x_pool
    elif x_scales is None:
        z, x_bf16 = recompute_z(x_pool, w13, plan, activation), x_pool
    else:
        w13_fp8 = fp8.quantized_weight(w13)
        z = recompute_z(x_pool, w13_fp8.q, plan, activation, x_scales, w13_fp8.scales)
    if dy_fp8 is None:
        dz, hp, dp_partial = gated_backward(dy_pool, w2, z, p_pool, plan, activation)
        in_place = torch.arange(x_pool.shape[0], dtype=torch.int32, device=x_pool.device)  # row s goes to row s
        grouped_gemm_scatter(dz, w13, plan, in_place, dx_pool, b_is_k_by_n=True)
        weight_grad(dz, x_bf16, plan, dw13)
        weight_grad(dy_pool, hp, plan, dw2)
    else:
        w2t, w2t_scales = fp8.transposed_weight(w2)
        dh = gated_backward_fp8(*dy_fp8, w2t, w2t_scales, z, p_pool, plan, activation)
        w13t, w13t_scales = fp8.transposed_weight(w13)
        grouped_gemm_fp8(*dh.dz_rows, w13t, w13t_scales, plan, out=dx_pool)
        weight_grad_fp8(dh.dz_t, x_bf16, plan, dw13)
        weight_grad_fp8(transpose_quantize(dy_fp8[0], plan, in_blocks=False, src_scales=dy_fp8[1]), dh.hp_t, plan, dw2)
        dp_partial = dh.dp_partial
    return reduce_dp(dp_partial, plan)


def _combine(ws: _Workspace, meta: _Meta, weights: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Barrier 2, then this rank's rows summed from their owners' shared out pools (weights None:
    every weight 1)."""
    ws.barrier(2)
    return combine_from_owners(ws.table("out"), ws.table("route_to_slot"), ws.world, weights,
                               meta.route_offsets[ws.rank], like, meta.top_k)


def _forward(ws: _Workspace, x, topk_ids, topk_weights, w13, w2, activation, precision, recompute, keep_z):
    """(y, (x_pool, x_scales), z, meta): the layer's forward for this rank's tokens; x_scales is None but
    in "fp8", where the pool of x is e4m3; z, GEMM1's gate | up for the backward, with keep_z only
    (else None)."""
    meta = _Meta.gather(ws, x, topk_ids, w13, precision, recompute, keep_z)
    plan = meta.plan
    if meta.total_routes == 0:
        return torch.zeros_like(x), (x.new_empty(0, x.shape[1]), None), None, meta
    z = empty_z(plan, w13) if keep_z else None
    if precision == "fp8":
        pools, _ = _publish_and_pull(ws, meta, plan, _fp8_rows(x))
        x_pool, x_scales = _fp8_pool(pools, x.shape[1])
        w13_fp8, w2_fp8 = fp8.quantized_weight(w13), fp8.quantized_weight(w2)
        h, h_scales = gated_gemm_fp8(x_pool, x_scales, w13_fp8.q, w13_fp8.scales, plan, activation, z)
        out = ws.local("out", x_pool.numel()).view(x_pool.shape[0], x.shape[1])
        grouped_gemm_fp8(h, h_scales, w2_fp8.q, w2_fp8.scales, plan, out=out)
    else:
        pools, _ = _publish_and_pull(ws, meta, plan, {"rows": x})
        x_pool, x_scales = pools["rows"], None
        h = gated_gemm(x_pool, w13, plan, activation, z)
        out = ws.local("out", x_pool.numel()).view(x_pool.shape)
        grouped_gemm(h, w2, plan, out=out)
    del h
    y = _combine(ws, meta, topk_weights, x)
    ws.raise_if_timed_out()
    meta.id_range.raise_if_any()
    return y, (x_pool, x_scales), z, meta


def _backward(ws: _Workspace, meta: _Meta, dy, x, x_pool, x_scales, z, topk_weights, w13, w2, main_grad13,
              main_grad2, activation, precision):
    """(dx, d topk_weights, dw13, dw2) for this rank (dw13 / dw2 None when added into main_grad). x_pool
    None (recompute): x is published beside dy and its pool pulled again, in bf16 only when z was kept
    (not None: no z to recompute)."""
    plan = meta.plan
    weights = topk_weights.to(torch.float32).contiguous()
    dw13 = torch.empty_like(w13) if main_grad13 is None else None
    dw2 = torch.empty_like(w2) if main_grad2 is None else None
    if meta.total_routes == 0:
        return (torch.zeros_like(dy), torch.zeros_like(topk_weights),
                None if dw13 is None else dw13.zero_(), None if dw2 is None else dw2.zero_())
    dy = dy.contiguous()
    rows = {"rows": dy} if precision == "bf16" else {"rows": dy, **_fp8_rows(dy)}
    fp8_x = x_pool is None and z is None and precision == "fp8"  # x again in e4m3, to recompute z in FP8
    if fp8_x:
        rows |= _fp8_rows(x, "x_")
    if x_pool is None or precision == "fp8":  # dW13 reads x's bf16 rows, not the e4m3 pool of "fp8"
        rows |= {"x_rows": x}
    pools, p_pool = _publish_and_pull(ws, meta, plan, rows, weights)
    if x_pool is None:
        x_pool, x_scales = _fp8_pool(pools, x.shape[1], "x_") if fp8_x else (pools["x_rows"], None)
    dy_pool, dy_fp8 = pools["rows"], None if precision == "bf16" else _fp8_pool(pools, dy.shape[1])
    dx_pool = ws.local("out", dy_pool.numel()).view(dy_pool.shape)  # dx per route, read by the peers
    ws.local("dp", meta.total_routes).copy_(owner_backward(
        x_pool, dy_pool, p_pool, w13, w2, plan, dx_pool,
        dw13 if main_grad13 is None else main_grad13, dw2 if main_grad2 is None else main_grad2, activation,
        x_scales, dy_fp8, pools.get("x_rows"), z))
    del pools, x_pool, x_scales, z, dy_pool, dy_fp8, p_pool
    dx = _combine(ws, meta, None, dy)
    # Each route's dp is non-zero in its owner's vector only, so the sum over owners is exact.
    begin, end = meta.route_offsets[ws.rank], meta.route_offsets[ws.rank + 1]
    dps = torch.empty(ws.world, end - begin, dtype=torch.float32, device=dy.device)
    for d in range(ws.world):
        ws.copy_from_peer(dps[d], "dp", d, begin)
    dp = dps.sum(0)
    ws.raise_if_timed_out()
    return dx, dp.view(topk_weights.shape).to(topk_weights.dtype), dw13, dw2


def _group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(group_name)


def _empty_kept(x: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_pool, x_scales, plan, tokens) when nothing is kept."""
    return (x.new_empty(0, x.shape[1]), x.new_empty(0, dtype=torch.float32),
            x.new_empty(0, dtype=torch.int32), torch.zeros(world, dtype=torch.int64))


@torch.library.custom_op("megamoe::group_moe_forward", mutates_args=())
@_native.on_the_tensors_gpu  # the workspace's collectives and the kernels follow the current device
def group_moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor, group_name: str, activation: str, precision: str, recompute: bool,
                      keep_z: bool, keep: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, x_pool, x_scales, plan, tokens) of this rank over the process group named group_name. With
    keep (a backward will run): the routing plan's buffer, every rank's token count (int64 on the
    host) and, unless recompute, this owner's pool of x (e4m3 with its scales [H / 128, rows] in
    "fp8", bf16 and empty scales otherwise), or with recompute and keep_z (recompute="gather") its z
    [routes, 2I] bf16 in the pool's place; all empty without keep. One op, so torch.compile
    traces a layer with group= as one node (the fake implementation sizes what is kept by the
    group's token total, which only the all-gather knows)."""
    ws = _workspace(_group(group_name), x.device)
    keep_z = keep and keep_z
    y, (x_pool, x_scales), z, meta = _forward(ws, x, topk_ids, topk_weights, w13, w2, activation, precision,
                                              recompute, keep_z)
    empty_pool, empty_scales, empty_plan, no_tokens = _empty_kept(x, ws.world)
    if not keep:
        return y, empty_pool, empty_scales, empty_plan, no_tokens
    if recompute:
        x_pool, x_scales = empty_pool if z is None else z, empty_scales
    return (y, x_pool, empty_scales if x_scales is None else x_scales,
            empty_plan if meta.plan is None else meta.plan.buffer, torch.tensor(meta.tokens, dtype=torch.int64))


@group_moe_forward.register_fake
def _(x, topk_ids, topk_weights, w13, w2, group_name, activation, precision, recompute, keep_z, keep):
    check_activation(activation)
    check_fused_precision(precision)
    world = _group(group_name).size()
    x_pool, x_scales, plan, tokens = _empty_kept(x, world)
    if keep:  # sized by the group's token total: one unbacked size each, as torch.compile requires
        ctx = torch.library.get_ctx()
        plan = x.new_empty(ctx.new_dynamic_size(), dtype=torch.int32)
        if recompute and keep_z:
            x_pool = x.new_empty(ctx.new_dynamic_size(), w13.shape[1])
        elif not recompute:
            rows, hidden = ctx.new_dynamic_size(), x.shape[1]
            if precision == "fp8":
                x_pool = x.new_empty(rows, hidden, dtype=torch.float8_e4m3fn)
                x_scales = x.new_empty(hidden // fp8.BLOCK, rows, dtype=torch.float32)
            else:
                x_pool = x.new_empty(rows, hidden)
    return torch.empty_like(x), x_pool, x_scales, plan, tokens


@torch.library.custom_op("megamoe::group_moe_backward", mutates_args=("main_grad13", "main_grad2"))
@_native.on_the_tensors_gpu
def group_moe_backward(dy: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                       w2: torch.Tensor, x_pool: torch.Tensor, x_scales: torch.Tensor, plan: torch.Tensor,
                       tokens: torch.Tensor, group_name: str, activation: str, precision: str, recompute: bool,
                       keep_z: bool, main_grad13: torch.Tensor | None, main_grad2: torch.Tensor | None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, d topk_weights, dw13, dw2) from what group_moe_forward kept (x: the input with recompute or
    in "fp8", else empty; with recompute and keep_z, z in x_pool's place). Every rank computes all
    four (the owners' kernels serve every rank); a weight gradient added into its main_grad comes back
    empty."""
    ws = _workspace(_group(group_name), dy.device)
    meta = _Meta.kept(ws, tokens, plan, topk_weights.shape[1], w13.shape[0])
    kept_pool = (None, None) if recompute else (x_pool, x_scales if x_scales.numel() else None)
    z = x_pool if recompute and keep_z else None
    dx, dweights, dw13, dw2 = _backward(ws, meta, dy, x, *kept_pool, z, topk_weights, w13, w2, main_grad13,
                                        main_grad2, activation, precision)
    return dx, dweights, *(w.new_empty(0) if g is None else g for g, w in ((dw13, w13), (dw2, w2)))


@group_moe_backward.register_fake
def _(dy, x, topk_weights, w13, w2, x_pool, x_scales, plan, tokens, group_name, activation, precision, recompute,
      keep_z, main_grad13, main_grad2):
    return (torch.empty_like(dy), torch.empty_like(topk_weights),
            *(w.new_empty(0) if main is not None else torch.empty_like(w) for w, main in ((w13, main_grad13),
                                                                                        (w2, main_grad2))))


def _setup_context(ctx, inputs, output):
    x, _, topk_weights, w13, w2, group_name, activation, precision, recompute, keep_z, _ = inputs
    _, x_pool, x_scales, plan, tokens = output
    ctx.group_name, ctx.activation, ctx.precision = group_name, activation, precision
    ctx.recompute, ctx.keep_z = recompute, keep_z
    ctx.mark_non_differentiable(x_pool, x_scales, plan, tokens)
    ctx.set_materialize_grads(False)
    # recompute keeps the input, not the pool; "fp8" keeps it beside the e4m3 pool, for dW13's bf16 rows.
    kept_x = x if recompute or precision == "fp8" else x.new_empty(0, x.shape[1])
    ctx.save_for_backward(kept_x, topk_weights, w13, w2, x_pool, x_scales, plan, tokens)


def _backward_of_forward(ctx, dy, _dx_pool, _dx_scales, _dplan, _dtokens):
    x, topk_weights, w13, w2, x_pool, x_scales, plan, tokens = ctx.saved_tensors
    # Every rank computes all four gradients (the owners' kernels serve every rank).
    return autograd_backward(ctx, dy, w13, w2, lambda _needs, main_grads: group_moe_backward(
        dy, x, topk_weights, w13, w2, x_pool, x_scales, plan, tokens, ctx.group_name, ctx.activation,
        ctx.precision, ctx.recompute, ctx.keep_z, *main_grads))


group_moe_forward.register_autograd(_backward_of_forward, setup_context=_setup_context)


def group_moe(x, topk_ids, topk_weights, w13, w2, group, activation: str = "swiglu", precision: str = "bf16",
              recompute: bool | str = False) -> torch.Tensor:
    """y [T_r, H] for this rank's tokens, its experts' weights w13 [E_local, 2I, H], w2 [E_local, H, I];
    differentiable like megamoe.moe, in `precision` ("bf16", "fp8", "fp8_bwd"); with recompute=True, only
    the inputs are kept and the backward pulls x again beside dy and recomputes z; with "gather", the
    owners keep z and the backward pulls x again. Every rank of `group` must make the same calls in
    the same order."""
    check_activation(activation)
    check_fused_precision(precision)
    backward_will_run = torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weights, w13, w2))
    return group_moe_forward(x, topk_ids, topk_weights, w13, w2, group.group_name, activation, precision,
                             bool(recompute), recompute == "gather", backward_will_run)[0]
