"""Dropless routing against an expert capacity as the router's imbalance grows: the time and the
memory of one training step of a MoELayer (GRAPH mode, float32, forward + backward + SGD).

The imbalance is made, not waited for: a share p of the tokens is pushed towards expert 0 (their
first choice), so expert 0 gets about p*T + (1-p)*T*K/E of the T*K (token, slot) pairs: the
imbalance (max / mean pairs per expert) grows from 1 to E/K as p goes from 0 to 1, as in a router
collapse early in training. Contenders at each point, on the same weights and tokens:
- dropless: every pair to its expert;
- capacity: capacity_factor 1.0 ("probs"), the pairs past ceil(T*K/E) of an expert dropped;
- padded: the same, every expert padded to exactly its capacity (static shapes).

Time: the three in turns, round after round, in one process (common.timed_together): compare
the ratios of one run. Memory: each contender and point in a process of its own, the growth of
its peak resident memory (VmHWM, reset after compiling) over two steps: what the steps take
from MindSpore's CPU memory pool beyond what the compiled process holds.

    python benchmarks/bench_capacity.py --csv benchmarks/capacity.csv --plot benchmarks/capacity.png
    python benchmarks/bench_capacity.py --from-csv benchmarks/capacity.csv --plot out.png
"""
import argparse
import csv
import json
import os
import subprocess
import sys

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

from common import timed_together
from ms_moe_ops import MoELayer, dropped_fraction, load_imbalance, update_expert_bias

CONTENDERS = {"dropless": dict(),
              "capacity": dict(capacity_factor=1.0),
              "padded": dict(capacity_factor=1.0, pad_to_capacity=True)}
SHARES = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)
FIELDS = ("share", "contender", "imbalance", "dropped", "busiest_rows", "ms", "mib")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--shares", type=float, nargs="+", default=SHARES,
                    help="shares of the tokens pushed to expert 0")
    ap.add_argument("--repeat", type=int, default=5, help="timed rounds")
    ap.add_argument("--csv", default=None, help="write the rows here")
    ap.add_argument("--plot", default=None, help="PNG of time and memory against the imbalance")
    ap.add_argument("--from-csv", default=None, help="no measurement: plot an earlier --csv")
    ap.add_argument("--memory-of", nargs=2, metavar=("CONTENDER", "SHARE"),
                    help=argparse.SUPPRESS)  # one memory measurement (a process of its own)
    return ap.parse_args(argv)


def batch(args, share):
    """(layer weights, x, target): tokens of which `share` prefer expert 0 first."""
    rng = np.random.default_rng(0)
    h, e = args.hidden, args.experts
    router = rng.normal(0, 0.02, (e, h)).astype(np.float32)
    x = rng.normal(0, 1, (args.tokens, h)).astype(np.float32)
    pushed = int(round(share * args.tokens))
    x[:pushed] += 40 * router[0] / np.linalg.norm(router[0])  # expert 0's logit up by ~0.8
    weights = {"router.weight": router}
    target = rng.normal(0, 1, x.shape).astype(np.float32)
    return weights, x, target


def training_step(args, name, share):
    """(step, x, target, layer) of one contender at one point, compiled (not run)."""
    layer = MoELayer(args.hidden, args.ffn, args.experts, args.top_k, bias_update_rate=0.0,
                     **CONTENDERS[name])
    rng = np.random.default_rng(1)
    weights, x, target = batch(args, share)
    for pname, p in layer.parameters_and_names():
        if pname in weights:
            p.set_data(Tensor(weights[pname]))
        elif p.requires_grad:
            p.set_data(Tensor(rng.normal(0, 0.05, p.shape).astype(np.float32)))
    step = nn.TrainOneStepCell(nn.WithLossCell(layer, nn.MSELoss()),
                               nn.SGD(layer.trainable_params(), learning_rate=1e-3))
    x, target = Tensor(x), Tensor(target)
    step.compile(x, target)
    return step, x, target, layer


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # MiB
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_of(args, name, share):
    """MiB the process's peak resident memory grows by over two steps (after compiling)."""
    step, x, target, _ = training_step(args, name, float(share))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the resident memory now
    before = _status("VmRSS")
    for _ in range(2):
        step(x, target).asnumpy()
    return _status("VmHWM") - before


