"""MoELayer forward + backward with the experts split over 2 processes (msrun, the AllReduce
exchange on CPU) against 1 process holding them all, on the same global batch; and the bytes
each process exchanges per step.

n=1: one process, all E experts, the global batch of 2T tokens (its default threads).
n=2: two processes launched with msrun, E/2 experts and T tokens each (one thread each: one core
per rank, as one device per rank). tokens/s = 2T / step time. The two run in turns, --rounds
times, so that load changes on the machine hit both; each round reports its median step.

    python benchmarks/bench_ep.py                       # T=2048 per process, H=512 F=256 E=16 K=4
    python benchmarks/bench_ep.py --tokens 512 --rounds 1
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from common import report, timeit
from ms_moe_ops import MoELayer
from ms_moe_ops.parallel import ExpertParallel, msrun


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per process (T)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=2, help="turns of n=1 then n=2")
    # a worker of a run with n processes (msrun's own options take every prefix of --worker)
    ap.add_argument("--run-as", type=int, choices=(1, 2), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def worker(args):
    """One timed run with n = args.run_as processes; rank 0 writes its result to args.result."""
    ms.set_device("CPU")
    n, ep, rank = args.run_as, None, 0
    if n > 1:
        from mindspore.communication import init

        init()
        ep = ExpertParallel()
        rank = ep.rank
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)
    h, e, k = args.hidden, args.experts, args.top_k
    tokens = args.tokens * (2 // n)  # this process's share of the global batch 2T
    layer = MoELayer(h, args.ffn, e, k, expert_parallel=ep)
    rng = np.random.default_rng(0)
    layer.router.weight.set_data(Tensor(rng.normal(0, 0.05, (e, h)).astype(np.float32)))
    data = np.random.default_rng(1 + rank)
    x = Tensor(data.normal(0, 1, (tokens, h)).astype(np.float32))
    cot = Tensor(data.normal(0, 1, (tokens, h)).astype(np.float32))
    step = ForwardBackward(layer)

    def run():
        for g in step(x, cot)[1]:
            g.asnumpy()

    seconds = timeit(run, repeat=args.repeats)
    result = dict(n=n, seconds=seconds, tokens=2 * args.tokens)
    if ep is not None:
        result.update(exchanged_bytes(layer, x, ep))
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(result, f)


class _Objective(nn.Cell):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def construct(self, x, cot):
        return (self.layer(x) * cot).sum()


class ForwardBackward(nn.Cell):
    """Gradients of sum(layer(x) * cot) with respect to (x, cot) and the weights."""

    def __init__(self, layer):
        super().__init__()
        self.objective = _Objective(layer)
        self.grad = ops.GradOperation(get_all=True, get_by_list=True)
        self.weights = ms.ParameterTuple(layer.trainable_params())

    def construct(self, x, cot):
        return self.grad(self.objective, self.weights)(x, cot)


def exchanged_bytes(layer, x, ep):
    """Bytes this process exchanges per forward+backward step, from the routing of x (rank 0's
    view; the rows routed off-rank are averaged over the ranks)."""
    _, expert_idx = layer.router(x)
    local = layer.num_experts // ep.size
    owner = expert_idx.asnumpy() // local
    off_rank = float((owner != ep.rank).sum())
    off_rank = float(ops.AllReduce(group=ep.group)(ms.Tensor([off_rank], ms.float32)).asnumpy()[0])
    off_rank /= ep.size
    rows, h = expert_idx.size, x.shape[1]
    f32 = 4
    return dict(
        # AlltoAllV: the rows that leave the process, there and back, forward and backward
        alltoallv=4 * off_rank * h * f32,
        # the AllReduce exchange: four all-reduces of an [n * T * K, H] buffer per step
        allreduce=4 * ep.size * rows * h * f32,
        # every rank's per-expert counts (AllGather, int64) and the router's load (AllReduce)
        counts=ep.size * layer.num_experts * 8 + layer.num_experts * 4,
        off_rank_rows=off_rank, routed_rows=rows)


def launch(args, n, out_dir):
    """Runs one round of n processes; returns rank 0's result."""
    result = os.path.join(out_dir, f"n{n}.json")
    cmd = [os.path.abspath(__file__), "--run-as", str(n), "--result", result]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k in ("tokens", "hidden", "ffn", "experts", "top_k", "repeats")]
    if n == 1:
        subprocess.run([sys.executable] + cmd, check=True, timeout=1200, cwd=out_dir,
                       env=dict(os.environ, GLOG_v="3"))
    else:
        one_core = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        msrun(cmd[0], cmd[1:], workers=n, timeout=1200, log_dir=os.path.join(out_dir, f"round{n}"),
              env=one_core)
    with open(result) as f:
        return json.load(f)


def main():
    args = parse_args()
    if args.run_as:
        return worker(args)

    runs = {1: [], 2: []}
    with tempfile.TemporaryDirectory(prefix="bench_ep_") as out_dir:
        for _ in range(args.rounds):
            for n in (1, 2):
                runs[n].append(launch(args, n, out_dir))
    seconds = {n: float(np.median([r["seconds"] for r in rs])) for n, rs in runs.items()}
    tokens = 2 * args.tokens
    print(f"MoELayer forward+backward, global batch {tokens} tokens, H={args.hidden} "
          f"F={args.ffn} E={args.experts} K={args.top_k}, float32, GRAPH mode "
          f"(median of {args.rounds} rounds x {args.repeats} steps)")
    for n, rs in runs.items():
        print(f"  n={n}: rounds " + ", ".join(f"{r['seconds'] * 1e3:.1f} ms" for r in rs))
    one = f"n=1 (1 process, {args.experts} experts)"
    report("tokens/s", [(one, seconds[1], f"{tokens / seconds[1]:.0f} tokens/s"),
                        (f"n=2 (2 processes, {args.experts // 2} experts each)", seconds[2],
                         f"{tokens / seconds[2]:.0f} tokens/s")], one)
    b = runs[2][-1]
    mb = 1 / 2 ** 20
    print(f"\nbytes exchanged per step and process (n=2): {b['off_rank_rows']:.0f} of "
          f"{b['routed_rows']} routed rows go to the other process")
    for what, value in (
            ("AlltoAllV (Ascend), rows there and back, forward and backward",
             f"{b['alltoallv'] * mb:8.2f} MiB"),
            ("AllReduce exchange (CPU), 4 all-reduced buffers", f"{b['allreduce'] * mb:8.2f} MiB"),
            ("counts (AllGather + the router's AllReduce)", f"{b['counts']:8d} bytes")):
        print(f"  {what:<64} {value}")


if __name__ == "__main__":
    main()
