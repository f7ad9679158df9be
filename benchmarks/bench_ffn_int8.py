"""MoeFFN int8 inference against float32: the int8 path of moe_ffn, the QuantMoeFFN Cell (float
x in, quantised on the fly), float32 moe_ffn, and numpy's float32 matmuls; plus the accuracy the
quantisation keeps at that size.

    python benchmarks/bench_ffn_int8.py [--m 4096 --h 1024 --f 2048 --e 8] [--runs 3]
    python benchmarks/bench_ffn_int8.py --m 1024 --h 512 --f 1024 --e 8 --paths all

GOP/s count the nominal products (4*M*H*F, int8 or float operations alike). --paths all (or a
list such as avx2,avx512) times the int8 and the float32 moe_ffn on each instruction-set path this
CPU runs, side by side: MS_MOE_OPS_ISA is read at every kernel call, so the paths take turns
within this process, round after round.
"""
import argparse
import ctypes
import os

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

from ms_moe_ops import moe_ffn
from ms_moe_ops.nn import MoeFFN, quantize_moe_ffn
from common import timed_together, timeit

ms.set_context(device_target="CPU", mode=ms.GRAPH_MODE)


class Int8FFN(nn.Cell):
    def construct(self, *args):
        return moe_ffn(*args, output_dtype="float32")


def numpy_matmuls(x, counts, w1, w2):
    s = 0
    for e, c in enumerate(counts):
        if c:
            x[s:s + c] @ w1[e] @ w2[e]
        s += c


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--h", type=int, default=1024)
    p.add_argument("--f", type=int, default=2048)
    p.add_argument("--e", type=int, default=8)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--paths", help="'all' or comma-separated instruction-set paths: int8 against "
                                   "float32 on each, side by side")
    a = p.parse_args()
    m, h, f, e = a.m, a.h, a.f, a.e
    rng = np.random.default_rng(0)
    counts = np.full(e, m // e, np.int64)
    counts[-1] += m - counts.sum()
    tokens = Tensor(counts)

    cell = MoeFFN(e, h, f, activation="fastgelu", has_bias=True)
    cell.bias1.set_data(Tensor((rng.standard_normal((e, f)) * 0.1).astype(np.float32)))
    cell.bias2.set_data(Tensor((rng.standard_normal((e, h)) * 0.1).astype(np.float32)))
    calib = rng.standard_normal((m, h)).astype(np.float32)
    quant = quantize_moe_ffn(cell, calib, counts, output_dtype="float32")
    x = rng.standard_normal((m, h)).astype(np.float32)
    x_t = Tensor(x)
    x_q = Tensor(np.clip(np.rint(x / quant.x_step.asnumpy()), -128, 127).astype(np.int8))
    int8_args = (x_q, tokens, quant.weight1, quant.weight2, quant.bias1, quant.bias2, quant.scale,
                 quant.offset, quant.deq_scale1, quant.deq_scale2)
    int8_op = Int8FFN()
    w1, w2 = cell.weight1.asnumpy(), cell.weight2.asnumpy()

    def timed(fn):
        return timeit(fn, repeat=a.runs, warmup=1)

    if a.paths:
        return per_path(a, lambda: int8_op(*int8_args).asnumpy(), lambda: cell(x_t, tokens).asnumpy())

    rows = [("moe_ffn int8 (x already int8)", timed(lambda: int8_op(*int8_args).asnumpy())),
            ("QuantMoeFFN (float x, quantised)", timed(lambda: quant(x_t, tokens).asnumpy())),
            ("moe_ffn float32 (MoeFFN Cell)", timed(lambda: cell(x_t, tokens).asnumpy())),
            ("numpy float32 matmuls only", timed(lambda: numpy_matmuls(x, counts, w1, w2)))]
    ops_ = 4 * m * h * f
    print(f"MoeFFN int8 vs float32  M={m} H={h} F={f} E={e} fastgelu, even split "
          f"(median of {a.runs}; GOP/s nominal)")
    base = rows[0][1]
    for name, sec in rows:
        ratio = "" if sec is base else f"   int8 is {sec / base:.2f}x faster"
        print(f"  {name:34s} {sec * 1e3:9.1f} ms  {ops_ / sec / 1e9:7.1f} GOP/s{ratio}")

    y_float = cell(x_t, tokens).asnumpy()
    y_int8 = quant(x_t, tokens).asnumpy()
    err = np.linalg.norm(y_int8 - y_float) / np.linalg.norm(y_float)
    cos = float((y_int8 * y_float).sum() / np.linalg.norm(y_int8) / np.linalg.norm(y_float))
    print(f"  QuantMoeFFN vs float32 MoeFFN on fresh unit-normal x: relative error {err:.3%}, "
          f"cosine {cos:.6f}")


def per_path(a, int8_fn, float_fn):
    """The int8 and the float32 moe_ffn on each path, in turns; int8's speed over float32's."""
    from ms_moe_ops.ops._library import kernel_library  # pylint: disable=import-outside-toplevel

    lib = ctypes.CDLL(kernel_library())
    lib.MsMoeOpsIsaPaths.restype = ctypes.c_char_p
    here = lib.MsMoeOpsIsaPaths().decode().split()
    paths = here if a.paths == "all" else a.paths.split(",")

    def on(path, fn):
        def call():
            os.environ["MS_MOE_OPS_ISA"] = path
            fn()
        return call

    contenders = [(f"{path} {kind}", on(path, fn)) for path in paths
                  for kind, fn in (("int8", int8_fn), ("float32", float_fn))]
    times = timed_together(contenders, repeat=a.runs)
    os.environ.pop("MS_MOE_OPS_ISA", None)
    ops_ = 4 * a.m * a.h * a.f
    print(f"MoeFFN int8 vs float32 per instruction-set path  M={a.m} H={a.h} F={a.f} E={a.e} "
          f"fastgelu (median of {a.runs}, in turns; GOP/s nominal)")
    print(f"  {'path':8s} {'int8':>10s} {'float32':>10s}  int8 speed over float32")
    for path in paths:
        i8, f32 = times[f"{path} int8"], times[f"{path} float32"]
        print(f"  {path:8s} {i8 * 1e3:7.1f} ms {f32 * 1e3:7.1f} ms  {f32 / i8:5.2f}x   "
              f"({ops_ / i8 / 1e9:.0f} / {ops_ / f32 / 1e9:.0f} GOP/s)")


if __name__ == "__main__":
    main()
