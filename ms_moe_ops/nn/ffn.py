"""MoeFFN: all the experts of a MoE layer as one Cell, on rows already grouped by expert, and the
registry of the kinds of experts it runs."""
import math
from dataclasses import dataclass
from typing import Callable

import mindspore as ms
from mindspore import Parameter
from mindspore.common.initializer import Uniform, initializer

from .. import ops as moe_ops
from ..ops.ffn import ACTIVATIONS as FUSED_ACTIVATIONS
from ._checks import checked, config_of, int_arg, same_rows
from ._precision import SelfCastingCell
from .config import ExpertsConfig

__all__ = ["MoeFFN", "ExpertKind", "EXPERT_KINDS", "register_expert_kind", "swiglu_experts"]


@dataclass(frozen=True)
class ExpertKind:
    """A kind of experts: what `activation` names in MoeFFN.

    forward(x [M, H], counts int64 [E], weight1, bias1, weight2, bias2, activation, clamp_limit,
    padded) -> [M, H] in x's dtype: every expert on its rows (expert 0's first), no routing
    weight. weight1 is [E, H, width * F] (bias1 [E, width * F]), weight2 [E, F, H] (bias2
    [E, H]); biases may be None. clamps: whether clamp_limit applies.
    """
    name: str
    forward: Callable
    width: int = 1
    clamps: bool = False


EXPERT_KINDS = {}


def register_expert_kind(kind):
    """Makes `kind` (an ExpertKind) available as MoeFFN(activation=kind.name)."""
    EXPERT_KINDS[kind.name] = kind
    return kind


def fused_experts(x, counts, w1, b1, w2, b2, activation, clamp_limit, padded):
    """act(x @ w1 + b1) @ w2 + b2 in one moe_ffn call (fastgelu, gelu, relu, silu)."""
    return moe_ops.moe_ffn(x, counts, w1, w2, b1, b2, activation=activation, padded=padded)


def swiglu_experts(x, counts, w1, b1, w2, b2, activation, clamp_limit, padded):
    """grouped_matmul -> swiglu_group -> grouped_matmul: w1's first F columns are the gate, its
    last F the up projection; clamp_limit > 0 clamps them (gate <= c, |up| <= c)."""
    h = moe_ops.grouped_matmul(x, w1, counts, b1, padded=padded)
    a = moe_ops.swiglu_group(h, None, counts, clamp_limit=clamp_limit)
    return moe_ops.grouped_matmul(a, w2, counts, b2, padded=padded)


for _name in FUSED_ACTIVATIONS:
    register_expert_kind(ExpertKind(_name, fused_experts))
register_expert_kind(ExpertKind("swiglu", swiglu_experts, width=2, clamps=True))


def _cast(bias, dtype):
    return None if bias is None else moe_ops.cast(bias, dtype)


class MoeFFN(SelfCastingCell):
    """The experts of a MoE layer: `y_rows(e) = act(x_rows(e) @ weight1[e] + bias1[e]) @ weight2[e]
    + bias2[e]`, expert e owning `expert_tokens[e]` consecutive rows (expert 0's rows first).

    Built from an ExpertsConfig, or from its options: `MoeFFN(num_experts, hidden_size,
    ffn_hidden_size, activation="fastgelu", has_bias=False, clamp_limit=0.0, padded=False)`.
    `activation` names a kind of experts (EXPERT_KINDS): "fastgelu", "gelu", "relu" or "silu" run
    the fused `moe_ffn` operator; "swiglu" composes grouped_matmul -> swiglu_group ->
    grouped_matmul, with weight1 [E, H, 2F] holding the gate (first F columns) and up (last F
    columns) projections; clamp_limit > 0 clamps them (gate <= c, |up| <= c) as in GPT-OSS style
    experts. `register_expert_kind` adds kinds.

    Parameters: `weight1` [E, H, F] ([E, H, 2F] for swiglu), `weight2` [E, F, H], and when
    has_bias `bias1` [E, F] ([E, 2F]) and `bias2` [E, H]; stored in float32 (any float dtype
    works) and cast to the compute dtype.

    The experts compute in x's dtype, or in the dtype mixed precision asks for (`to_float`,
    `auto_mixed_precision` O2/O3: `compute_dtype`), on this package's kernels.

    construct(x [M, H], expert_tokens int64 [E] counts, row_weight=None [M] or [M, 1]) -> [M, H]
    in the compute dtype. row_weight (e.g. routing probabilities in row order) multiplies each
    expert's whole output row (bias2 included), in float32.

    The counts must add up to M (a RuntimeError otherwise), unless padded=True: then they may
    cover fewer rows (a padded batch, as the expert-parallel exchange makes), whose output rows
    are zero.
    """

    def __init__(self, config=None, *args, **options):
        super().__init__()
        config = self.config = config_of("MoeFFN", ExpertsConfig, config, args, options)
        num_experts, hidden_size, ffn_hidden_size = (
            int_arg("MoeFFN", name, getattr(config, name))
            for name in ("num_experts", "hidden_size", "ffn_hidden_size"))
        kind = EXPERT_KINDS.get(config.activation)
        if kind is None:
            raise ValueError(f"MoeFFN: activation must be one of {tuple(EXPERT_KINDS)}, got "
                             f"{config.activation!r}")
        if config.clamp_limit > 0 and not kind.clamps:
            raise ValueError(f"MoeFFN: clamp_limit applies to activation="
                             f"{' or '.join(repr(k) for k, v in EXPERT_KINDS.items() if v.clamps)}"
                             f" only, got activation={config.activation!r} with clamp_limit="
                             f"{config.clamp_limit}")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.activation = config.activation
        self.has_bias = bool(config.has_bias)
        self.clamp_limit = float(config.clamp_limit)
        self.padded = bool(config.padded)
        self._forward = kind.forward  # a module function: compiled in GRAPH mode
        width = kind.width * ffn_hidden_size
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
        checked("MoeFFN", "x", x, ("[M, {}]",), self.hidden_size)
        checked("MoeFFN", "expert_tokens", expert_tokens, ("[{}]",),
                self.num_experts, ("int64",))
        dtype = x.dtype if self.compute_dtype is None else self.compute_dtype
        y = self._forward(moe_ops.cast(x, dtype), expert_tokens, moe_ops.cast(self.weight1, dtype),
                          _cast(self.bias1, dtype), moe_ops.cast(self.weight2, dtype),
                          _cast(self.bias2, dtype), self.activation, self.clamp_limit,
                          self.padded)
        if row_weight is not None:
            checked("MoeFFN", "row_weight", row_weight, ("[M]", "[M, 1]"))
            rows = same_rows("MoeFFN", "row_weight", row_weight, "x", x)  # 0: used, so checked
            y = moe_ops.cast(moe_ops.cast(y, ms.float32) *
                             moe_ops.cast(row_weight, ms.float32).reshape(-1, 1 + rows), dtype)
        return y

    def extend_repr(self):
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation}, "
                f"has_bias={self.has_bias}, clamp_limit={self.clamp_limit}, padded={self.padded}")
