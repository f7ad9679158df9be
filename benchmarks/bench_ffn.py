"""moe_ffn against the alternatives: the same per-expert maths from MindSpore MatMul (GRAPH mode,
jit'ed Cell) and from numpy, forward and forward+backward, even and uneven expert loads.

    python benchmarks/bench_ffn.py [--m 4096 --h 1024 --f 2048 --e 8] [--dtype float32] [--int8]

GFLOP/s count the nominal products (forward 4*M*H*F, forward+backward 12*M*H*F). --int8 adds the
quantised inference path (int8 x int8 products, GOP/s).

numpy's bundled OpenBLAS can mis-detect the CPU in a virtual machine (OPENBLAS_VERBOSE=2 prints
"Core: Prescott", SSE3 kernels); compare against its real speed with OPENBLAS_CORETYPE=SkylakeX
(or the CPU's family) set in the environment.
"""
import argparse
import os
import sys

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from ms_moe_ops import moe_ffn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

ms.set_context(device_target="CPU", mode=ms.GRAPH_MODE)


def timed(fn, runs):
    return timed_together([("", fn)], runs)[0][1]


def timed_together(contenders, runs):
    """[(name, median seconds)] of the contenders, timed in turns (common.timed_together)."""
    return list(common.timed_together(contenders, runs).items())


