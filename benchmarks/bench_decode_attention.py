"""The attention of a decoding step over a KV cache: ms_moe_ops' decode_attention kernel vs the
same maths composed from MindSpore ops (rotations, two cache scatters, the scores, softmax and the
weighted sum: what the models' GQAttention ran before, 15 kernels) vs numpy, in turns.

Shapes: Qwen3-MoE-like heads (16 query heads on 4 key heads of 64) at batch 1 and 8, with caches
of 64, 512 and 2048 positions. Short caches cost launches; long ones memory (each step copies the
caches it returns, as the composition's scatters do: GB/s counts the caches read twice and
written once). Every time includes reading the results back into numpy.

    python benchmarks/bench_decode_attention.py
"""
import argparse

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

from ms_moe_ops import reference as ref
from ms_moe_ops.ops.decode_attention import DECODE_ATTENTION, _composed
from common import report, timed_together

SCALING = 0.125


class Ours(nn.Cell):
    def construct(self, *inputs):
        return DECODE_ATTENTION(*inputs, scaling=SCALING)


class Composed(nn.Cell):
    def __init__(self):
        super().__init__()
        self.f = _composed({"scaling": SCALING})

    def construct(self, *inputs):
        return self.f(*inputs)


def _inputs(rng, b, length, heads=16, kv_heads=4, d=64):
    angles = rng.uniform(0, 50, (b, 1, 1, d // 2))
    angles = np.concatenate([angles, angles], -1)
    floats = [rng.normal(size=(b, heads, 1, d)), rng.normal(size=(b, kv_heads, 1, d)),
              rng.normal(size=(b, kv_heads, 1, d)), np.cos(angles), np.sin(angles),
              rng.normal(size=(b, kv_heads, length, d)), rng.normal(size=(b, kv_heads, length, d)),
              np.zeros((b, 1, 1, length))]
    return [a.astype(np.float32) for a in floats] + [np.int32(length // 2)]


def _numpy(q, k, v, cos, sin, key_cache, value_cache, mask, slot):
    def rotate(x):
        half = x.shape[-1] // 2
        return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin

    keys, values = key_cache.copy(), value_cache.copy()
    keys[:, :, slot], values[:, :, slot] = rotate(k)[:, :, 0], v[:, :, 0]
    b, heads, _, d = q.shape
    rows = rotate(q).reshape(b, keys.shape[1], -1, d)
    scores = rows @ keys.swapaxes(-1, -2) * SCALING + mask
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return (probs @ values).reshape(b, heads, 1, d), keys, values


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=21)
    a = p.parse_args(argv)
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    rng = np.random.default_rng(0)
    for b in (1, 8):
        for length in (64, 512, 2048):
            arrays = _inputs(rng, b, length)
            tensors = [Tensor(x) for x in arrays]
            ours, composed = Ours(), Composed()
            want = ref.decode_attention(*arrays, scaling=SCALING)
            for got in (ours(*tensors), composed(*tensors), _numpy(*arrays)):
                for g, w in zip(got, want):
                    g = g.asnumpy() if isinstance(g, Tensor) else g
                    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
            times = timed_together([
                ("ms_moe_ops (GRAPH)", lambda: [t.asnumpy() for t in ours(*tensors)]),
                ("MindSpore ops composed (GRAPH)", lambda: [t.asnumpy() for t in composed(*tensors)]),
                ("numpy", lambda: _numpy(*arrays)),
            ], repeat=a.repeats)
            moved = 3 * arrays[5].nbytes * 2
            rows = [(name, t, f"{moved / t / 1e9:6.2f} GB/s") for name, t in times.items()]
            report(f"decode_attention batch {b}, cache [{b}, 4, {length}, 64] float32", rows,
                   "ms_moe_ops (GRAPH)")


if __name__ == "__main__":
    main()
