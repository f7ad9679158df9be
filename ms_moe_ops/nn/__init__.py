"""Cells built on the operators."""
from .gating import GatingTopK
from .ffn import MoeFFN
from .moe_layer import (MoELayer, SharedExperts, convert_deepseek_v3_moe, expert_load,
                        load_imbalance, moe_layers, reset_expert_load,
                        update_expert_bias)

__all__ = ["GatingTopK", "MoeFFN", "MoELayer", "SharedExperts", "moe_layers", "expert_load",
           "load_imbalance", "update_expert_bias", "reset_expert_load", "convert_deepseek_v3_moe"]

from .quant import QuantMoeFFN, quantize_moe_ffn

__all__ += ["QuantMoeFFN", "quantize_moe_ffn"]
