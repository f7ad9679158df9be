"""How MoELayer's forward+backward time grows with the tokens T (1k to 16k) and with the experts E
(8 to 256 at fixed active FLOPs: T, K, H and F fixed, so every token does the same work), side by
side with transformers' DeepseekV3MoE on the same weights (see bench_layer.py).

    python benchmarks/bench_scaling.py [--plot benchmarks/scaling.png] [--csv benchmarks/scaling.csv]
    python benchmarks/bench_scaling.py --dtypes float32 bfloat16   # both (bfloat16: AMP O2 / .to(bf16))
    python benchmarks/bench_scaling.py --sweeps tokens       # one sweep only
    python benchmarks/bench_scaling.py --from-csv benchmarks/scaling.csv --plot out.png

Prints one table per sweep (ms per step, tokens/s, useful GFLOP/s, time relative to the first row,
and DeepseekV3MoE's time as a ratio); --csv keeps the rows, --plot draws both sweeps.
"""
import argparse
import csv
import os
import sys
from types import SimpleNamespace

import numpy as np
import mindspore as ms
from mindspore import Tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import (ForwardBackward, deepseek_block, in_dtype, our_layer,  # noqa: E402
                         product_shapes, sync, torch_step)
from common import cores, timed_together  # noqa: E402


def measure(tokens, experts, a, rng, dtype):
    """(ours seconds, DeepseekV3MoE seconds, useful flops) of one forward+backward in dtype."""
    shape = SimpleNamespace(hidden=a.hidden, ffn=a.ffn, experts=experts, top_k=a.top_k,
                            shared=a.shared)
    block, config, torch = deepseek_block(shape, rng)
    layer = our_layer(block, config)
    x_np = rng.normal(0, 1, (tokens, a.hidden)).astype(np.float32)
    cot_np = rng.normal(0, 1, (tokens, a.hidden)).astype(np.float32)
    layer, block, x, cot, xt, cott = in_dtype(dtype, layer, block, torch, x_np, cot_np)
    step = ForwardBackward(layer)
    times = timed_together([
        ("ours", lambda: sync(step(x, cot))),
        ("torch", torch_step(torch, block, xt, cott))], a.repeats)
    # the useful flops depend on the routed rows T*K only, not on how they are split
    counts = np.full(experts, tokens * a.top_k / experts)
    flops = sum(2 * m * k * n for m, k, n in
                product_shapes(tokens, a.hidden, a.ffn, counts, a.ffn * a.shared))
    return times["ours"], times["torch"], flops


def sweep(title, points, a, rng, dtype):
    rows = []
    print(f"\n{title}, {dtype}")
    print(f"  {'T':>6} {'E':>4} {'ms':>9} {'tokens/s':>9} {'GFLOP/s':>8} {'vs first':>9} "
          f"{'DeepseekV3MoE ms':>17} {'ms_moe_ops is':>14}")
    for tokens, experts in points:
        ours, theirs, flops = measure(tokens, experts, a, rng, dtype)
        first = rows[0]["ours_ms"] / 1e3 if rows else ours
        row = dict(sweep=title.split()[0], dtype=dtype, tokens=tokens, experts=experts, ours_ms=ours * 1e3,
                   torch_ms=theirs * 1e3, gflops=flops / ours / 1e9, speedup=theirs / ours)
        rows.append(row)
        print(f"  {tokens:>6} {experts:>4} {ours * 1e3:9.1f} {tokens / ours:9.0f} "
              f"{row['gflops']:8.1f} {ours / first:8.2f}x {theirs * 1e3:17.1f} "
              f"{theirs / ours:8.2f}x faster")
    return rows


def plot(rows, path):
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, name, key, label in ((axes[0], "tokens", "tokens", "tokens T"),
                                 (axes[1], "experts", "experts", "experts E (fixed active FLOPs)")):
        for dtype, color in (("float32", "tab:blue"), ("bfloat16", "tab:orange")):
            part = [r for r in rows if r["sweep"] == name and r.get("dtype", "float32") == dtype]
            if not part:
                continue
            xs = [r[key] for r in part]
            ax.plot(xs, [r["ours_ms"] for r in part], "o-", color=color,
                    label=f"ms_moe_ops MoELayer, {dtype}")
            ax.plot(xs, [r["torch_ms"] for r in part], "s--", color=color,
                    label=f"transformers DeepseekV3MoE, {dtype}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("forward+backward, ms")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_title("time grows with T")
    axes[1].set_title("time against E")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--shared", type=int, default=1)
    ap.add_argument("--experts", type=int, default=16, help="E of the token sweep")
    ap.add_argument("--tokens", type=int, default=4096, help="T of the expert sweep")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                    help="bfloat16: both layers in mixed precision (AMP O2 / .to(torch.bfloat16))")
    ap.add_argument("--plot", default=None, help="PNG of both sweeps")
    ap.add_argument("--csv", default=None, help="the rows as CSV")
    ap.add_argument("--sweeps", nargs="+", default=["tokens", "experts"],
                    choices=["tokens", "experts"], help="which sweeps to run")
    ap.add_argument("--from-csv", default=None,
                    help="no measurement: the rows of an earlier --csv (e.g. to --plot them)")
    a = ap.parse_args()
    if a.from_csv:
        with open(a.from_csv, newline="", encoding="utf-8") as f:
            rows = [{k: v if k in ("sweep", "dtype") else float(v) for k, v in r.items()}
                    for r in csv.DictReader(f)]
        if a.plot:
            plot(rows, a.plot)
        return
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)
    rng = np.random.default_rng(0)
    print(f"MoELayer forward+backward, H={a.hidden} F={a.ffn} K={a.top_k} shared={a.shared}, "
          f"{' and '.join(a.dtypes)}, GRAPH mode, {cores()} cores; median of {a.repeats} rounds, "
          f"in turns; load average {os.getloadavg()[0]:.2f}")
    rows = []
    for dtype in a.dtypes:
        if "tokens" in a.sweeps:
            rows += sweep("tokens (E fixed)",
                          [(t, a.experts) for t in (1024, 2048, 4096, 8192, 16384)], a, rng, dtype)
        if "experts" in a.sweeps:
            rows += sweep("experts (T, K, F fixed: same active FLOPs)",
                          [(a.tokens, e) for e in (8, 16, 32, 64, 128, 256)], a, rng, dtype)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    if a.csv:
        with open(a.csv, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    if a.plot:
        plot(rows, a.plot)


if __name__ == "__main__":
    main()
