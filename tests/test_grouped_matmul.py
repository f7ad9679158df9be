"""grouped_matmul (SPEC §5): golden forms, gradients by finite differences, bad input."""
import mindspore as ms
import numpy as np
import pytest

from ms_moe_ops import grouped_matmul, reference
from conftest import (DEVICE, assert_close, assert_rounded, finite_diff, grad, needs_kernels, numpy,
                      rounded, run, tensor)

pytestmark = pytest.mark.every_isa  # the kernels run under every instruction-set path


DATA_CHECK = needs_kernels("a data fault is found by this package's CPU kernels")


def _case(rng, m=9, k=5, n=4, counts=(3, 0, 6), dtype="float32"):
    g = len(counts)
    x = rounded(rng.standard_normal((m, k)), dtype)
    w = rounded(rng.standard_normal((g, k, n)), dtype)
    b = rounded(rng.standard_normal((g, n)), dtype)
    dy = rounded(rng.standard_normal((m, n)), dtype)
    return x, w, b, dy, np.array(counts, np.int64)


def test_forms_match_golden(dtype, mode, rng):
    x, w, b, dy, gl = _case(rng, dtype=dtype)
    wt = w.transpose(0, 2, 1).copy()

    def forms(x, w, wt, b, dy, gl):
        return (grouped_matmul(x, w, gl, b), grouped_matmul(x, wt, gl, transpose_weight=True),
                grouped_matmul(x, dy, gl, transpose_x=True))

    t = lambda a: tensor(a, dtype)
    y, yt, dw = run(forms, t(x), t(w), t(wt), t(b), t(dy), tensor(gl), mode=mode)
    for out in (y, yt, dw):
        assert str(out.dtype).lower() == dtype.lower()
    assert_close(numpy(y), reference.grouped_matmul(x, w, gl, b), dtype)
    assert_close(numpy(yt), reference.grouped_matmul(x, w, gl), dtype)
    assert_close(numpy(dw), reference.grouped_matmul(x, dy, gl, transpose_x=True), dtype)
    assert not numpy(dw)[1].any()  # the empty group's product is exactly zero


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_many_rows_in_blocks(dtype, rng):
    # more rows than the kernel's float16/bfloat16 conversion block (512)
    x, w, b, dy, gl = _case(rng, m=1300, k=6, n=5, counts=(1100, 0, 200), dtype=dtype)
    t = lambda a: tensor(a, dtype)
    y = grouped_matmul(t(x), t(w), tensor(gl), t(b))
    dw = grouped_matmul(t(x), t(dy), tensor(gl), transpose_x=True)
    assert_close(numpy(y), reference.grouped_matmul(x, w, gl, b), dtype)
    # 1100 rows summed in float32 over three row blocks, rounded once at the end
    size = reference.grouped_matmul(np.abs(x), np.abs(dy), gl, transpose_x=True)
    exact = reference.grouped_matmul(x, dy, gl, transpose_x=True)
    if dtype == "bfloat16":
        assert_rounded(numpy(dw), exact, dtype, err=1e-5 * size)
    else:
        assert_close(numpy(dw), exact, atol=1e-6 * size.max())


@pytest.mark.parametrize("rows,n", [(1, 129), (37, 200), (255, 300)])
@pytest.mark.parametrize("transpose_weight", [False, True], ids=["plain", "transpose_weight"])
def test_column_tiles(transpose_weight, rows, n, dtype, rng):
    """Fewer than 256 rows and N > 128: the kernel splits the columns into tiles too."""
    counts = (rows - rows // 3, 0, rows // 3)
    x, w, b, _, gl = _case(rng, m=rows, k=16, n=n, counts=counts, dtype=dtype)
    stored = w.transpose(0, 2, 1).copy() if transpose_weight else w
    y = grouped_matmul(tensor(x, dtype), tensor(stored, dtype), tensor(gl), tensor(b, dtype),
                       transpose_weight=transpose_weight)
    assert_close(numpy(y), reference.grouped_matmul(x, w, gl, b), dtype)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16, 17])
