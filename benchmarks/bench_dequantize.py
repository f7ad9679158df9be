"""Dequantising quantised experts' weights: ms_moe_ops' dequantize kernel vs the same maths
composed from MindSpore ops (a gather, a cast, the step tiled and multiplied: what
ms_moe_ops.quantize's experts ran before) vs numpy, in turns.

Default shape: the experts' first weight of benchmarks/bench_generate.py (E=16 experts of
[K=1024, N=1024] int8), for the 2 experts one decoding token uses and for all 16. GB/s counts the
bytes the kernel must move: each int8 weight read, each float32 written (the steps are small);
every time includes reading the result back into numpy.

    python benchmarks/bench_dequantize.py
"""
import argparse

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

from ms_moe_ops import reference as ref
from ms_moe_ops.ops.dequantize import DEQUANTIZE, _composed
from common import report, timed_together


class Ours(nn.Cell):
    def construct(self, weight, scale, index):
        return DEQUANTIZE(weight, scale, index)


class Composed(nn.Cell):
    def __init__(self):
        super().__init__()
        self.f = _composed({})

    def construct(self, weight, scale, index):
        return self.f(weight, scale, index)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=9)
    a = p.parse_args(argv)
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    rng = np.random.default_rng(0)
    weight = rng.integers(-127, 128, (a.experts, a.k, a.n)).astype(np.int8)
    scale = rng.uniform(1e-3, 1e-2, (a.experts, a.n)).astype(np.float32)
    ours, composed = Ours(), Composed()
    wt, st = Tensor(weight), Tensor(scale)
    for picked in sorted({2, a.experts}):
        index = np.sort(rng.choice(a.experts, picked, replace=False)).astype(np.int32)
        it = Tensor(index)
        want = ref.dequantize(weight, scale, index)
        assert np.array_equal(ours(wt, st, it).asnumpy(), want)
        assert np.array_equal(composed(wt, st, it).asnumpy(), want)
        times = timed_together([
            ("ms_moe_ops (GRAPH)", lambda: ours(wt, st, it).asnumpy()),
            ("MindSpore ops composed (GRAPH)", lambda: composed(wt, st, it).asnumpy()),
            ("numpy", lambda: ref.dequantize(weight, scale, index)),
        ], repeat=a.repeats)
        moved = picked * a.k * a.n * 5
        rows = [(name, t, f"{moved / t / 1e9:6.1f} GB/s") for name, t in times.items()]
        report(f"dequantize {picked} of {a.experts} experts of [{a.k}, {a.n}] int8 -> float32 "
               f"(bit-identical results)", rows, "ms_moe_ops (GRAPH)")


if __name__ == "__main__":
    main()
