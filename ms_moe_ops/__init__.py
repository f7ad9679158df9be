"""ms_moe_ops: fused Mixture-of-Experts operators and layers for MindSpore."""
from . import nn, ops, parallel, reference
from .nn import *  # noqa: F401,F403
from .ops import *  # noqa: F401,F403

__version__ = "0.4.11"
