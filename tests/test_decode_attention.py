"""decode_attention (ms_moe_ops.ops.decode_attention), the attention of a decoding step over a KV
cache: the golden model in both modes and at edge shapes, the caches it writes, gradients
against finite differences and against MindSpore's autograd of the plain composition, bad
inputs, and the models' decoding step on it."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from ms_moe_ops import reference as ref
from ms_moe_ops.ops import decode_attention
from ms_moe_ops.ops._attention import attend, rotate, write_cache
from conftest import finite_diff, grad, numpy, run

_LOWEST = np.finfo(np.float32).min


def _case(rng, b, heads, kv_heads, length, d, slot=None, masked=0.3):
    """float32 inputs (cos and sin of real rotary angles, repeated over both halves) and a slot."""
    angles = rng.uniform(0, 20, (b, 1, 1, d // 2)) * rng.uniform(0.01, 1, d // 2)
    angles = np.concatenate([angles, angles], -1)
    mask = np.where(rng.random((b, 1, 1, length)) < masked, _LOWEST, 0)
    slot = rng.integers(0, length) if slot is None else slot
    mask[..., slot] = 0  # the new position is always attended
    return [rng.normal(size=(b, heads, 1, d)), rng.normal(size=(b, kv_heads, 1, d)),
            rng.normal(size=(b, kv_heads, 1, d)), np.cos(angles), np.sin(angles),
            rng.normal(size=(b, kv_heads, length, d)), rng.normal(size=(b, kv_heads, length, d)),
            mask], np.int32(slot)


def _tensors(floats, slot):
    return [Tensor(np.asarray(a, np.float32)) for a in floats] + [Tensor(slot)]


def _attention(*inputs):
    return decode_attention(*inputs, scaling=0.125)


@pytest.mark.parametrize("b, heads, kv_heads, length, d, slot", [
    (1, 16, 4, 64, 64, 40), (2, 4, 4, 5, 8, 0), (3, 6, 2, 9, 6, 8), (1, 2, 1, 1, 2, 0),
    (2, 130, 1, 3, 4, 1), (8, 16, 4, 300, 64, 299)],
    ids=["qwen3 step", "one head per key", "odd sizes", "one position", "groups > 64", "threads"])
def test_matches_golden(b, heads, kv_heads, length, d, slot, mode, rng):
    floats, slot = _case(rng, b, heads, kv_heads, length, d, slot)
    got = [numpy(t) for t in run(_attention, *_tensors(floats, slot), mode=mode)]
    want = ref.decode_attention(*floats, slot, scaling=0.125)
    for name, g, w in zip(("out", "key_cache", "value_cache"), got, want):
        assert g.shape == w.shape and g.dtype == np.float32, name
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6, err_msg=name)


def test_caches_change_only_at_the_slot(rng):
    floats, slot = _case(rng, 2, 8, 2, 7, 16, 3)
    out, keys, values = (numpy(t) for t in decode_attention(*_tensors(floats, slot)))  # scaling 1
    np.testing.assert_allclose(out, ref.decode_attention(*floats, slot)[0], rtol=2e-5, atol=2e-6)
    kc, vc = (np.asarray(a, np.float32) for a in floats[5:7])
    others = np.arange(7) != 3
    np.testing.assert_array_equal(keys[:, :, others], kc[:, :, others])
    np.testing.assert_array_equal(values[:, :, others], vc[:, :, others])
    np.testing.assert_array_equal(values[:, :, 3], np.asarray(floats[2], np.float32)[:, :, 0])
    rotated = ref.decode_attention(*floats, slot)[1][:, :, 3]
    np.testing.assert_allclose(keys[:, :, 3], rotated, rtol=1e-6, atol=1e-6)


def test_masked_positions_are_ignored(rng):
    # a masked position's key and value change nothing; with every position masked, the lowest
    # float32 added to every score leaves the mean of the values (as the composition gives)
    floats, slot = _case(rng, 1, 4, 2, 6, 8, 2, masked=0)
    floats[7][..., 4] = _LOWEST
    base = numpy(_attention(*_tensors(floats, slot))[0])
    floats[5][:, :, 4] += 100
    floats[6][:, :, 4] -= 100
    np.testing.assert_array_equal(numpy(_attention(*_tensors(floats, slot))[0]), base)
    floats[7][:] = _LOWEST
    out, _, values = (numpy(t) for t in _attention(*_tensors(floats, slot)))
    mean = values.mean(2, keepdims=True).repeat(2, 1)
    np.testing.assert_allclose(out, mean, rtol=1e-5, atol=1e-6)


def test_one_sequence_gives_the_same_bits_in_any_batch(rng):
    floats, slot = _case(rng, 8, 16, 4, 300, 64, 17)
    whole = [numpy(t) for t in _attention(*_tensors(floats, slot))]
    for i in (0, 5):
        one = [numpy(t) for t in _attention(*_tensors([a[i:i + 1] for a in floats], slot))]
        for o, w in zip(one, whole):
            np.testing.assert_array_equal(o, w[i:i + 1])


def _weights(rng, floats, slot):
    """Random output weights c: the loss sum(out c0) + sum(keys c1) + sum(values c2)."""
    outs = ref.decode_attention(*floats, slot)
    return [rng.normal(size=o.shape) for o in outs]


def test_gradient(mode, rng):
    floats, slot = _case(rng, 2, 4, 2, 5, 4, 3)
    c = _weights(rng, floats, slot)
    cs = [Tensor(w.astype(np.float32)) for w in c]

    def loss(*inputs):
        out, keys, values = decode_attention(*inputs, scaling=0.7)
        return (out * cs[0]).sum() + (keys * cs[1]).sum() + (values * cs[2]).sum()

    got = grad(loss, *_tensors(floats, slot), mode=mode, argnums=tuple(range(8)))
    x64 = [np.asarray(np.asarray(a, np.float32), np.float64) for a in floats]
    for i, g in enumerate(got):
        def f(v, i=i):
            args = x64[:i] + [v] + x64[i + 1:]
            return sum((o * w).sum() for o, w in zip(ref.decode_attention(*args, slot, 0.7), c))
        want = finite_diff(f, x64[i]) if i != 7 else None
        if i == 7:  # the mask: its gradient is the scores' (finite differences, unmasked entries)
            v = x64[7].copy()
            v[v < -1e30] = -30.0  # a large negative number: the same softmax, finite steps
            x64[7] = v
            want = finite_diff(f, v)
        np.testing.assert_allclose(numpy(g), want, rtol=1e-3, atol=2e-4, err_msg=f"input {i}")


def _plain(q, k, v, cos, sin, key_cache, value_cache, mask, slot):
    keys = write_cache(key_cache, rotate(k, cos, sin), slot)
    values = write_cache(value_cache, v, slot)
    return attend(rotate(q, cos, sin), keys, values, mask, 0.7), keys, values


def test_gradient_equals_autograd_of_the_composition(mode, rng):
    floats, slot = _case(rng, 2, 6, 3, 7, 8, 6)
    c = [Tensor(w.astype(np.float32)) for w in _weights(rng, floats, slot)]

    def weighted(outs):
        return sum((o * w).sum() for o, w in zip(outs, c))

    def ours(*inputs):
        return weighted(decode_attention(*inputs, scaling=0.7))

    def plain(*inputs):
        return weighted(_plain(*inputs))

    args = _tensors(floats, slot)
    got = grad(ours, *args, mode=mode, argnums=tuple(range(8)))
    want = grad(plain, *args, mode=mode, argnums=tuple(range(8)))
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(numpy(g), numpy(w), rtol=1e-4, atol=1e-5, err_msg=f"input {i}")


def _bad(**changes):
    floats, slot = _case(np.random.default_rng(0), 2, 4, 2, 5, 8, 1)
    names = ("query", "key", "value", "cos", "sin", "key_cache", "value_cache", "mask")
    arrays = dict(zip(names, (np.asarray(a, np.float32) for a in floats)), slot=slot)
    arrays.update(changes)
    return [Tensor(arrays[n]) for n in names + ("slot",)]


@pytest.mark.parametrize("changes, error, words", [
    (dict(query=np.ones((2, 4, 8), np.float32)), ValueError, "'query' must be [B, heads, 1, D]"),
    (dict(query=np.ones((2, 4, 2, 8), np.float32)), ValueError, "one position"),
    (dict(query=np.ones((2, 3, 1, 8), np.float32)), ValueError, "multiple of the key heads"),
    (dict(key=np.ones((2, 2, 1, 4), np.float32)), ValueError, "'key' must have shape"),
    (dict(value=np.ones((2, 1, 1, 8), np.float32)), ValueError, "'value' must have shape"),
    (dict(cos=np.ones((2, 1, 1, 4), np.float32)), ValueError, "'cos' must have shape"),
    (dict(sin=np.ones((1, 1, 1, 8), np.float32)), ValueError, "'sin' must have shape"),
    (dict(key_cache=np.ones((2, 2, 5, 4), np.float32)), ValueError, "'key_cache' must have shape"),
    (dict(value_cache=np.ones((2, 2, 6, 8), np.float32)), ValueError, "'value_cache' must have"),
    (dict(mask=np.ones((2, 1, 5), np.float32)), ValueError, "'mask' must have shape"),
    (dict(slot=np.array([1], np.int32)), ValueError, "'slot' must have shape []"),
    (dict(query=np.ones((2, 4, 1, 8), np.float16)), TypeError, "'query' must have dtype float32"),
    (dict(mask=np.ones((2, 1, 1, 5), bool)), TypeError, "'mask' must have dtype float32"),
    (dict(slot=np.int64(1)), TypeError, "'slot' must have dtype int32"),
], ids=["query rank", "two positions", "heads", "key", "value", "cos", "sin", "key_cache",
        "value_cache", "mask", "slot shape", "query dtype", "mask dtype", "slot dtype"])
def test_bad_inputs_are_refused(changes, error, words):
    with pytest.raises(error, match="decode_attention") as info:
        decode_attention(*_bad(**changes))
    assert words in str(info.value)


def test_odd_head_size_is_refused():
    with pytest.raises(ValueError, match="head size must be even"):
        decode_attention(*_bad(**{n: np.ones(s, np.float32) for n, s in (
            ("query", (2, 4, 1, 7)), ("key", (2, 2, 1, 7)), ("value", (2, 2, 1, 7)),
            ("cos", (2, 1, 1, 7)), ("sin", (2, 1, 1, 7)), ("key_cache", (2, 2, 5, 7)),
            ("value_cache", (2, 2, 5, 7)))}))


@pytest.mark.parametrize("slot", [5, -1])
def test_a_slot_outside_the_cache_is_an_error(slot, mode):
    # a run-time value: the kernel refuses it (no write outside the cache), as the composition's
    # scatter does
    with pytest.raises(RuntimeError, match=r"'slot' -?\d+ is outside the cache's 5 positions"):
        numpy(run(_attention, *_bad(slot=np.int32(slot)), mode=mode)[0])


@pytest.mark.parametrize("scaling", [float("inf"), float("nan")])
def test_bad_scaling_is_refused(scaling):
    with pytest.raises(ValueError, match="decode_attention: attribute 'scaling' must be finite"):
        decode_attention(*_bad(), scaling=scaling)
