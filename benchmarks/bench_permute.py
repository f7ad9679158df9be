"""Token permutation: ms_moe_ops vs the same maths composed from MindSpore ops vs numpy.

Default shape: T=8192 tokens, H=2048, K=8 experts per token out of E=64. GB/s counts the bytes a
kernel must move: permute reads and writes T*K rows, unpermute reads T*K rows and writes T.
"""
import argparse

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from ms_moe_ops import reference as ref
from ms_moe_ops.ops import moe_token_permute, moe_token_unpermute
from common import report, timeit


class OursPermute(nn.Cell):
    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def construct(self, x, idx):
        return moe_token_permute(x, idx, self.experts)


class OursUnpermute(nn.Cell):
    def construct(self, permuted, sorted_index, probs):
        return moe_token_unpermute(permuted, sorted_index, probs)


class OursLoss(nn.Cell):
    """permute -> (experts) -> weighted unpermute, for forward + backward."""

    def __init__(self, experts):
        super().__init__()
        self.permute = OursPermute(experts)

    def construct(self, x, idx, probs, c):
        permuted, sorted_index, _ = self.permute(x, idx)
        return (moe_token_unpermute(permuted, sorted_index, probs) * c).sum()


class ComposedPermute(nn.Cell):
    """What a user writes without this package: a sort by (expert, slot), gathers and scatters."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def construct(self, x, idx):
        t, k = idx.shape
        n = t * k
        flat = idx.reshape(-1)
        slot = ops.arange(n, dtype=ms.int32)
        # unique keys make any sort stable; exact in float32 while E*T*K < 2**24
        _, order = ops.sort((flat * n + slot).astype(ms.float32))
        permuted = ops.gather(x, order // k, 0)
        sorted_index = ops.scatter_nd(order.reshape(-1, 1), slot, (n,))
        counts = ops.scatter_nd(flat.reshape(-1, 1).astype(ms.int32), ops.ones((n,), ms.int32),
                                (self.experts,)).astype(ms.int64)
        return permuted, sorted_index, counts


class ComposedUnpermute(nn.Cell):
    def construct(self, permuted, sorted_index, probs):
        t, k = probs.shape
        rows = ops.gather(permuted, sorted_index, 0).reshape(t, k, -1)
        return (rows * probs.reshape(t, k, 1).astype(rows.dtype)).sum(1)


class ComposedLoss(nn.Cell):
    def __init__(self, experts):
        super().__init__()
        self.permute = ComposedPermute(experts)
        self.unpermute = ComposedUnpermute()

    def construct(self, x, idx, probs, c):
        permuted, sorted_index, _ = self.permute(x, idx)
        return (self.unpermute(permuted, sorted_index, probs) * c).sum()


def numpy_permute(x, idx):
    k = idx.shape[1]
    order = np.argsort(idx.reshape(-1), kind="stable")
    sorted_index = np.empty(order.size, np.int32)
    sorted_index[order] = np.arange(order.size, dtype=np.int32)
    return x[order // k], sorted_index


def numpy_unpermute(permuted, sorted_index, probs):
    t, k = probs.shape
    return np.einsum("tkh,tk->th", permuted[sorted_index].reshape(t, k, -1), probs)


def numpy_loss_grad(x, idx, probs, c):
    """Forward and backward of (unpermute(permute(x), probs) * c).sum() with respect to x, probs."""
    t, k = probs.shape
    permuted, sorted_index = numpy_permute(x, idx)
    rows = permuted[sorted_index].reshape(t, k, -1)
    np.einsum("tkh,tk->th", rows, probs)  # forward output (the loss needs only its gradient c)
    g_probs = np.einsum("tkh,th->tk", rows, c)
    d_permuted = np.empty_like(permuted)
    d_permuted[sorted_index] = (probs[..., None] * c[:, None, :]).reshape(t * k, -1)
    g_x = d_permuted[sorted_index].reshape(t, k, -1).sum(1)
    return g_x, g_probs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--t", type=int, default=8192)
    p.add_argument("--h", type=int, default=2048)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--e", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    a = p.parse_args()
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    rng = np.random.default_rng(0)
    npd = np.dtype(a.dtype)
    es = npd.itemsize
    x = rng.normal(size=(a.t, a.h)).astype(npd)
    idx = np.array([rng.choice(a.e, a.k, replace=False) for _ in range(a.t)], np.int32)
    probs = rng.uniform(size=(a.t, a.k)).astype(np.float32)
    c = rng.normal(size=(a.t, a.h)).astype(npd)
    xt, it, pt, ct = Tensor(x), Tensor(idx), Tensor(probs), Tensor(c)

    ours_p, comp_p = OursPermute(a.e), ComposedPermute(a.e)
    ours_u, comp_u = OursUnpermute(), ComposedUnpermute()
    ours_g = ms.grad(OursLoss(a.e), grad_position=(0, 2))
    comp_g = ms.grad(ComposedLoss(a.e), grad_position=(0, 2))

    # agreement (also compiles every graph)
    perm, sidx, counts = ours_p(xt, it)
    cperm, csidx, ccounts = comp_p(xt, it)
    _, rsidx, rcounts = ref.moe_token_permute(x[:1].repeat(a.t, 0), idx, a.e)
    assert (sidx.asnumpy() == rsidx).all() and (csidx.asnumpy() == rsidx).all()
    assert (counts.asnumpy() == rcounts).all() and (ccounts.asnumpy() == rcounts).all()
    assert np.array_equal(perm.asnumpy(), cperm.asnumpy())
    out, cout = ours_u(perm, sidx, pt).asnumpy(), comp_u(perm, sidx, pt).asnumpy()
    g_ours = [g.asnumpy() for g in ours_g(xt, it, pt, ct)]
    g_comp = [g.asnumpy() for g in comp_g(xt, it, pt, ct)]
    print(f"T={a.t} H={a.h} K={a.k} E={a.e} {a.dtype}; max |ours - composed|: unpermute "
          f"{np.abs(out.astype(np.float64) - cout).max():.2e}, grads "
          f"{max(np.abs(u.astype(np.float64) - v).max() for u, v in zip(g_ours, g_comp)):.2e}")

    rows_bytes = a.t * a.k * a.h * es
    perm_np = perm.asnumpy()
    sidx_np = sidx.asnumpy()

    def gbs(nbytes):
        return lambda s: f"{nbytes / s / 1e9:6.2f} GB/s"

    def table(title, fns, nbytes):
        rate = gbs(nbytes)
        rows = [(name, s, rate(s)) for name, s in ((n, timeit(f, repeat=5)) for n, f in fns)]
        report(title, rows, "ms_moe_ops (GRAPH)")

    table("moe_token_permute (forward)", [
        ("ms_moe_ops (GRAPH)", lambda: ours_p(xt, it)[0].asnumpy()),
        ("MindSpore ops composed (GRAPH)", lambda: comp_p(xt, it)[0].asnumpy()),
        ("numpy", lambda: numpy_permute(x, idx)),
    ], 2 * rows_bytes)
    table("moe_token_unpermute with probs (forward)", [
        ("ms_moe_ops (GRAPH)", lambda: ours_u(perm, sidx, pt).asnumpy()),
        ("MindSpore ops composed (GRAPH)", lambda: comp_u(perm, sidx, pt).asnumpy()),
        ("numpy", lambda: numpy_unpermute(perm_np, sidx_np, probs)),
    ], rows_bytes + a.t * a.h * es)
    # forward + backward moves: permute 2R, unpermute R, d_permuted 2R (read permuted, write),
    # unpermute of d_permuted into dx R
    table("permute -> weighted unpermute, forward + backward", [
        ("ms_moe_ops (GRAPH)", lambda: [g.asnumpy() for g in ours_g(xt, it, pt, ct)]),
        ("MindSpore ops composed (GRAPH)", lambda: [g.asnumpy() for g in comp_g(xt, it, pt, ct)]),
        ("numpy", lambda: numpy_loss_grad(x, idx, probs, c)),
    ], 6 * rows_bytes)


if __name__ == "__main__":
    main()
