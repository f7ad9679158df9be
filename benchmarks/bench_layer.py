"""MoELayer forward + backward side by side with transformers' DeepseekV3MoE (torch, CPU), the same
products as bare BLAS calls, numpy, and optionally the layer composed from MindSpore ops.

All contenders hold the same weights (DeepseekV3MoE's, converted with convert_deepseek_v3_moe)
and see the same input; the outputs are checked against each other before anything is timed.
Timings are medians of rounds in which every contender runs once, in turns.

- DeepseekV3MoE: transformers' block (router with bias-based choice, routed SwiGLU experts, one
  shared expert) in torch eager mode with `torch.set_num_threads(cores)`, its default experts
  loop, and its "grouped_mm" experts when torch has them on CPU.
- bare BLAS: every matrix product of the layer's forward and backward (router, each expert's
  two products and their four gradient products, the shared expert's) as one sgemm call each,
  same shapes, through the BLAS the kernels link (scipy-openblas32), on every core and on one
  (on a loaded machine the BLAS's spinning threads can make one thread faster): the speed the
  products reach in the BLAS and nothing else. The faster of the two is the reference.
- composed (--composed): the layer from MindSpore ops in GRAPH mode, every expert on every token
  (E/K times the useful work), which is what static shapes force without this package.

- bfloat16 (--dtype bfloat16): the layer under `ms.amp.auto_mixed_precision(layer, "O2",
  dtype=ms.bfloat16)` on bfloat16 tokens, as a user trains it, against DeepseekV3MoE
  `.to(torch.bfloat16)` on the same tokens; `--no-onednn` also times the layer with
  MS_MOE_OPS_ONEDNN=0 (its bfloat16 operands converted to float32 for float32 products, as on a
  CPU without a bfloat16 dot product), in the same rounds.

    python benchmarks/bench_layer.py                       # T=4096 H=512 F=256 E=16 K=4, shared 1
    python benchmarks/bench_layer.py --dtype bfloat16
    python benchmarks/bench_layer.py --tokens 1024 --composed
"""
import argparse
import os
import sys

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ms_moe_ops import MoELayer
from ms_moe_ops.info import _products
from ms_moe_ops.nn.families import convert_deepseek_v3_moe, moe_config_from_transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_record_arguments, cores, record_goal, timed_together  # noqa: E402


class ComposedMoE(nn.Cell):
    """The MoELayer maths from MindSpore ops: sigmoid router with bias-based choice and
    renormalised weights, dense masked SwiGLU experts, optional shared SwiGLU expert."""

    def __init__(self, layer):
        super().__init__()
        self.router_weight = Parameter(Tensor(layer.router.weight.asnumpy()), name="router_weight")
        self.bias = Tensor(layer.router.expert_bias.asnumpy())
        self.w1 = Parameter(Tensor(layer.experts.weight1.asnumpy()), name="w1")
        self.w2 = Parameter(Tensor(layer.experts.weight2.asnumpy()), name="w2")
        self.shared = layer.shared_experts is not None
        if self.shared:
            self.sw1 = Parameter(Tensor(layer.shared_experts.weight1.asnumpy()), name="sw1")
            self.sw2 = Parameter(Tensor(layer.shared_experts.weight2.asnumpy()), name="sw2")
        self.num_experts = layer.num_experts
        self.top_k = layer.top_k
        self.scale = layer.router.routed_scaling_factor

    @staticmethod
    def swiglu(h):
        gate, up = ops.chunk(h, 2, axis=1)
        return ops.silu(gate) * up

    def construct(self, x):
        scores = ops.sigmoid(ops.matmul(x, self.router_weight.T))
        _, idx = ops.topk(scores + self.bias, self.top_k)
        w = ops.gather_elements(scores, 1, idx)
        w = w / (w.sum(axis=1, keepdims=True) + 1e-20) * self.scale
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
        self.objective = _Objective(layer)
        self.grad = ops.GradOperation(get_all=True, get_by_list=True)
        self.weights = ms.ParameterTuple(layer.trainable_params())

    def construct(self, x, cotangent):
        return self.grad(self.objective, self.weights)(x, cotangent)


class _Objective(nn.Cell):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def construct(self, x, cotangent):
        return (self.layer(x).astype(ms.float32) * cotangent).sum()


# -- transformers ---------------------------------------------------------------------------------

