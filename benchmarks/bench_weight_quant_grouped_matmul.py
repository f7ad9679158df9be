"""Weight-only int8 experts' products for a decoding step's few rows: ms_moe_ops'
weight_quant_grouped_matmul kernel (each int8 weight read once) vs what ms_moe_ops.quantize's
experts ran before (dequantize the experts the rows use, then grouped_matmul: both this
package's kernels) vs the same maths composed from MindSpore ops (gather, cast, multiply,
matmul per expert) vs numpy, in turns.

Default shape: the experts' first weight of benchmarks/bench_generate.py (E=16 experts of
[K=1024, N=1024] int8), for one decoding token (2 rows on 2 experts) and a batch of 8 (16 rows on
the experts they pick). The weights are Parameters of the timed Cells, as in a model; a time is
one call's, over 20 in a row, each result read back into numpy. GB/s counts the int8 weights of
the experts with rows (the bytes the product must read).

    python benchmarks/bench_weight_quant_grouped_matmul.py
"""
import argparse

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ms_moe_ops import reference as ref
from ms_moe_ops.ops import dequantize, grouped_matmul
from ms_moe_ops.ops.weight_quant_grouped_matmul import WEIGHT_QUANT_GROUPED_MATMUL
from common import report, timed_together


class _Experts(nn.Cell):
    """The experts' int8 weights and steps held as Parameters, as in a model (a graph input
    would be copied on every call)."""

    def __init__(self, weight, scale):
        super().__init__()
        self.weight = Parameter(Tensor(weight), requires_grad=False)
        self.scale = Parameter(Tensor(scale), requires_grad=False)


class Ours(_Experts):
    def construct(self, x, counts, picked, picked_counts, row_expert):
        return WEIGHT_QUANT_GROUPED_MATMUL(x, self.weight, self.scale, counts)


class Before(_Experts):
    """0.4.8's quantised experts: the used experts' weights dequantised, then grouped_matmul."""

    def construct(self, x, counts, picked, picked_counts, row_expert):
        return grouped_matmul(x, dequantize(self.weight, self.scale, picked), picked_counts)


class Composed(_Experts):
    """MindSpore ops alone: each row's expert weight gathered, cast and scaled, one batched
    matmul."""

    def construct(self, x, counts, picked, picked_counts, row_expert):
        w = ops.gather(self.weight, row_expert, 0).astype(ms.float32)
        w = w * ops.gather(self.scale, row_expert, 0).expand_dims(1)
        return ops.bmm(x.expand_dims(1), w).squeeze(1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--calls", type=int, default=20, help="calls per timed round")
    a = p.parse_args(argv)
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    rng = np.random.default_rng(0)
    weight = rng.integers(-127, 128, (a.experts, a.k, a.n)).astype(np.int8)
    scale = rng.uniform(1e-3, 1e-2, (a.experts, a.n)).astype(np.float32)
    cells = {"ms_moe_ops (GRAPH)": Ours(weight, scale),
             "dequantize + grouped_matmul (GRAPH)": Before(weight, scale),
             "MindSpore ops composed (GRAPH)": Composed(weight, scale)}
    for tokens in (1, 8):  # top-2 rows, grouped by expert
        row_expert = np.sort(np.concatenate([rng.choice(a.experts, 2, replace=False)
                                             for _ in range(tokens)]))
        counts = np.bincount(row_expert, minlength=a.experts).astype(np.int64)
        picked = np.flatnonzero(counts).astype(np.int32)
        x = rng.standard_normal((len(row_expert), a.k)).astype(np.float32)
        args = (Tensor(x), Tensor(counts), Tensor(picked), Tensor(counts[picked]),
                Tensor(row_expert.astype(np.int32)))
        want = ref.weight_quant_grouped_matmul(x, weight, scale, counts)
        for cell in cells.values():
            np.testing.assert_allclose(cell(*args).asnumpy(), want, rtol=1e-4, atol=1e-4)

        def calls(cell):  # a decoding step's call after call (each result read back)
            def run():
                for _ in range(a.calls):
                    cell(*args).asnumpy()
            return run

        times = timed_together(
            [(name, calls(cell)) for name, cell in cells.items()]
            + [("numpy", lambda: [ref.weight_quant_grouped_matmul(x, weight, scale, counts)
                                  for _ in range(a.calls)])], repeat=a.repeats)
        times = {name: t / a.calls for name, t in times.items()}
        moved = len(picked) * a.k * a.n
        rows = [(name, t, f"{moved / t / 1e9:6.1f} GB/s") for name, t in times.items()]
        report(f"{len(row_expert)} rows on {len(picked)} of {a.experts} experts of [{a.k}, {a.n}] "
               f"int8, float32 x", rows, "ms_moe_ops (GRAPH)")


if __name__ == "__main__":
    main()
