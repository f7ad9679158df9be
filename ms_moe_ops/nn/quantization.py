"""Post-training int8 quantisation of the routed experts of whole models:
`ms_moe_ops.quantize(model, mode, calibration)` (also `ms_moe_ops.nn.quantize`).

Two modes, both per expert and output channel for the weights (symmetric, step max|w| / 127):
- "int8" (W8A8): the activations entering each product are quantised too, with static scales
  calibrated on representative batches. Experts with a fused activation (fastgelu, gelu, relu,
  silu) become a QuantMoeFFN: the seed's int8 path of `moe_ffn` (static per-tensor x scale,
  asymmetric per-expert requantisation of the activation, see nn/quant.py). SwiGLU experts (every
  model of ms_moe_ops.models) have no fused int8 kernel: they become an Int8Experts, the same
  integer maths composed from grouped_matmul and swiglu_group, x and the SwiGLU output each
  quantised with one static symmetric per-tensor step.
- "w8a16" (weight-only): float activations, int8 weights dequantised in the product (the form
  Ascend's GroupedMatmul antiquant serves); no calibration.

The int8 weights are Parameters (4x smaller than float32). On the CPU kernels, SwiGLU experts
without biases computing in float32 on a call of up to DIRECT_ROWS rows (a decoding step) read
them as they are (`weight_quant_grouped_matmul`: `(x @ w_q) * deq`, each int8 weight read once
per block of 4 rows of its expert). Other
calls dequantise them (`w_q * deq`, deq [E, N]), then run a float product; a call with fewer
rows than experts dequantises only the experts that have rows. For W8A8, `deq = x_step * w_step`
is the seed's dequant scale, and `x_q @ (w_q * deq) = (x_q @ w_q) * deq` (the per-column and
per-tensor steps factor out of the sum), so the composition computes the int32 product's value,
rounded to float32. The router, the shared experts, attention and everything else stay float.
"""
import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, ops
from mindspore.ops import functional as F

from .. import ops as moe_ops
from ..ops._indexing import take_rows
from ..ops._library import kernel_library_missing
from ..ops._platform import device_target, forced_impl
from ..ops.ffn import ACTIVATIONS as FUSED_ACTIVATIONS
from ._precision import SelfCastingCell, register_opaque_to_rewrite
from .ffn import EXPERT_KINDS, MoeFFN
from .moe_layer import moe_layers, reset_expert_load
from .quant import quantize_moe_ffn

__all__ = ["quantize", "QUANT_MODES", "Int8Experts", "W8A16Experts", "per_channel_int8"]

QUANT_MODES = ("int8", "w8a16")
# Rows up to which the products read the int8 weights directly: weight_quant_grouped_matmul's
# kernel is made for few rows per expert; past them, dequantising once for many rows and
# the BLAS's product win.
DIRECT_ROWS = 64


def _direct_rows():
    """DIRECT_ROWS where weight_quant_grouped_matmul runs its CPU kernel, else -1: its
    composition dequantises every expert, where the gathered path dequantises only those with
    rows."""
    kernel = (device_target() == "CPU" and not kernel_library_missing()
              and forced_impl() in (None, "kernel"))
    return DIRECT_ROWS if kernel else -1


def per_channel_int8(w):
    """w [E, K, N] float -> (int8 [E, K, N], float32 step [E, N]): symmetric per expert and
    output column, step max|w[e, :, n]| / 127 (1 for an all-zero column)."""
    w = np.asarray(w, np.float64)
    step = np.abs(w).max(axis=1) / 127
    step[step == 0] = 1.0
    step = step.astype(np.float32)
    q = np.clip(np.rint(w / step[:, None, :]), -127, 127).astype(np.int8)
    return q, step


def _experts_with_rows(counts, rows):
    """(int32 [n] experts, int64 [n] counts), n = max(rows, 1): the first n experts with rows
    (counts > 0) in expert order, then experts without. Valid counts (adding up to at most
    `rows`) have at most n experts with rows, and these are theirs; the last count also carries
    every other expert's (0 for valid counts), and a negative count replaces it, so that the
    product rejects invalid counts here as it rejects them whole."""
    n = max(rows, 1)
    ids = ops.arange(counts.shape[0], dtype=ms.int32)
    key = ops.where(counts > 0, ids, ids + counts.shape[0])  # distinct: the sort is exact
    # (the indices alone: an unused sorted-values output is a node GRAPH mode warns about)
    pick = ops.sort(key)[1][:n].astype(ms.int32)
    kept = take_rows(counts, pick)
    last = counts.sum() - kept[:n - 1].sum() if n > 1 else counts.sum()
    last = ops.where(counts.min() < 0, counts.min(), last)
    return pick, ops.concat((kept[:n - 1], last.reshape(1).astype(kept.dtype)))


