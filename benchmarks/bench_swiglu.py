"""swiglu_group / swiglu_group_quant_grad against the same maths composed from MindSpore ops
(GRAPH mode, jit'ed Cell) and numpy, and against the memory bandwidth limit (np.copyto moving as
many bytes as the operator reads plus writes).

    python benchmarks/bench_swiglu.py [--tokens 8192] [--hidden 2048] [--dtypes float32 bfloat16]

"ms_moe_ops" is the operator in a GRAPH-mode Cell (like the composed version). Every contender,
the copy included, runs once per round, in turns; the tables give medians. Both directions use every input (per-token weight, group_index covering all rows, clamp on), so
the backward also produces the weight's gradient: the heaviest path.
"""
import argparse

import numpy as np
import mindspore as ms
from mindspore import nn, ops

from ms_moe_ops.ops import swiglu_group_quant_grad
from ms_moe_ops.ops.swiglu import SWIGLU_GROUP
from common import add_record_arguments, record_goal, timed_together

CLAMP = 7.0
BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def sync(out):
    """Waits for the result (asnumpy of a CPU tensor shares its memory: no copy)."""
    (out[0] if isinstance(out, (tuple, list)) else out).asnumpy()
    return out


# -- the same maths from MindSpore ops --------------------------------------------------------

class OursForward(nn.Cell):
    def construct(self, x, weight, group_index):
        return SWIGLU_GROUP(x, weight, group_index, clamp_limit=CLAMP)


class OursBackward(nn.Cell):
    def construct(self, grad_y, x, weight, y_origin, group_index):
        return swiglu_group_quant_grad(grad_y, x, weight, y_origin, group_index, clamp_limit=CLAMP)


class ComposedForward(nn.Cell):
    def construct(self, x, weight, group_index):
        x0, x1 = ops.chunk(x.astype(ms.float32), 2, axis=-1)
        x0 = ops.minimum(x0, CLAMP)
        x1 = ops.clamp(x1, -CLAMP, CLAMP)
        y_origin = ops.silu(x0) * x1
        keep = ops.arange(x.shape[0], dtype=ms.int64) < ops.minimum(group_index.sum(), x.shape[0])
        y_origin = y_origin * keep.astype(ms.float32).reshape(-1, 1)
        return (y_origin * weight).astype(x.dtype), y_origin.astype(x.dtype)


class ComposedBackward(nn.Cell):
    def construct(self, grad_y, x, weight, y_origin, group_index):
        x0, x1 = ops.chunk(x.astype(ms.float32), 2, axis=-1)
        a = ops.minimum(x0, CLAMP)
        b = ops.clamp(x1, -CLAMP, CLAMP)
        s = ops.sigmoid(a)
        g = grad_y.astype(ms.float32)
        keep = ops.arange(x.shape[0], dtype=ms.int64) < ops.minimum(group_index.sum(), x.shape[0])
        keep = keep.astype(ms.float32).reshape(-1, 1)
        grad_w = (g * y_origin.astype(ms.float32)).sum(axis=-1, keepdims=True) * keep
        g = g * (weight * keep)
        da = g * b * s * (1 + a * (1 - s)) * (x0 < CLAMP).astype(ms.float32)
        db = g * a * s * ((x1 > -CLAMP) & (x1 < CLAMP)).astype(ms.float32)
        return ops.cat((da, db), axis=-1).astype(x.dtype), grad_w


# -- numpy (float32) ----------------------------------------------------------------------------

def numpy_forward(x, weight):
    h = x.shape[1] // 2
    a = np.minimum(x[:, :h], CLAMP)
    b = np.clip(x[:, h:], -CLAMP, CLAMP)
    y_origin = a / (1 + np.exp(-a)) * b
    return y_origin * weight, y_origin


def numpy_backward(grad_y, x, weight, y_origin):
    h = x.shape[1] // 2
    x0, x1 = x[:, :h], x[:, h:]
    a, b = np.minimum(x0, CLAMP), np.clip(x1, -CLAMP, CLAMP)
    s = 1 / (1 + np.exp(-a))
    grad_w = (grad_y * y_origin).sum(axis=1, keepdims=True)
    g = grad_y * weight
    da = g * b * s * (1 + a * (1 - s)) * (x0 < CLAMP)
    db = g * a * s * ((x1 > -CLAMP) & (x1 < CLAMP))
    return np.concatenate([da, db], axis=1), grad_w