def deepseek_block(a, rng):
    """transformers' DeepseekV3MoE with random weights (float32), its config, and torch."""
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE  # noqa

    # MindSpore sets OMP_NUM_THREADS=1 when it is imported: give torch every core explicitly
    torch.set_num_threads(cores())
    config = transformers.DeepseekV3Config(
        hidden_size=a.hidden, intermediate_size=a.ffn, moe_intermediate_size=a.ffn,
        n_routed_experts=a.experts, num_experts_per_tok=a.top_k, n_group=1, topk_group=1,
        n_shared_experts=a.shared, routed_scaling_factor=1.0, norm_topk_prob=True,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=16)
    block = DeepseekV3MoE(config).float()
    with torch.no_grad():
        for key, value in block.state_dict().items():
            scale = 0.05 if key.startswith("gate.") else value.shape[-1] ** -0.5
            value.copy_(torch.from_numpy(rng.normal(0, scale, tuple(value.shape)).astype(np.float32)))
    return block, config, torch


def our_layer(block, config):
    layer = MoELayer.from_config(moe_config_from_transformers(config))
    state = {k: v.detach().numpy().copy() for k, v in block.state_dict().items()}
    params = convert_deepseek_v3_moe(state, "", "")
    ms.load_param_into_net(layer, {k: Parameter(Tensor(v), name=k) for k, v in params.items()})
    return layer


def with_env(name, value, fn):
    """fn with the environment variable name set to value during the call."""
    def run():
        before = os.environ.get(name)
        os.environ[name] = value
        try:
            return fn()
        finally:
            if before is None:
                del os.environ[name]
            else:
                os.environ[name] = before
    return run


def in_dtype(dtype, layer, block, torch, x_np, cot_np):
    """(layer, block, x, cotangent, torch x, torch cotangent) for a step in dtype: float32 as they
    are; bfloat16 as users train, the layer under AMP O2 and the block `.to(torch.bfloat16)`, on
    bfloat16 tokens (the cotangent stays float32 here: our objective sums in float32)."""
    x, cot = Tensor(x_np), Tensor(cot_np)
    xt, cott = torch.from_numpy(x_np), torch.from_numpy(cot_np)
    if dtype == "bfloat16":
        layer = ms.amp.auto_mixed_precision(layer, "O2", dtype=ms.bfloat16)
        block = block.to(torch.bfloat16)
        x = Tensor(x_np, ms.bfloat16)
        xt, cott = xt.to(torch.bfloat16), cott.to(torch.bfloat16)
    return layer, block, x, cot, xt, cott


def torch_step(torch, block, x, cotangent):
    """forward + backward of sum(block(x) * cotangent) -> d/dx (parameter grads accumulate)."""
    def run():
        for p in block.parameters():
            p.grad = None
        xi = x.detach().requires_grad_(True)
        (block(xi) * cotangent).sum().backward()
        return xi.grad
    return run


def grouped_mm_block(torch, block, config):
    """The same block with transformers' grouped_mm experts, or None when they cannot run here."""
    import copy  # pylint: disable=import-outside-toplevel

    other = copy.deepcopy(block)
    other.config._experts_implementation = "grouped_mm"  # pylint: disable=protected-access
    other.experts.config = other.config
    try:
        with torch.no_grad():
            other(torch.zeros(8, config.hidden_size, dtype=next(block.parameters()).dtype))
    except Exception as err:  # pylint: disable=broad-except
        print(f"(grouped_mm experts do not run here: {type(err).__name__}: {err})")
        return None
    return other


# -- numpy and bare BLAS --------------------------------------------------------------------------

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


def product_shapes(t, h, f, counts, shared_f):
    """(m, k, n) of every matrix product in one forward + backward of the layer."""
    shapes = []

    def dense(m, k, n):  # y = a @ b: forward, then d(a) = dy @ b^T and d(b) = a^T @ dy
        shapes.extend([(m, k, n), (m, n, k), (k, m, n)])

    dense(t, h, len(counts))  # router
    for c in counts:
        if c:
            dense(c, h, 2 * f)
            dense(c, f, h)
    if shared_f:
        dense(t, h, 2 * shared_f)
        dense(t, shared_f, h)
    return shapes


def bare_blas(shapes, rng, threads):
    """The given products as single sgemm calls of the BLAS the kernels link (scipy-openblas32,
    on `threads` threads) on preallocated operands: the BLAS and nothing else."""
    import ctypes  # pylint: disable=import-outside-toplevel
    import scipy_openblas32  # pylint: disable=import-outside-toplevel

    lib = ctypes.CDLL(os.path.join(scipy_openblas32.get_lib_dir(),
                                   f"lib{scipy_openblas32.get_library()}.so"))
    sgemm = lib.scipy_cblas_sgemm
    sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                                           ctypes.c_void_p, ctypes.c_int, ctypes.c_float,
                                           ctypes.c_void_p, ctypes.c_int]
    shapes = [(int(m), int(k), int(n)) for m, k, n in shapes]
    operands = [(m, k, n, rng.standard_normal((m, k), np.float32),
                 rng.standard_normal((k, n), np.float32), np.empty((m, n), np.float32))
                for m, k, n in shapes]
    row_major, no_trans = 101, 111

    def run():
        before = lib.scipy_openblas_get_num_threads()
        lib.scipy_openblas_set_num_threads(threads)
        for m, k, n, a, b, c in operands:
            sgemm(row_major, no_trans, no_trans, m, n, k, 1.0, a.ctypes.data, k, b.ctypes.data, n,
                  0.0, c.ctypes.data, n)
        lib.scipy_openblas_set_num_threads(before)
    return run


