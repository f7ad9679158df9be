"""moe_ffn int8 path (SPEC §4 quant path) against the exact-integer golden model, and the
post-training quantisation of a MoeFFN Cell (quantize_moe_ffn / QuantMoeFFN)."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from ms_moe_ops import moe_ffn, reference
from ms_moe_ops.nn import MoeFFN, QuantMoeFFN, quantize_moe_ffn
from cases import (INT8_FFN_INPUTS as NAMES, as_f32 as _as_f32, assert_int8_matches as _assert_matches,
                   int8_ffn as _call, int8_ffn_case as _case)
from conftest import grad, needs_kernels, numpy, run, tensor

# the kernels run under every instruction-set path; the int8 path has no composition
pytestmark = [pytest.mark.every_isa, needs_kernels("on CPU the int8 path runs on the kernel only",
                                                       other_devices_too=True)]

ACTIVATIONS = ["fastgelu", "gelu", "relu", "silu"]
def _golden(v, **kw):
    return reference.moe_ffn_quant(*(v[n] for n in NAMES[:2]), v["w1"], v["w2"], v["b1"], v["b2"],
                                   v["scale"], v["offset"], v["dq1"], v["dq2"], **kw)


# -- golden model ---------------------------------------------------------------------------------

@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_matches_golden(activation, mode, rng):
    v = _case(rng)
    _assert_matches(_call(v, mode, activation=activation, output_dtype="float32"),
                    _golden(v, activation=activation, output_dtype="float32"), v, activation)


def test_requantisation_saturates_at_both_ends(rng):
    # _case's scales must drive the kernel's requantised activation into both ends of int8:
    # with weight2 the identity and deq_scale2 = 1, y is the kernel's q itself
    v = _case(rng, h=40, f=40)
    v.update(w2=np.tile(np.eye(40, dtype=np.int8), (4, 1, 1)), b2=None,
             dq2=np.ones((4, 40), np.float32))
    q = _as_f32(_call(v, activation="relu", output_dtype="float32"))
    np.testing.assert_array_equal(q, _golden(v, activation="relu", output_dtype="float32"))
    assert (q == 127).any() and (q == -128).any() and ((q > -100) & (q < 100)).mean() > 0.3


def test_requantisation_rounds_halves_to_even():
    # h = x = 2 j + 1 (j = 0..39), q = rint(h / 2 - 20) = rint(j - 19.5): every value is a half,
    # negative and positive; 40 columns run the vectorised store and its tail (or the scalar
    # code of a build without AVX-512). Halves go to the even neighbour: -19.5 -> -20,
    # -18.5 -> -18, ..., -0.5 -> 0, 0.5 -> 0, 1.5 -> 2, ..., 19.5 -> 20.
    j = np.arange(40)
    v = _identity_case(x=2 * j + 1, b1=np.zeros(40), scale=0.5, offset=-20.0)
    halves = j - 19.5
    expected = np.where(np.floor(halves) % 2 == 0, np.floor(halves), np.ceil(halves))
    assert list(expected[:4]) == [-20, -18, -18, -16] and list(expected[18:22]) == [-2, 0, 0, 2]
    y = _as_f32(_call(v, activation="relu", output_dtype="float32"))
    np.testing.assert_array_equal(y[0], expected)


@pytest.mark.parametrize("output_dtype", ["float16", "bfloat16", "float32", None])
def test_output_dtypes(output_dtype, rng):
    v = _case(rng, counts=(7, 3))
    y = _call(v, output_dtype=output_dtype)
    name = output_dtype or "float16"
    assert y.dtype == {"float16": ms.float16, "bfloat16": ms.bfloat16, "float32": ms.float32}[name]
    _assert_matches(y, _golden(v, output_dtype=output_dtype), v, "fastgelu")


def test_bfloat16_output_graph(rng):
    v = _case(rng, counts=(4, 6))
    y = _call(v, "graph", activation="relu", output_dtype="bfloat16")
    _assert_matches(y, _golden(v, activation="relu", output_dtype="bfloat16"), v, "relu")


def test_float32_and_uint64_deq_scales_agree(rng):
    v = _case(rng, deq="float32")
    u = dict(v, dq1=reference.float_to_deq_scale(v["dq1"]), dq2=reference.float_to_deq_scale(v["dq2"]))
    assert u["dq1"].dtype == np.uint64
    y32 = _as_f32(_call(v, activation="relu", output_dtype="float32"))
    y64 = _as_f32(_call(u, activation="relu", output_dtype="float32"))
    np.testing.assert_array_equal(y32, y64)
    np.testing.assert_array_equal(y32, _golden(v, activation="relu", output_dtype="float32"))


def test_uint64_deq_scale_uses_low_32_bits_only(rng):
    v = _case(rng, counts=(6,))
    u = dict(v, dq2=v["dq2"] | np.uint64(0xABCD) << np.uint64(40))
    np.testing.assert_array_equal(_as_f32(_call(u, output_dtype="float32")),
                                  _as_f32(_call(v, output_dtype="float32")))


def _identity_case(x, b1, scale, offset, dq1=1.0, dq2=1.0):
    """One expert, H = F, identity weights: y = (q + 0) * dq2 with
    q = int8(rint(relu((x + b1) * dq1) * scale + offset))."""
    x = np.asarray(x, np.int8).reshape(1, -1)
    n = x.shape[1]
    eye = np.eye(n, dtype=np.int8)[None]
    return dict(x=x, tokens=np.array([1], np.int64), w1=eye, w2=eye,
                b1=np.asarray(b1, np.int32).reshape(1, n), b2=None,
                scale=np.float32([scale]), offset=np.float32([offset]),
                dq1=np.full((1, n), dq1, np.float32), dq2=np.full((1, n), dq2, np.float32))


def test_round_half_to_even_and_saturation():
    # h = x + b1; q = rint(h / 2 - 1) saturated: halves go to the even neighbour
    v = _identity_case(x=[3, 5, 7, 9, 1, 127, 127, 0], b1=[0, 0, 0, 0, 0, 200, 2000, 0],
                       scale=0.5, offset=-1.0)
    y = _as_f32(_call(v, activation="relu", output_dtype="float32"))
    # x = 3, 5, 7, 9, 1 give 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, 3.5 -> 4, -0.5 -> 0; 162.5 and 1062.5
    # saturate to 127; x = 0 gives -1
    np.testing.assert_array_equal(y[0], [0, 2, 2, 4, 0, 127, 127, -1])
    # negative saturation through the offset
    v = _identity_case(x=[0, 10, 100], b1=[0, 0, 0], scale=1.0, offset=-300.0)
    y = _as_f32(_call(v, activation="relu", output_dtype="float32"))
    np.testing.assert_array_equal(y[0], [-128, -128, -128])
    np.testing.assert_array_equal(y, _golden(v, activation="relu", output_dtype="float32"))


def test_deq_scale_truncated_to_19_bits():
    # 1 + 2^-12 has only bits below the top 19: the device uses 1.0. With q = h exactly,
    # y must be the integer sum itself, not sum * (1 + 2^-12).
    fine = np.float32(1 + 2 ** -12)
    assert fine != 1
    x = [100, -77, 55, 12]
    v = _identity_case(x=x, b1=[0] * 4, scale=1.0, offset=0.0, dq1=fine, dq2=fine)
    v["w2"] = np.full((1, 4, 4), 127, np.int8)
    q = np.maximum(np.array(x), 0)  # relu(x * 1.0)
    y = _as_f32(_call(v, activation="relu", output_dtype="float32"))
    np.testing.assert_array_equal(y[0], np.full(4, 127 * q.sum(), np.float32))
    assert (y[0] != np.float32(127 * q.sum()) * fine).all()
    np.testing.assert_array_equal(y, _golden(v, activation="relu", output_dtype="float32"))
    # the same through uint64 (an offset of 0x1FFF below the top 19 bits is dropped too)
    bits = np.float32([1.0]).view(np.uint32).astype(np.uint64) | np.uint64(0x1FFF)
    v.update(dq1=np.full((1, 4), bits, np.uint64), dq2=np.full((1, 4), bits, np.uint64))
    np.testing.assert_array_equal(_as_f32(_call(v, activation="relu", output_dtype="float32")), y)


def test_int32_sums_wrap():
    # bias near the int32 limit: the accumulator wraps like the device's
    v = _identity_case(x=[100, 1], b1=[2 ** 31 - 50, 2 ** 31 - 1], scale=1.0, offset=0.0,
                       dq1=2.0 ** -24)
    y = _as_f32(_call(v, activation="relu", output_dtype="float32"))
    np.testing.assert_array_equal(y, _golden(v, activation="relu", output_dtype="float32"))
    assert y[0, 0] == 0 and y[0, 1] == 0  # wrapped negative -> relu 0 -> q = 0


def _bytes(rng, pattern, shape, weights):
    """Adversarial int8 operands for the products. The avx2 path multiplies |x| by sign(x) * w in
    16-bit pairs (vpmaddubsw), exact while w != -128: a panel of weights with a few -128 has them
    replaced and corrected for, one with more takes a widening product."""
    if pattern == "uniform":
        return rng.integers(-128, 128, shape).astype(np.int8)
    if pattern == "all -128":
        return np.full(shape, -128, np.int8)
    if pattern == "largest pairs":  # |x| = 128 against |w| = 127: pair sums of +-32512
        return rng.choice(np.int8([-128, -128, 127]) if not weights else np.int8([-127, 127]), shape)
    if pattern in ("-128 in one panel", "-128 in every other column"):
        # the package's own weights ([-127, 127]) and a few -128, replaced in the packed panels
        # (the product corrected afterwards): one in panel 2, or one per column as per-channel
        # quantisers over all of int8 give them (32 per panel, under the avx2 path's limit)
        v = rng.choice(np.int8([-127, 127, -1, 0]), shape)
        if not weights:
            v[::2] = -128
        elif pattern == "-128 in one panel":
            v[..., 7, 130] = -128  # k = 7, panel 2 (columns 128..191) of each expert
        else:
            columns = np.arange(0, shape[-1], 2)
            v[..., rng.integers(0, shape[-2], len(columns)), columns] = -128
        return v
    raise AssertionError(pattern)


@pytest.mark.every_isa_by_default  # (each path has its own product: avx2's corrects -128 weights)
@pytest.mark.parametrize("pattern", ["uniform", "all -128", "largest pairs", "-128 in one panel",
                                     "-128 in every other column"])
def test_products_exact_for_every_byte(pattern, rng):
    # y = q @ weight2 as integers: weight1 the identity, b1 = 128, scale 1, offset -128 give
    # q = x (relu sees x + 128 >= 0); deq scales 1. K = 203 (an odd number of 4-byte groups),
    # N = 203 (a partial last panel); integers below 2^24 are exact in float32.
    n, counts = 203, (20, 0, 31)
    x = _bytes(rng, pattern, (sum(counts), n), weights=False)
    w2 = _bytes(rng, pattern, (3, n, n), weights=True)
    v = dict(x=x, tokens=np.array(counts, np.int64), w1=np.tile(np.eye(n, dtype=np.int8), (3, 1, 1)),
             w2=w2, b1=np.full((3, n), 128, np.int32), b2=None, scale=np.ones(3, np.float32),
             offset=np.full(3, -128, np.float32), dq1=np.ones((3, n), np.float32),
             dq2=np.ones((3, n), np.float32))
    y = _as_f32(_call(v, activation="relu", output_dtype="float32"))
    expert = np.repeat([0, 2], [20, 31])
    expected = np.einsum("mk,mkn->mn", x.astype(np.int64), w2[expert].astype(np.int64))
    np.testing.assert_array_equal(y, expected.astype(np.float32))
    # the first product with the same operands, through the golden model (relu: bit for bit)
    v = dict(_case(rng, counts=counts, h=n, f=n), x=x, w1=w2, w2=w2)
    v["dq1"] = np.full((3, n), 2.0 ** -21, np.float32)
    _assert_matches(_call(v, activation="relu", output_dtype="float32"),
                    _golden(v, activation="relu", output_dtype="float32"), v, "relu")


# -- expert layouts -------------------------------------------------------------------------------

def test_zero_token_experts_and_biases_absent(rng):
    v = _case(rng, counts=(0, 6, 0, 0, 11, 0), bias=False)
    _assert_matches(_call(v, activation="relu", output_dtype="float32"),
                    _golden(v, activation="relu", output_dtype="float32"), v, "relu")


def test_no_hidden_columns(rng):
    # F = 0: the second product sums nothing, y = b2 * deq_scale2
    with np.errstate(divide="ignore"):  # (_case scales deq_scale2 by 1 / sqrt(F))
        v = _case(rng, counts=(3, 0, 5), h=13, f=0)
    v["dq2"] = np.full((3, 13), 2.0 ** -10, np.float32)
    _assert_matches(_call(v, activation="relu", output_dtype="float32"),
                    _golden(v, activation="relu", output_dtype="float32"), v, "relu")


def test_no_rows(rng):
    v = _case(rng, counts=(0, 0))
    assert _call(v).shape == (0, 13)


def test_tokens_index_flag(mode, rng):
    v = _case(rng, counts=(3, 0, 8, 2))
    ends = dict(v, tokens=np.cumsum(v["tokens"]))
    y = _call(ends, mode, tokens_index_flag=True, activation="relu", output_dtype="float32")
    _assert_matches(y, _golden(v, activation="relu", output_dtype="float32"), v, "relu")


def test_many_rows_and_tile_tails(rng):
    # more rows than one parallel task, columns beyond one register tile
    v = _case(rng, counts=(130, 1, 67), h=67, f=131)
    _assert_matches(_call(v, output_dtype="float32"), _golden(v, output_dtype="float32"), v,
                    "fastgelu")


@needs_kernels("a data fault is found by this package's CPU kernels")
@pytest.mark.parametrize("tokens, flag", [([5, 0, 9, 5], False), ([0, 0, 0, 19], False),
                                          ([5, 0, -1, 14], False), ([5, 4, 14, 18], True),
                                          ([5, 5, 14, 19], True)])
def test_bad_expert_tokens(tokens, flag, rng):
    v = dict(_case(rng), tokens=np.array(tokens, np.int64))
    with pytest.raises(RuntimeError):
        _call(v, tokens_index_flag=flag).asnumpy()


def test_rows_past_the_experts(rng):
    """Counts covering 18 of 21 rows (a padded batch, padded=True): the same first rows, zero
    last rows; refused without padded=True."""
    v = _case(rng)
    padded = dict(v, x=np.concatenate([v["x"], np.full((3, v["x"].shape[1]), 127, np.int8)]))
    y, y_padded = _as_f32(_call(v)), _as_f32(_call(padded, padded=True))
    assert np.array_equal(y_padded[:18], y) and not y_padded[18:].any()
    with pytest.raises(RuntimeError, match="cover 18 of the 21 rows"):
        _call(padded).asnumpy()


def test_gradient_request_raises(mode, rng):
    cell = _quantised(MoeFFN(2, 8, 16), np.array([4, 4], np.int64), rng)[0]
    x = tensor(rng.standard_normal((8, 8)).astype(np.float32))
    tokens = tensor(np.array([4, 4], np.int64))

    def loss(x, tokens):
        return cell(x, tokens).astype(ms.float32).sum()

    with pytest.raises(RuntimeError, match="no gradient"):
        grad(loss, x, tokens, mode=mode)


# -- quantisation of a trained Cell ---------------------------------------------------------------

def _quantised(cell, tokens, rng, bias=None, output_dtype="float32"):
    """(QuantMoeFFN, calibration x) for cell, its weights set from rng (nn.Dense's uniform
    initialisation); bias: set random biases of that size."""
    e, h, f = cell.weight1.shape
    for p, fan_in in ((cell.weight1, h), (cell.weight2, f)):
        p.set_data(Tensor(rng.uniform(-1, 1, p.shape).astype(np.float32) / np.sqrt(fan_in)))
    if bias:
        cell.bias1.set_data(Tensor((rng.standard_normal((e, f)) * bias).astype(np.float32)))
        cell.bias2.set_data(Tensor((rng.standard_normal((e, h)) * bias).astype(np.float32)))
    calib = rng.standard_normal((int(tokens.sum()), h)).astype(np.float32)
    return quantize_moe_ffn(cell, calib, tokens, output_dtype=output_dtype), calib


@pytest.mark.parametrize("activation, bias", [("fastgelu", None), ("gelu", 0.1), ("relu", 0.1),
                                              ("silu", None)])
def test_quantised_cell_is_close_to_float(activation, bias, rng):
    # Dense-initialised experts on unit-normal tokens: W8A8 with a per-tensor x scale keeps the
    # relative error (Frobenius) near 1.3%; 3% is the bound.
    tokens = np.array([90, 0, 70, 96], np.int64)
    cell = MoeFFN(4, 64, 128, activation=activation, has_bias=bias is not None)
    q, _ = _quantised(cell, tokens, rng, bias)
    x = tensor(rng.standard_normal((256, 64)).astype(np.float32))
    t = tensor(tokens)
    y_float, y_int8 = numpy(cell(x, t)), numpy(q(x, t))
    err = np.linalg.norm(y_int8 - y_float) / np.linalg.norm(y_float)
    assert err < 0.03, f"relative error {err:.3%}"


def test_quantised_cell_runs_the_int8_golden_model(mode, rng):
    tokens = np.array([20, 0, 12], np.int64)
    q, calib = _quantised(MoeFFN(3, 24, 40, has_bias=True), tokens, rng, bias=0.1,
                          output_dtype="bfloat16")
    assert isinstance(q, QuantMoeFFN) and q.weight1.dtype == ms.int8 and q.deq_scale1.dtype == ms.uint64
    p = {n: getattr(q, n).asnumpy() for n in ("weight1", "weight2", "bias1", "bias2", "scale",
                                             "offset", "deq_scale1", "deq_scale2")}
    # the calibration data, then inputs past its range: x saturates at int8's both ends
    for x in (calib, (1.5 * calib).astype(np.float32)):
        y = run(q, tensor(x), tensor(tokens), mode=mode)
        x_q = np.clip(np.rint(x / q.x_step.asnumpy()), -128, 127).astype(np.int8)
        expected = reference.moe_ffn_quant(x_q, tokens, p["weight1"], p["weight2"], p["bias1"],
                                           p["bias2"], p["scale"], p["offset"], p["deq_scale1"],
                                           p["deq_scale2"], output_dtype="bfloat16")
        _assert_matches(y, expected, dict(dq2=p["deq_scale2"]), "fastgelu")
    assert (x_q == -128).any() and (x_q == 127).any()


def test_quantised_cell_checkpoint_round_trip(tmp_path, rng):
    tokens = np.array([6, 10], np.int64)
    q, calib = _quantised(MoeFFN(2, 8, 16, has_bias=True), tokens, rng, bias=0.1)
    other, _ = _quantised(MoeFFN(2, 8, 16, has_bias=True), tokens, rng, bias=0.1)
    path = str(tmp_path / "quant.ckpt")
    ms.save_checkpoint(q, path)
    ms.load_param_into_net(other, ms.load_checkpoint(path))
    x, t = tensor(calib * 3), tensor(tokens)
    np.testing.assert_array_equal(numpy(other(x, t)), numpy(q(x, t)))


def test_quantised_scales_sit_on_the_19_bit_grid(rng):
    q, _ = _quantised(MoeFFN(2, 16, 32), np.array([10, 6], np.int64), rng)
    for name in ("deq_scale1", "deq_scale2"):
        bits = getattr(q, name).asnumpy()
        assert (bits & np.uint64(0x1FFF) == 0).all() and (bits >> np.uint64(32) == 0).all()


def test_quantize_rejects_bad_input():
    cell = MoeFFN(2, 8, 16)
    with pytest.raises(ValueError, match="do not add up"):
        quantize_moe_ffn(cell, np.zeros((5, 8), np.float32), np.array([2, 2]))
    with pytest.raises(ValueError, match="calibration_x must be"):
        quantize_moe_ffn(cell, np.zeros((4, 9), np.float32), np.array([2, 2]))
    with pytest.raises(ValueError, match="activation"):
        quantize_moe_ffn(MoeFFN(2, 8, 16, activation="swiglu"), np.zeros((4, 8), np.float32),
                         np.array([2, 2]))