def copier(nbytes):
    """np.copyto moving nbytes in total (nbytes/2 read + nbytes/2 written)."""
    src = np.ones(nbytes // 2, np.uint8)
    dst = np.zeros_like(src)
    return lambda: np.copyto(dst, src)


COPY = "np.copyto, same bytes"
EAGER = "ms_moe_ops, called eagerly"


def report(name, nbytes, times, args=None, dtype=None):
    ours = times["ms_moe_ops"]
    gbs = lambda sec: nbytes / sec / 1e9
    print(f"  {name}: {nbytes / 2**20:.0f} MiB moved (median of rounds, contenders in turns)")
    for label, sec in times.items():
        ratio = "" if label == "ms_moe_ops" else f"ms_moe_ops is {sec / ours:5.2f}x as fast"
        print(f"    {label:<22} {sec * 1e3:9.1f} ms {gbs(sec):7.1f} GB/s  {ratio}")
    print(f"    ms_moe_ops reaches {times[COPY] / ours:.0%} of the copy bandwidth")
    if EAGER in times:
        print(f"    called eagerly: {times[COPY] / times[EAGER]:.0%} of the copy bandwidth (goal 70%)")
    if args is not None:
        record_goal(args, f"swiglu-{name}-{dtype}", ours * 1e3, times[COPY] * 1e3, "ms",
                    times[COPY] / ours)
        if EAGER in times:
            record_goal(args, f"swiglu-{name}-eager-{dtype}", times[EAGER] * 1e3,
                        times[COPY] * 1e3, "ms", times[COPY] / times[EAGER])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--repeat", type=int, default=7)
    add_record_arguments(p)
    args = p.parse_args()
    ms.set_context(device_target="CPU")
    t, h = args.tokens, args.hidden
    rng = np.random.default_rng(0)
    x_np = rng.normal(scale=3.0, size=(t, 2 * h)).astype(np.float32)
    w_np = rng.uniform(0.1, 1.0, (t, 1)).astype(np.float32)
    gy_np = rng.normal(size=(t, h)).astype(np.float32)
    counts = ms.Tensor(np.array([t // 2, t - t // 2], np.int64))
    print(f"swiglu_group, T={t}, H={h}, clamp_limit={CLAMP}, weight and group_index given")
    for dtype in args.dtypes:
        e = BYTES[dtype]
        mtype = getattr(ms, dtype)
        x = ms.Tensor(x_np, mtype)
        w = ms.Tensor(w_np)
        gy = ms.Tensor(gy_np, mtype)
        print(f"{dtype}:")

        # forward: reads x and weight, writes y and y_origin
        fwd_bytes = t * 2 * h * e + t * 4 + 2 * t * h * e
        y_origin = SWIGLU_GROUP(x, w, counts, clamp_limit=CLAMP)[1]
        fwd, comp_fwd = OursForward(), ComposedForward()
        # backward: reads grad_y, x, weight, y_origin; writes grad_x and grad_weight
        bwd_bytes = t * h * e + t * 2 * h * e + t * 4 + t * h * e + t * 2 * h * e + t * 4
        bwd, comp_bwd = OursBackward(), ComposedBackward()
        yo_np = y_origin.asnumpy().astype(np.float32)
        for name, nbytes, ours, composed, numpy_fn in (
                ("forward", fwd_bytes, lambda: sync(fwd(x, w, counts)),
                 lambda: sync(comp_fwd(x, w, counts)), lambda: numpy_forward(x_np, w_np)),
                ("backward", bwd_bytes, lambda: sync(bwd(gy, x, w, y_origin, counts)),
                 lambda: sync(comp_bwd(gy, x, w, y_origin, counts)),
                 lambda: numpy_backward(gy_np, x_np, w_np, yo_np))):
            ms.set_context(mode=ms.GRAPH_MODE)
            contenders = [("ms_moe_ops", ours), ("MindSpore composed", composed), (COPY, copier(nbytes))]
            if name == "backward":  # called as a user calls it, outside a graph, result read
                contenders.append((EAGER, lambda: sync(swiglu_group_quant_grad(
                    gy, x, w, y_origin, counts, clamp_limit=CLAMP))))
            if dtype == "float32":
                contenders.append(("numpy", numpy_fn))
            report(name, nbytes, timed_together(contenders, args.repeat), args, dtype)
        ms.set_context(mode=ms.PYNATIVE_MODE)


if __name__ == "__main__":
    main()
