"""MoeFFN: all the experts of a MoE layer as one Cell, on rows already grouped by expert."""
import math

import mindspore as ms
from mindspore import Parameter, ops
from mindspore.common.initializer import Uniform, initializer

from .. import ops as moe_ops
from ..ops._checks import int_arg
from ._precision import SelfCastingCell

__all__ = ["MoeFFN"]

ACTIVATIONS = ("fastgelu", "gelu", "relu", "silu", "swiglu")


class MoeFFN(SelfCastingCell):
    """The experts of a MoE layer: `y_rows(e) = act(x_rows(e) @ weight1[e] + bias1[e]) @ weight2[e]
    + bias2[e]`, expert e owning `expert_tokens[e]` consecutive rows (expert 0's rows first).

    activation "fastgelu", "gelu", "relu" or "silu" runs the fused `moe_ffn` operator; "swiglu"
    composes grouped_matmul -> swiglu_group -> grouped_matmul, with weight1 [E, H, 2F] holding
    the gate (first F columns) and up (last F columns) projections; clamp_limit > 0 clamps them
    (gate <= c, |up| <= c) as in GPT-OSS style experts.

    Parameters: `weight1` [E, H, F] ([E, H, 2F] for swiglu), `weight2` [E, F, H], and when
    has_bias `bias1` [E, F] ([E, 2F]) and `bias2` [E, H]; stored in float32 (any float dtype
    works) and cast to the compute dtype.

    The experts compute in x's dtype, or in the dtype mixed precision asks for (`to_float`,
    `auto_mixed_precision` O2/O3: `compute_dtype`), on this package's kernels.

    construct(x [M, H], expert_tokens int64 [E] counts, row_weight=None [M] or [M, 1]) -> [M, H]
    in the compute dtype. row_weight (float32, e.g. routing probabilities in row order) multiplies each
    output row; with swiglu it is swiglu_group's per-token weight, so its gradient comes from the
    fused backward.

    The counts must add up to M (a RuntimeError otherwise), unless padded=True: then they may
    cover fewer rows (a padded batch, as the expert-parallel exchange makes), whose output rows
    are zero.
    """

    def __init__(self, num_experts, hidden_size, ffn_hidden_size, activation="fastgelu",
                 has_bias=False, clamp_limit=0.0, padded=False):
        super().__init__()
        num_experts = int_arg("MoeFFN", "num_experts", num_experts)
        hidden_size = int_arg("MoeFFN", "hidden_size", hidden_size)
        ffn_hidden_size = int_arg("MoeFFN", "ffn_hidden_size", ffn_hidden_size)
        if activation not in ACTIVATIONS:
            raise ValueError(f"MoeFFN: activation must be one of {ACTIVATIONS}, got {activation!r}")
        if clamp_limit > 0 and activation != "swiglu":
            raise ValueError(f"MoeFFN: clamp_limit applies to activation='swiglu' only, got "
                             f"activation={activation!r} with clamp_limit={clamp_limit}")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.activation = activation
        self.swiglu = activation == "swiglu"
        self.has_bias = bool(has_bias)
        self.clamp_limit = float(clamp_limit)
        self.padded = bool(padded)
        width = 2 * ffn_hidden_size if self.swiglu else ffn_hidden_size
        # the usual nn.Dense initialisation, per expert
        self.weight1 = Parameter(initializer(Uniform(1 / math.sqrt(hidden_size)),
                                             (num_experts, hidden_size, width), ms.float32),
                                 name="weight1")
        self.weight2 = Parameter(initializer(Uniform(1 / math.sqrt(ffn_hidden_size)),
                                             (num_experts, ffn_hidden_size, hidden_size), ms.float32),
                                 name="weight2")
        if self.has_bias:
            self.bias1 = Parameter(initializer("zeros", (num_experts, width), ms.float32), name="bias1")
            self.bias2 = Parameter(initializer("zeros", (num_experts, hidden_size), ms.float32),
                                   name="bias2")
        else:
            self.bias1 = None
            self.bias2 = None

    def construct(self, x, expert_tokens, row_weight=None):
        dtype = x.dtype if self.compute_dtype is None else self.compute_dtype
        x = x.astype(dtype)
        w1 = self.weight1.astype(dtype)
        w2 = self.weight2.astype(dtype)
        if row_weight is not None:
            row_weight = row_weight.astype(ms.float32).reshape(-1, 1)
        if not self.swiglu:
            b1 = None if self.bias1 is None else self.bias1.astype(dtype)
            b2 = None if self.bias2 is None else self.bias2.astype(dtype)
            y = moe_ops.moe_ffn(x, expert_tokens, w1, w2, b1, b2, activation=self.activation,
                                padded=self.padded)
            if row_weight is not None:
                y = (y.astype(ms.float32) * row_weight).astype(dtype)
            return y
        b1 = None if self.bias1 is None else self.bias1.astype(dtype)
        h = moe_ops.grouped_matmul(x, w1, expert_tokens, b1, padded=self.padded)
        a = moe_ops.swiglu_group(h, row_weight, expert_tokens, clamp_limit=self.clamp_limit)
        y = moe_ops.grouped_matmul(a, w2, expert_tokens, padded=self.padded)
        if self.has_bias:
            # bias2 is part of the expert, so the routing weight (applied inside swiglu_group)
            # must scale it too: added per row rather than by the grouped matmul
            # (each row's expert bias: a grouped product of a column of ones with bias2)
            ones = ops.ones((x.shape[0], 1), ms.float32)
            b2 = moe_ops.grouped_matmul(ones, self.bias2.astype(ms.float32).expand_dims(1),
                                        expert_tokens)
            if row_weight is not None:
                b2 = b2 * row_weight
            y = (y.astype(ms.float32) + b2).astype(dtype)
        return y

    def extend_repr(self):
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation}, "
                f"has_bias={self.has_bias}, clamp_limit={self.clamp_limit}, padded={self.padded}")
