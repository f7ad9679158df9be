"""Whole MoE language models on MoELayer, with transformers' parameter names: DeepSeek-V3 and
DeepSeek-V2 (multi-head latent attention), Qwen3-MoE, Qwen2-MoE and Mixtral (grouped-query
attention). One configuration per model (CausalLMConfig, holding the MoEConfig of its MoE
blocks), read from a transformers config.json; checkpoints come from `ms_moe_ops.convert`."""
from .config import CausalLMConfig, GQAConfig, MLAConfig, RopeConfig
from .causal_lm import CausalLMLoss, DecoderModel, MoECausalLM, generate
from .generation import DecodeStep, cache_bytes_per_token, new_cache
from .layers import DecoderLayer, GQAttention, MLAttention, MLP, RMSNorm

__all__ = ["CausalLMConfig", "GQAConfig", "MLAConfig", "RopeConfig", "MoECausalLM",
           "DecoderModel", "CausalLMLoss", "generate", "DecoderLayer", "GQAttention",
           "MLAttention", "MLP", "RMSNorm", "DecodeStep", "new_cache",
           "cache_bytes_per_token"]
