"""Model presets and the synthetic inputs that tests and benchmarks share."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class MoEShape:
    hidden_size: int  # H
    intermediate_size: int  # I (per expert)
    num_experts: int  # E
    top_k: int  # K

    def flops_forward(self, routes: int) -> int:
        """Forward FLOPs: 2·H·2I for GEMM1 plus 2·I·H for GEMM2 per route."""
        return 6 * self.hidden_size * self.intermediate_size * routes


PRESETS = {
    "qwen3-30b-a3b": MoEShape(hidden_size=2048, intermediate_size=768, num_experts=128, top_k=8),
    "qwen3-235b-a22b": MoEShape(hidden_size=4096, intermediate_size=1536, num_experts=128, top_k=8),
    # The other classes of open MoE models: one rank of 8 of a DeepSeek-V3-class model (Kimi-K2: 384
    # experts), few large experts, sizes that are not multiples of 128, many small experts.
    "kimi-k2-ep8": MoEShape(hidden_size=7168, intermediate_size=2048, num_experts=48, top_k=8),
    "mixtral-8x22b": MoEShape(hidden_size=6144, intermediate_size=16384, num_experts=8, top_k=2),
    "gpt-oss-20b": MoEShape(hidden_size=2880, intermediate_size=2880, num_experts=32, top_k=4),
    "qwen3-next-80b-a3b": MoEShape(hidden_size=2048, intermediate_size=512, num_experts=512, top_k=10),
    # Small enough for CPU tests; same structure.
    "tiny": MoEShape(hidden_size=256, intermediate_size=128, num_experts=8, top_k=2),
}

ROUTINGS = ("balanced", "skewed")

# Skewed routing: expert popularity follows a Zipf law with this exponent (hottest expert ≈ 3×
# the mean load at E = 128, K = 8).
SKEW_EXPONENT = 0.3


def make_routing(num_tokens: int, num_experts: int, top_k: int, routing: str = "balanced",
                 *, device="cpu", generator: torch.Generator | None = None):
    """Router-like (topk_ids int32 [T, K], topk_weights fp32 [T, K]): K distinct experts per token.

    balanced: every expert equally likely. skewed: popularity ∝ 1 / rank^SKEW_EXPONENT.
    Weights are a softmax over the chosen experts' random logits, as a renormalised top-k router gives.
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}")
    draw = dict(generator=generator, device=generator.device if generator is not None else None)
    scores = torch.rand(num_tokens, num_experts, **draw)
    if routing == "skewed":
        ranks = torch.arange(1, num_experts + 1, dtype=torch.float32, device=scores.device)
        popularity = ranks.pow(-SKEW_EXPONENT)
        # Gumbel-top-k samples K distinct experts with probability ∝ popularity.
        scores = popularity.log() - torch.log(-torch.log(scores.clamp_min(1e-20)))
    topk_ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    logits = torch.randn(num_tokens, top_k, **draw)
    topk_weights = torch.softmax(logits, dim=-1)
    return topk_ids.to(device), topk_weights.to(device)


def make_inputs(shape: MoEShape, num_tokens: int, routing: str = "balanced", *, device="cpu",
                dtype=torch.bfloat16, seed: int = 0):
    """(x, topk_ids, topk_weights, w13, w2) with weights scaled like a trained layer's (std 1/sqrt(fan_in)).

    Drawn on `device` itself (the 235B preset's weights take tens of seconds on a host), so the same
    seed gives different numbers on different device types."""
    g = torch.Generator(device=device).manual_seed(seed)
    H, I, E = shape.hidden_size, shape.intermediate_size, shape.num_experts
    x = torch.randn(num_tokens, H, generator=g, device=g.device)
    w13 = torch.randn(E, 2 * I, H, generator=g, device=g.device) / H**0.5
    w2 = torch.randn(E, H, I, generator=g, device=g.device) / I**0.5
    topk_ids, topk_weights = make_routing(num_tokens, E, shape.top_k, routing, device=g.device, generator=g)
    return x.to(dtype), topk_ids, topk_weights, w13.to(dtype), w2.to(dtype)
