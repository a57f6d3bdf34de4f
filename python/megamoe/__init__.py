"""megamoe: fused Mixture-of-Experts layers for training on Hopper GPUs."""

from .functional import fused_moe, moe
from .reference import reference_moe
from .routing import RoutingPlan, build_routing
from .shapes import PRESETS, MoEShape, make_inputs, make_routing

__all__ = ["fused_moe", "moe", "reference_moe", "RoutingPlan", "build_routing", "PRESETS",
           "MoEShape", "make_inputs", "make_routing"]
__version__ = "0.1.0"
