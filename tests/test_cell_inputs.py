"""What the Cells check of the tensors they receive: rank, last dimension and dtype against their
configuration, in PyNative and GRAPH mode; the error names the Cell, the argument, what was
expected and what was given. (What dynamic shapes leave unknown passes: test_dynamic_shapes.py.)

Before these checks a MoELayer re-cut the tokens of a wrong-width input whenever the element count
divided, and returned a finite tensor of the input's shape."""
import re

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from ms_moe_ops import GatingTopK, MoELayer, MoeFFN, SharedExperts, quantize_moe_ffn
from conftest import run, tensor

# the layer of the report: hidden_size 64
LAYER = dict(hidden_size=64, ffn_hidden_size=32, num_experts=16, top_k=4, n_group=4, topk_group=2)
TOKENS = "[T, 64] or [B, S, 64]"


def _input(shape, dtype="float32"):
    if dtype == "float64":
        return Tensor(np.zeros(shape, np.float64))
    if dtype == "int32":
        return Tensor(np.zeros(shape, np.int32))
    return tensor(np.zeros(shape, np.float32), dtype)


def _raises(error, message, cell, *args, mode):
    with pytest.raises(error, match=re.escape(message)):
        run(cell, *args, mode=mode)


@pytest.mark.parametrize("shape,dtype,error,message", [
    # widths whose element counts divide by 64: silently re-cut before
    ((2, 8, 48), "float32", ValueError, f"MoELayer: 'hidden' must be {TOKENS}, got shape [2, 8, 48]"),
    ((2, 8, 128), "float32", ValueError, f"MoELayer: 'hidden' must be {TOKENS}, got shape [2, 8, 128]"),
    # MindSpore's Reshape message before, which never named the layer
    ((2, 8, 50), "float32", ValueError, f"MoELayer: 'hidden' must be {TOKENS}, got shape [2, 8, 50]"),
    ((2, 2, 4, 64), "float32", ValueError, f"MoELayer: 'hidden' must be {TOKENS}, got shape [2, 2, 4, 64]"),
    ((64,), "float32", ValueError, f"MoELayer: 'hidden' must be {TOKENS}, got shape [64]"),
    # an internal operator (moe_token_permute) named before
    ((2, 8, 64), "float64", TypeError,
     "MoELayer: 'hidden' must have dtype float32 or float16 or bfloat16, got float64"),
    ((2, 8, 64), "int32", TypeError,
     "MoELayer: 'hidden' must have dtype float32 or float16 or bfloat16, got int32"),
], ids=["48-wide", "128-wide", "50-wide", "4-D", "1-D", "float64", "int32"])
def test_moe_layer(shape, dtype, error, message, mode):
    _raises(error, message, MoELayer(**LAYER, n_shared_experts=1), _input(shape, dtype), mode=mode)


@pytest.mark.slow_in_graph
def test_moe_layer_still_takes_both_layouts_and_every_float_dtype(mode):
    layer = MoELayer(**LAYER)
    for shape in ((5, 64), (2, 3, 64)):
        for dtype in ("float32", "float16", "bfloat16"):
            out = run(layer, _input(shape, dtype), mode=mode)
            assert out.shape == shape and out.dtype == _input(shape, dtype).dtype


@pytest.mark.parametrize("shape,dtype,error,message", [
    ((2, 8, 48), "float32", ValueError,
     f"GatingTopK: 'hidden_states' must be {TOKENS}, got shape [2, 8, 48]"),
    ((4, 2, 2, 64), "float32", ValueError,
     f"GatingTopK: 'hidden_states' must be {TOKENS}, got shape [4, 2, 2, 64]"),
    ((3, 64), "float64", TypeError,
     "GatingTopK: 'hidden_states' must have dtype float32 or float16 or bfloat16, got float64"),
], ids=["width", "rank", "dtype"])
def test_router(shape, dtype, error, message, mode):
    router = GatingTopK(64, 16, 4, n_group=4, topk_group=2)
    _raises(error, message, router, _input(shape, dtype), mode=mode)


def _ffn_args(rows=6, width=8, counts=(2, 0, 4), counts_dtype=np.int64, x_dtype="float32"):
    return _input((rows, width), x_dtype), Tensor(np.array(counts, counts_dtype))


