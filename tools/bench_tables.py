"""The performance tables of README.md, docs/performance.md and benchmarks/README.md, generated
from the benchmarks' CSVs (never typed by hand).

    python tools/bench_tables.py            # rewrite the tables from the CSVs
    python tools/bench_tables.py --check    # exit 1 when a table differs from its CSV

A table sits between `<!-- table: NAME -->` and `<!-- /table -->` in a Markdown file. Its data:
- goals: benchmarks/results/goals.csv, one row per goal and run, written by bench_layer.py,
  bench_ffn.py, bench_swiglu.py and bench_gating.py with `--csv benchmarks/results/goals.csv
  --run NAME` (the runs published before the benchmarks wrote CSVs were entered from their
  printed output; an empty cell was not printed);
- scaling: benchmarks/scaling.csv, written by bench_scaling.py --csv.
"""
import argparse
import csv
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENTS = ("README.md", "docs/performance.md", "benchmarks/README.md")

# goal -> (what, how its ratio reads, target); the order of the table
GOALS = {
    "layer-transformers": ("MoELayer fwd+bwd, T=4096, H=512, F=256, E=16, K=4, 1 shared "
                           "(`bench_layer.py`), against transformers DeepseekV3MoE (torch 2.13 "
                           "CPU, same weights)", "{:.2f}x faster", "2.0x"),
    "layer-sgemm": ("the same, against its products as bare sgemm calls (the fastest of "
                    "OpenBLAS on 2 threads and 1, and oneDNN's on 1)", "{:.0%} of the BLAS GFLOP/s",
                    "60%"),
    "layer-transformers-bf16": ("the same in bfloat16 (`bench_layer.py --dtype bfloat16`: AMP O2 "
                                "against DeepseekV3MoE `.to(torch.bfloat16)`)",
                                "{:.2f}x faster", "1.5x (2x)"),
    "ffn-numpy-even": ("MoeFFN fp32 forward, M=4096, H=1024, F=2048, E=8 (`bench_ffn.py "
                       "--no-backward`), against numpy's matmul per expert, even split",
                       "{:.2f} of numpy's GFLOP/s", "0.9"),
    "ffn-numpy-uneven": ("the same, uneven split (geometric, one expert empty)",
                         "{:.2f} of numpy's GFLOP/s", "0.9"),
    "swiglu-forward-float32": ("SwiGLU forward fp32, T=8192, H=2048 (`bench_swiglu.py`), against "
                               "np.copyto of the same bytes", "{:.0%} of the copy bandwidth", "75%"),
    "swiglu-backward-float32": ("SwiGLU backward fp32, the same", "{:.0%} of the copy bandwidth",
                                "75%"),
    "swiglu-backward-eager-float32": ("the same called eagerly (PyNative, the result read)",
                                      "{:.0%} of the copy bandwidth", "70%"),
    "router-torch": ("router fwd+bwd, M=16384, N=256, K=8, 8 groups / top 4 (`bench_gating.py`), "
                     "against torch autograd", "{:.2f}x faster", "4x"),
}


def _rows(path):
    with open(os.path.join(ROOT, path), newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def goals_table():
    """The goals, one column of ratios per run (the first run's times too)."""
    rows = _rows("benchmarks/results/goals.csv")
    runs = list(dict.fromkeys(r["run"] for r in rows))
    by = {(r["goal"], r["run"]): r for r in rows}
    goals = [g for g in GOALS if any(r["goal"] == g for r in rows)]
    goals += [g for g in dict.fromkeys(r["goal"] for r in rows) if g not in GOALS]
    first = runs[0]
    lines = [f"| goal (default shapes) | {first}: ms_moe_ops / other | "
             + " | ".join(f"{run} ratio" for run in runs) + " | goal |",
             "|---|---|" + "---|" * len(runs) + "---|"]
    for goal in goals:
        what, ratio_format, target = GOALS.get(goal, (goal, "{:.3g}", ""))
        head = by.get((goal, first))
        times = ""
        if head and head["ours"]:
            times = f"{head['ours']} {head['unit']}"
            if head["other"]:
                times += f" / {head['other']} {head['unit']}"
        ratios = [ratio_format.format(float(by[(goal, run)]["ratio"]))
                  if (goal, run) in by and by[(goal, run)]["ratio"] else "" for run in runs]
        lines.append(f"| {what} | {times} | " + " | ".join(ratios) + f" | {target} |")
    return "\n".join(lines)


def _times(x):
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def scaling_table():
    """MoELayer against DeepseekV3MoE as T and E grow (bench_scaling.py)."""
    lines = ["| dtype | T | E | ms_moe_ops ms | tokens/s | GFLOP/s | DeepseekV3MoE ms | ms_moe_ops is |",
             "|---|---|---|---|---|---|---|---|"]
    for r in _rows("benchmarks/scaling.csv"):
        ours, tokens = float(r["ours_ms"]), int(r["tokens"])
        lines.append(f"| {r.get('dtype') or 'float32'} | {tokens} | {r['experts']} | {ours:.0f} | "
                     f"{tokens / ours * 1e3:.0f} | "
                     f"{float(r['gflops']):.0f} | {float(r['torch_ms']):.0f} | "
                     f"{_times(float(r['speedup']))}x faster |")
    return "\n".join(lines)


TABLES = {"goals": goals_table, "scaling": scaling_table}
_BLOCK = re.compile(r"(<!-- table: (\w+) -->\n)(.*?)(<!-- /table -->)", re.S)


def regenerate(text):
    """text with every table block rebuilt from its data."""
    def table(match):
        name = match.group(2)
        if name not in TABLES:
            raise SystemExit(f"bench_tables: unknown table {name!r} (known: {sorted(TABLES)})")
        return match.group(1) + TABLES[name]() + "\n" + match.group(4)

    return _BLOCK.sub(table, text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="report stale tables, change nothing")
    args = p.parse_args(argv)
    stale = []
    for name in DOCUMENTS:
        path = os.path.join(ROOT, name)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = regenerate(text)
        if new != text:
            stale.append(name)
            if not args.check:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
    if args.check and stale:
        print("tables out of date with their CSVs (python tools/bench_tables.py): "
              + ", ".join(stale), file=sys.stderr)
        return 1
    if stale and not args.check:
        print("rewrote the tables of " + ", ".join(stale))
    return 0


if __name__ == "__main__":
    sys.exit(main())