@pytest.mark.parametrize("transpose_weight", [False, True], ids=["plain", "transpose_weight"])
def test_few_rows(transpose_weight, rows, rng):
    """Up to 16 rows a float32 product is the kernels' own matrix-vector path (custom_aot/gemm.h,
    decoding's shapes): blocks of 4 rows and of 4 weight rows or 1024 columns with masked tails, so
    odd K and N and every row count up to 17 (the BLAS again) against float64; a bias and a
    second group (padding rows at the end) included."""
    k, n = 37, 133
    counts = (rows - rows // 2, rows // 2)
    x, w, b, _, gl = _case(rng, m=rows + 1, k=k, n=n, counts=counts)
    stored = w.transpose(0, 2, 1).copy() if transpose_weight else w
    y = grouped_matmul(tensor(x, "float32"), tensor(stored, "float32"), tensor(gl),
                       tensor(b, "float32"), transpose_weight=transpose_weight)
    assert_close(numpy(y), reference.grouped_matmul(x, w, gl, b), rtol=1e-5)


@pytest.mark.parametrize("rows", [8, 9, 12, 13, 15, 16])
@pytest.mark.parametrize("n", [133, 134])
def test_few_rows_one_group(n, rows, rng):
    """Eight rows and more of one group, transposed weight: blocks of 8 rows against 3 weight
    rows, then of 4 and single rows, N leaving 1 or 2 weight rows after the blocks of 3."""
    x, w, b, _, gl = _case(rng, m=rows, k=37, n=n, counts=(rows,))
    y = grouped_matmul(tensor(x, "float32"), tensor(w.transpose(0, 2, 1).copy(), "float32"),
                       tensor(gl), tensor(b, "float32"), transpose_weight=True)
    assert_close(numpy(y), reference.grouped_matmul(x, w, gl, b), rtol=1e-5)


@pytest.mark.parametrize("k,n", [(511, 300), (512, 300), (513, 1100), (1000, 300), (1000, 128)])
@pytest.mark.parametrize("counts,shared", [((0, 1, 0), False), ((0, 16), False), ((0, 17), False),
                                           ((3,), True), ((0, 2), True)],
                         ids=["one row", "16 rows", "17 rows", "shared weight",
                              "shared weight, second group"])
def test_few_rows_cut_along_k(counts, shared, k, n, rng):
    """A few float32 rows of one group against a [K, N] weight of K >= 512 and N > 128 (a shared
    expert's or a top-1 expert's at decoding): the kernel cuts K into chunks of 256 weight rows
    (the last one shorter) whose partial sums it adds afterwards; with a bias, rows past the
    groups, a weight every group shares, N past one pass of 1024 columns; 16 rows is the last
    count it cuts, and K = 511 or N = 128 take the column slices (the results the same)."""
    x, w, b, _, gl = _case(rng, m=sum(counts) + 2, k=k, n=n, counts=counts)
    weight = w[0] if shared else w
    w = np.broadcast_to(w[:1], w.shape) if shared else w
    y = numpy(grouped_matmul(tensor(x, "float32"), tensor(weight, "float32"), tensor(gl),
                             tensor(b, "float32")))
    assert_close(y, reference.grouped_matmul(x, w, gl, b), rtol=1e-5)
    assert not y[-2:].any()  # the padding rows


@pytest.mark.parametrize("counts", [(2,), (1, 0, 2), (1, 1, 0, 2, 1, 3)],
                         ids=["one group", "two groups", "five groups"])
@pytest.mark.parametrize("transpose_weight", [False, True], ids=["plain", "transpose_weight"])
def test_few_rows_wide(transpose_weight, counts, rng):
    """The few-rows path on wide weights: N past one block of columns (1024) with a masked tail,
    K not a multiple of the 4 weight rows taken per pass, and 1, 2 or 5 groups with rows (the
    kernel cuts the columns into 4 tiles for one such group, else gives each group whole
    rows)."""
    k, n = 38, 1024 + 133
    x, w, b, _, gl = _case(rng, m=sum(counts) + 1, k=k, n=n, counts=counts)
    stored = w.transpose(0, 2, 1).copy() if transpose_weight else w
    args = (tensor(x, "float32"), tensor(stored, "float32"), tensor(gl), tensor(b, "float32"))
    y = numpy(grouped_matmul(*args, transpose_weight=transpose_weight))
    assert_close(y, reference.grouped_matmul(x, w, gl, b), rtol=1e-5)
    assert not y[-1].any()  # the padding row


def test_cumulative_group_list(rng):
    x, w, b, _, gl = _case(rng)
    y = grouped_matmul(tensor(x, "float32"), tensor(w, "float32"), tensor(np.cumsum(gl)),
                       tensor(b, "float32"), cumulative=True)
    assert_close(numpy(y), reference.grouped_matmul(x, w, gl, b))


@pytest.mark.parametrize("form", ["plain", "transpose_weight", "transpose_x", "shared",
                                  "shared_transposed"])
def test_gradients_by_finite_differences(form, mode, rng):
    x, w, b, dy, gl = _case(rng, m=6, k=3, n=2, counts=(2, 0, 4))
    r = rng.standard_normal((3, 3, 2) if form == "transpose_x" else (6, 2))  # loss weights
    if form.startswith("shared"):  # one weight for every group: its gradient sums theirs
        w = w[0]
    if form.endswith("transpose_weight") or form == "shared_transposed":
        w = np.swapaxes(w, -1, -2).copy()
    second = dy if form == "transpose_x" else w
    use_bias = form in ("plain", "shared")
    kw = dict(transpose_x=form == "transpose_x",
              transpose_weight=form in ("transpose_weight", "shared_transposed"))

    def loss(x, second, b, gl):
        out = grouped_matmul(x, second, gl, b if use_bias else None, **kw)
        return (out * tensor(r, "float32")).sum()

    args = [tensor(a, "float32") for a in (x, second, b)] + [tensor(gl)]
    got = grad(loss, *args, mode=mode, argnums=(0, 1, 2) if use_bias else (0, 1))

    def ref(*vals):
        v = dict(x=x, second=second, b=b)
        v.update(vals)
        out = reference.grouped_matmul(v["x"], v["second"], gl, v["b"] if use_bias else None, **kw)
        return (out * r).sum()

    names = ("x", "second", "b") if use_bias else ("x", "second")
    for name, g in zip(names, got):
        expected = finite_diff(lambda a: ref((name, a)), dict(x=x, second=second, b=b)[name])
        assert_close(numpy(g), expected, rtol=1e-4)
    if form == "plain":
        assert not numpy(got[1])[1].any(), "an empty group must get a zero weight gradient"


def test_rows_past_the_groups(dtype, mode, rng):
    """Counts covering 7 of 10 rows (a padded batch): the last 3 rows are zero in the row forms,
    left out of the transposed form and never read (NaN there changes nothing)."""
    m, k, n, gl = 10, 5, 4, np.array([3, 0, 4], np.int64)
    x, dy = (rounded(rng.standard_normal((m, c)), dtype) for c in (k, n))
    w, b = (rounded(rng.standard_normal(s), dtype) for s in ((3, k, n), (3, n)))
    x[7:] = dy[7:] = np.nan
    wt = w.transpose(0, 2, 1).copy()

    def forms(x, w, wt, b, dy, gl):
        return (grouped_matmul(x, w, gl, b), grouped_matmul(x, wt, gl, transpose_weight=True),
                grouped_matmul(x, dy, gl, transpose_x=True))

    t = lambda a: tensor(a, dtype)
    y, yt, dw = (numpy(o) for o in run(forms, t(x), t(w), t(wt), t(b), t(dy), tensor(gl), mode=mode))
    assert not y[7:].any() and not yt[7:].any()
    assert_close(y, reference.grouped_matmul(x, w, gl, b), dtype)
    assert_close(yt, reference.grouped_matmul(x, w, gl), dtype)
    assert_close(dw, reference.grouped_matmul(x, dy, gl, transpose_x=True), dtype)

    r = rng.standard_normal((m, n))
    loss = lambda x, w, gl: (grouped_matmul(x, w, gl) * tensor(r, "float32")).sum()
    x[7:] = 0
    dx, dw = grad(loss, tensor(x, "float32"), tensor(w, "float32"), tensor(gl), mode=mode,
                  argnums=(0, 1))
    assert_close(numpy(dx), reference.grouped_matmul(r, w, gl, transpose_weight=True))
    assert_close(numpy(dw), reference.grouped_matmul(x, r, gl, transpose_x=True))


def test_gradient_low_precision(mode, rng):
    x, w, b, dy, gl = _case(rng, counts=(4, 5, 0), dtype="bfloat16")
    weights = tensor(dy, "float32")  # bfloat16-exact; the CPU has no bfloat16 sum

    def loss(x, w, b, gl):
        return (grouped_matmul(x, w, gl, b).astype(ms.float32) * weights).sum()

    bf = lambda a: tensor(a, "bfloat16")
    got = grad(loss, bf(x), bf(w), bf(b), tensor(gl), mode=mode, argnums=(0, 1, 2))
    # each gradient is one product of bfloat16 inputs, rounded once: within half an ulp
    gmm = reference.grouped_matmul
    a = np.abs
    assert_rounded(numpy(got[0]), gmm(dy, w, gl, transpose_weight=True), "bfloat16",
                   err=1e-6 * gmm(a(dy), a(w), gl, transpose_weight=True))
    assert_rounded(numpy(got[1]), gmm(x, dy, gl, transpose_x=True), "bfloat16",
                   err=1e-6 * gmm(a(x), a(dy), gl, transpose_x=True))
    assert not numpy(got[1])[2].any()
    assert_rounded(numpy(got[2]), [dy[:4].sum(0), dy[4:].sum(0), np.zeros(4)], "bfloat16",
                   err=1e-6 * a(dy).sum())


def test_gradients_with_cumulative_group_list(mode, rng):
    x, w, b, dy, gl = _case(rng, counts=(3, 0, 6))
    r = rng.standard_normal((9, 4))

    def loss(x, w, b, ends):
        return (grouped_matmul(x, w, ends, b, cumulative=True) * tensor(r, "float32")).sum()

    f32 = lambda a: tensor(a, "float32")  # noqa: E731
    gx, gw, gb = grad(loss, f32(x), f32(w), f32(b), tensor(np.cumsum(gl)), mode=mode,
                      argnums=(0, 1, 2))
    # d/dx = r @ w[g]^T, d/dw[g] = x_g^T r_g, d/db[g] = sum of r_g, group by group (plain numpy)
    ends = np.cumsum(gl)
    starts = ends - gl
    for g in range(3):
        rows = slice(starts[g], ends[g])
        assert_close(numpy(gx)[rows], r[rows] @ w[g].T)
        assert_close(numpy(gw)[g], x[rows].T @ r[rows], atol=1e-6)
        assert_close(numpy(gb)[g], r[rows].sum(0), atol=1e-6)


# -- bad input ------------------------------------------------------------------------------------

def _inputs(**over):
    v = dict(x=np.zeros((6, 3), np.float32), w=np.zeros((2, 3, 4), np.float32),
             gl=np.array([2, 4], np.int64), b=None)
    v.update(over)
    return v


@pytest.mark.parametrize("over, attrs, error, match", [
    (dict(x=np.zeros((6, 3, 1), np.float32)), {}, ValueError, "'x' must be 2-D"),
    (dict(w=np.zeros((2, 4, 4), np.float32)), {}, ValueError, "'weight' must have shape"),
    (dict(w=np.zeros((3, 3, 4), np.float32)), {}, ValueError, "'weight' must have shape"),
    (dict(w=np.zeros((4,), np.float32)), {}, ValueError, "'weight' must be 3-D or 2-D"),
    (dict(w=np.zeros((4, 4), np.float32)), {}, ValueError, r"'weight' must have shape \[3, 4\]"),
    (dict(w=np.zeros((3, 4), np.float32)), dict(transpose_weight=True), ValueError,
     r"'weight' must have shape \[3, 3\] \(\[N, K\] \(transpose_weight\)"),
    (dict(gl=np.array([[2, 4]], np.int64)), {}, ValueError, "'group_list' must be 1-D"),
    (dict(b=np.zeros((2, 3), np.float32)), {}, ValueError, "'bias' must have shape"),
    (dict(w=np.zeros((5, 4), np.float32)), dict(transpose_x=True), ValueError, "M=6 rows"),
    (dict(w=np.zeros((6, 4), np.float32), b=np.zeros((2, 4), np.float32)), dict(transpose_x=True),
     ValueError, "'bias' is not supported"),
    ({}, dict(transpose_x=True, transpose_weight=True), ValueError, "cannot both be True"),
    (dict(x=np.zeros((6, 3), np.int32)), {}, TypeError, "'x' must have dtype"),
    (dict(w=np.zeros((2, 3, 4), np.float16)), {}, TypeError, "'weight' must have the dtype"),
    (dict(gl=np.array([2, 4], np.int32)), {}, TypeError, "'group_list' must have dtype int64"),
    (dict(b=np.zeros((2, 4), np.float16)), {}, TypeError, "'bias' must have the dtype"),
    ({}, dict(transpose_x=1), TypeError, "must be bool"),
    pytest.param(dict(gl=np.array([3, 4], np.int64)), {}, RuntimeError, None,
                 marks=DATA_CHECK),
    pytest.param(dict(gl=np.array([7, -1], np.int64)), {}, RuntimeError, None,
                 marks=DATA_CHECK),
    pytest.param(dict(gl=np.array([4, 2], np.int64)), dict(cumulative=True), RuntimeError, None,
                 marks=DATA_CHECK),
])
def test_bad_input(over, attrs, error, match):
    v = _inputs(**over)
    if attrs.get("transpose_x") is True and "w" not in over:
        v["w"] = np.zeros((6, 4), np.float32)
    b = None if v["b"] is None else tensor(v["b"])
    with pytest.raises(error, match=match):
        out = grouped_matmul(tensor(v["x"]), tensor(v["w"]), tensor(v["gl"]), b, **attrs)
        out.asnumpy()


def test_bad_input_graph_mode():
    with pytest.raises(ValueError, match="'weight' must have shape"):
        run(grouped_matmul, tensor(np.zeros((6, 3), np.float32)),
            tensor(np.zeros((2, 4, 4), np.float32)), tensor(np.array([2, 4], np.int64)), mode="graph")




_EMPTY_SUMS = """
import os, sys
import numpy as np
import mindspore as ms
from mindspore import Tensor
from ms_moe_ops import grouped_matmul
ms.set_device("{device}")
rng, wrong = np.random.default_rng(0), 0
for _ in range(100):
    grouped_matmul(Tensor(rng.normal(size=(9, 1)), ms.float16), Tensor(rng.normal(size=(9, 2)), ms.float16),
                   Tensor(np.array([9], np.int64)), transpose_x=True).asnumpy()
    dw = grouped_matmul(Tensor(np.zeros((0, 1)), ms.float16), Tensor(np.zeros((0, 2)), ms.float16),
                        Tensor(np.array([0], np.int64)), transpose_x=True)
    y = grouped_matmul(Tensor(np.zeros((4, 0)), ms.float32), Tensor(np.zeros((1, 0, 5)), ms.float32),
                       Tensor(np.array([4], np.int64)))
    wrong += int(dw.asnumpy().any()) + int(y.asnumpy().any())
print("wrong", wrong)
"""


@pytest.mark.slow  # (a fresh process, 300 products: ~10 s)
@pytest.mark.best_isa_only
@pytest.mark.parametrize("impl", [pytest.param("kernel", marks=needs_kernels()), "composition"])
def test_empty_sums_are_zeros(impl):
    # no rows with transpose_x (the weight gradient of an empty batch), or K = 0: the products are
    # empty sums, exactly 0. MindSpore's CPU MatMul leaves its output unset there (it shows the
    # memory of an earlier product now and then, in a fresh process: so one is started here):
    # the composition must not multiply.
    import os, subprocess, sys  # pylint: disable=import-outside-toplevel
    from ms_moe_ops.ops import _platform  # pylint: disable=import-outside-toplevel

    env = dict(os.environ, **{_platform.IMPL_ENV: impl})
    done = subprocess.run([sys.executable, "-c", _EMPTY_SUMS.format(device=DEVICE)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["wrong", "0"], done.stdout
