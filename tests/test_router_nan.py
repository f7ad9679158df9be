"""NaN in the router: a NaN selection score (x_norm + bias) ranks above every number, +inf
included, whatever its sign bit (as torch.topk), NaNs among themselves by index; a group holding
one scores NaN. So a NaN logit is never hidden: with sigmoid its expert is chosen first and its
NaN weight spreads over the renormalised row; with softmax the whole row of scores is NaN and
experts 0..k-1 are chosen. The expert indices stay valid and unique whatever the data. The CPU
kernel, the composition and the golden model agree on all of it."""
import numpy as np
import pytest

from ms_moe_ops import moe_gating_top_k
from ms_moe_ops import reference as ref
from ms_moe_ops.ops import _platform
from conftest import DEVICE, kernels_missing, numpy, run, tensor

NEG_NAN = np.frombuffer(np.uint32(0xFFC00000).tobytes(), np.float32)[0]  # NaN with the sign bit
IMPLS = ["kernel", "composition"] if DEVICE == "CPU" else ["composition"]


def _route(x, k, mode, bias=None, **attrs):
    def fn(a, b):
        return moe_gating_top_k(a, k, bias=b, **attrs)

    y, idx, x_norm = run(fn, tensor(x), None if bias is None else tensor(bias), mode=mode)
    return numpy(y), idx.asnumpy(), numpy(x_norm)


def _valid(idx, n):
    assert ((idx >= 0) & (idx < n)).all()
    assert all(len(set(row)) == len(row) for row in idx.tolist())


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    if request.param == "kernel" and kernels_missing():
        pytest.skip(f"the CPU kernel: {kernels_missing()}")
    monkeypatch.setenv(_platform.IMPL_ENV, request.param)
    return request.param


@pytest.mark.parametrize("nan", [np.nan, NEG_NAN], ids=["nan", "negative-nan"])
def test_sigmoid_nan_logit_is_chosen_first(nan, impl, mode, rng):
    x = rng.normal(size=(3, 8)).astype(np.float32)
    x[0, 5] = nan
    x[1, 2] = np.inf
    x[1, 6] = nan
    x[2, [1, 4]] = nan
    y, idx, x_norm = _route(x, 3, mode)
    assert idx[0, 0] == 5 and idx[1, 0] == 6 and list(idx[2, :2]) == [1, 4]
    assert idx[1, 1] == 2  # +inf right after the NaN
    assert np.isnan(y).all()  # renormalised by a NaN sum
    np.testing.assert_array_equal(idx, ref.moe_gating_top_k(x, 3)[1])
    _valid(idx, 8)


def test_softmax_nan_logit_makes_the_row_nan(impl, mode, rng):
    x = rng.normal(size=(2, 8)).astype(np.float32)
    x[1, 6] = NEG_NAN
    y, idx, x_norm = _route(x, 3, mode, norm_type=0, renorm=1)
    assert np.isnan(x_norm[1]).all() and np.isnan(y[1]).all()
    assert list(idx[1]) == [0, 1, 2]
    assert not np.isnan(y[0]).any()
    np.testing.assert_array_equal(idx, ref.moe_gating_top_k(x, 3, norm_type=0, renorm=1)[1])
    _valid(idx, 8)


@pytest.mark.parametrize("mode_select", [0, 1])
@pytest.mark.slow_in_graph
def test_nan_in_groups_and_bias(mode_select, impl, mode, rng):
    x = rng.normal(size=(4, 16)).astype(np.float32)
    bias = np.zeros(16, np.float32)
    bias[13] = np.nan        # group 3 of 4 scores NaN: kept first, expert 13 first in every row
    x[2, 1] = NEG_NAN        # row 2: group 0 holds a NaN too
    bias[6] = -np.inf        # never chosen unless nothing else is left
    attrs = dict(k_group=2, group_count=4, group_select_mode=mode_select)
    _, idx, _ = _route(x, 5, mode, bias=bias, **attrs)
    want = ref.moe_gating_top_k(x, 5, bias=bias, **attrs)[1]
    np.testing.assert_array_equal(idx, want)
    assert (idx[:, 0] == np.where(np.arange(4) == 2, 1, 13)).all()
    _valid(idx, 16)


def test_indices_valid_and_unique_on_hostile_rows(impl, rng):
    """All-NaN rows, +-inf, huge and tiny values, with and without groups: every index in range
    and no expert twice in a row."""
    specials = np.array([np.nan, NEG_NAN, np.inf, -np.inf, 3e38, -3e38, 1e-45, 0.0, -0.0],
                        np.float32)
    x = rng.choice(specials, size=(12, 32)).astype(np.float32)
    x[0] = np.nan
    x[1] = -np.inf
    for attrs in (dict(), dict(k_group=2, group_count=4, group_select_mode=1),
                  dict(norm_type=0, renorm=1), dict(k_group=3, group_count=8)):
        k = 6
        _, idx, _ = _route(x, k, "pynative", **attrs)
        _valid(idx, 32)
        np.testing.assert_array_equal(idx, ref.moe_gating_top_k(x, k, **attrs)[1])
