"""moe_ffn (SPEC §4, seed aclnnMoeFFN): every expert's feed-forward network over its rows,
y[rows e] = act(x[rows e] @ weight1[e] + bias1[e]) @ weight2[e] + bias2[e], in one primitive.

The float path trains: its bprop recomputes the pre-activation with grouped_matmul and builds
every gradient from grouped_matmul calls and one fused activation-derivative op. Recomputing
costs one grouped product (about 1/7 of a training step's FFN flops) but keeps no [M, F] tensor
alive between forward and backward, and keeps the primitive's single output y. The int8 path
(ffn_int8.cc) is inference only.

Implementations: the CPU kernel; on Atlas A2 in GRAPH mode aclnnFFNV3 (the interface that carries
aclnnMoeFFN's computation in current CANN, its expert token counts a device tensor) for
float16 and for int8 with float16 output; on Atlas A2 in PyNative mode MindSpore's
built-in FFN (aclnnFFN) for float16 and that int8 case; a composition of grouped_matmul and the
activation everywhere else.

The seed's aclnnMoeFFN is not bound: its expertTokens is a host aclIntArray, which a Custom
primitive of MindSpore 2.10 can only be given as a constant of the graph (it declares no input
whose value is read on the host at run time, so counts computed by the router cannot reach it),
and current CANN no longer ships it (its FFN document: "provides the MoeFFN and FFN
computation"). Its char* activation would cross (tests/test_compat.py keeps a canary of both).
"""
import mindspore as ms
from mindspore import ops

from .._compat import auto_generate
from ._checks import FLOATS, attr_error, check_dtype, check_range, check_same_dtype, \
    check_shape, dims
from ._impls import aclnn, builtin, composition, kernel
from ._op import Attr, OpDef
from ._platform import A2
from .grouped_matmul import cover_every_row, group_sum, grouped_matmul

_OP = "moe_ffn"
MAX_EXPERTS = 256
ACTIVATIONS = ("fastgelu", "gelu", "relu", "silu")
OUTPUT_DTYPES = ("float16", "bfloat16", "float32")  # int8 path; float16 is the default
_QUANT = ("scale", "offset", "deq_scale1", "deq_scale2")


def _check_activation(op, a):
    if a["activation"] not in ACTIVATIONS:
        raise attr_error(op, "activation", f"one of {ACTIVATIONS}", a["activation"])


def _check_attrs(a):
    _check_activation(_OP, a)
    if a["output_dtype"] not in ("",) + OUTPUT_DTYPES:
        raise attr_error(_OP, "output_dtype", f"None or one of {OUTPUT_DTYPES} (names or MindSpore "
                         f"dtypes)", a["output_dtype"])


def _infer(a, x, tokens, w1, b1, w2, b2, scale, offset, dq1, dq2):
    m, h = dims(_OP, "x", x, 2)
    e = dims(_OP, "expert_tokens", tokens, 1)[0]
    f = dims(_OP, "weight1", w1, 3)[2]
    check_range(_OP, "the expert count E (expert_tokens.shape[0])", e, 1, MAX_EXPERTS)
    check_shape(_OP, "weight1", w1, [e, h, f], "[E, H, F] with E experts and H = x.shape[1]")
    check_shape(_OP, "weight2", w2, [e, f, h], "[E, F, H]")
    for name, shape, expected in (("bias1", b1, [e, f]), ("bias2", b2, [e, h]), ("scale", scale, [e]),
                                  ("offset", offset, [e]), ("deq_scale1", dq1, [e, f]),
                                  ("deq_scale2", dq2, [e, h])):
        if shape is not None:
            check_shape(_OP, name, shape, expected)
    return ([m, h],)