def splits(m, e):
    """Expert loads: even, and uneven (geometric, one expert empty)."""
    even = np.full(e, m // e, np.int64)
    even[-1] += m - even.sum()
    w = 0.6 ** np.arange(e)
    w[-1] = 0.0
    uneven = np.floor(w / w.sum() * m).astype(np.int64)
    uneven[0] += m - uneven.sum()
    return {"even": even, "uneven": uneven}


# -- our operator -------------------------------------------------------------------------------

class Ours(nn.Cell):
    def construct(self, x, tokens, w1, w2, b1, b2):
        return moe_ffn(x, tokens, w1, w2, b1, b2)


class Loss(nn.Cell):
    """sum(ffn(...) * r): its gradient feeds r as dy."""

    def __init__(self, ffn, r):
        super().__init__()
        self.ffn, self.r = ffn, r

    def construct(self, *args):
        return (self.ffn(*args) * self.r).sum()


# -- MindSpore composition: one MatMul pair per expert (counts baked in: static slices) -----------

class Composed(nn.Cell):
    def __init__(self, counts):
        super().__init__()
        self.bounds = [(int(s), int(s + c)) for s, c in zip(np.cumsum(counts) - counts, counts)]

    def construct(self, x, tokens, w1, w2, b1, b2):
        outs = []
        for e, (s, t) in enumerate(self.bounds):
            if t > s:
                h = ops.matmul(x[s:t], w1[e]) + b1[e]
                outs.append(ops.matmul(ops.fast_gelu(h), w2[e]) + b2[e])
        return ops.concat(outs, 0)


def grad_fn(loss):
    return ms.jit(ms.grad(loss, grad_position=(0, 2, 3, 4, 5)))


# -- numpy: the same per-expert products ---------------------------------------------------------

def np_forward(x, counts, w1, w2, b1, b2, matmul_only=False):
    y = np.empty_like(x)
    s = 0
    for e, c in enumerate(counts):
        if c:
            h = x[s:s + c] @ w1[e]
            if not matmul_only:
                h += b1[e]
                h = h / (1 + np.exp(-1.702 * h))  # fastgelu
            y[s:s + c] = h @ w2[e]
            if not matmul_only:
                y[s:s + c] += b2[e]
        s += c
    return y


def np_forward_backward(x, counts, w1, w2, b1, b2, dy):
    grads = [np.empty_like(x), np.zeros_like(w1), np.zeros_like(w2), np.zeros_like(b1),
             np.zeros_like(b2)]
    s = 0
    for e, c in enumerate(counts):
        if c:
            xe, dye = x[s:s + c], dy[s:s + c]
            h = xe @ w1[e] + b1[e]
            sg = 1 / (1 + np.exp(-1.702 * h))
            a = h * sg
            _ = a @ w2[e] + b2[e]
            da = dye @ w2[e].T
            dh = da * (sg + 1.702 * h * sg * (1 - sg))
            grads[0][s:s + c] = dh @ w1[e].T
            grads[1][e] = xe.T @ dh
            grads[2][e] = a.T @ dye
            grads[3][e] = dh.sum(0)
            grads[4][e] = dye.sum(0)
        s += c
    return grads


# -- int8 inference path (--int8) ----------------------------------------------------------------

def int8_forward(m, h, f, counts, runs):
    """Seconds per int8 moe_ffn forward (output float16), or None when the path fails."""
    rng = np.random.default_rng(1)
    e = len(counts)
    i8 = lambda *s: Tensor(rng.integers(-64, 64, s).astype(np.int8))
    args = (i8(m, h), Tensor(counts), i8(e, h, f), i8(e, f, h),
            Tensor(rng.integers(-100, 100, (e, f)).astype(np.int32)),
            Tensor(rng.integers(-100, 100, (e, h)).astype(np.int32)),
            Tensor(np.full(e, 0.05, np.float32)), Tensor(np.zeros(e, np.float32)),
            Tensor(np.full((e, f), 1e-4, np.float32)), Tensor(np.full((e, h), 1e-4, np.float32)))
    try:
        return timed(lambda: moe_ffn(*args).asnumpy(), runs)
    except RuntimeError as err:
        print(f"  int8 path failed: {err}")
        return None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--h", type=int, default=1024)
    p.add_argument("--f", type=int, default=2048)
    p.add_argument("--e", type=int, default=8)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--int8", action="store_true", help="also time the int8 inference path")
    p.add_argument("--no-backward", action="store_true")
    common.add_record_arguments(p)
    a = p.parse_args()
    m, h, f, e = a.m, a.h, a.f, a.e
    rng = np.random.default_rng(0)
    r = lambda *s, scale=1.0: (rng.standard_normal(s) * scale).astype(np.float32)
    x, w1, w2 = r(m, h), r(e, h, f, scale=h ** -0.5), r(e, f, h, scale=f ** -0.5)
    b1, b2, dy = r(e, f, scale=0.1), r(e, h, scale=0.1), r(m, h)
    dt = getattr(ms, a.dtype)
    t = lambda v: Tensor(v).astype(dt)
    fwd_flops, train_flops = 4 * m * h * f, 12 * m * h * f
    print(f"moe_ffn  M={m} H={h} F={f} E={e} {a.dtype}  (median of {a.runs}; GFLOP/s nominal)")
    for name, counts in splits(m, e).items():
        print(f"\n[{name} split] tokens per expert: {counts.tolist()}")
        args = (t(x), Tensor(counts), t(w1), t(w2), t(b1), t(b2))
        ours, comp = Ours(), Composed(counts)
        fns = [("moe_ffn (ours)", lambda: ours(*args).asnumpy())]
        if a.dtype != "bfloat16":  # MindSpore's CPU MatMul has no bfloat16 kernel
            fns.append(("MindSpore MatMul per expert", lambda: comp(*args).asnumpy()))
        if a.dtype == "float32":
            fns.append(("numpy per expert (matmul only)",
                        lambda: np_forward(x, counts, w1, w2, b1, b2, True)))
            fns.append(("numpy per expert (full ffn)", lambda: np_forward(x, counts, w1, w2, b1, b2)))
        rows = timed_together(fns, a.runs)
        report("forward", rows, fwd_flops)
        times = dict(rows)
        if "numpy per expert (matmul only)" in times:
            share = times["numpy per expert (matmul only)"] / times["moe_ffn (ours)"]
            print(f"    goal: ours at 0.9 or more of numpy's matmul GFLOP/s -> {share:.2f}")
            common.record_goal(a, f"ffn-numpy-{name}", fwd_flops / times["moe_ffn (ours)"] / 1e9,
                               fwd_flops / times["numpy per expert (matmul only)"] / 1e9,
                               "GFLOP/s", share)
        if a.int8:
            sec = int8_forward(m, h, f, counts, a.runs)
            if sec is not None:
                print(f"  int8 forward: {sec * 1e3:8.1f} ms  {fwd_flops / sec / 1e9:7.1f} GOP/s  "
                      f"({rows[0][1] / sec:.2f}x the {a.dtype} forward)")
        if a.no_backward:
            continue
        r_t = Tensor(dy)
        g_ours, g_comp = grad_fn(Loss(Ours(), r_t)), grad_fn(Loss(comp, r_t))
        fns = [("moe_ffn (ours)", lambda: [g.asnumpy() for g in g_ours(*args)])]
        if a.dtype != "bfloat16":
            fns.append(("MindSpore MatMul per expert", lambda: [g.asnumpy() for g in g_comp(*args)]))
        if a.dtype == "float32":
            fns.append(("numpy per expert", lambda: np_forward_backward(x, counts, w1, w2, b1, b2, dy)))
        rows = timed_together(fns, a.runs)
        report("forward+backward", rows, train_flops)
        times = dict(rows)
        if "MindSpore MatMul per expert" in times:
            speedup = times["MindSpore MatMul per expert"] / times["moe_ffn (ours)"]
            print(f"    target: ours >= 2x faster than the MindSpore composition -> {speedup:.2f}x")


def report(title, rows, flops):
    ours = rows[0][1]
    print(f"  {title}")
    for name, sec in rows:
        ratio = "" if sec is ours else f"   speed-up of ours: {sec / ours:.2f}x"
        print(f"    {name:32s} {sec * 1e3:9.1f} ms  {flops / sec / 1e9:7.1f} GFLOP/s{ratio}")


if __name__ == "__main__":
    main()
