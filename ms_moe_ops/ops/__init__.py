"""Functional API: every operator of the package."""
from .gating import moe_gating_top_k, moe_gating_top_k_backward
from .permute import moe_token_permute, moe_token_unpermute, moe_token_unpermute_backward
from .swiglu import swiglu_group, swiglu_group_quant_grad

__all__ = ["moe_gating_top_k", "moe_gating_top_k_backward"]
__all__ += ["moe_token_permute", "moe_token_unpermute", "moe_token_unpermute_backward"]
__all__ += ["swiglu_group", "swiglu_group_quant_grad"]
from .grouped_matmul import grouped_matmul
from .ffn import moe_ffn

__all__ += ["grouped_matmul", "moe_ffn"]