def _param(value, dtype, name):
    return None if value is None else Parameter(Tensor(np.asarray(value, dtype)), name=name,
                                                requires_grad=False)


def _numpy(p):
    return None if p is None else p.astype(ms.float32).asnumpy()


class _QuantExperts(SelfCastingCell):
    """Common part: int8 weights with float32 dequant scales, float biases, the expert kind and
    the inference-only checks."""

    def __init__(self, experts, deq_scale1, deq_scale2, weight1, weight2):
        super().__init__()
        self.num_experts = experts.num_experts
        self.hidden_size = experts.hidden_size
        self.ffn_hidden_size = experts.ffn_hidden_size
        self.activation = experts.activation
        self.clamp_limit = experts.clamp_limit
        self.padded = experts.padded
        self._forward = EXPERT_KINDS[experts.activation].forward
        self.weight1 = _param(weight1, np.int8, "weight1")
        self.weight2 = _param(weight2, np.int8, "weight2")
        self.deq_scale1 = _param(deq_scale1, np.float32, "deq_scale1")
        self.deq_scale2 = _param(deq_scale2, np.float32, "deq_scale2")
        self.bias1 = _param(_numpy(experts.bias1), np.float32, "bias1")
        self.bias2 = _param(_numpy(experts.bias2), np.float32, "bias2")
        self.compute_dtype = experts.compute_dtype
        self.direct_rows = _direct_rows()

    def dequantized(self, dtype, counts, rows):
        """(counts, weight1, bias1, weight2, bias2) in dtype, w_q * deq per call. With fewer
        rows than experts (decoding: a few tokens), only the experts that have rows (at most
        `rows`, a static number) are gathered and dequantised, in expert order: the same groups
        of rows against the same weights, the empty groups left out (_experts_with_rows)."""
        w1, w2, s1, s2, b1, b2 = (self.weight1, self.weight2, self.deq_scale1, self.deq_scale2,
                                  self.bias1, self.bias2)
        # (only with rows known when the graph compiles, and counts of every expert: otherwise
        # the whole weights, which the products check against the counts)
        if F.isconstant(rows) and rows < self.num_experts and counts.shape[0] == self.num_experts:
            pick, counts = _experts_with_rows(counts, rows)
            b1 = None if b1 is None else take_rows(b1, pick)
            b2 = None if b2 is None else take_rows(b2, pick)
        else:
            pick = ops.arange(self.num_experts, dtype=ms.int32)
        w1, w2 = moe_ops.dequantize(w1, s1, pick), moe_ops.dequantize(w2, s2, pick)
        b1 = None if b1 is None else moe_ops.cast(b1, dtype)
        b2 = None if b2 is None else moe_ops.cast(b2, dtype)
        return counts, moe_ops.cast(w1, dtype), b1, moe_ops.cast(w2, dtype), b2

    def direct(self, dtype, rows):
        """True when the call reads the int8 weights as they are (see the module's docstring):
        rows known when the graph compiles."""
        return (self.activation == "swiglu" and dtype == ms.float32 and self.bias1 is None
                and self.bias2 is None and F.isconstant(rows) and rows <= self.direct_rows)

    def direct_swiglu(self, x, counts, a_step=None):
        """The SwiGLU experts on the int8 weights read as they are: x @ weight1 * deq_scale1,
        swiglu, (quantised with the static step a_step, if given), @ weight2 * deq_scale2."""
        h = moe_ops.weight_quant_grouped_matmul(x, self.weight1, self.deq_scale1, counts,
                                                padded=self.padded)
        a = moe_ops.swiglu_group(h, None, counts, clamp_limit=self.clamp_limit)
        if a_step is not None:
            a = _to_int8(a, a_step)
        return moe_ops.weight_quant_grouped_matmul(a, self.weight2, self.deq_scale2, counts,
                                                   padded=self.padded)

    def inference_only(self):
        if self.training:
            raise RuntimeError(f"{type(self).__name__}: quantised experts are inference only; "
                               f"call set_train(False) (train the float model, then quantize)")

    def bprop(self, x, expert_tokens, out, dout):
        raise RuntimeError(f"{type(self).__name__}: quantised experts are inference only; they "
                           f"have no gradient (train the float model, then quantize)")

    def extend_repr(self):
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation}")


