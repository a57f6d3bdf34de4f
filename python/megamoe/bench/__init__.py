"""Benchmark harness: `python -m megamoe.bench --help`.

Times every backend of one MoE layer (megamoe's naive / grouped / fused, the grouped path under
torch.compile, transformers' grouped_mm experts) on the same inputs in one process, against dense GEMM
peaks measured in the same run, and writes latest.json plus a dated copy to --out (default runs/bench
under the current directory; the JSON layout is a contract: see report.build_result and
record.Record). `--device cpu` is a smoke run of the harness on the tiny preset, about a minute.
"""

from .cli import main

__all__ = ["main"]
