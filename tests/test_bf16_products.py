"""bfloat16 matrix products: oneDNN's bfloat16 dot-product GEMM (the avx512 path of a CPU with
AVX512-BF16, oneDNN found in the process) and the float32 products every other path, CPU or
host takes (MS_MOE_OPS_ONEDNN=0 forces them; a oneDNN that cannot be loaded falls back to them).
Element-wise against the float64 golden model on the same bfloat16 inputs: each output is the
float32 result rounded once (half an ulp of bfloat16, plus the float32 sums' own error), on every
instruction-set path of this CPU, in every form grouped_matmul has (the layer's forward and
backward products) and in moe_ffn."""
import ctypes
import os

import numpy as np
import pytest

from ms_moe_ops import grouped_matmul, moe_ffn, reference
from conftest import assert_rounded, isa_paths, needs_kernels, numpy, rounded, tensor

pytestmark = [pytest.mark.every_isa, needs_kernels("the CPU kernels' products")]
EPS32 = 2.0 ** -24
BF16 = "bfloat16"
ONEDNN = "MS_MOE_OPS_ONEDNN"


@pytest.fixture(params=["onednn", "float32"])
def products(request, monkeypatch):
    """Which products a test asks for: oneDNN's where this path has them, or float32 ones."""
    if request.param == "float32":
        monkeypatch.setenv(ONEDNN, "0")
    return request.param


def _products_line():
    from ms_moe_ops.ops._library import kernel_library  # pylint: disable=import-outside-toplevel

    lib = ctypes.CDLL(kernel_library())
    lib.MsMoeOpsProducts.restype = ctypes.c_char_p
    return lib.MsMoeOpsProducts().decode()


def _bf16_cpu():
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()
    return "avx512_bf16" in flags


def _data(rng, *shape, scale=1.0):
    return rounded(rng.standard_normal(shape) * scale, BF16)


def test_the_path_says_which_products_it_takes(products, isa):
    line = _products_line()
    # oneDNN only on the avx512 path (the one a call takes now), when it runs such kernels here
    onednn = products == "onednn" and (isa or isa_paths()[-1]) == "avx512"
    assert ("float32: oneDNN sgemm" in line) == (onednn and "AVX-512 float32" in line), line
    # (MindSpore's oneDNN is in every process that imported it, unless another one is named)
    dot = onednn and _bf16_cpu() and ("in the process" in line or bool(os.environ.get(ONEDNN)))
    assert ("bfloat16: oneDNN bfloat16 dot-product GEMM" in line) == dot, line


def test_a_missing_onednn_falls_back_to_float32_products(monkeypatch, rng):
    monkeypatch.setenv(ONEDNN, "/nonexistent/libdnnl.so.3")
    line = _products_line()
    assert "cannot load /nonexistent/libdnnl.so.3" in line and "oneDNN sgemm" not in line, line
    x, w = _data(rng, 40, 33), _data(rng, 2, 33, 20)
    gl = np.array([25, 15], np.int64)
    y = grouped_matmul(tensor(x, BF16), tensor(w, BF16), tensor(gl))
    assert_rounded(numpy(y), reference.grouped_matmul(x, w, gl), BF16,
                   err=4 * 33 * EPS32 * reference.grouped_matmul(np.abs(x), np.abs(w), gl))


# rows (several 512-row tiles, a group of one row, an empty group), K odd (the dot product takes
# pairs along K), N over the 16-wide vectors; and few rows with N > 128 (column tiles)
SHAPES = [((600, 1, 0, 499), 75, 130), ((50, 30), 64, 300)]


@pytest.mark.parametrize("counts, k, n", SHAPES)
def test_grouped_matmul_forms(counts, k, n, products, rng):
    m, g = sum(counts) + 3, len(counts)  # 3 rows past the last group: zeros
    gl = np.array(counts, np.int64)
    x, w, b, dy = _data(rng, m, k), _data(rng, g, k, n), _data(rng, g, n), _data(rng, m, n)
    t = lambda a: tensor(a, BF16)  # noqa: E731
    ab = np.abs

    y = grouped_matmul(t(x), t(w), tensor(gl), t(b))
    assert_rounded(numpy(y), reference.grouped_matmul(x, w, gl, b), BF16,
                   err=4 * k * EPS32 * reference.grouped_matmul(ab(x), ab(w), gl, ab(b)))
    assert not numpy(y)[sum(counts):].any()
    # dx = dy @ w^T: the backward's input gradient
    dx = grouped_matmul(t(dy), t(w), tensor(gl), transpose_weight=True)
    wt = w.transpose(0, 2, 1)
    assert_rounded(numpy(dx), reference.grouped_matmul(dy, wt, gl), BF16,
                   err=4 * n * EPS32 * reference.grouped_matmul(ab(dy), ab(wt), gl))
    # dw = x_g^T @ dy_g: the weight gradient, a sum over every row of the group
    dw = grouped_matmul(t(x), t(dy), tensor(gl), transpose_x=True)
    size = reference.grouped_matmul(ab(x), ab(dy), gl, transpose_x=True)
    assert_rounded(numpy(dw), reference.grouped_matmul(x, dy, gl, transpose_x=True), BF16,
                   err=4 * max(counts) * EPS32 * size)
    assert not numpy(dw)[list(counts).index(0)].any() if 0 in counts else True


@pytest.mark.parametrize("activation", ["fastgelu", "silu"])
def test_moe_ffn(activation, products, rng):
    counts = np.array([530, 0, 170], np.int64)
    m, h, f = 700, 48, 37
    x, w1, w2 = _data(rng, m, h), _data(rng, 3, h, f, scale=0.3), _data(rng, 3, f, h, scale=0.3)
    b1, b2 = _data(rng, 3, f), _data(rng, 3, h)
    t = lambda a: tensor(a, BF16)  # noqa: E731
    y = moe_ffn(t(x), tensor(counts), t(w1), t(w2), t(b1), t(b2), activation=activation)
    ab = np.abs
    # one rounding of the whole FFN: its hidden layer stays float32 on every path
    size = reference.grouped_matmul(reference.grouped_matmul(ab(x), ab(w1), counts, ab(b1)),
                                    ab(w2), counts, ab(b2))
    assert_rounded(numpy(y), reference.moe_ffn(x, counts, w1, w2, b1, b2, activation=activation),
                   BF16, err=8 * h * EPS32 * size)


def test_info_reports_the_products(products):
    from ms_moe_ops import info  # pylint: disable=import-outside-toplevel

    lines = [line for line in info.report() if line.startswith("matrix products: ")]
    assert lines == [f"matrix products: {_products_line()}"], lines
