"""Post-training int8 quantisation of a MoeFFN Cell, and the inference Cell that runs it.

Scheme (what the int8 path of `moe_ffn` computes, SPEC §4):
- x: one static symmetric per-tensor scale sx from the calibration data, x_q = rint(x / sx).
  Being one number, it folds into deq_scale1.
- weight1, weight2: symmetric, per expert and output channel (weight1[e, :, f] / weight2[e, :, h]).
- the activation a = act(h) feeding the second product: asymmetric per expert, from the range the
  calibration data reaches: q = rint(a * scale[e] + offset[e]) with an integer offset, so the
  offset's contribution `offset * colsum(weight2_q)` is an exact int32 folded into bias2.
- dequant scales are chosen on the 19-bit grid the device keeps (nearest, not truncated), and the
  weights are quantised against the scale actually applied, so the truncation costs nothing.
"""
import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, ops

from .. import ops as moe_ops
from ..ops._checks import dtype_arg
from ..ops.activations import ffn_activation, float_to_deq_scale
from ..ops.ffn import ACTIVATIONS, OUTPUT_DTYPES
from ._checks import checked
from ._precision import SelfCastingCell, register_opaque_to_rewrite

__all__ = ["QuantMoeFFN", "quantize_moe_ffn"]


def _numpy(v):
    if v is None:
        return None
    if isinstance(v, Tensor):
        return v.astype(ms.float32).asnumpy() if v.dtype == ms.bfloat16 else v.asnumpy()
    return np.asarray(v)


def _on_19_bit_grid(v):
    """float32 values rounded to nearest on the grid of float32s whose low 13 bits are zero."""
    bits = np.asarray(v, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)


def _symmetric_int8(w, deq):
    """w [E, K, N] quantised against the per-column step deq [E, N] -> int8 [E, K, N]."""
    return np.clip(np.rint(w / deq[:, None, :]), -127, 127).astype(np.int8)


def _int32(v, name):
    v = np.rint(v)
    if np.abs(v).max(initial=0) >= 2 ** 31:
        raise ValueError(f"quantize_moe_ffn: the quantised {name} does not fit int32")
    return v.astype(np.int32)


def _expert_rows(tokens, rows):
    ends = np.cumsum(tokens)
    if (tokens < 0).any() or ends[-1] != rows:
        raise ValueError(f"quantize_moe_ffn: expert_tokens {tokens.tolist()} do not add up to the "
                         f"{rows} calibration rows")
    return [slice(end - n, end) for n, end in zip(tokens, ends)]


def quantize_moe_ffn(cell, calibration_x, expert_tokens, output_dtype="float16"):
    """int8 inference version of a trained float MoeFFN Cell.

    Args:
        cell: a MoeFFN (or any object with `weight1` [E, H, F], `weight2` [E, F, H], optional
            `bias1` [E, F] / `bias2` [E, H] and `activation` in fastgelu/gelu/relu/silu).
        calibration_x: [M, H] float rows grouped by expert, representative of inference data.
        expert_tokens: [E] per-expert row counts of calibration_x.
        output_dtype: dtype of the QuantMoeFFN's output: "float16", "bfloat16" or "float32" (or
            the MindSpore dtype).

    Returns:
        QuantMoeFFN. An expert with no calibration rows gets the activation range of all rows.
    """
    activation = getattr(cell, "activation", None)
    if activation not in ACTIVATIONS:
        raise ValueError(f"quantize_moe_ffn: activation must be one of {ACTIVATIONS} (the fused "
                         f"moe_ffn operator), got {activation!r}")
    output_dtype = dtype_arg("quantize_moe_ffn", "output_dtype", output_dtype, OUTPUT_DTYPES)
    w1 = _numpy(cell.weight1).astype(np.float64)
    w2 = _numpy(cell.weight2).astype(np.float64)
    e, hidden, ffn = w1.shape
    b1 = _numpy(getattr(cell, "bias1", None))
    b2 = _numpy(getattr(cell, "bias2", None))
    x = _numpy(calibration_x).astype(np.float64)
    tokens = _numpy(expert_tokens).astype(np.int64).reshape(-1)
    if x.ndim != 2 or x.shape[1] != hidden or tokens.shape != (e,):
        raise ValueError(f"quantize_moe_ffn: calibration_x must be [M, {hidden}] and expert_tokens "
                         f"[{e}], got {list(x.shape)} and {list(tokens.shape)}")
    if x.shape[0] == 0:
        raise ValueError("quantize_moe_ffn: calibration_x has no rows")
    rows = _expert_rows(tokens, x.shape[0])

    # x: static symmetric per-tensor
    x_step = float(np.float32(np.abs(x).max(initial=0.0) / 127)) or 1.0  # as the Cell holds it
    # first product: deq1 = x_step * w1 column step, on the device's grid
    w1_step = np.abs(w1).max(axis=1) / 127
    w1_step[w1_step == 0] = 1.0
    deq1 = _on_19_bit_grid(x_step * w1_step)
    w1_q = _symmetric_int8(w1, deq1 / x_step)
    b1_q = None if b1 is None else _int32(b1 / deq1, "bias1")

    # activation range per expert, from the float model on the calibration rows
    def act_range(r, e_):
        h = x[r] @ w1[e_] + (0.0 if b1 is None else b1[e_])
        a = ffn_activation(activation, h).astype(np.float64)
        return a.min(initial=0.0), a.max(initial=0.0)

    ranges = [act_range(r, i) for i, r in enumerate(rows) if r.stop > r.start]
    overall = (min(lo for lo, _ in ranges), max(hi for _, hi in ranges))
    ranges = iter(ranges)
    lo, hi = np.array([next(ranges) if r.stop > r.start else overall for r in rows]).T
    scale = (255.0 / np.maximum(hi - lo, 1e-12)).astype(np.float32)
    offset = np.rint(-128.0 - lo * scale).astype(np.float32)

    # second product: y = (q - offset) / scale @ w2 + b2 = deq2 * (q @ w2_q + b2_q)
    w2_step = np.abs(w2).max(axis=1) / 127
    w2_step[w2_step == 0] = 1.0
    deq2 = _on_19_bit_grid(w2_step / scale[:, None])
    w2_q = _symmetric_int8(w2, deq2.astype(np.float64) * scale[:, None])
    colsum = w2_q.astype(np.int64).sum(axis=1)
    b2_q = (0.0 if b2 is None else b2 / deq2) - offset[:, None] * colsum
    b2_q = _int32(b2_q, "bias2")
    return QuantMoeFFN(x_step, w1_q, w2_q, b1_q, b2_q, scale, offset, deq1, deq2, activation,
                       output_dtype, padded=bool(getattr(cell, "padded", False)))