def bare_onednn(shapes, rng, dtype):
    """The given products as single calls of oneDNN's sgemm (float32) or bfloat16 GEMM, MindSpore's
    libdnnl, the library the kernels call on an AVX-512 CPU; one thread (its threadpool runtime
    runs a call on the calling thread)."""
    import ctypes  # pylint: disable=import-outside-toplevel

    lib = ctypes.CDLL(os.path.join(os.path.dirname(ms.__file__), "lib", "libdnnl.so.3"))
    bf16 = dtype == "bfloat16"
    gemm = lib.dnnl_gemm_bf16bf16f32 if bf16 else lib.dnnl_sgemm
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    gemm.argtypes = [ctypes.c_char, ctypes.c_char, i64, i64, i64, ctypes.c_float, ptr, i64, ptr,
                     i64, ctypes.c_float, ptr, i64]
    kind = np.uint16 if bf16 else np.float32  # (bfloat16 bit patterns: any values do)
    operands = []
    for m, k, n in shapes:
        m, k, n = int(m), int(k), int(n)
        a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
        if bf16:
            a, b = (a.view(np.uint32) >> 16).astype(kind), (b.view(np.uint32) >> 16).astype(kind)
        operands.append((m, k, n, a, b, np.empty((m, n), np.float32)))

    def run():
        for m, k, n, a, b, c in operands:
            gemm(b"N", b"N", m, n, k, 1.0, a.ctypes.data, k, b.ctypes.data, n, 0.0, c.ctypes.data, n)
    return run


def sync(result):
    if isinstance(result, (tuple, list)):
        for r in result:
            sync(r)
    elif isinstance(result, Tensor):
        result.asnumpy()
    return result


