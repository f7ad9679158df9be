"""Router forward+backward: ms_moe_ops vs the same maths in torch autograd (CPU), composed from
MindSpore ops, and in numpy; all in turns, medians of the rounds.

Default shape: M=16384 tokens, N=256 experts, K=8, 8 groups of which the best 4 are kept
(DeepSeek-V3 routing). The input is the router's logits (the projection is a plain matmul).
"""
import argparse
import os
import sys

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from ms_moe_ops import moe_gating_top_k
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_record_arguments, cores, record_goal, timed_together  # noqa: E402


class Ours(nn.Cell):
    def __init__(self, k, groups, top_groups):
        super().__init__()
        self.k, self.groups, self.top_groups = k, groups, top_groups

    def construct(self, x, bias, c):
        y, _, _ = moe_gating_top_k(x, self.k, bias, k_group=self.top_groups, group_count=self.groups,
                                   group_select_mode=1, routed_scaling_factor=2.5)
        return (y * c).sum()


class Composed(nn.Cell):
    """What a user writes without this package (DeepSeek-V3 reference router in MindSpore ops)."""

    def __init__(self, k, groups, top_groups):
        super().__init__()
        self.k, self.groups, self.top_groups = k, groups, top_groups

    def construct(self, x, bias, c):
        m, n = x.shape
        scores = ops.sigmoid(x)
        choice = ops.stop_gradient(scores + bias)
        grouped = choice.reshape(m, self.groups, n // self.groups)
        group_scores = ops.topk(grouped, 2)[0].sum(-1)
        _, keep = ops.topk(group_scores, self.top_groups)
        mask = ops.zeros((m, self.groups), ms.float32).scatter(1, keep, ops.ones_like(keep).astype(ms.float32))
        mask = mask.reshape(m, self.groups, 1).broadcast_to((m, self.groups, n // self.groups)).reshape(m, n)
        choice = ops.masked_fill(choice, mask == 0, float("-inf"))
        _, idx = ops.topk(choice, self.k)
        w = ops.gather_elements(scores, 1, idx)
        y = w / (w.sum(-1, keepdims=True) + 1e-20) * 2.5
        return (y * c).sum()


def numpy_forward_backward(x, bias, c, k, groups, top_groups):
    m, n = x.shape
    s = 1 / (1 + np.exp(-x))
    choice = (s + bias).reshape(m, groups, n // groups)
    gscore = np.sort(choice, -1)[..., -2:].sum(-1)
    drop = np.argsort(-gscore, -1, kind="stable")[:, top_groups:]
    np.put_along_axis(choice, drop[..., None].repeat(n // groups, -1), -np.inf, 1)
    idx = np.argsort(-choice.reshape(m, n), -1, kind="stable")[:, :k]
    w = np.take_along_axis(s, idx, 1)
    d = w.sum(-1, keepdims=True) + 1e-20
    g = 2.5 * c
    gw = (g - (w / d * g).sum(-1, keepdims=True)) / d
    gx = np.zeros_like(s)
    np.put_along_axis(gx, idx, gw, 1)
    return gx * s * (1 - s)


def torch_router(torch, k, groups, top_groups):
    """d/dx sum(router(x) * c) in torch autograd: transformers' DeepSeek-V3 router maths."""
    def run(x, bias, c):
        x = x.detach().requires_grad_(True)
        m, n = x.shape
        scores = x.sigmoid()
        choice = (scores + bias).detach()
        group_scores = choice.view(m, groups, n // groups).topk(2, dim=-1)[0].sum(-1)
        keep = group_scores.topk(top_groups, dim=-1)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0)
        mask = mask.unsqueeze(-1).expand(m, groups, n // groups).reshape(m, n)
        idx = choice.masked_fill(mask == 0, float("-inf")).topk(k, dim=-1)[1]
        w = scores.gather(1, idx)
        y = w / (w.sum(-1, keepdim=True) + 1e-20) * 2.5
        (y * c).sum().backward()
        return x.grad
    return run


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--top-groups", type=int, default=4)
    p.add_argument("--repeat", type=int, default=7)
    add_record_arguments(p)
    a = p.parse_args()
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    import torch  # pylint: disable=import-outside-toplevel

    torch.set_num_threads(cores())  # MindSpore sets OMP_NUM_THREADS=1 when imported
    rng = np.random.default_rng(0)
    x = rng.normal(size=(a.m, a.n)).astype(np.float32)
    bias = rng.normal(scale=0.01, size=a.n).astype(np.float32)
    c = rng.normal(size=(a.m, a.k)).astype(np.float32)
    xt, bt, ct = Tensor(x), Tensor(bias), Tensor(c)
    xp, bp, cp = torch.from_numpy(x), torch.from_numpy(bias), torch.from_numpy(c)
    cfg = (a.k, a.groups, a.top_groups)
    ours = ms.grad(Ours(*cfg))
    composed = ms.grad(Composed(*cfg))
    theirs = torch_router(torch, *cfg)
    g_ours = ours(xt, bt, ct).asnumpy()
    g_comp = composed(xt, bt, ct).asnumpy()
    g_np = numpy_forward_backward(x, bias, c, *cfg)
    g_torch = theirs(xp, bp, cp).numpy()
    print(f"M={a.m} N={a.n} K={a.k} groups={a.groups}/{a.top_groups}, {cores()} cores; max |ours - "
          f"composed| = {np.abs(g_ours - g_comp).max():.2e}, |ours - numpy| = "
          f"{np.abs(g_ours - g_np).max():.2e}, |ours - torch| = {np.abs(g_ours - g_torch).max():.2e}")
    ours_name = "ms_moe_ops (GRAPH)"
    times = timed_together([
        (ours_name, lambda: ours(xt, bt, ct).asnumpy()),
        ("torch autograd", lambda: theirs(xp, bp, cp)),
        ("MindSpore ops composed (GRAPH)", lambda: composed(xt, bt, ct).asnumpy()),
        ("numpy", lambda: numpy_forward_backward(x, bias, c, *cfg)),
    ], a.repeat)
    print(f"\nrouter forward + backward (median of {a.repeat} rounds, contenders in turns)")
    for name, sec in times.items():
        ratio = "" if name == ours_name else f"ms_moe_ops is {sec / times[ours_name]:5.2f}x as fast"
        print(f"  {name:<34} {sec * 1e3:9.2f} ms  {ratio}")
    torch_s = times["torch autograd"]
    record_goal(a, "router-torch", times[ours_name] * 1e3, torch_s * 1e3, "ms",
                torch_s / times[ours_name])


if __name__ == "__main__":
    main()