def _infer_dtype(a, x, tokens, w1, b1, w2, b2, scale, offset, dq1, dq2):
    check_dtype(_OP, "expert_tokens", tokens, ("int64",))
    check_dtype(_OP, "x", x, FLOATS + ("int8",))
    quant = dict(zip(_QUANT, (scale, offset, dq1, dq2)))
    if x == "int8":
        check_dtype(_OP, "weight1", w1, ("int8",))
        check_dtype(_OP, "weight2", w2, ("int8",))
        for name, d in (("bias1", b1), ("bias2", b2)):
            if d is not None:
                check_dtype(_OP, name, d, ("int32",))
        missing = [name for name, d in quant.items() if d is None]
        if missing:
            raise ValueError(f"{_OP}: the int8 path needs {', '.join(_QUANT)}; missing "
                             f"{', '.join(missing)}")
        check_dtype(_OP, "scale", scale, ("float32",))
        check_dtype(_OP, "offset", offset, ("float32",))
        check_dtype(_OP, "deq_scale1", dq1, ("uint64", "float32"))
        check_dtype(_OP, "deq_scale2", dq2, ("uint64", "float32"))
        return (a["output_dtype"] or "float16",)
    given = [name for name, d in quant.items() if d is not None]
    if given:
        raise ValueError(f"{_OP}: {', '.join(given)} are quantisation arguments of the int8 path; "
                         f"x is {x}, so they must be None")
    if a["output_dtype"] not in ("", x):
        raise ValueError(f"{_OP}: attribute 'output_dtype' is for the int8 path; on the float "
                         f"path y has x's dtype ({x}), got output_dtype={a['output_dtype']!r}")
    for name, d in (("weight1", w1), ("weight2", w2), ("bias1", b1), ("bias2", b2)):
        if d is not None:
            check_same_dtype(_OP, name, d, "x", x)
    return (x,)


# -- the activation's backward ------------------------------------------------------------------

_ACT = "moe_ffn_activation_grad"


def _infer_act(a, h, grad_a):
    check_shape(_ACT, "grad_a", grad_a, h, "the shape of h")
    return list(h), list(h)


def _infer_act_dtype(a, h, grad_a):
    check_dtype(_ACT, "h", h, FLOATS)
    check_same_dtype(_ACT, "grad_a", grad_a, "h", h)
    return h, h


def _activation(name, v):
    """(act(v), act'(v)) in float32 from MindSpore ops: every activation but relu is
    v * sigmoid(u(v))."""
    if name == "relu":
        return ops.relu(v), (v > 0).astype(ms.float32)
    if name == "fastgelu":
        u, du = 1.702 * v, 1.702
    elif name == "gelu":
        u, du = 1.59576912 * (v + 0.044715 * v * v * v), 1.59576912 * (1 + 0.134145 * v * v)
    else:
        u, du = v, 1.0
    s = ops.sigmoid(u)
    return v * s, s + v * s * (1 - s) * du


def _act_grad_composed(a):
    name = a["activation"]

    def f(h, grad_a):
        act, deriv = _activation(name, h.astype(ms.float32))
        return (grad_a.astype(ms.float32) * deriv).astype(h.dtype), act.astype(h.dtype)

    return f


FFN_ACTIVATION_GRAD = OpDef(
    name=_ACT,
    inputs=("h", "grad_a"),
    outputs=("grad_h", "a"),
    attrs=(Attr("activation", str, "fastgelu"),),
    check_attrs=lambda a: _check_activation(_ACT, a),
    infer=_infer_act,
    infer_dtype=_infer_act_dtype,
    impls=(kernel("MoeFFNActivationGrad"), composition(_act_grad_composed)),
)


