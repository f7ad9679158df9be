"""MoELayer forward + backward against the same layer composed from MindSpore ops, and numpy.

The composed layer is what a user writes without this package in GRAPH mode (static shapes): a
loop over the experts in which every expert runs on every token and a mask keeps the routed
ones (E/K times the useful work, but no dynamic shapes). numpy: a vectorised forward that gathers
each expert's tokens. All three use the same weights; the outputs are checked against each other.

    python benchmarks/bench_layer.py                       # T=4096 H=512 F=256 E=16 K=4
    python benchmarks/bench_layer.py --tokens 1024 --shared 1
"""
import argparse
import time

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from ms_moe_ops import MoELayer


class ComposedMoE(nn.Cell):
    """The MoELayer maths from MindSpore ops: sigmoid router with bias-based choice and
    renormalised weights, dense masked SwiGLU experts, optional shared SwiGLU expert."""

    def __init__(self, layer):
        super().__init__()
        self.router_weight = ms.Parameter(Tensor(layer.router.weight.asnumpy()), name="router_weight")
        self.bias = Tensor(layer.router.expert_bias.asnumpy())
        self.w1 = ms.Parameter(Tensor(layer.experts.weight1.asnumpy()), name="w1")
        self.w2 = ms.Parameter(Tensor(layer.experts.weight2.asnumpy()), name="w2")
        self.shared = layer.shared_experts is not None
        if self.shared:
            self.sw1 = ms.Parameter(Tensor(layer.shared_experts.weight1.asnumpy()), name="sw1")
            self.sw2 = ms.Parameter(Tensor(layer.shared_experts.weight2.asnumpy()), name="sw2")
        self.num_experts = layer.num_experts
        self.top_k = layer.top_k

    @staticmethod
    def swiglu(h):
        gate, up = ops.chunk(h, 2, axis=1)
        return ops.silu(gate) * up

    def construct(self, x):
        scores = ops.sigmoid(ops.matmul(x, self.router_weight.T))
        _, idx = ops.topk(scores + self.bias, self.top_k)
        w = ops.gather_elements(scores, 1, idx)
        w = w / (w.sum(axis=1, keepdims=True) + 1e-20)
        out = ops.zeros_like(x)
        for e in range(self.num_experts):
            we = (w * (idx == e).astype(w.dtype)).sum(axis=1, keepdims=True)  # 0 when not routed
            out = out + we * ops.matmul(self.swiglu(ops.matmul(x, self.w1[e])), self.w2[e])
        if self.shared:
            out = out + ops.matmul(self.swiglu(ops.matmul(x, self.sw1)), self.sw2)
        return out


class ForwardBackward(nn.Cell):
    """d/d(x, weights) of sum(layer(x) * cotangent): one training step's layer work."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self.grad = ops.GradOperation(get_all=True, get_by_list=True)
        self.weights = ms.ParameterTuple(layer.trainable_params())

    def construct(self, x, cotangent):
        return self.grad(_Objective(self.layer), self.weights)(x, cotangent)


class _Objective(nn.Cell):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def construct(self, x, cotangent):
        return (self.layer(x) * cotangent).sum()


def numpy_forward(x, p, top_k, shared):
    scores = 1 / (1 + np.exp(-(x @ p["router.weight"].T)))
    idx = np.argsort(-(scores + p["router.expert_bias"]), axis=1, kind="stable")[:, :top_k]
    w = np.take_along_axis(scores, idx, 1)
    w /= w.sum(1, keepdims=True)
    out = np.zeros_like(x)

    def swiglu(h):
        g, u = np.split(h, 2, axis=1)
        return g / (1 + np.exp(-g)) * u

    for e in range(p["experts.weight1"].shape[0]):
        tok, slot = np.nonzero(idx == e)
        if tok.size:
            y = swiglu(x[tok] @ p["experts.weight1"][e]) @ p["experts.weight2"][e]
            np.add.at(out, tok, w[tok, slot, None] * y)
    if shared:
        out += swiglu(x @ p["shared_experts.weight1"]) @ p["shared_experts.weight2"]
    return out


def timed(fn, repeats, warmup=2):
    for _ in range(warmup):
        sync(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def sync(result):
    if isinstance(result, (tuple, list)):
        for r in result:
            sync(r)
    elif isinstance(result, Tensor):
        result.asnumpy()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--shared", type=int, default=0, help="shared experts (0 = none)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)

    t, h = args.tokens, args.hidden
    layer = MoELayer(h, args.ffn, args.experts, args.top_k, n_shared_experts=args.shared)
    layer.router.weight.set_data(Tensor(np.random.default_rng(0).normal(0, 0.05, (args.experts, h))
                                        .astype(np.float32)))
    composed = ComposedMoE(layer)
    rng = np.random.default_rng(1)
    x_np = rng.normal(0, 1, (t, h)).astype(np.float32)
    x, cot = Tensor(x_np), Tensor(rng.normal(0, 1, (t, h)).astype(np.float32))
    params = {n: p.asnumpy() for n, p in layer.parameters_and_names()}

    ours_fwd, ref_fwd = layer(x).asnumpy(), composed(x).asnumpy()
    np_out = numpy_forward(x_np, params, args.top_k, args.shared)
    print(f"T={t} H={h} F={args.ffn} E={args.experts} K={args.top_k} shared={args.shared} "
          f"(GRAPH mode, {args.repeats} runs, median)")
    print(f"max |ours - composed| = {np.abs(ours_fwd - ref_fwd).max():.2e}, "
          f"max |ours - numpy| = {np.abs(ours_fwd - np_out).max():.2e}")

    ours_step, ref_step = ForwardBackward(layer), ForwardBackward(composed)
    results = {
        "ours forward": timed(lambda: layer(x), args.repeats),
        "composed forward": timed(lambda: composed(x), args.repeats),
        "numpy forward": timed(lambda: numpy_forward(x_np, params, args.top_k, args.shared),
                               args.repeats, warmup=1),
        "ours forward+backward": timed(lambda: ours_step(x, cot), args.repeats),
        "composed forward+backward": timed(lambda: ref_step(x, cot), args.repeats),
    }
    # useful work: the routed tokens' expert matmuls (3 GEMMs of T*K x H x F) and the router
    flops = 2 * t * args.top_k * h * args.ffn * 3 + 2 * t * h * args.experts
    flops += 2 * t * h * args.ffn * args.shared * 3
    for name, sec in results.items():
        work = flops * (3 if "backward" in name else 1)
        print(f"{name:28s} {sec * 1e3:9.1f} ms   {work / sec / 1e9:6.1f} useful GFLOP/s")
    print(f"speed-up over composed: forward {results['composed forward'] / results['ours forward']:.1f}x, "
          f"forward+backward "
          f"{results['composed forward+backward'] / results['ours forward+backward']:.1f}x; "
          f"over numpy forward {results['numpy forward'] / results['ours forward']:.1f}x")


if __name__ == "__main__":
    main()
