"""Functional API: every operator of the package (declarations and kernels: one module each)."""
from .ffn import moe_ffn
from .gating import moe_gating_top_k, moe_gating_top_k_backward
from .grouped_matmul import grouped_matmul
from .permute import moe_token_permute, moe_token_unpermute, moe_token_unpermute_backward
from .swiglu import swiglu_group, swiglu_group_quant_grad

__all__ = [
    "moe_gating_top_k", "moe_gating_top_k_backward",
    "swiglu_group", "swiglu_group_quant_grad",
    "moe_ffn", "grouped_matmul",
    "moe_token_permute", "moe_token_unpermute", "moe_token_unpermute_backward",
]
