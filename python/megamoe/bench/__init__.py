"""Benchmark harness: `python -m megamoe.bench --help`.

Times every backend of one MoE layer (megamoe's naive / grouped / fused, the grouped path under
torch.compile, transformers' grouped_mm experts) on the same inputs in one process, against dense GEMM
peaks measured in the same run, and writes bench/results/latest.json plus a dated copy (the JSON
layout is a contract: see report.build_result and record.Record).
"""

from .cli import main

__all__ = ["main"]
