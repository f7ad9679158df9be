"""The index arithmetic of the compositions and Cells (ms_moe_ops.ops._indexing): counts by
either of their two routes (a one-hot sum for small known sizes, a sort past them) against numpy,
in both modes, empty and out-of-range-free inputs alike."""
import numpy as np
import pytest

from mindspore import Tensor

from ms_moe_ops.ops import _indexing
from conftest import numpy, run


@pytest.mark.parametrize("shape,length", [((1, 2), 16), ((8, 2), 16), ((4, 8), 64), ((0, 2), 8),
                                          ((64, 8), 64), ((4096, 4), 16)],
                         ids=["one token", "8 tokens", "wide", "empty", "past one-hot",
                              "training"])
def test_count_is_numpys(shape, length, mode, rng):
    index = rng.integers(0, length, shape).astype(np.int32)

    def count(i):
        return _indexing.count(i, length)

    got = numpy(run(count, Tensor(index), mode=mode))
    assert got.dtype == np.int64 and got.shape == (length,)
    np.testing.assert_array_equal(got, np.bincount(index.reshape(-1), minlength=length))


def test_both_routes_agree(rng):
    # the sizes either side of the one-hot limit give the same counts
    limit = _indexing._ONE_HOT_COUNT
    for rows in (limit // 16, limit // 16 + 1):
        index = rng.integers(0, 16, (rows,)).astype(np.int32)
        got = numpy(_indexing.count(Tensor(index), 16))
        np.testing.assert_array_equal(got, np.bincount(index, minlength=16))