def print_table(title, rows, flops, ours):
    print(f"\n{title}")
    print(f"  {'contender':<44} {'ms':>9} {'GFLOP/s':>8}  {'ms_moe_ops is':>16}")
    for name, sec in rows.items():
        ratio = "" if name == ours else f"{sec / rows[ours]:.2f}x faster"
        print(f"  {name:<44} {sec * 1e3:9.1f} {flops / sec / 1e9:8.1f}  {ratio:>16}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--shared", type=int, default=1, help="shared experts (0 = none)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--composed", action="store_true", help="also the MindSpore-ops composition")
    ap.add_argument("--pynative", action="store_true", help="also MoELayer in PyNative mode")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="bfloat16: both layers in mixed precision (AMP O2 / .to(torch.bfloat16))")
    ap.add_argument("--no-onednn", action="store_true",
                    help="also the layer with MS_MOE_OPS_ONEDNN=0 (float32 products)")
    add_record_arguments(ap)
    args = ap.parse_args()
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)

    t, h, k = args.tokens, args.hidden, args.top_k
    rng = np.random.default_rng(0)
    block, config, torch = deepseek_block(args, rng)
    layer = our_layer(block, config)
    params = {n: p.asnumpy() for n, p in layer.parameters_and_names()}
    x_np = rng.normal(0, 1, (t, h)).astype(np.float32)
    cot_np = rng.normal(0, 1, (t, h)).astype(np.float32)
    bf16 = args.dtype == "bfloat16"
    layer, block, x, cot, xt, cott = in_dtype(args.dtype, layer, block, torch, x_np, cot_np)
    if bf16:
        x_np = x.astype(ms.float32).asnumpy()

    ours = layer(x).astype(ms.float32).asnumpy()
    with torch.no_grad():
        theirs = block(xt).float().numpy()
    numpy_out = numpy_forward(x_np, params, k, args.shared)
    print(f"T={t} H={h} F={args.ffn} E={args.experts} K={k} shared={args.shared}, {args.dtype}, "
          f"{cores()} cores, GRAPH mode; median of {args.repeats} rounds, contenders in turns")
    print(f"max |ours - DeepseekV3MoE| = {np.abs(ours - theirs).max():.2e}, "
          f"max |ours - numpy| = {np.abs(ours - numpy_out).max():.2e}")
    idx = np.argsort(-(1 / (1 + np.exp(-(x_np @ params["router.weight"].T)))), 1,
                     kind="stable")[:, :k]
    counts = np.bincount(idx.reshape(-1), minlength=args.experts)
    shapes = product_shapes(t, h, args.ffn, counts, args.ffn * args.shared)
    train_flops = sum(2 * m * kk * n for m, kk, n in shapes)
    fwd_flops = train_flops / 3

    ours_name = "ms_moe_ops MoELayer (GRAPH)" + (", AMP O2 bf16" if bf16 else "")
    fwd = [(ours_name, lambda: layer(x).asnumpy()),
           ("transformers DeepseekV3MoE (torch)", lambda: _no_grad(torch, block, xt)),
           ("numpy", lambda: numpy_forward(x_np, params, k, args.shared))]
    step = ForwardBackward(layer)
    theirs_name = "transformers DeepseekV3MoE (torch)" + (", bf16" if bf16 else "")
    fwd[1] = (theirs_name, fwd[1][1])
    train = [(ours_name, lambda: sync(step(x, cot))),
             (theirs_name, torch_step(torch, block, xt, cott))]
    if args.no_onednn:
        train.append(("the same, MS_MOE_OPS_ONEDNN=0 (float32 products)",
                      with_env("MS_MOE_OPS_ONEDNN", "0", lambda: sync(step(x, cot)))))
    grouped = grouped_mm_block(torch, block, config)
    if grouped is not None:
        train.append(("transformers DeepseekV3MoE, grouped_mm", torch_step(torch, grouped, xt, cott)))
    # bare bfloat16 GEMMs only where the kernels run them: on a CPU without a bfloat16 dot product
    # oneDNN's bfloat16 GEMM is a reference loop (seconds per call) and the kernels multiply in
    # float32, so the float32 products are the reference there
    bf16_dot = bf16 and "bfloat16: oneDNN" in _products()
    if bf16 and not bf16_dot:
        print("(no bfloat16 dot product here: bare products in float32, as the kernels run them)")
    blas_names = [] if bf16_dot else [f"bare BLAS: the same products, {n} thread{'s' * (n > 1)}"
                                      for n in sorted({cores(), 1}, reverse=True)]
    for name in blas_names:
        train.append((name, bare_blas(shapes, rng, int(name.split(", ")[1].split()[0]))))
    onednn_name = f"bare oneDNN {'bf16 GEMM' if bf16_dot else 'sgemm'}: the same products, 1 thread"
    train.append((onednn_name, bare_onednn(shapes, rng, "bfloat16" if bf16_dot else "float32")))
    if args.pynative:
        def pynative():
            ms.set_context(mode=ms.PYNATIVE_MODE)
            try:
                return sync(ms.grad(lambda a: (layer(a) * cot).sum(), 0,
                                    layer.trainable_params())(x))
            finally:
                ms.set_context(mode=ms.GRAPH_MODE)
        train.append(("ms_moe_ops MoELayer (PyNative)", pynative))
    if args.composed:
        composed = ComposedMoE(layer)
        composed_step = ForwardBackward(composed)
        fwd.append(("MindSpore ops composed (GRAPH)", lambda: composed(x).asnumpy()))
        train.append(("MindSpore ops composed (GRAPH)", lambda: sync(composed_step(x, cot))))

    print_table("forward", timed_together(fwd, args.repeats), fwd_flops, ours_name)
    rows = timed_together(train, args.repeats)
    print_table("forward + backward", rows, train_flops, ours_name)
    theirs = rows[theirs_name]
    print(f"\nload average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} at the end")
    print(f"the layer reaches {rows[onednn_name] / rows[ours_name]:.0%} of the GFLOP/s of its "
          f"products as bare oneDNN calls on one thread")
    if bf16:
        print(f"goal: forward+backward {theirs / rows[ours_name]:.2f}x transformers in bfloat16 "
              f"(>= 1.5x, 2x wanted)")
        record_goal(args, "layer-transformers-bf16", rows[ours_name] * 1e3, theirs * 1e3, "ms",
                    theirs / rows[ours_name])
        return
    # the faster bare run of the products is the reference (OpenBLAS on 2 threads or 1, oneDNN)
    blas = min(rows[name] for name in blas_names + [onednn_name])
    print(f"goals: forward+backward {theirs / rows[ours_name]:.2f}x "
          f"transformers (>= 2.0x); {blas / rows[ours_name]:.0%} of the bare-BLAS GFLOP/s (>= 60%)")
    record_goal(args, "layer-transformers", rows[ours_name] * 1e3, theirs * 1e3, "ms",
                theirs / rows[ours_name])
    record_goal(args, "layer-sgemm", rows[ours_name] * 1e3, blas * 1e3, "ms", blas / rows[ours_name])


def _no_grad(torch, block, x):
    with torch.no_grad():
        return block(x)


if __name__ == "__main__":
    main()
