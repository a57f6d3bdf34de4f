"""Hidden and intermediate sizes that are multiples of 8 but not of the GEMM tile (128) through the
fused kernels: x, w13 and w2 are padded with zeros up to the next multiple of 128 in H and I, and y
is cut back to H. Exact, not approximate: a padded intermediate unit has zero gate and up rows, so
its h is act(0) · 0 = 0 and its w2 column adds nothing; a padded hidden column of x meets zero
columns of w13, and the padded rows of w2 make output columns that are cut off. The padding is torch
ops, so autograd cuts the gradients back to the unpadded shapes. It costs a copy of the weights per
call (about 2·(3·E·H·I) bf16 bytes of traffic) and the GEMMs' work on the padding."""

from __future__ import annotations

import torch
import torch.nn.functional as F

TILE = 128


def padded_size(n: int) -> int:
    return -(-n // TILE) * TILE


def needs_padding(hidden: int, intermediate: int) -> bool:
    return hidden % TILE != 0 or intermediate % TILE != 0


def pad_to_tiles(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor):
    """(x [T, H'], w13 [E, 2I', H'], w2 [E, H', I']) with H' and I' the next multiples of 128; w13's gate
    rows stay the first I' rows and its up rows the last I'. Refuses weights with an fp32 main_grad: the
    padded copies' gradients come back through autograd as .grad, not added into main_grad."""
    experts, two_i, hidden = w13.shape
    inter = two_i // 2
    for name, w in (("w13", w13), ("w2", w2)):
        if getattr(w, "main_grad", None) is not None:
            raise NotImplementedError(
                f"{name}.main_grad: the fused backward adds into main_grad for H and I multiples of {TILE}; "
                f"H = {hidden}, I = {inter} run zero-padded to them, with the weight gradients returned as "
                ".grad: delete main_grad, or use backend='grouped'")
    pad_h, pad_i = padded_size(hidden) - hidden, padded_size(inter) - inter
    x = F.pad(x, (0, pad_h))
    w13 = F.pad(w13.view(experts, 2, inter, hidden), (0, pad_h, 0, pad_i)).view(experts, 2 * (inter + pad_i), -1)
    w2 = F.pad(w2, (0, pad_i, 0, pad_h))
    return x, w13, w2
