"""Block-FP8 quantisation of the DeepSeek-V3 recipe: e4m3 values with one fp32 scale per row and 128 K
values (activations) or per 128 x 128 block (weights), scale = amax / 448 so the block's largest
magnitude maps to e4m3's largest finite value (a block holding a NaN gets a NaN scale: it stays
non-finite), q = value · (1 / scale) rounded to e4m3. Contiguous bf16 tensors on a GPU go through the
core's kernels (megamoe_quantize_rows_fp8, megamoe_quantize_blocks_fp8), any other tensor through torch
ops with the same results."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary

from . import _native
from .validation import is_plain_tensor

E4M3_MAX = 448.0
BLOCK = 128


def _scales(amax: torch.Tensor) -> torch.Tensor:
    # An all-zero block gets scale 1 (its values quantise to 0 either way); a NaN amax stays NaN.
    return torch.where(amax > 0, amax / E4M3_MAX, torch.where(amax.isnan(), amax, torch.ones_like(amax)))


def _on_core(a: torch.Tensor) -> bool:
    return a.is_cuda and a.dtype == torch.bfloat16 and a.is_contiguous()


def token_scale_columns(k: int) -> int:
    """Columns of quantize_rows' token-major scales for rows of k values: k / 128 rounded up to 4."""
    return -(-(k // BLOCK) // 4) * 4


def quantize_rows(a: torch.Tensor, token_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """a [rows, K] -> (e4m3 [rows, K], scales fp32): [K / 128, rows], k-block major as the GEMMs read
    them, or with token_major [rows, S], S = K / 128 rounded up to 4 (16-byte rows, which dispatch like
    the values; the columns past K / 128 are padding)."""
    rows, k = a.shape
    if k % BLOCK:
        raise ValueError(f"K must be a multiple of {BLOCK} for 1x{BLOCK} scales, got {k}")
    padded = token_scale_columns(k)
    if _on_core(a) and a.data_ptr() % 16 == 0:
        q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=a.device)
        scales = torch.empty((rows, padded) if token_major else (k // BLOCK, rows), dtype=torch.float32,
                             device=a.device)
        _native.call("megamoe_quantize_rows_fp8", "quantize_rows",
                     _native.QuantizeFp8Args(a.data_ptr(), q.data_ptr(), scales.data_ptr(), rows, k,
                                             padded if token_major else 0), _native.stream(a.device))
        return q, scales
    blocks = a.float().view(rows, k // BLOCK, BLOCK)
    scales = _scales(blocks.abs().amax(dim=2))
    q = (blocks * (1 / scales).unsqueeze(2)).to(torch.float8_e4m3fn).view(rows, k)
    if token_major:
        return q, torch.nn.functional.pad(scales, (0, padded - k // BLOCK))
    return q, scales.t().contiguous()


def _check_block_sizes(n: int, k: int) -> None:
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"N and K must be multiples of {BLOCK} for {BLOCK}x{BLOCK} scales, got {n} and {k}")


def quantize_blocks(b: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """b [E, N, K] -> (e4m3 [E, N, K], scales fp32 [E, N / 128, K / 128]), written into `out` if given
    (contiguous tensors of those shapes and dtypes, on b's device)."""
    e, n, k = b.shape
    _check_block_sizes(n, k)
    if _on_core(b) and b.data_ptr() % 16 == 0:
        q, scales = out or (torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=b.device),
                            torch.empty(e, n // BLOCK, k // BLOCK, dtype=torch.float32, device=b.device))
        _native.call("megamoe_quantize_blocks_fp8", "quantize_blocks",
                     _native.QuantizeFp8Args(b.data_ptr(), q.data_ptr(), scales.data_ptr(), e * n, k, 0),
                     _native.stream(b.device))
        return q, scales
    blocks = b.float().view(e, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scales = _scales(blocks.abs().amax(dim=(2, 4)))
    q = (blocks * (1 / scales)[:, :, None, :, None]).to(torch.float8_e4m3fn).view(e, n, k)
    return _into(out, q, scales.contiguous())


def _into(out: tuple[torch.Tensor, ...] | None, *made: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """made, or copied into out."""
    if out is None:
        return made
    for held, value in zip(out, made):
        held.copy_(value)
    return out


def quantize_blocks_transposed(w: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (e4m3 [E, K, N], scales fp32 [E, K / 128, N / 128]): quantize_blocks of
    w.transpose(1, 2), with w read once (a 128 x 128 block transposes into one with the same scale);
    written into `out` if given."""
    e, n, k = w.shape
    _check_block_sizes(n, k)
    if not (_on_core(w) and w.data_ptr() % 16 == 0):
        return quantize_blocks(w.transpose(1, 2).contiguous(), out)
    q_t, scales_t = out or (torch.empty(e, k, n, dtype=torch.float8_e4m3fn, device=w.device),
                            torch.empty(e, k // BLOCK, n // BLOCK, dtype=torch.float32, device=w.device))
    _native.call("megamoe_quantize_blocks_transposed_fp8", "quantize_blocks_transposed",
                 _native.QuantizeBlocksTransposedFp8Args(w.data_ptr(), q_t.data_ptr(), scales_t.data_ptr(), e, n, k),
                 _native.stream(w.device))
    return q_t, scales_t


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values quantize_rows' output (k-block major scales) stands for, in fp32 or rounded to dtype."""
    rows, k = q.shape
    if q.is_cuda and dtype == torch.bfloat16 and q.is_contiguous() and scales.is_contiguous():
        a = torch.empty(rows, k, dtype=dtype, device=q.device)
        _native.call("megamoe_dequantize_rows_fp8", "dequantize_rows",
                     _native.DequantizeFp8Args(q.data_ptr(), scales.data_ptr(), a.data_ptr(), rows, k),
                     _native.stream(q.device))
        return a
    return (q.float().view(rows, k // BLOCK, BLOCK) * scales.t().unsqueeze(2)).view(rows, k).to(dtype)


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values quantize_blocks' output stands for."""
    e, n, k = q.shape
    blocks = q.float().view(e, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    return (blocks * scales[:, :, None, :, None]).view(e, n, k)


# --- The weight-quantisation cache ---------------------------------------------------------------
# Weights change once per optimizer step, so their 128x128 block-FP8 copies are made at most once per
# step and shared by every micro-batch's forward and by the backward. An entry is keyed on the weight
# tensor itself, by identity, and lives as long as it: torch.utils.weak.WeakIdKeyDictionary, because
# weakref.WeakKeyDictionary compares keys with ==, which a tensor answers elementwise. An entry is
# valid while the weight's version counter (bumped by in-place updates through torch ops: copy_(),
# add_(), the foreach and for-loop optimizers), storage, shape, strides, dtype and device are those
# it was made from; a stale entry is replaced by the next call. The fused optimizers
# (torch.optim.AdamW(fused=True)) update parameters without bumping their version counters, so every
# torch.optim optimizer's step also drops all cached copies (a global step hook). An alias of a cached
# weight (the same memory, shape and strides, e.g. the detached copy that activation checkpointing
# hands the backward in place of the parameter) shares its entry: _OWNERS finds the weight from where
# it lies, and while that weight is alive no other tensor can lie there. A view of the whole of a
# tensor (the fresh one DTensor.to_local() makes on every call) keeps its entry under that tensor, so
# the copy outlives the view.
# A CUDA graph captured inside cached_weights_in_graphs() while an entry is valid reads that entry's
# copies by address (the capture quantises nothing of its own): such an entry is held by the graph, so
# it is never dropped or reallocated; where another entry would be dropped (the optimizer step's hook,
# clear_weight_cache, a call that finds the weight changed) a held one is quantised again in place,
# from the weight as it is. Any other capture quantises the weights in the graph, on every replay.


@dataclasses.dataclass(eq=False)
class QuantizedWeight:
    """The block-FP8 copies of a weight w [E, N, K], each made when first asked for: the forward's, q
    e4m3 [E, N, K] and scales fp32 [E, N/128, K/128] (quantize_blocks; None until a forward asks,
    fp8.quantized_weight), and the backward's transposed one (`transposed()`, fp8.transposed_weight)."""

    q: torch.Tensor | None
    scales: torch.Tensor | None
    _transposed: tuple[torch.Tensor, torch.Tensor] | None = dataclasses.field(default=None, repr=False)
    held_by_graph: bool = False  # a captured CUDA graph reads these copies: refreshed in place, never dropped

    def transposed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(e4m3 [E, K, N], scales fp32 [E, K/128, N/128]): the copy of w.transpose(1, 2), made once.
        Made from the forward's copy when there is one: a 128x128 block transposes into a 128x128 block
        with the same amax, so transposing q and the scales gives exactly quantize_blocks_transposed(w)
        and reads a byte per element instead of w's two."""
        if self._transposed is None:
            self._transposed = _transpose_copy(self.q, self.scales)
        return self._transposed

    def refresh(self, w: torch.Tensor) -> None:
        """Quantises w again into the copies made so far, in place (same memory, so a graph that reads
        them reads the new values)."""
        with torch.no_grad():
            w = w.detach()
            if self.q is not None:
                quantize_blocks(w, out=(self.q, self.scales))
                if self._transposed is not None:
                    _transpose_copy(self.q, self.scales, out=self._transposed)
            elif self._transposed is not None:
                quantize_blocks_transposed(w, out=self._transposed)

    def _copies(self) -> list[torch.Tensor]:
        """The tensors made so far: either copy, or both, each with its scales."""
        return [t for t in (self.q, self.scales, *(self._transposed or ())) if t is not None]

    @property
    def device(self) -> torch.device | None:
        """Where the copies lie (None before any is made)."""
        copies = self._copies()
        return copies[0].device if copies else None

    def nbytes(self) -> int:
        """Device bytes held: the copies made so far and their scales."""
        return sum(t.numel() * t.element_size() for t in self._copies())


def _transpose_copy(q: torch.Tensor, scales: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The copy of w.transpose(1, 2) from w's (q, scales) (into `out` if given): the values transposed,
    each 128x128 block keeping its scale."""
    values = _transposed_values(q, None if out is None else out[0])
    if out is None:
        return values, scales.transpose(1, 2).contiguous()
    out[1].copy_(scales.transpose(1, 2))
    return out


def _transposed_values(q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [E, N, K] e4m3 -> [E, K, N] (into `out` if given): on a GPU by the core's tiled transpose (a
    strided torch copy of one-byte elements reads and writes far from the bandwidth), elsewhere by torch."""
    if not (q.is_cuda and q.is_contiguous() and q.data_ptr() % 16 == 0):
        return q.transpose(1, 2).contiguous() if out is None else out.copy_(q.transpose(1, 2))
    e, n, k = q.shape
    out = torch.empty(e, k, n, dtype=q.dtype, device=q.device) if out is None else out
    _native.call("megamoe_transpose_fp8", "transpose", _native.TransposeFp8Args(q.data_ptr(), out.data_ptr(), e, n, k),
                 _native.stream(q.device))
    return out


_CACHE: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight -> (key, QuantizedWeight)
_OWNERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # _place(weight) -> weight


def _place(w: torch.Tensor) -> tuple:
    return (w.data_ptr(), tuple(w.shape), w.stride(), w.dtype, w.device)


def _owner_entry(w: torch.Tensor, place: tuple) -> tuple[torch.Tensor, tuple | None]:
    """(the tensor w's cache entry is kept under, that entry or None): w itself, else the cached weight
    that w (at `place`) is an alias of, else w without an entry. One dictionary lookup when w is cached."""
    entry = _CACHE.get(w)
    if entry is not None:
        return w, entry
    owner = _OWNERS.get(place)
    if owner is not None and _place(owner) == place:
        return owner, _CACHE.get(owner)
    return w, None


def _cacheable(w: torch.Tensor) -> bool:
    """False under torch.compile, for fake / meta tensors (no storage, no real version) and for inference
    tensors (no version counter): those are quantised on every call."""
    if torch.compiler.is_compiling() or w.is_meta or w.is_inference():
        return False
    if is_plain_tensor(w):  # fake tensors are subclasses or functorch wrappers: no need to ask
        return True
    from torch._subclasses.fake_tensor import is_fake
    return not is_fake(w)


def _capturing(w: torch.Tensor) -> bool:
    return w.is_cuda and torch.cuda.is_current_stream_capturing()


def _key(w: torch.Tensor, place: tuple) -> tuple:
    return (w._version, *place)  # the version and where w lies


def _keep(owner: torch.Tensor, place: tuple, key: tuple, quantized: QuantizedWeight) -> None:
    _CACHE[owner] = (key, quantized)
    _OWNERS[place] = owner  # the owner lies where w does


def _refresh_held(w: torch.Tensor, place: tuple, key_then: tuple, quantized: QuantizedWeight) -> None:
    """A held entry made stale by a change of w: quantised again in place, kept under w's new key."""
    _, _, shape, _, dtype, device = key_then
    if (shape, dtype, device) != (tuple(w.shape), w.dtype, w.device):
        raise RuntimeError(f"a captured CUDA graph reads the FP8 copy of a {dtype} weight of shape {shape} on "
                           f"{device}, which is now {w.dtype} {tuple(w.shape)} on {w.device}: capture the "
                           f"graph again after replacing the weight")
    quantized.refresh(w)
    _keep(w, place, _key(w, place), quantized)


def _lookup(w: torch.Tensor) -> tuple[torch.Tensor, tuple, tuple, tuple | None]:
    """(owner, place, key, entry): where w lies, its key as it is now, and the entry it is cached
    under (see _owner_entry), valid or stale, or None."""
    place = _place(w)
    if w._base is not None and _place(w._base) == place:  # a whole view (DTensor.to_local()'s): its base's entry
        w = w._base
    owner, entry = _owner_entry(w, place)
    return owner, place, _key(w, place), entry


def _cached(w: torch.Tensor) -> QuantizedWeight:
    """w's cache entry, made empty (no copy yet) when there is none for w as it is now; a held entry
    is brought up to date in place instead."""
    owner, place, key, entry = _lookup(w)
    if entry is not None and entry[0] == key:
        return entry[1]
    if entry is not None and entry[1].held_by_graph:
        _refresh_held(owner, place, entry[0], entry[1])
        return entry[1]
    _CACHE.pop(owner, None)  # the stale copies go before new ones are made: never both at once
    quantized = QuantizedWeight(None, None)
    _keep(owner, place, key, quantized)
    return quantized


_GRAPHS_READ_CACHED_WEIGHTS = False  # process-wide: autograd captures a backward on its own thread


@contextlib.contextmanager
def cached_weights_in_graphs():
    """CUDA graphs captured inside read the weights' cached block-FP8 copies (made by an eager call
    before the capture, e.g. torch.cuda.make_graphed_callables' warm-up) instead of quantising the
    weights on every replay. Those copies are then quantised again in place, from the weights as they
    are, by every torch.optim optimizer's step(), by clear_weight_cache() and by an eager call that
    finds a weight changed; so between replays change such weights only through an optimizer, or call
    clear_weight_cache() after any other change."""
    global _GRAPHS_READ_CACHED_WEIGHTS
    before, _GRAPHS_READ_CACHED_WEIGHTS = _GRAPHS_READ_CACHED_WEIGHTS, True
    try:
        yield
    finally:
        _GRAPHS_READ_CACHED_WEIGHTS = before


def _held(w: torch.Tensor, transposed: bool) -> QuantizedWeight | None:
    """While a CUDA graph is captured: w's entry if the capture is inside cached_weights_in_graphs() and
    the entry is valid and has the copy asked for (the forward's, or with `transposed` the backward's);
    the graph then reads that copy, and holds the entry. Else None: the graph quantises w itself, on
    every replay, and the entry stays free to be dropped."""
    if not (_GRAPHS_READ_CACHED_WEIGHTS and _cacheable(w)):
        return None
    _, _, key, entry = _lookup(w)
    if entry is None or entry[0] != key:
        return None
    quantized = entry[1]
    if (quantized._transposed if transposed else quantized.q) is None:
        return None
    quantized.held_by_graph = True
    return quantized


def quantized_weight(w: torch.Tensor) -> QuantizedWeight:
    """The block-FP8 copies of the weight w [E, N, K] (N and K multiples of 128), from the cache while w
    is unchanged, with the forward's copy (q, scales) made. The copies have no autograd history."""
    if _capturing(w):
        quantized = _held(w, transposed=False)
        if quantized is None:
            quantized = QuantizedWeight(None, None)
    else:
        quantized = _cached(w) if _cacheable(w) else QuantizedWeight(None, None)
    if quantized.q is None:
        with torch.no_grad():
            quantized.q, quantized.scales = quantize_blocks(w.detach())
    return quantized


def transposed_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward's copy of the weight w [E, N, K]: (e4m3 [E, K, N], scales fp32 [E, K/128, N/128]),
    from the cache while w is unchanged. Made from the forward's copy when the forward made one, else
    quantised from w straight into the transposed layout, with no forward copy made (the FP8 backward
    of a bf16 forward, "fp8_bwd", holds one copy instead of two)."""
    capturing = _capturing(w)
    if capturing:
        held = _held(w, transposed=True)
        if held is not None:
            return held._transposed
    if capturing or not _cacheable(w):
        with torch.no_grad():
            return quantize_blocks_transposed(w.detach())
    quantized = _cached(w)
    if quantized.q is None and quantized._transposed is None:
        with torch.no_grad():
            quantized._transposed = quantize_blocks_transposed(w.detach())
    return quantized.transposed()


def cache_bytes(device: torch.device | str | None = None) -> int:
    """Bytes held by the cached copies of weights that are still alive (on `device` if given): one byte
    per weight element for each copy made (the forward's, the backward's transposed one), plus 4 bytes
    per 128x128 block for each copy's scales."""
    device = None if device is None else torch.device(device)
    return sum(entry.nbytes() for _, entry in _CACHE.values()
               if device is None or (entry.device is not None and _same_device(entry.device, device)))


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (b.index is None or a.index == b.index)


def clear_weight_cache() -> None:
    """Drops every cached copy (their memory returns to the caching allocator), except those a captured
    CUDA graph reads: those are quantised again in place from their weights as they are now."""
    held = [(w, key, quantized) for w, (key, quantized) in _CACHE.items() if quantized.held_by_graph]
    _CACHE.clear()
    _OWNERS.clear()
    for w, key, quantized in held:
        _refresh_held(w, _place(w), key, quantized)


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    clear_weight_cache()


register_optimizer_step_post_hook(_after_optimizer_step)
