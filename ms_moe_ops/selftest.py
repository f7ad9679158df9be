"""Device self-test: `python -m ms_moe_ops.selftest` (on an Ascend machine: after `source
set_env.sh`; any device works).

Runs each operator that has an aclnn binding, and the MoeFFN and GatingTopK Cells, in GRAPH and
PyNative mode on the current device, compares every output with the float64 golden model of
`ms_moe_ops.reference`, and prints a table ready to paste into an issue: the implementation the
resolver chose (the aclnn kernel and its route, a built-in or a composition), the largest error
against the golden model and the tolerance it is held to, and the time of a call after a warm-up.
Exit status 1 when a result is past its tolerance or a call fails.
"""
import argparse
import logging
import sys
import time

import numpy as np
import mindspore as ms

from . import reference as ref
from .nn import GatingTopK, MoeFFN
from .ops import (_op, _platform, moe_ffn, moe_gating_top_k, moe_gating_top_k_backward,
                  swiglu_group_quant_grad)

# float16 results against the float64 golden model
TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 6e-2}


def _cases(rng, dtype):
    """(name, function, its tensor inputs, golden output) of each operator and Cell. The functions
    are named (a lambda defined among other expressions is refused by MindSpore's graph parser)
    and take their tensors as arguments, so one function runs in both modes."""
    np_dt = np.float32 if dtype == "bfloat16" else np.dtype(dtype)
    t = lambda a, d=dtype: ms.Tensor(a.astype(np.float32 if d == "bfloat16" else d),  # noqa: E731
                                     dtype=getattr(ms, d))
    m, n, k = 32, 64, 4
    logits = rng.standard_normal((m, n)).astype(np_dt)
    y, idx, norm = ref.moe_gating_top_k(logits.astype(np.float64), k, k_group=4, group_count=8)
    grad_y = rng.standard_normal((m, k)).astype(np.float32)
    grad_x = ref.moe_gating_top_k_backward(norm, grad_y, idx)
    x2 = rng.standard_normal((m, 2 * 16)).astype(np_dt)
    gy = rng.standard_normal((m, 16)).astype(np_dt)
    gx, _ = ref.swiglu_group_quant_grad(gy.astype(np.float64), x2.astype(np.float64))
    e, h, f = 4, 32, 48
    counts = np.array([8, 0, 16, 8], np.int64)
    x = (rng.standard_normal((m, h)) * 0.5).astype(np_dt)
    w1 = (rng.standard_normal((e, h, f)) * 0.1).astype(np_dt)
    w2 = (rng.standard_normal((e, f, h)) * 0.1).astype(np_dt)
    ffn = ref.moe_ffn(x.astype(np.float64), counts, w1.astype(np.float64), w2.astype(np.float64))
    cell = MoeFFN(e, h, f, activation="fastgelu")
    gating = GatingTopK(h, n, k)

    def gating_top_k(v):
        return moe_gating_top_k(v, k, k_group=4, group_count=8)[0]

    def gating_backward(v, g, i):
        return moe_gating_top_k_backward(v, g, i)

    def swiglu_grad(g, v):
        return swiglu_group_quant_grad(g, v)[0]

    def ffn_op(v, c, a, b):
        return moe_ffn(v, c, a, b)

    def ffn_cell(v, c):
        return cell(v, c)

    def gating_cell(v):
        return gating(v)[0]

    return [
        ("moe_gating_top_k", gating_top_k, (t(logits),), y),
        ("moe_gating_top_k_backward", gating_backward,
         (t(norm, "float32"), t(grad_y, "float32"), ms.Tensor(idx)), grad_x),
        ("swiglu_group_quant_grad", swiglu_grad, (t(gy), t(x2)), gx),
        ("moe_ffn", ffn_op, (t(x), ms.Tensor(counts), t(w1), t(w2)), ffn),
        ("MoeFFN (Cell)", ffn_cell, (t(x), ms.Tensor(counts)), None),
        ("GatingTopK (Cell)", gating_cell, (t(x),), None),
    ]


def run(dtypes=("float16",), modes=("pynative", "graph"), repeat=5, out=sys.stdout):
    """Prints the table; returns the number of failures. GRAPH mode compiles each function (the
    Cells' construct included) with ms.jit under GRAPH_MODE."""
    target = _platform.device_target()
    soc = _platform.soc_family(target) or "-"
    out.write(f"ms_moe_ops self-test on {target} {soc}, MindSpore {ms.__version__}\n\n")
    out.write("| operator | dtype | mode | implementation | max error | tolerance | ms/call |\n")
    out.write("|---|---|---|---|---|---|---|\n")
    failures = 0
    for mode in modes:
        ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
        try:
            for dtype in dtypes:
                for name, fn, inputs, golden in _cases(np.random.default_rng(0), dtype):
                    failures += _row(out, name, dtype, mode, ms.jit(fn) if mode == "graph" else fn,
                                     inputs, golden, repeat)
        finally:
            ms.set_context(mode=ms.PYNATIVE_MODE)
    return failures


def _row(out, name, dtype, mode, fn, inputs, golden, repeat):
    """Runs one case, writes its row; 1 when it failed, else 0."""
    chosen, error, ms_per_call, failed = "-", "-", "-", 0
    try:
        with _op.record_choices() as log:
            got = fn(*inputs)
        chosen = ", ".join(sorted({f"{o}: {i}" for o, i in log})) or "-"
        start = time.perf_counter()
        for _ in range(repeat):
            got = fn(*inputs)
        got = got.asnumpy() if hasattr(got, "asnumpy") else got
        ms_per_call = f"{(time.perf_counter() - start) / repeat * 1e3:.2f}"
        if golden is not None:
            err = float(np.max(np.abs(got.astype(np.float64) - golden)))
            error = f"{err:.2e}"
            failed = int(not err <= TOLERANCE[dtype])
    except Exception as exc:  # pylint: disable=broad-except
        failed = 1
        error = f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    out.write(f"| {name} | {dtype} | {mode} | {chosen} | {error} | "
              f"{TOLERANCE[dtype]:g} | {ms_per_call} |\n")
    return failed


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ms_moe_ops.selftest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", action="append", choices=sorted(TOLERANCE),
                        help="dtype to run (repeatable; default float16)")
    parser.add_argument("--mode", action="append", choices=("pynative", "graph"))
    args = parser.parse_args(argv)
    logging.getLogger("ms_moe_ops").setLevel(logging.WARNING)
    failures = run(tuple(args.dtype or ("float16",)), tuple(args.mode or ("pynative", "graph")))
    print(f"\n{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