def _bprop(a):
    act, c, p = a["activation"], a["tokens_index_flag"], a["padded"]

    def bprop(x, tokens, w1, b1, w2, b2, scale, offset, dq1, dq2, out, dout):
        if x.dtype == ms.int8:
            raise RuntimeError(f"{_OP}: the int8 (quantised) path is inference only; it has no "
                               f"gradient")
        h = grouped_matmul(x, w1, tokens, b1, cumulative=c, padded=p)  # pre-activation, again
        da = grouped_matmul(dout, w2, tokens, transpose_weight=True, cumulative=c, padded=p)
        dh, act_h = FFN_ACTIVATION_GRAD(h, da, activation=act)
        dx = grouped_matmul(dh, w1, tokens, transpose_weight=True, cumulative=c, padded=p)
        dw1 = grouped_matmul(x, dh, tokens, transpose_x=True, cumulative=c, padded=p)
        dw2 = grouped_matmul(act_h, dout, tokens, transpose_x=True, cumulative=c, padded=p)
        db1 = None if b1 is None else group_sum(dh, tokens, c, p)
        db2 = None if b2 is None else group_sum(dout, tokens, c, p)
        return dx, ops.zeros_like(tokens), dw1, db1, dw2, db2, None, None, None, None

    return bprop


def _ffn_composed(a):
    """The float path from grouped_matmul and the activation (each resolves on its own)."""
    name, cumulative, padded = a["activation"], a["tokens_index_flag"], a["padded"]

    def ffn(x, tokens, w1, b1, w2, b2, scale, offset, dq1, dq2):
        h = grouped_matmul(x, w1, tokens, b1, cumulative=cumulative, padded=padded)
        act = _activation(name, h.astype(ms.float32))[0].astype(x.dtype)
        return grouped_matmul(act, w2, tokens, b2, cumulative=cumulative, padded=padded)

    return ffn


def _float_only(a, args, soc):
    if args["x"].dtype == "int8":
        return False, "the int8 path has no composition"
    return True, ""


def _every_row_covered(a):
    """Wraps an Ascend FFN kernel call: the kernels need counts that cover every row, so a padded
    batch's rows past the last expert join it and are masked out of y."""
    cumulative, padded = a["tokens_index_flag"], a["padded"]

    def wrap(call, inputs):
        x, tokens = inputs[0], inputs[1]
        covered = None
        if padded:
            tokens, covered = cover_every_row(tokens, x.shape[0], cumulative)
        y = call((x, tokens) + tuple(inputs[2:]))
        return y if covered is None else y * covered.astype(y.dtype)

    return wrap


def _ffn_builtin(a):
    """MindSpore's built-in FFN (aclnnFFN): expert tokens as host counts (a device-to-host copy
    per call), activation an enum."""
    tensor_to_tuple = auto_generate("tensor_to_tuple")
    prim = auto_generate("FFNExt")(a["activation"], 0)  # inner_precise 0: high-precision float16
    covering = _every_row_covered(dict(a, tokens_index_flag=False))
    cumulative = a["tokens_index_flag"]

    def kernel_call(x, tokens, w1, b1, w2, b2, scale, offset, dq1, dq2):
        return prim(x, w1, w2, tensor_to_tuple(tokens), b1, b2, scale, offset, dq1, dq2)

    def ffn(x, tokens, w1, b1, w2, b2, scale, offset, dq1, dq2):
        if cumulative:  # FFNExt takes counts
            tokens = tokens - ops.concat((ops.zeros((1,), dtype=ms.int64), tokens[:-1]))
        return covering(lambda inputs: kernel_call(*inputs),
                        (x, tokens, w1, b1, w2, b2, scale, offset, dq1, dq2))

    return ffn


FFN_BUILTIN_MAX_DIM = 65536  # aclnnFFN / aclnnFFNV3: H and F below it


def _ascend_ffn_fits(a, args, dtypes):
    """Where aclnnFFN(V3)'s contract matches this operator's (CANN FFN operator documents):
    x of `dtypes`, H and F < 65536, int8 written as float16."""
    x, w1 = args["x"].dtype, args["weight1"].shape
    if len(w1) != 3:
        return False, "weight1's rank is only known at run time"
    if max(w1[1], w1[2]) >= FFN_BUILTIN_MAX_DIM:
        return False, f"the kernel needs H and F < {FFN_BUILTIN_MAX_DIM}, got weight1 {list(w1)}"
    if x == "int8" and a["output_dtype"] not in ("", "float16"):
        return False, (f"the kernel's int8 path writes float16 (bfloat16 only with bfloat16 "
                       f"dequant scales, float32 never), got output_dtype={a['output_dtype']!r}: "
                       f"use output_dtype='float16', or the CPU kernel")
    if x not in dtypes:
        return False, f"it takes {'/'.join(dtypes)} x, got {x}"
    return True, ""