class QuantMoeFFN(SelfCastingCell):
    """int8 inference MoeFFN (build it with `quantize_moe_ffn`).

    construct(x [M, H] float, expert_tokens int64 [E] counts) -> [M, H] in output_dtype:
    x is quantised with the static scale (round half to even, saturated), then both expert
    products run on the int8 path of `moe_ffn`. Inference only: asking for a gradient raises.
    Mixed precision (`to_float`, `auto_mixed_precision`) changes nothing: the scales stay float32
    and y has output_dtype.
    padded=True (set from the MoeFFN's own): the counts may cover fewer rows than x has, as in
    moe_ffn. Inference only: in training mode (`set_train()`) it raises RuntimeError.
    Parameters (x_step: the static x scale, int8 weights, int32 biases, float32 scale/offset,
    uint64 dequant scales) are saved and loaded with the usual checkpoint functions.
    """

    def __init__(self, x_step, weight1, weight2, bias1, bias2, scale, offset, deq_scale1,
                 deq_scale2, activation="fastgelu", output_dtype="float16", padded=False):
        super().__init__()
        self.activation = activation
        self.padded = padded
        self.output_dtype = dtype_arg("QuantMoeFFN", "output_dtype", output_dtype, OUTPUT_DTYPES)

        def param(v, dtype, name):
            return None if v is None else Parameter(Tensor(np.asarray(v, dtype)), name=name,
                                                    requires_grad=False)

        self.x_step = param(x_step, np.float32, "x_step")  # a Parameter: checkpoints keep it
        self.weight1 = param(weight1, np.int8, "weight1")
        self.weight2 = param(weight2, np.int8, "weight2")
        self.bias1 = param(bias1, np.int32, "bias1")
        self.bias2 = param(bias2, np.int32, "bias2")
        self.scale = param(scale, np.float32, "scale")
        self.offset = param(offset, np.float32, "offset")
        self.deq_scale1 = param(float_to_deq_scale(deq_scale1), np.uint64, "deq_scale1")
        self.deq_scale2 = param(float_to_deq_scale(deq_scale2), np.uint64, "deq_scale2")
        self.num_experts, self.hidden_size = self.weight1.shape[:2]

    def construct(self, x, expert_tokens):
        if self.training:
            raise RuntimeError("QuantMoeFFN: the int8 path is inference only; call "
                               "set_train(False) (train the float model, then quantise it)")
        checked("QuantMoeFFN", "x", x, ("[M, {}]",), self.hidden_size)
        checked("QuantMoeFFN", "expert_tokens", expert_tokens, ("[{}]",),
                self.num_experts, ("int64",))
        x_q = ops.clamp(ops.round(x.astype(ms.float32) / self.x_step), -128.0, 127.0)
        return moe_ops.moe_ffn(x_q.astype(ms.int8), expert_tokens, self.weight1, self.weight2,
                               self.bias1, self.bias2, self.scale, self.offset, self.deq_scale1,
                               self.deq_scale2, activation=self.activation,
                               output_dtype=self.output_dtype, padded=self.padded)

    def extend_repr(self):
        e, h, f = self.weight1.shape
        return (f"num_experts={e}, hidden_size={h}, ffn_hidden_size={f}, "
                f"activation={self.activation}, output_dtype={self.output_dtype}")


register_opaque_to_rewrite(QuantMoeFFN)
