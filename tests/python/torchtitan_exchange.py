"""The TorchTitan adapters' expert-parallel tests on the CPU: megamoe's token exchange runs in its
fused kernels (a GPU), so there the adapter's megamoe call runs megamoe's all-to-all baseline over the
same group instead. The baseline keeps the exchange's contract (each rank's tokens with global expert
ids, the weights of its own experts), so the adapter's wiring is checked without a GPU."""

from __future__ import annotations

from types import ModuleType

from megamoe.backends.all_to_all import all_to_all_moe


def exchange_on_the_cpu(adapter: ModuleType) -> None:
    """Route `adapter.routed_experts` (megamoe/torchtitan_layout.py's, as the adapter module imported it)
    through the all-to-all baseline where a group is given."""
    one_process = adapter.routed_experts

    def exchanged(x, topk_ids, topk_scores, w13, w2, group=None, **options):
        if group is None:
            return one_process(x, topk_ids, topk_scores, w13, w2, **options)
        dim, top_k = x.shape[-1], topk_ids.shape[-1]
        y = all_to_all_moe(x.reshape(-1, dim).bfloat16(), topk_ids.reshape(-1, top_k),
                           topk_scores.reshape(-1, top_k).float(), w13.bfloat16(), w2.bfloat16(), group)
        return y.view(x.shape).type_as(x)
    adapter.routed_experts = exchanged