def measure(args):
    rows = []
    for share in args.shares:
        contenders, stats = [], {}
        for name in CONTENDERS:
            step, x, target, layer = training_step(args, name, share)
            step(x, target).asnumpy()
            loads = update_expert_bias(layer)[0]
            capacity = -(-args.tokens * args.top_k // args.experts)  # factor 1.0
            busiest = loads.max() if name == "dropless" else min(loads.max(), capacity)
            stats[name] = (load_imbalance(loads)[0], dropped_fraction(layer)[0], busiest)
            contenders.append((name, lambda s=step, a=x, b=target: s(a, b).asnumpy()))
        times = timed_together(contenders, repeat=args.repeat)
        for name in CONTENDERS:
            mib = _memory_in_a_process(args, name, share)
            imbalance, dropped, busiest = stats[name]
            rows.append(dict(share=share, contender=name, imbalance=f"{imbalance:.3f}",
                             dropped=f"{dropped:.4f}", busiest_rows=int(busiest),
                             ms=f"{times[name] * 1e3:.1f}", mib=f"{mib:.1f}"))
            print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    return rows


def _memory_in_a_process(args, name, share):
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-of", name, str(share),
           "--tokens", str(args.tokens), "--hidden", str(args.hidden), "--ffn", str(args.ffn),
           "--experts", str(args.experts), "--top-k", str(args.top_k)]
    env = dict(os.environ, GLOG_v="3")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["mib"]


def plot(rows, path):
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    dropless = {r["share"]: r for r in rows if r["contender"] == "dropless"}
    for name in CONTENDERS:
        mine = [r for r in rows if r["contender"] == name]
        x = [float(dropless[r["share"]]["imbalance"]) for r in mine]
        # the time as a ratio to the dropless step of the same rounds: the load cancels out
        axes[0].plot(x, [float(r["ms"]) / float(dropless[r["share"]]["ms"]) for r in mine],
                     marker="o", label=name)
        for ax, field in zip(axes[1:], ("mib", "busiest_rows")):
            ax.plot(x, [float(r[field]) for r in mine], marker="o", label=name)
    for ax, label in zip(axes, ("time per step / dropless's", "memory per step (MiB)",
                                "rows of the busiest expert")):
        ax.set_xlabel("router imbalance (max / mean pairs per expert)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("MoELayer training step: dropless against capacity_factor=1.0")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    args = parse_args(argv)
    ms.set_context(mode=ms.GRAPH_MODE)
    if args.memory_of:
        print(json.dumps({"mib": memory_of(args, *args.memory_of)}))
        return
    if args.from_csv:
        with open(args.from_csv, newline="") as f:
            rows = list(csv.DictReader(f))
    else:
        print(f"T={args.tokens} H={args.hidden} F={args.ffn} E={args.experts} K={args.top_k}, "
              f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
        rows = measure(args)
    for row in rows:
        row["share"] = float(row["share"])
    if args.csv and not args.from_csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)
    by = {(r["share"], r["contender"]): r for r in rows}
    print("\nimbalance  dropped  capacity/dropless time  padded/dropless time  memory MiB "
          "(dropless, capacity, padded)")
    for share in sorted({r["share"] for r in rows}):
        d, c, p = (by[(share, n)] for n in CONTENDERS)
        print(f"{float(d['imbalance']):9.2f}  {float(c['dropped']):7.3f}  "
              f"{float(c['ms']) / float(d['ms']):22.2f}  {float(p['ms']) / float(d['ms']):20.2f}"
              f"  {d['mib']}, {c['mib']}, {p['mib']}")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