# aclnnFFNV3's prototype takes the OpDef's tensors in another order, four antiquant tensors this
# package never passes, the activation as a char*, and innerPrecise (0: float16 in high
# precision; bfloat16 requires 0) and tokensIndexFlag (cumulative ends) as scalars.
_FFN_V3 = ("x, weight1, weight2, expert_tokens, bias1, bias2, scale, offset, deq_scale1, "
           "deq_scale2, antiquant_scale1?, antiquant_scale2?, antiquant_offset1?, "
           "antiquant_offset2?, activation:str, inner_precise:int, tokens_index_flag:bool")
_NO_QUANT = (None,) * 4
# (bfloat16 is documented for Atlas A2 inference products only: it is composed)
_FFN_V3_DTYPES = [
    ("float16", "int64", "float16", "float16", "float16", "float16") + _NO_QUANT + ("float16",),
] + [("int8", "int64", "int8", "int32", "int8", "int32", "float32", "float32", dq, dq, "float16")
     for dq in ("uint64", "float32")]


# The seed's aclnnMoeFFN (older CANN releases; absent from current operator sources): expert
# counts as a host aclIntArray (a host copy of E int64 per call, read as a value-depend input in
# GRAPH mode), activation "fastgelu" only, float16 and int8 (uint64 dequant scales) x.
_MOE_FFN = ("x, expert_tokens:host, weight1, bias1, weight2, bias2, scale, offset, deq_scale1, "
            "deq_scale2, activation:str")
_MOE_FFN_DTYPES = [
    ("float16", "int64", "float16", "float16", "float16", "float16") + _NO_QUANT + ("float16",),
    ("int8", "int64", "int8", "int32", "int8", "int32", "float32", "float32", "uint64", "uint64",
     "float16")]


def _moe_ffn_fits(a, args, soc):
    if a["activation"] != "fastgelu":
        return False, f"the kernel computes fastgelu only, got activation={a['activation']!r}"
    if args["x"].dtype == "int8" and args["deq_scale1"] is not None and \
            args["deq_scale1"].dtype != "uint64":
        return False, "the kernel takes uint64 dequant scales only"
    return _ascend_ffn_fits(a, args, ("float16", "int8"))


def _counts_covered(a):
    """_every_row_covered for a kernel that takes counts: cumulative ends become counts first."""
    covering = _every_row_covered(dict(a, tokens_index_flag=False))
    cumulative = a["tokens_index_flag"]

    def wrap(call, inputs):
        tokens = inputs[1]
        if cumulative:
            tokens = tokens - ops.concat((ops.zeros((1,), dtype=ms.int64), tokens[:-1]))
        return covering(call, (inputs[0], tokens) + tuple(inputs[2:]))

    return wrap


MOE_FFN = OpDef(
    name=_OP,
    inputs=("x", "expert_tokens", "weight1", "bias1", "weight2", "bias2", "scale", "offset",
            "deq_scale1", "deq_scale2"),
    optional=("bias1", "bias2", "scale", "offset", "deq_scale1", "deq_scale2"),
    outputs=("y",),
    attrs=(Attr("activation", str, "fastgelu"), Attr("tokens_index_flag", bool, False),
           Attr("output_dtype", str, ""), Attr("padded", bool, False)),
    check_attrs=_check_attrs,
    infer=_infer,
    infer_dtype=_infer_dtype,
    impls=(
        kernel("MoeFFN"),
        *aclnn("aclnnFFNV3", _FFN_V3, socs=(A2,), dtypes=_FFN_V3_DTYPES,
               fixed={"inner_precise": 0},
               supports=lambda a, args, soc: _ascend_ffn_fits(a, args, ("float16", "int8")),
               around=_every_row_covered),
        *aclnn("aclnnMoeFFN", _MOE_FFN, socs=(A2,), dtypes=_MOE_FFN_DTYPES, supports=_moe_ffn_fits,
               around=_counts_covered),
        builtin(_ffn_builtin, socs=(A2,), primitive="FFNExt", kernel="aclnnFFN",
                supports=lambda a, args, soc: _ascend_ffn_fits(a, args, ("float16", "int8"))),
        composition(_ffn_composed, supports=_float_only),
    ),
    bprop=_bprop,
)


