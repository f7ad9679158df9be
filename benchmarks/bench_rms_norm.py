"""RMSNorm: ms_moe_ops' rms_norm kernel vs the same maths composed from MindSpore ops (square,
mean, add, rsqrt and two products: what the models' RMSNorm ran before) vs numpy, in turns; then
add_rms_norm (a residual sum and the next norm in one kernel) vs MindSpore's Add then rms_norm
(what a decoding step ran before) vs numpy.

Shapes: a decoding step's norms (one or 8 tokens of hidden 1024; Qwen3-MoE's per-head query
norm, 8 tokens x 16 heads of 64) and a training step's (4096 tokens of 1024). At a decoding
step's sizes the cost is the launches (one kernel against six), hidden in one call by the
graph's own cost; so the last case is a decoding step's pattern: 9 norms of one token, each
after a product that streams a [1024, 1024] weight (36 MB in all, past the L3), in one graph.
At a training step's sizes the cost is memory (GB/s counts x read and y written). Every time
includes reading the result back into numpy.

    python benchmarks/bench_rms_norm.py
"""
import argparse

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

from ms_moe_ops import reference as ref
from ms_moe_ops.models.layers import linear
from ms_moe_ops.ops.rms_norm import ADD_RMS_NORM, RMS_NORM, _composed
from common import report, timed_together


class Ours(nn.Cell):
    def construct(self, x, weight):
        return RMS_NORM(x, weight, eps=1e-6)


class Composed(nn.Cell):
    def __init__(self):
        super().__init__()
        self.f = _composed({"eps": 1e-6})

    def construct(self, x, weight):
        return self.f(x, weight)


class AddNorm(nn.Cell):
    def construct(self, x, residual, weight):
        return ADD_RMS_NORM(x, residual, weight, eps=1e-6)


class AddThenNorm(nn.Cell):
    def construct(self, x, residual, weight):
        total = x + residual
        return RMS_NORM(total, weight, eps=1e-6), total


def _kernel_norm(x, weight):
    return RMS_NORM(x, weight, eps=1e-6)


_composed_norm = _composed({"eps": 1e-6})


class Step(nn.Cell):
    """x -> norm(x @ w_i^T) nine times: a decoding step's norms between its products."""

    def __init__(self, weights, norm):
        super().__init__()
        self.weights = weights
        self.norm = norm

    def construct(self, x, weight):
        for w in self.weights:
            x = self.norm(linear(x, w, True), weight)
        return x


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=9)
    a = p.parse_args(argv)
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    rng = np.random.default_rng(0)
    for shape in ((1, 1024), (8, 1024), (8, 16, 64), (4096, 1024)):
        x = rng.normal(0, 2, shape).astype(np.float32)
        w = rng.normal(1, 0.3, shape[-1]).astype(np.float32)
        xt, wt = Tensor(x), Tensor(w)
        ours, composed = Ours(), Composed()
        want = ref.rms_norm(x, w)
        np.testing.assert_allclose(ours(xt, wt).asnumpy(), want, rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(composed(xt, wt).asnumpy(), want, rtol=1e-5, atol=1e-5)
        times = timed_together([
            ("ms_moe_ops (GRAPH)", lambda: ours(xt, wt).asnumpy()),
            ("MindSpore ops composed (GRAPH)", lambda: composed(xt, wt).asnumpy()),
            ("numpy", lambda: (w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)))),
        ], repeat=a.repeats)
        moved = x.nbytes * 2
        rows = [(name, t, f"{moved / t / 1e9:6.2f} GB/s") for name, t in times.items()]
        report(f"rms_norm x {list(shape)} float32", rows, "ms_moe_ops (GRAPH)")
    for shape in ((1, 1024), (8, 1024), (4096, 1024)):
        x, r = (rng.normal(0, 2, shape).astype(np.float32) for _ in range(2))
        w = rng.normal(1, 0.3, shape[-1]).astype(np.float32)
        xt, rt, wt = Tensor(x), Tensor(r), Tensor(w)
        fused, separate = AddNorm(), AddThenNorm()
        want = ref.add_rms_norm(x, r, w)
        for got in (fused(xt, rt, wt), separate(xt, rt, wt)):
            np.testing.assert_allclose(got[0].asnumpy(), want[0], rtol=2e-6, atol=1e-6)
            np.testing.assert_array_equal(got[1].asnumpy(), want[1])

        def numpy_add_norm():
            total = x + r
            return w * (total / np.sqrt((total * total).mean(-1, keepdims=True) + 1e-6)), total

        times = timed_together([
            ("ms_moe_ops (GRAPH)", lambda: [t.asnumpy() for t in fused(xt, rt, wt)]),
            ("Add, then rms_norm (GRAPH)", lambda: [t.asnumpy() for t in separate(xt, rt, wt)]),
            ("numpy", numpy_add_norm),
        ], repeat=a.repeats)
        moved = x.nbytes * 4  # x and the residual read, y and the sum written
        rows = [(name, t, f"{moved / t / 1e9:6.2f} GB/s") for name, t in times.items()]
        report(f"add_rms_norm x {list(shape)} float32", rows, "ms_moe_ops (GRAPH)")
    weights = [Tensor(rng.normal(0, 0.03, (1024, 1024)).astype(np.float32)) for _ in range(9)]
    x, w = Tensor(rng.normal(0, 1, (1, 1024)).astype(np.float32)), Tensor(np.ones(1024, np.float32))
    ours, composed = Step(weights, _kernel_norm), Step(weights, _composed_norm)
    np.testing.assert_allclose(ours(x, w).asnumpy(), composed(x, w).asnumpy(), rtol=1e-4, atol=1e-4)
    times = timed_together([("ms_moe_ops (GRAPH)", lambda: ours(x, w).asnumpy()),
                            ("MindSpore ops composed (GRAPH)", lambda: composed(x, w).asnumpy())],
                           repeat=a.repeats * 5)
    report("9 x (one token's [1024, 1024] product, then rms_norm): a decoding step's pattern",
           [(name, t, "") for name, t in times.items()], "ms_moe_ops (GRAPH)")


if __name__ == "__main__":
    main()