class W8A16Experts(_QuantExperts):
    """Weight-only int8 experts of a MoeFFN: `weight1`/`weight2` int8 per expert and output
    channel, `deq_scale1` [E, width*F] / `deq_scale2` [E, H] float32 steps; each call runs the
    expert kind on the int8 weights read as they are (see `direct`) or dequantised, activations
    in the compute dtype (x's, or mixed precision's). construct(x [M, H], expert_tokens int64
    [E]) -> [M, H]. Inference only."""

    def __init__(self, experts):
        w1, step1 = per_channel_int8(_numpy(experts.weight1))
        w2, step2 = per_channel_int8(_numpy(experts.weight2))
        super().__init__(experts, step1, step2, w1, w2)

    def construct(self, x, expert_tokens):
        self.inference_only()
        dtype = x.dtype if self.compute_dtype is None else self.compute_dtype
        if self.direct(dtype, x.shape[0]):
            return self.direct_swiglu(moe_ops.cast(x, dtype), expert_tokens)
        counts, w1, b1, w2, b2 = self.dequantized(dtype, expert_tokens, x.shape[0])
        return self._forward(moe_ops.cast(x, dtype), counts, w1, b1, w2, b2,
                             self.activation, self.clamp_limit, self.padded)


def _to_int8(v, step):
    """Static symmetric quantisation: round half to even, saturated to int8 (as float values)."""
    return (v / step).round().clip(-128.0, 127.0)


class Int8Experts(_QuantExperts):
    """W8A8 SwiGLU experts (the seed's int8 scheme, composed): x quantised with the static step
    `x_step`, `h = x_q @ (weight1 * deq_scale1) + bias1` (deq_scale1 = x_step * weight1's
    per-channel step), `a = swiglu(h)` in float, a quantised with the static step `a_step`,
    `y = a_q @ (weight2 * deq_scale2) + bias2` (deq_scale2 = a_step * weight2's step).
    Built by `quantize(model, "int8", calibration)`, which measures max|x| and max|a| on the float
    model. construct(x [M, H], expert_tokens int64 [E]) -> [M, H]. Inference only."""

    def __init__(self, experts, x_max, a_max):
        x_step = np.float32(x_max / 127 or 1.0)
        a_step = np.float32(a_max / 127 or 1.0)
        w1, step1 = per_channel_int8(_numpy(experts.weight1))
        w2, step2 = per_channel_int8(_numpy(experts.weight2))
        super().__init__(experts, x_step * step1, a_step * step2, w1, w2)
        self.x_step = _param(x_step, np.float32, "x_step")
        self.a_step = _param(a_step, np.float32, "a_step")

    def construct(self, x, expert_tokens):
        self.inference_only()
        dtype = x.dtype if self.compute_dtype is None else self.compute_dtype
        x_q = moe_ops.cast(_to_int8(moe_ops.cast(x, ms.float32), self.x_step), dtype)
        if self.direct(dtype, x.shape[0]):  # (float32: no casts)
            return self.direct_swiglu(x_q, expert_tokens, self.a_step)
        counts, w1, b1, w2, b2 = self.dequantized(dtype, expert_tokens, x.shape[0])
        h = moe_ops.grouped_matmul(x_q, w1, counts, b1, padded=self.padded)
        a = moe_ops.swiglu_group(h, None, counts, clamp_limit=self.clamp_limit)
        a_q = moe_ops.cast(_to_int8(moe_ops.cast(a, ms.float32), self.a_step), dtype)
        return moe_ops.grouped_matmul(a_q, w2, counts, b2, padded=self.padded)


register_opaque_to_rewrite(Int8Experts, W8A16Experts)


class _Observer(ms.nn.Cell):
    """Stands in for a MoeFFN during calibration (PyNative): runs it and keeps its rows per
    expert."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts
        self.rows = [[] for _ in range(experts.num_experts)]

    def construct(self, x, expert_tokens):
        x_np = x.astype(ms.float32).asnumpy()
        start = 0
        for e, n in enumerate(expert_tokens.asnumpy()):
            self.rows[e].append(x_np[start:start + n])
            start += n
        return self.experts(x, expert_tokens)

    def grouped(self):
        """(rows [M, H] grouped by expert, counts int64 [E])."""
        per_expert = [np.concatenate(r) if r else np.zeros((0, self.experts.hidden_size),
                                                            np.float32) for r in self.rows]
        return (np.concatenate(per_expert),
                np.array([len(r) for r in per_expert], np.int64))


def _calibrate(model, layers, calibration):
    """Runs the float model on every calibration batch (PyNative) and returns, per MoELayer,
    its experts' input rows grouped by expert and their counts."""
    observers = [_Observer(layer.experts) for layer in layers]
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    batches = 0
    try:
        for layer, observer in zip(layers, observers):
            layer.experts = observer
        for batch in calibration:
            batch = batch if isinstance(batch, (tuple, list)) else (batch,)
            model(*(b if isinstance(b, Tensor) else Tensor(np.asarray(b)) for b in batch))
            batches += 1
    finally:
        for layer, observer in zip(layers, observers):
            layer.experts = observer.experts
        ms.set_context(mode=mode)
        reset_expert_load(model)  # calibration tokens must not steer the balancing
    if not batches:
        raise ValueError("quantize: calibration holds no batch")
    return [observer.grouped() for observer in observers]