@pytest.mark.parametrize("args,error,message", [
    (_ffn_args(width=6), ValueError, "MoeFFN: 'x' must be [M, 8], got shape [6, 6]"),
    ((_input((2, 3, 8)), Tensor(np.array([2, 0, 4], np.int64))), ValueError,
     "MoeFFN: 'x' must be [M, 8], got shape [2, 3, 8]"),
    (_ffn_args(x_dtype="float64"), TypeError,
     "MoeFFN: 'x' must have dtype float32 or float16 or bfloat16, got float64"),
    (_ffn_args(counts=(2, 4)), ValueError, "MoeFFN: 'expert_tokens' must be [3], got shape [2]"),
    (_ffn_args(counts_dtype=np.int32), TypeError,
     "MoeFFN: 'expert_tokens' must have dtype int64, got int32"),
    (_ffn_args() + (_input((6, 1, 1)),), ValueError,
     "MoeFFN: 'row_weight' must be [M] or [M, 1], got shape [6, 1, 1]"),
    (_ffn_args() + (_input((1,)),), ValueError,
     "MoeFFN: 'row_weight' must have one row per row of 'x' (6), got shape [1]"),
    (_ffn_args() + (_input((4, 1)),), ValueError,
     "MoeFFN: 'row_weight' must have one row per row of 'x' (6), got shape [4, 1]"),
], ids=["width", "rank", "dtype", "experts", "counts-dtype", "row-weight", "row-weight-broadcast",
        "row-weight-rows"])
@pytest.mark.parametrize("activation", ["swiglu",
                                        pytest.param("gelu", marks=pytest.mark.slow_in_graph)])
def test_experts(activation, args, error, message, mode):
    _raises(error, message, MoeFFN(3, 8, 5, activation=activation), *args, mode=mode)


def test_shared_experts(mode):
    _raises(ValueError, "SharedExperts: 'x' must be [T, 8], got shape [6, 16]",
            SharedExperts(8, 5, gate=True), _input((6, 16)), mode=mode)
    _raises(ValueError, "SharedExperts: 'x' must be [T, 8], got shape [2, 3, 8]",
            SharedExperts(8, 5), _input((2, 3, 8)), mode=mode)


def test_quantised_experts(mode, rng):
    cell = quantize_moe_ffn(MoeFFN(2, 8, 16), rng.normal(size=(6, 8)).astype(np.float32),
                            np.array([4, 2], np.int64))
    counts = Tensor(np.array([4, 2], np.int64))
    _raises(ValueError, "QuantMoeFFN: 'x' must be [M, 8], got shape [6, 4]", cell,
            _input((6, 4)), counts, mode=mode)
    _raises(TypeError, "QuantMoeFFN: 'expert_tokens' must have dtype int64, got int32", cell,
            _input((6, 8)), Tensor(np.array([4, 2], np.int32)), mode=mode)


def test_half_precision_inputs_pass_the_checks(mode):
    ffn = MoeFFN(3, 8, 5, activation="swiglu")
    x, counts = _ffn_args(x_dtype="bfloat16")
    assert run(ffn, x, counts, mode=mode).dtype == ms.bfloat16


def _quantised():
    return quantize_moe_ffn(MoeFFN(3, 8, 5), np.ones((6, 8), np.float32), np.array([2, 0, 4], np.int64))


# every Cell with a valid call: (name, factory, the arguments' names, the arguments)
_CALLS = [
    ("MoELayer", lambda: MoELayer(**LAYER), ["hidden"], lambda: [_input((2, 3, 64))]),
    ("GatingTopK", lambda: GatingTopK(64, 16, 4), ["hidden_states"], lambda: [_input((3, 64))]),
    ("MoeFFN", lambda: MoeFFN(3, 8, 5, activation="swiglu"), ["x", "expert_tokens", "row_weight"],
     lambda: [*_ffn_args(), _input((6,))]),
    ("SharedExperts", lambda: SharedExperts(8, 5), ["x"], lambda: [_input((6, 8))]),
    ("QuantMoeFFN", _quantised, ["x", "expert_tokens"], lambda: list(_ffn_args())),
]


# In GRAPH mode a numpy argument is a constant of the graph, and these Cells cast it to float32
# (numpy's astype, run while the graph is built) before the check's value is used: numpy's
# message comes first there.
_NUMPY_FIRST_IN_GRAPH = {("MoELayer", "hidden"), ("GatingTopK", "hidden_states"),
                         ("MoeFFN", "row_weight")}


@pytest.mark.parametrize("owner,factory,names,arguments,i", [
    pytest.param(*call, i, id=f"{call[0]}-{name}") for call in _CALLS
    for i, name in enumerate(call[2])])
def test_a_numpy_array_is_refused_naming_the_tensor_it_should_be(owner, factory, names, arguments,
                                                                 i, mode):
    """Each tensor argument of each Cell, given as a numpy array: the error says a MindSpore Tensor
    is expected (before: "Cannot interpret 'mindspore.float32' as a data type", from numpy)."""
    if mode == "graph" and (owner, names[i]) in _NUMPY_FIRST_IN_GRAPH:
        pytest.skip("GRAPH mode: numpy's cast runs before the check (see _NUMPY_FIRST_IN_GRAPH)")
    args = arguments()
    cell = factory()
    if mode == "pynative":
        run(cell, *args, mode=mode)  # the call is valid as Tensors
    args[i] = args[i].asnumpy()
    _raises(TypeError, f"{owner}: '{names[i]}' must be a MindSpore Tensor, got numpy.ndarray "
                       f"(wrap it: mindspore.Tensor({names[i]}))", cell, *args, mode=mode)
