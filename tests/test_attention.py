"""models.layers.attend: grouped-query attention reads the keys and values as they are (a key
head's query heads stacked as rows), against numpy with the key heads repeated per query head
(transformers' repeat_kv), for every mask form the models and users pass."""
import numpy as np
import pytest
from mindspore import Tensor

from ms_moe_ops.models.layers import attend
from conftest import run

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