def moe_ffn(x, expert_tokens, weight1, weight2, bias1=None, bias2=None, scale=None, offset=None,
            deq_scale1=None, deq_scale2=None, activation="fastgelu", tokens_index_flag=False,
            output_dtype=None, padded=False):
    """Feed-forward network of every expert over its rows (SPEC §4).

    Args:
        x: [M, H] float32/float16/bfloat16 (float path) or int8 (quant path), rows grouped by
            expert (expert 0's rows first).
        expert_tokens: int64 tensor [E], 1 <= E <= 256: rows per expert (each >= 0, sum == M), or
            with tokens_index_flag=True inclusive cumulative ends (non-decreasing, last == M).
            Experts with no rows are skipped. Counts that do not cover the M rows exactly raise
            RuntimeError before anything is written, unless padded.
        weight1: [E, H, F]; weight2: [E, F, H]; bias1: [E, F] or None; bias2: [E, H] or None.
            Float path: all of x's dtype. Quant path: int8 weights, int32 biases.
        scale, offset: [E] float32; deq_scale1: [E, F], deq_scale2: [E, H] uint64 (float32 bit
            patterns) or float32. Quant path only (required there, ValueError on the float path).
        activation: "fastgelu" (x * sigmoid(1.702 x)), "gelu" (tanh form), "relu" or "silu".
        output_dtype: quant path only: "float16" (default), "bfloat16" or "float32", or the
            MindSpore dtype (ms.float32). On the float path only None or x's own dtype.
        padded: False (default, SPEC §4): the counts cover every row. True: they may cover fewer
            (sum <= M, last end <= M; a padded batch, as expert parallelism's exchange makes):
            the rows past the last expert's are zero in y and cost nothing on CPU.

    Returns:
        y [M, H]: x's dtype (float path) or output_dtype (quant path). The float path is
        differentiable with respect to x, weight1, bias1, weight2 and bias2; asking for the
        quant path's gradient raises RuntimeError.

    Ascend: on Atlas A2, float16 and int8 (float16 output) run aclnnFFNV3 (the expert
    counts stay on the device; GRAPH mode through ops.Custom, PyNative through the C++
    extension), else the seed's aclnnMoeFFN where the installed CANN has it (fastgelu; its counts
    are copied to the host each call), else MindSpore's built-in FFN (aclnnFFN, host counts too);
    float32 and bfloat16 (documented for Atlas A2 inference products only), and every dtype on
    Atlas A3 and Ascend 950 (no FFN kernel), run grouped_matmul and the activation. The kernels
    need counts that cover every row (aclnnFFN's CheckExpertTokens rejects a sum != M): a padded batch's
    rows past the last expert are handed to it and masked out of y. int8 with another output_dtype raises
    NotImplementedError on Ascend. Both FFN kernels are non-deterministic unless MindSpore's
    deterministic mode is on (`ms.set_deterministic(True)`; `set_context(deterministic=...)` is
    deprecated in MindSpore 2.10).
    """
    return MOE_FFN(x, expert_tokens, weight1, bias1, weight2, bias2, scale, offset, deq_scale1,
                   deq_scale2, activation=activation, tokens_index_flag=tokens_index_flag,
                   output_dtype="" if output_dtype is None else output_dtype, padded=padded)
