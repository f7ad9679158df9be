"""Sanitizer fuzzing of the CPU kernels through MindSpore's AOT ABI, checked against the golden model.

1. Builds custom_aot/ with -fsanitize=address,undefined (setup.py with MS_MOE_OPS_SANITIZE, every
   instruction-set path, into build/fuzz/; rebuilt only when a source changes) and the driver
   custom_aot/harness/fuzz_kernels.cc with the same sanitizers.
2. Runs the driver under every instruction-set path this CPU has (MS_MOE_OPS_ISA), splitting the
   time between them. The driver checks the call invariants itself (verdicts, canaries, inputs
   untouched, identical reruns with another thread count) and dumps every accepted case; a
   sanitizer finding aborts it with a report.
3. Compares the dumped results with ms_moe_ops/reference.py (the numpy golden model), within the
   time left (cases in turn, round robin over the kernels): see `check_case` for what is compared.

    python tools/fuzz_kernels.py                   # about 60 s: the suite's short run
    python tools/fuzz_kernels.py --seconds 1800    # the long run
    python tools/fuzz_kernels.py --replay 1234 --isa avx2   # one case, verbose

Exit status: 0 no finding, 1 a finding (printed), 3 the sanitizer runtime or a compiler is missing.
"""
import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DRIVER = os.path.join(ROOT, "custom_aot", "harness", "fuzz_kernels.cc")
SANITIZERS = "address,undefined"
DRIVER_FLAGS = ["-std=c++17", "-O1", "-g", "-D_GLIBCXX_USE_CXX11_ABI=0", "-Wall",
                f"-fsanitize={SANITIZERS}", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer",
                "-I" + os.path.join(ROOT, "custom_aot")]
# leaks: OpenBLAS and OpenMP keep their thread buffers until exit; the sanitizers stop at the
# first finding and say where
SANITIZER_ENV = {"ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:symbolize=1",
                 "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}


class Missing(Exception):
    """A prerequisite is not there (exit status 3)."""


def sanitizer_available(work):
    """True when g++ links and runs a program with the sanitizers (their runtimes installed)."""
    src, exe = os.path.join(work, "probe.cc"), os.path.join(work, "probe")
    with open(src, "w") as f:
        f.write("int main() { return 0; }\n")
    try:
        subprocess.run(["g++", f"-fsanitize={SANITIZERS}", src, "-o", exe], check=True,
                       capture_output=True, timeout=120)
        subprocess.run([exe], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def build(work):
    """(sanitized kernel library, driver executable)."""
    env = dict(os.environ, MS_MOE_OPS_SANITIZE=SANITIZERS)
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib",
                           os.path.join(work, "lib"), "--build-temp", os.path.join(work, "temp")],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the sanitized build failed:\n{done.stderr[-3000:]}")
    library = glob.glob(os.path.join(work, "lib", "ms_moe_ops", "_kernels*.so"))[0]
    driver = os.path.join(work, "fuzz_kernels")
    sources = [DRIVER, os.path.join(ROOT, "custom_aot", "harness", "aot_call.h")]
    if not os.path.exists(driver) or any(os.path.getmtime(s) > os.path.getmtime(driver) for s in sources):
        subprocess.run(["g++", *DRIVER_FLAGS, DRIVER, "-o", driver, "-ldl"], check=True)
    return library, driver


def blas_dir():
    import scipy_openblas32  # pylint: disable=import-outside-toplevel

    return scipy_openblas32.get_lib_dir()


def isa_paths(driver, library):
    """The instruction-set paths the library offers here (the driver's first line)."""
    out = run_driver(driver, library, ["--cases", "0"], {})
    return out.splitlines()[0].split(":", 1)[1].split(";")[0].split()


def run_driver(driver, library, args, env):
    full_env = dict(os.environ, LD_LIBRARY_PATH=blas_dir(), **SANITIZER_ENV, **env)
    done = subprocess.run([driver, library, *args], env=full_env, capture_output=True, text=True)
    if done.returncode not in (0, 1) or "ERROR: AddressSanitizer" in done.stderr or \
            "runtime error:" in done.stderr:
        raise Finding(f"the driver stopped (status {done.returncode}) under {env}:\n"
                      f"{done.stdout[-2000:]}\n{done.stderr[-6000:]}")
    if done.returncode == 1:
        raise Finding(done.stdout[-6000:])
    return done.stdout


class Finding(Exception):
    """A failed invariant, a sanitizer report or a mismatch with the golden model."""


# -- the dump -------------------------------------------------------------------------------------

DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64, "int8": np.int8,
          "int32": np.int32, "int64": np.int64, "uint64": np.uint64, "uint8": np.uint8}


