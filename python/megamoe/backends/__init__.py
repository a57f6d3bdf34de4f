"""MoE backends: the same math (docs/DESIGN.md) through different implementations."""

from .grouped import grouped_moe
from .naive import naive_moe

__all__ = ["grouped_moe", "naive_moe"]
