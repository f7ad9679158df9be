"""Functional API: every operator of the package (declarations and kernels: one module each)."""
from .cast import CAST, cast
from .decode_attention import DECODE_ATTENTION, decode_attention
from .dequantize import DEQUANTIZE, dequantize
from .ffn import FFN_ACTIVATION_GRAD, MOE_FFN, moe_ffn
from .gating import (GATING_BACKWARD, GATING_GRAD, GATING_SOFTMAX_BACKWARD, GATING_TOP_K,
                     moe_gating_top_k, moe_gating_top_k_backward)
from .grouped_matmul import GROUPED_MATMUL, grouped_matmul
from .permute import (PERMUTE, UNPERMUTE, UNPERMUTE_BACKWARD, moe_token_permute,
                      moe_token_unpermute, moe_token_unpermute_backward)
from .rms_norm import ADD_RMS_NORM, RMS_NORM, add_rms_norm, rms_norm
from .swiglu import SWIGLU_GROUP, SWIGLU_GROUP_QUANT_GRAD, swiglu_group, swiglu_group_quant_grad
from .weight_quant_grouped_matmul import WEIGHT_QUANT_GROUPED_MATMUL, weight_quant_grouped_matmul
from ._op import record_choices  # noqa: F401 (ms_moe_ops.ops.record_choices)

# Every operator declaration (OpDef), public operators first: what the resolver, the tests and
# the README's implementation table go through.
OPERATORS = (GATING_TOP_K, GATING_BACKWARD, GATING_SOFTMAX_BACKWARD, GATING_GRAD, SWIGLU_GROUP,
             SWIGLU_GROUP_QUANT_GRAD, MOE_FFN, FFN_ACTIVATION_GRAD, GROUPED_MATMUL, PERMUTE,
             UNPERMUTE, UNPERMUTE_BACKWARD, CAST, DEQUANTIZE, RMS_NORM, ADD_RMS_NORM, DECODE_ATTENTION,
             WEIGHT_QUANT_GROUPED_MATMUL)

__all__ = [
    "moe_gating_top_k", "moe_gating_top_k_backward",
    "swiglu_group", "swiglu_group_quant_grad",
    "moe_ffn", "grouped_matmul",
    "moe_token_permute", "moe_token_unpermute", "moe_token_unpermute_backward",
]