def as_array(dtype, dims, raw):
    if dtype == "none":
        return None
    shape = () if dims == "-" else tuple(int(d) for d in dims.split(","))
    if dtype == "bfloat16":
        bits = np.frombuffer(raw, np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    return np.frombuffer(raw, DTYPES[dtype]).reshape(shape)


def read_cases(path):
    """Yields (case id, kernel, attrs, inputs, outputs, dtypes) from a driver's dump."""
    with open(path, "rb") as f:
        while True:
            header = f.readline().decode().split()
            if not header:
                return
            _, case_id, kernel, n_attrs, n_in, n_out = header
            attrs, tensors, dtypes = {}, [], {}
            for _ in range(int(n_attrs)):
                parts = f.readline().decode().rstrip("\n").split(" ", 3)
                name, kind, value = parts[1], parts[2], parts[3] if len(parts) > 3 else ""
                attrs[name] = {"i": int, "f": float, "b": lambda v: v == "1", "s": str}[kind](value)
            for _ in range(int(n_in) + int(n_out)):
                _, name, dtype, dims, nbytes = f.readline().decode().split()
                tensors.append((name, as_array(dtype, dims, f.read(int(nbytes)))))
                dtypes[name] = dtype
            ins, outs = dict(tensors[:int(n_in)]), dict(tensors[int(n_in):])
            yield int(case_id), kernel, attrs, ins, outs, dtypes


# -- comparing with the golden model ---------------------------------------------------------------

TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def moderate(*arrays):
    """Every float input finite and below 1e4 in magnitude: float32 sums cannot overflow, so the
    float64 model is the kernel's result within rounding."""
    return all(a is None or a.dtype.kind not in "f" or
               (np.isfinite(a).all() and np.abs(a).max(initial=0) < 1e4) for a in arrays)


def close(name, got, want, dtype, tol=None, bound=0.0):
    """|got - want| <= tol * max(1, max |want|) + bound (bound: a number or per element)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise Finding(f"{name}: shape {got.shape}, golden {want.shape}")
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    excess = np.abs(got - want) - ((TOL[dtype] if tol is None else tol) * scale + bound)
    bad = ~(excess <= 0)  # (NaN included)
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, np.nan_to_num(excess, nan=np.inf), -np.inf)),
                             excess.shape)
        raise Finding(f"{name}{list(i)}: {got[i]:.6g}, golden {want[i]:.6g} ({dtype}, beyond the "
                      f"bound by {excess[i]:.3g})")


# The kernel's float32 fastgelu/gelu/silu part from the exact ones by at most this times |h|
# (measured: 2^-22.8 on a dense grid of [-130, 130] on every path; an error of the sigmoid's
# argument z weighs at most |z| e^-|z| <= 1/e in the tails, so it stays relative to |h|).
ACT_RTOL = 2.0 ** -20


def requant_bound(v, a):
    """Per element of y, how far the int8 path may legitimately part from the golden model: a
    hidden value whose pre-rounding value act(h) * scale + offset lies within the kernel's
    activation error of a half-integer (|act(h)| <= |h| for every activation, so the error is
    at most ACT_RTOL * |h * scale|, plus one float32 ulp of the result) may requantise one step
    apart; each such step j of row i moves y[i, c] by |weight2[e, j, c]| * deq_scale2[e, c]."""
    from ms_moe_ops import reference as ref  # pylint: disable=import-outside-toplevel

    h, pre = ref.moe_ffn_quant_hidden(v["x"], v["expert_tokens"], v["weight1"], v["bias1"],
                                      v["scale"], v["offset"], v["deq_scale1"], a["activation"],
                                      a["tokens_index_flag"])
    rtol = 0.0 if a["activation"] == "relu" else ACT_RTOL  # (relu is exact)
    pre = pre.astype(np.float64)
    dq2 = ref._deq_scale_values(v["deq_scale2"]).astype(np.float64)
    bound = np.zeros((h.shape[0], dq2.shape[1]))
    for e, rows in ref._quant_rows(v["x"], v["expert_tokens"], a["tokens_index_flag"]):
        slack = (rtol * np.abs(h[rows] * float(v["scale"][e])) +
                 np.abs(np.spacing(pre[rows].astype(np.float32))))
        edge = np.abs(pre[rows] - np.floor(pre[rows]) - 0.5) <= slack
        edge &= (pre[rows] > -129) & (pre[rows] < 128)  # (saturated further out)
        bound[rows] = edge @ np.abs(v["weight2"][e].astype(np.float64)) * dq2[e]
    return bound


def check_case(kernel, a, ins, outs, dtypes):
    """Compares one accepted case with the golden model. Returns False when the case is not
    comparable (non-finite or huge float inputs to a product or a sum: float32 and float64 may
    legitimately differ there), True when it matched; raises Finding otherwise. The router's
    choice is compared for any data (NaN included): its expert_idx must be the golden model's
    choice on the kernel's own float32 x_norm (the selection is exact), and that x_norm the
    golden scores wherever they are finite."""
    from ms_moe_ops import reference as ref  # pylint: disable=import-outside-toplevel

    if kernel == "MoeGatingTopK":
        x, bias = ins["x"], ins["bias"]
        attrs = {k: a[k] for k in ("k", "k_group", "group_count", "group_select_mode", "renorm",
                                   "norm_type", "routed_scaling_factor", "eps")}
        idx = outs["expert_idx"]
        n = x.shape[1]
        if ((idx < 0) | (idx >= n)).any() or any(len(set(r)) != len(r) for r in idx.tolist()):
            raise Finding("expert_idx out of range or repeated in a row")
        _, want_idx = ref.gating_from_scores(outs["x_norm"], bias=bias, **attrs)
        if not np.array_equal(idx, want_idx):
            raise Finding(f"expert_idx differs from the golden choice on the kernel's scores:\n"
                          f"{idx}\n{want_idx}")
        _, _, x_norm = ref.moe_gating_top_k(x.astype(np.float64), **attrs)
        finite = np.isfinite(x_norm)
        if not np.array_equal(np.isnan(outs["x_norm"]), np.isnan(x_norm)):
            raise Finding("x_norm: NaN where the golden model has none, or the reverse")
        close("x_norm", outs["x_norm"][finite], x_norm[finite], "float32", 1e-6)
        if moderate(x, bias):
            y, _ = ref.gating_from_scores(outs["x_norm"], bias=bias, **attrs)
            close("y", outs["y"], y, dtypes["x"])
        return True
    if kernel in ("MoeGatingTopKBackward", "MoeGatingTopKSoftmaxBackward"):
        if not moderate(ins["x_norm"], ins["grad_y"]):
            return False
        fn = ref.moe_gating_top_k_backward if kernel == "MoeGatingTopKBackward" else \
            ref.moe_gating_top_k_softmax_backward
        want = fn(ins["x_norm"], ins["grad_y"], ins["expert_idx"], renorm=a["renorm"],
                  routed_scaling_factor=a["routed_scaling_factor"], eps=a["eps"])
        close("grad_x", outs["grad_x"], want, dtypes["grad_y"], tol=max(TOL[dtypes["grad_y"]], 1e-4))
        return True
    if kernel == "MoeGatingTopKGrad":
        if not moderate(ins["x_norm"], ins["grad_y"], ins["grad_x_norm"]):
            return False
        want = ref.moe_gating_top_k_grad(ins["x_norm"], ins["grad_y"], ins["expert_idx"],
                                         ins["grad_x_norm"], norm_type=a["norm_type"],
                                         renorm=a["renorm"],
                                         routed_scaling_factor=a["routed_scaling_factor"],
                                         eps=a["eps"])
        close("grad_x", outs["grad_x"], want, dtypes["grad_y"], tol=max(TOL[dtypes["grad_y"]], 1e-4))
        return True
    if kernel == "SwigluGroup":
        x, w, gi, c = ins["x"], ins["weight"], ins["group_index"], a["clamp_limit"]
        if not moderate(x, w) or not np.isfinite(c) or x.shape[-1] == 0:  # (2H = 0: no operator call)
            return False
        close("y", outs["y"], ref.swiglu_group(x, w, gi, c), dtypes["x"])
        close("y_origin", outs["y_origin"], ref.swiglu_group(x, None, gi, c), dtypes["x"])
        return True
    if kernel == "SwigluGroupQuantGrad":
        gy, x, w, yo, gi = (ins[k] for k in ("grad_y", "x", "weight", "y_origin", "group_index"))
        c = a["clamp_limit"]
        if not moderate(gy, x, w, yo) or not np.isfinite(c) or x.shape[-1] == 0:
            return False
        gx, gw = ref.swiglu_group_quant_grad(gy, x, w, yo, gi, c)
        close("grad_x", outs["grad_x"], gx, dtypes["x"])
        close("grad_weight", outs["grad_weight"], np.zeros_like(outs["grad_weight"]) if gw is None
              else gw, "float32", 1e-4)
        return True
    if kernel == "GroupedMatmul":
        if not moderate(ins["x"], ins["weight"], ins["bias"]):
            return False
        want = ref.grouped_matmul(ins["x"], ins["weight"], ins["group_list"], ins["bias"],
                                  a["transpose_x"], a["transpose_weight"], a["cumulative"],
                                  a["padded"])
        close("out", outs["out"], want, dtypes["x"], tol=max(TOL[dtypes["x"]], 1e-4))
        return True
    if kernel == "MoeFFN":
        v = ins
        if not moderate(*v.values()):
            return False
        args = (v["x"], v["expert_tokens"], v["weight1"], v["weight2"], v["bias1"], v["bias2"],
                v["scale"], v["offset"], v["deq_scale1"], v["deq_scale2"])
        kw = dict(activation=a["activation"], tokens_index_flag=a["tokens_index_flag"],
                  padded=a["padded"])
        if dtypes["x"] == "int8":
            if not all(np.isfinite(ref._deq_scale_values(v[k])).all()
                       for k in ("deq_scale1", "deq_scale2")):
                # non-finite hidden values: the kernel's activations take relu(NaN) = 0 and
                # x * sigmoid(x) = -inf at x = -inf (its exp never reaches 0), float64 gives NaN
                return False
            y = ref.moe_ffn(*args, output_dtype=dtypes["y"], **kw)
            if not np.isfinite(y).all():  # (beyond the output dtype)
                return False
            close("y", outs["y"], y, dtypes["y"], bound=requant_bound(v, a))
        else:
            close("y", outs["y"], ref.moe_ffn(*args, **kw), dtypes["x"],
                  tol=max(TOL[dtypes["x"]], 1e-4))
        return True
    if kernel == "MoeFFNActivationGrad":
        h, g = ins["h"].astype(np.float64), ins["grad_a"].astype(np.float64)
        if not moderate(h, g):
            return False
        act = ref.ffn_activation(a["activation"], h)
        eps = 1e-6
        deriv = (ref.ffn_activation(a["activation"], h + eps) -
                 ref.ffn_activation(a["activation"], h - eps)) / (2 * eps)
        kink = (a["activation"] == "relu") & (np.abs(h) < eps)
        close("a", outs["a"], act, dtypes["h"])
        close("grad_h", np.where(kink, 0, outs["grad_h"]), np.where(kink, 0, g * deriv), dtypes["h"],
              tol=max(TOL[dtypes["h"]], 1e-4))
        return True
    if kernel == "MoeTokenPermute":
        permuted, sorted_index, counts = ref.moe_token_permute(ins["x"], ins["expert_idx"],
                                                                a["num_experts"])
        if not (np.array_equal(outs["sorted_index"], sorted_index)
                and np.array_equal(outs["counts"], counts)
                and outs["permuted"].tobytes() == np.ascontiguousarray(permuted).tobytes()):
            raise Finding("moe_token_permute differs from the golden model (bitwise)")
        return True
    if kernel in ("MoeTokenUnpermute", "MoeTokenUnpermuteBackward"):
        p, s, q = ins["permuted"], ins["sorted_index"], ins["probs"]
        if not moderate(p, q, ins.get("grad_out")):
            return False
        dt = dtypes["permuted"]
        if kernel == "MoeTokenUnpermute":
            close("out", outs["out"], ref.moe_token_unpermute(p, s, q, a["top_k"]), dt)
        else:
            gp, gq = ref.moe_token_unpermute_backward(p, s, q, ins["grad_out"], a["top_k"])
            close("grad_permuted", outs["grad_permuted"], gp, dt)
            close("grad_probs", outs["grad_probs"], gq, dt if q is not None else "float32",
                  tol=max(TOL[dt], 1e-4))
        return True
    if kernel == "Cast":  # bitwise: one rounding to nearest-even (NaN stays NaN)
        want = ref.cast(ins["x"], dtypes["y"]).astype(np.float32)
        got = np.asarray(outs["y"], np.float32)
        number = ~np.isnan(want)
        if not (np.array_equal(np.isnan(got), ~number) and
                np.array_equal(got[number].view(np.uint32), want[number].view(np.uint32))):
            raise Finding("cast differs from the golden model (bitwise)")
        return True
    if kernel == "WeightQuantGroupedMatmul":
        x, w, s = ins["x"], ins["weight"], ins["scale"]
        if not moderate(x, s):
            return False
        want = ref.weight_quant_grouped_matmul(x, w, s, ins["group_list"])
        # float32 sums of K products: within a few roundings of the sum of their magnitudes
        bound = ref.weight_quant_grouped_matmul(np.abs(x), np.abs(np.asarray(w, np.int16)),
                                                np.abs(s), ins["group_list"])
        error = np.abs(np.asarray(outs["y"], np.float64) - want)
        if not (error <= 4e-7 * (x.shape[1] + 2) * bound + 1e-30).all():
            raise Finding("weight_quant_grouped_matmul differs from the golden model")
        return True
    if kernel == "Dequantize":  # bitwise: one float32 product per element
        want = ref.dequantize(ins["weight"], ins["scale"], ins["index"])
        if np.asarray(outs["y"], np.float32).tobytes() != want.tobytes():
            raise Finding("dequantize differs from the golden model (bitwise)")
        return True
    if kernel == "RmsNorm":
        x, w = ins["x"], ins["weight"]
        if not moderate(x, w) or (a["eps"] == 0 and not np.abs(x).any(-1).all()):
            return False  # (a zero row without eps is 0/0)
        close("y", outs["y"], ref.rms_norm(x, w, a["eps"]), "float32")
        return True
    if kernel == "AddRmsNorm":
        x, r, w = ins["x"], ins["residual"], ins["weight"]
        total = (np.asarray(x, np.float32) + np.asarray(r, np.float32)).astype(np.float64)
        if not moderate(total, w) or (a["eps"] == 0 and not np.abs(total).any(-1).all()):
            return False  # (a zero row without eps is 0/0)
        if np.asarray(outs["sum"], np.float32).tobytes() != total.astype(np.float32).tobytes():
            raise Finding("add_rms_norm's sum differs from x + residual (bitwise)")
        close("y", outs["y"], ref.rms_norm(total, w, a["eps"]), "float32")
        return True
    if kernel == "DecodeAttention":
        names = ("query", "key", "value", "cos", "sin", "key_cache", "value_cache", "mask")
        inputs = [ins[n] for n in names]
        if not moderate(*inputs):
            return False
        want = ref.decode_attention(*inputs, ins["slot"], a["scaling"])
        for name, w in zip(("out", "key_cache_out", "value_cache_out"), want):
            close(name, outs[name], w, "float32", tol=1e-4)
        return True
    raise Finding(f"no golden comparison for {kernel}")


def check_dumps(dumps, deadline):
    """{kernel: [compared, not comparable]} over the dumps until the deadline (kernels in turn)."""
    per_kernel = {}
    for path in dumps:
        for case in read_cases(path):
            per_kernel.setdefault(case[1], []).append(case)
    stats = {k: [0, 0] for k in per_kernel}
    queues = [list(v) for v in per_kernel.values()]
    while any(queues) and time.time() < deadline:
        for q in queues:
            if not q:
                continue
            case_id, kernel, attrs, ins, outs, dtypes = q.pop(0)
            try:
                compared = check_case(kernel, attrs, ins, outs, dtypes)
            except Finding as e:
                raise Finding(f"case {case_id} ({kernel}, {attrs}): {e}") from None
            stats[kernel][0 if compared else 1] += 1
    return stats


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="total time: about 3/4 fuzzing (split between the paths), the rest "
                             "comparing with the golden model (the build comes on top)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--isa", help="one instruction-set path only (default: every one)")
    parser.add_argument("--replay", type=int, help="run one case verbosely")
    parser.add_argument("--work", default=os.path.join(ROOT, "build", "fuzz"))
    args = parser.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    if not sanitizer_available(args.work):
        print(f"fuzz_kernels: g++ cannot build and run a program with -fsanitize={SANITIZERS} "
              "(install g++ and its libasan/libubsan)", file=sys.stderr)
        return 3
    start = time.time()
    library, driver = build(args.work)
    built = time.time() - start
    paths = [args.isa] if args.isa else isa_paths(driver, library)
    try:
        if args.replay is not None:
            print(run_driver(driver, library, ["--replay", str(args.replay), "--seed",
                                               str(args.seed)], {"MS_MOE_OPS_ISA": paths[-1]}))
            return 0
        fuzz_start = time.time()
        dumps = []
        for isa in paths:
            dump = os.path.join(args.work, f"cases_{isa}.bin")
            out = run_driver(driver, library, ["--seconds", str(args.seconds * 0.75 / len(paths)),
                                               "--seed", str(args.seed), "--dump", dump],
                             {"MS_MOE_OPS_ISA": isa})
            print(f"== path {isa}\n{out.split(chr(10), 1)[1]}", end="")
            dumps.append(dump)
        fuzzed = time.time() - fuzz_start
        check_start = time.time()
        stats = check_dumps(dumps, check_start + args.seconds * 0.25)
        checked = time.time() - check_start
    except Finding as e:
        print(f"FINDING: {e}")
        return 1
    print("== against the golden model (reference.py)")
    print(f"{'kernel':28s} {'compared':>9s} {'not comparable':>15s}")
    for kernel, (compared, skipped) in sorted(stats.items()):
        print(f"{kernel:28s} {compared:9d} {skipped:15d}")
    print(f"no finding: build {built:.0f} s, fuzzing {fuzzed:.0f} s on {' '.join(paths)}, "
          f"golden comparison {checked:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
