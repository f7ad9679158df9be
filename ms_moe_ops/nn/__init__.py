"""Cells built on the operators, their configs, losses, token dispatchers and checkpoint
converters."""
from .config import CapacityConfig, ExpertsConfig, MoEConfig, RouterConfig, SharedExpertsConfig
from .dispatcher import LocalDispatcher
from .gating import GatingTopK
from .ffn import EXPERT_KINDS, ExpertKind, MoeFFN, register_expert_kind
from .losses import AuxLossScaler, set_loss_scale
from .moe_layer import (MoELayer, SharedExperts, dropped_fraction, expert_load, load_imbalance,
                        moe_layers, reset_expert_load, update_expert_bias)
from .families import (convert_deepseek_v2_moe, convert_deepseek_v3_moe, convert_mixtral_moe,
                       convert_moe_checkpoint, convert_qwen2_moe, convert_qwen3_moe,
                       moe_config_from_transformers)
from .quant import QuantMoeFFN, quantize_moe_ffn
from .quantization import Int8Experts, W8A16Experts, quantize

__all__ = ["GatingTopK", "MoeFFN", "MoELayer", "SharedExperts", "AuxLossScaler",
           "set_loss_scale",
           "MoEConfig", "RouterConfig", "ExpertsConfig", "CapacityConfig", "SharedExpertsConfig",
           "LocalDispatcher", "EXPERT_KINDS", "ExpertKind", "register_expert_kind",
           "moe_layers", "expert_load", "load_imbalance", "dropped_fraction", "update_expert_bias",
           "reset_expert_load", "moe_config_from_transformers", "convert_moe_checkpoint",
           "convert_deepseek_v3_moe", "convert_deepseek_v2_moe", "convert_qwen3_moe",
           "convert_qwen2_moe", "convert_mixtral_moe", "QuantMoeFFN", "quantize_moe_ffn",
           "quantize", "Int8Experts", "W8A16Experts"]
