"""models.layers.attend: grouped-query attention reads the keys and values as they are (a key
head's query heads stacked as rows), against numpy with the key heads repeated per query head
(transformers' repeat_kv), for every mask form the models and users pass, in float16 too, with
gradients equal to those of the plain composition (keys transposed, then multiplied). And
write_cache: new positions written into a KV cache buffer, exactly, at any slot."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, ops

from ms_moe_ops.models.layers import attend, write_cache
from conftest import grad, run

B, HEADS, D, L = 2, 6, 5, 7


def _golden(q, k, v, mask, scaling):
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    scores = q @ np.swapaxes(k, -1, -2) * scaling + mask
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def _attend(q, k, v, mask):
    return attend(q, k, v, mask, 0.5)


@pytest.mark.parametrize("kv_heads", [6, 3, 1])
@pytest.mark.parametrize("s", [1, 4])
@pytest.mark.parametrize("mask_shape", ["S,L", "B,1,S,L", "B,heads,S,L", "1,S,L"])
def test_grouped_heads_match_repeated_heads(kv_heads, s, mask_shape, mode, rng):
    q = rng.standard_normal((B, HEADS, s, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, kv_heads, L, D)).astype(np.float32) for _ in range(2))
    shape = {"S,L": (s, L), "B,1,S,L": (B, 1, s, L), "B,heads,S,L": (B, HEADS, s, L),
             "1,S,L": (1, s, L)}[mask_shape]
    mask = np.where(rng.random(shape) < 0.3, np.float32(-1e9), np.float32(0)).astype(np.float32)
    mask[..., 0] = 0  # every row sees a key
    out = run(_attend, *(Tensor(a) for a in (q, k, v, mask)), mode=mode)
    assert out.shape == (B, HEADS, s, D)
    golden = _golden(*(a.astype(np.float64) for a in (q, k, v, mask)), 0.5)
    np.testing.assert_allclose(out.asnumpy(), golden, rtol=1e-5, atol=1e-5)


def _attend_composed(q, k, v, mask):
    """attend written plainly: the key heads repeated, the keys transposed, then multiplied."""
    groups = q.shape[1] // k.shape[1]
    k, v = ops.repeat_interleave(k, groups, 1), ops.repeat_interleave(v, groups, 1)
    scores = ops.matmul(q, k.swapaxes(-1, -2)) * 0.5 + mask
    return ops.matmul(ops.softmax(scores, -1), v)


def _inputs(rng, s, kv_heads):
    q = rng.standard_normal((B, HEADS, s, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, kv_heads, L, D)).astype(np.float32) for _ in range(2))
    mask = np.where(rng.random((B, 1, s, L)) < 0.3, np.float32(-1e9), np.float32(0))
    mask[..., 0] = 0
    return q, k, v, mask.astype(np.float32)


def test_float16_matches_float32(mode, rng):
    # (bfloat16 attention is for Ascend: the CPU's BatchMatMul has no bfloat16)
    q, k, v, mask = _inputs(rng, 3, 3)
    args = [Tensor(a).astype(ms.float16) for a in (q, k, v)] + [Tensor(mask)]
    out = run(_attend, *args, mode=mode)
    assert out.dtype == ms.float16
    golden = _golden(*(a.astype(np.float16).astype(np.float64) for a in (q, k, v)),
                     mask.astype(np.float64), 0.5)
    np.testing.assert_allclose(out.astype(ms.float32).asnumpy(), golden, rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize("s", [1, 4])
def test_gradients_are_the_plain_compositions(s, mode, rng):
    args = [Tensor(a) for a in _inputs(rng, s, 2)]
    weights = Tensor(rng.standard_normal((B, HEADS, s, D)).astype(np.float32))

    def ours(q, k, v, mask):
        return (_attend(q, k, v, mask) * weights).sum()

    def composed(q, k, v, mask):
        return (_attend_composed(q, k, v, mask) * weights).sum()

    got = grad(ours, *args, mode=mode, argnums=(0, 1, 2))
    want = grad(composed, *args, mode=mode, argnums=(0, 1, 2))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [ms.float32, ms.float16, ms.bfloat16])
@pytest.mark.parametrize("s, slot", [(1, 0), (1, 3), (1, L - 1), (3, 0), (3, L - 3)])
def test_write_cache_places_new_positions_exactly(dtype, s, slot, mode, rng):
    buffer = rng.standard_normal((B, 2, L, D)).astype(np.float32)
    new = rng.standard_normal((B, 2, s, D)).astype(np.float32)
    out = run(write_cache, Tensor(buffer).astype(dtype), Tensor(new).astype(dtype),
              Tensor(np.int32(slot)), mode=mode)
    golden = buffer.copy()
    golden[:, :, slot:slot + s] = new
    assert out.dtype == dtype and out.shape == buffer.shape
    cast = Tensor(golden).astype(dtype).astype(ms.float32).asnumpy()
    np.testing.assert_array_equal(out.astype(ms.float32).asnumpy(), cast)