def _swiglu(h, clamp_limit):
    """SwiGLU of h [M, 2F] (gate | up) in float64, clamped as swiglu_group clamps."""
    gate, up = np.split(h, 2, axis=-1)
    if clamp_limit > 0:
        gate, up = np.minimum(gate, clamp_limit), np.clip(up, -clamp_limit, clamp_limit)
    return gate / (1 + np.exp(-gate)) * up


def _swiglu_range(experts, x, counts):
    """(max|x|, max|swiglu(x @ weight1 + bias1)|) of the float experts on their rows."""
    w1, b1 = _numpy(experts.weight1), _numpy(experts.bias1)
    a_max, start = 0.0, 0
    for e, n in enumerate(counts):
        h = x[start:start + n].astype(np.float64) @ w1[e] + (0.0 if b1 is None else b1[e])
        a = _swiglu(h, experts.clamp_limit)
        a_max = max(a_max, float(np.abs(a).max(initial=0.0)))
        start += n
    return float(np.abs(x).max(initial=0.0)), a_max


def quantize(model, mode="int8", calibration=None):
    """Quantises the routed experts of every MoELayer of model (a MoELayer, a MoECausalLM or any
    Cell holding MoELayers), in place, for inference; returns model.

    Args:
        model: the float model (trained or converted).
        mode: "int8" (W8A8: int8 weights and activations, static activation scales from
            calibration) or "w8a16" (int8 weights, float activations).
        calibration: "int8" only, required: an iterable of input batches representative of
            inference (token ids [B, S] for a causal LM, hidden [T, H] for a MoELayer; a tuple
            for a model of several inputs), run once through the float model in PyNative mode.

    Each MoeFFN `layer.experts` is replaced: "int8" gives a QuantMoeFFN (fused activations, the
    seed's int8 moe_ffn kernel) or an Int8Experts (SwiGLU), "w8a16" a W8A16Experts. Routers,
    shared experts, attention and dense layers stay float. A quantised model is inference only:
    in training mode (`set_train()`) or under a gradient it raises RuntimeError.

    Raises:
        ValueError: an unknown mode, a model without MoELayer, experts already quantised, "int8"
            without calibration (there is no dynamic fallback: use "w8a16" to skip calibration),
            or an empty calibration.
    """
    if mode not in QUANT_MODES:
        raise ValueError(f"quantize: mode must be one of {QUANT_MODES}, got {mode!r}")
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"quantize: {type(model).__name__} holds no MoELayer: nothing to quantise")
    done = [type(layer.experts).__name__ for layer in layers
            if not isinstance(layer.experts, MoeFFN)]
    if done:
        raise ValueError(f"quantize: the experts are already quantised ({done[0]}); quantise the "
                         f"float model once")
    if mode == "w8a16":
        for layer in layers:
            _replace_experts(model, layer, W8A16Experts(layer.experts))
        return model
    if calibration is None:
        raise ValueError("quantize: mode 'int8' needs calibration: an iterable of input batches "
                         "(token ids for a causal LM) that fixes the activation scales; mode "
                         "'w8a16' (weight-only) needs none")
    observed = _calibrate(model, layers, calibration)
    for layer, (x, counts) in zip(layers, observed):
        experts = layer.experts
        if experts.activation in FUSED_ACTIVATIONS:
            dtype = experts.compute_dtype or ms.float32
            quantised = quantize_moe_ffn(experts, x, counts, output_dtype=dtype)
        else:
            quantised = Int8Experts(experts, *_swiglu_range(experts, x, counts))
        _replace_experts(model, layer, quantised)
    return model


def _replace_experts(model, layer, quantised):
    """layer.experts = quantised, its parameters named after their place in model (a Cell set
    after construction gets only its attribute's name as prefix, and GRAPH mode needs every
    name once)."""
    prefix = next(name for name, cell in model.cells_and_names() if cell is layer)
    layer.experts = quantised
    for name, p in quantised.parameters_and_names():
        p.name = ".".join(filter(None, (prefix, "experts", name)))


