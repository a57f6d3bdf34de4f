"""megamoe: fused Mixture-of-Experts layers for training on Hopper GPUs."""

from .activation import ACTIVATIONS
from .functional import fused_moe, moe
from .hf import patch_hf_model
from .layer import MoELayer
from .reference import reference_moe
from .router import load_balancing_loss
from .routing import RoutingPlan, build_routing
from .shapes import PRESETS, MoEShape, make_inputs, make_routing

__all__ = ["ACTIVATIONS", "fused_moe", "moe", "reference_moe", "RoutingPlan", "build_routing", "PRESETS",
           "MoEShape", "make_inputs", "make_routing", "MoELayer", "load_balancing_loss", "patch_hf_model"]
__version__ = "0.1.0"
