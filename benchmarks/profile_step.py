"""Where a MoELayer training step spends its time, operator by operator (MindSpore's profiler).

The step is bench_layer.py's: forward + backward of the DeepseekV3MoE-shaped layer in GRAPH mode,
in float32 or as users train in bfloat16 (`ms.amp.auto_mixed_precision(layer, "O2",
dtype=ms.bfloat16)` on bfloat16 tokens). Each contender (a name and environment settings, e.g.
MS_MOE_OPS_ONEDNN=0 for float32 products) is profiled over the same steps in a process of its
own; the table gives each operator's time per step, grouped by what it does (this package's
kernels by their entry point, MindSpore's own operators by type), side by side.

    python benchmarks/profile_step.py --dtype bfloat16          # oneDNN products against none
    python benchmarks/profile_step.py --dtype float32 --steps 5
    python benchmarks/profile_step.py --contender "before:PYTHONPATH=../main" --contender after
"""
import argparse
import csv
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_WORKER = r'''
import json, os, sys
import numpy as np
import mindspore as ms
from mindspore import Tensor
sys.path.insert(0, sys.argv[1])
from bench_layer import ForwardBackward, deepseek_block, our_layer, sync
a = json.loads(sys.argv[2])
ms.set_device("CPU")
ms.set_context(mode=ms.GRAPH_MODE, save_graphs=2, save_graphs_path=a["out"] + "/ir")
ms.set_seed(0)
args = argparse = type("A", (), dict(hidden=a["hidden"], ffn=a["ffn"], experts=a["experts"],
                                    top_k=a["top_k"], shared=a["shared"]))
rng = np.random.default_rng(0)
block, config, _ = deepseek_block(args, rng)
layer = our_layer(block, config)
x = rng.normal(0, 1, (a["tokens"], a["hidden"])).astype(np.float32)
cot = Tensor(rng.normal(0, 1, (a["tokens"], a["hidden"])).astype(np.float32))
if a["dtype"] == "bfloat16":
    layer = ms.amp.auto_mixed_precision(layer, "O2", dtype=ms.bfloat16)
    x = Tensor(x, ms.bfloat16)
else:
    x = Tensor(x)
step = ForwardBackward(layer)
import ms_moe_ops
with open(os.path.join(a["out"], "package.txt"), "w") as f:
    f.write(os.path.dirname(ms_moe_ops.__file__))
import time
for _ in range(2):
    sync(step(x, cot))
walls = []
for _ in range(a["steps"]):  # wall time of a step, without the profiler
    start = time.perf_counter()
    sync(step(x, cot))
    walls.append(time.perf_counter() - start)
with open(os.path.join(a["out"], "wall.txt"), "w") as f:
    f.write(str(1e3 * sorted(walls)[len(walls) // 2]))
from mindspore import Profiler
profiler = Profiler(output_path=a["out"])
for _ in range(a["steps"]):
    sync(step(x, cot))
profiler.stop()
profiler.analyse()
'''


def kernel_names(out_dir):
    """{"Custom-opN": what it is} from the IR MindSpore saved of the compiled graph: the kernel's
    entry point, with grouped_matmul's form ("GroupedMatmul x^T", "... w^T") and each kernel's
    first source line in this package (the profiler only says "Custom-opN")."""
    found = sorted(glob.glob(os.path.join(out_dir, "ir", "graph_build_0_*.ir")))
    if not found:
        return {}
    names, attrs = {}, None
    with open(found[-1], encoding="utf-8") as f:
        for line in f:
            if "= Custom(" in line and "func_name" in line:
                attrs = line
            match = re.search(r"Fullname with scope: \((?:\S*/)?(Custom-op\d+)\)", line)
            if match and attrs:
                entry = re.search(r'func_name: "[^"]*:(\w+)"', attrs).group(1)
                if "transpose_x: Bool(1)" in attrs:
                    entry += " x^T (weight gradients)"
                elif "transpose_weight: Bool(1)" in attrs:
                    entry += " w^T (input gradients)"
                names[match.group(1)] = entry
                attrs = None
    return names


def per_operator(out_dir, steps):
    """{operator group: ms per step} from the profiler's per-operator CSV."""
    detail = glob.glob(os.path.join(out_dir, "**", "cpu_op_detail_info_0.csv"), recursive=True)
    if not detail:
        raise SystemExit(f"no profiler output in {out_dir}")
    kernels = kernel_names(out_dir)
    groups = {}
    with open(detail[0], newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            name = group_of(row, kernels)
            groups[name] = groups.get(name, 0.0) + float(row["op_total_time(ms)"]) / steps
    return groups


def group_of(row, kernels):
    """What an operator does: this package's kernel (entry point and form), or MindSpore's
    operator type and whether it is in the backward pass."""
    if row["op_type"] == "Custom":
        return "ms_moe_ops " + kernels.get(row["op_name"], "kernel")
    part = "backward" if row["full_op_name"].startswith("Gradients/") else "forward"
    return f"{row['op_type']} ({part})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--shared", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--contender", action="append", default=None, metavar="NAME[:VAR=VALUE,...]",
                    help="a run with these environment settings (default: 'oneDNN' and "
                         "'float32 products:MS_MOE_OPS_ONEDNN=0')")
    ap.add_argument("--json", default=None, help="write {contender: {operator: ms}} here")
    args = ap.parse_args()
    contenders = args.contender or ["oneDNN", "float32 products:MS_MOE_OPS_ONEDNN=0"]
    results, walls = {}, {}
    for spec in contenders:
        name, _, settings = spec.partition(":")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        for setting in filter(None, settings.split(",")):
            key, _, value = setting.partition("=")
            env[key] = value
        with tempfile.TemporaryDirectory() as out:
            config = dict(vars(args), out=out)
            config.pop("contender"), config.pop("json")
            # (run in the scratch directory: the package comes from PYTHONPATH alone, so a
            # contender may name another checkout, e.g. PYTHONPATH=../main)
            subprocess.run([sys.executable, "-c", _WORKER, HERE, json.dumps(config)], env=env,
                           check=True, capture_output=True, cwd=out)
            results[name] = per_operator(out, args.steps)
            with open(os.path.join(out, "wall.txt"), encoding="utf-8") as f:
                walls[name] = float(f.read())
            with open(os.path.join(out, "package.txt"), encoding="utf-8") as f:
                package = f.read()
        print(f"{name} ({package}): {sum(results[name].values()):.1f} ms of operators per step, "
              f"{walls[name]:.1f} ms wall per step (median, unprofiled)", flush=True)
    print_table(results, walls, args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"operators": results, "wall": walls}, f, indent=1)


def print_table(results, walls, args):
    names = list(results)
    ops = sorted({op for r in results.values() for op in r},
                 key=lambda op: -max(r.get(op, 0.0) for r in results.values()))
    print(f"\nMoELayer forward+backward, T={args.tokens} H={args.hidden} F={args.ffn} "
          f"E={args.experts} K={args.top_k} shared={args.shared}, {args.dtype}, GRAPH mode; "
          f"ms per step (mean of {args.steps}); load average {os.getloadavg()[0]:.2f}")
    print(f"| operator | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for op in ops:
        print(f"| {op} | " + " | ".join(f"{results[n].get(op, 0.0):.1f}" for n in names) + " |")
    print("| total | " + " | ".join(f"{sum(results[n].values()):.1f}" for n in names) + " |")
    print("| wall time of a step (median, unprofiled) | " +
          " | ".join(f"{walls[n]:.1f}" for n in names) + " |")


if __name__ == "__main__":
    main()
