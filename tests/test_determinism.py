"""Bit-identical results whatever the thread count (SPEC error rules), for every kernel on every
instruction-set path this CPU runs.

The kernels take their threads from OpenMP (OMP_NUM_THREADS) and the matrix products from
OpenBLAS (OPENBLAS_NUM_THREADS); both are read once per process, so each thread count runs in a
subprocess of its own: 1, 2 and 3 threads (3 on 2 cores still splits the work three ways). The
shapes are above every kernel's one-thread threshold."""
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import needs_kernels

_SCRIPT = r'''
import sys
import numpy as np
import mindspore as ms
from mindspore import Tensor
ms.set_device("CPU")
import ms_moe_ops as mo
from ms_moe_ops.ops.ffn import FFN_ACTIVATION_GRAD
from ms_moe_ops.ops.gating import GATING_GRAD, GATING_SOFTMAX_BACKWARD
from ms_moe_ops.ops.permute import moe_token_unpermute_backward
from ms_moe_ops.ops.swiglu import SWIGLU_GROUP

import ctypes, os
from ms_moe_ops.ops._library import kernel_library

lib = ctypes.CDLL(kernel_library())
lib.MsMoeOpsIsaPaths.restype = ctypes.c_char_p
out = {}
sys.path.insert(0, sys.argv[2])
import cases
for path in lib.MsMoeOpsIsaPaths().decode().split():  # every path, each on the same data
    os.environ["MS_MOE_OPS_ISA"] = path
    rng = np.random.default_rng(1234)
    bf = lambda a: Tensor(np.asarray(a, np.float32), ms.bfloat16)
    f32 = lambda a: Tensor(np.asarray(a, np.float32))
    x = rng.normal(size=(700, 256))
    y, idx, xn = mo.moe_gating_top_k(f32(x), 8, k_group=4, group_count=8, group_select_mode=1)
    out[path + "/router"] = y.asnumpy()
    gy = rng.normal(size=(700, 8))
    out[path + "/router_bwd"] = mo.moe_gating_top_k_backward(xn, f32(gy), idx).asnumpy()
    out[path + "/router_softmax_bwd"] = GATING_SOFTMAX_BACKWARD(xn, f32(gy), idx, renorm=1).asnumpy()
    dxn = f32(rng.normal(size=(700, 256)))
    out[path + "/router_grad"] = GATING_GRAD(xn, f32(gy), idx, dxn).asnumpy()
    out[path + "/router_grad_softmax"] = GATING_GRAD(xn, f32(gy), idx, dxn, norm_type=0, renorm=1).asnumpy()
    sx = rng.normal(size=(600, 1040))
    w = rng.uniform(0.1, 1, (600, 1))
    y, yo = SWIGLU_GROUP(bf(sx), f32(w), None, clamp_limit=1.5)
    out[path + "/swiglu"] = y.astype(ms.float32).asnumpy()
    gx, gw = mo.swiglu_group_quant_grad(bf(rng.normal(size=(600, 520))), bf(sx), f32(w), yo,
                                        clamp_limit=1.5)
    out[path + "/swiglu_bwd"] = gx.astype(ms.float32).asnumpy()
    out[path + "/swiglu_bwd_weight"] = gw.asnumpy()
    counts = Tensor(np.array([300, 0, 400], np.int64))
    gx_ = rng.normal(size=(700, 96))
    out[path + "/gmm"] = mo.grouped_matmul(f32(gx_), f32(rng.normal(size=(3, 96, 80))), counts).asnumpy()
    # a few rows (decoding): two groups of whole weight rows, and one group cut along K
    few = f32(rng.normal(size=(4, 1000)))
    w_few = f32(rng.normal(size=(3, 1000, 700)))
    out[path + "/gmm_few_rows"] = mo.grouped_matmul(few, w_few, Tensor(np.array([1, 0, 2], np.int64))).asnumpy()
    out[path + "/gmm_few_rows_one_group"] = mo.grouped_matmul(
        few, w_few, Tensor(np.array([0, 3, 0], np.int64)), f32(rng.normal(size=(3, 700)))).asnumpy()
    out[path + "/gmm_tx"] = mo.grouped_matmul(bf(gx_), bf(rng.normal(size=(700, 80))), counts,
                                      transpose_x=True).astype(ms.float32).asnumpy()
    out[path + "/gmm_bf16"] = mo.grouped_matmul(bf(gx_), bf(rng.normal(size=(3, 96, 80))),
                                                counts).astype(ms.float32).asnumpy()
    w1, w2 = rng.normal(size=(3, 96, 64)) * 0.1, rng.normal(size=(3, 64, 96)) * 0.1
    out[path + "/ffn"] = mo.moe_ffn(bf(gx_), counts, bf(w1), bf(w2)).astype(ms.float32).asnumpy()
    gh, a = FFN_ACTIVATION_GRAD(f32(rng.normal(size=(700, 64))), f32(rng.normal(size=(700, 64))),
                                activation="gelu")
    out[path + "/ffn_act_grad"] = gh.asnumpy()
    v = cases.int8_ffn_case(rng, counts=(300, 0, 212), h=256, f=520)
    out[path + "/ffn_int8"] = cases.int8_ffn(v, output_dtype="float32").asnumpy()
    # weights in [-127, 127] as quantize_moe_ffn makes them, and a few -128 (the avx2 path's
    # fast product, and its correction)
    v = dict(v, w1=np.maximum(v["w1"], -127), w2=np.maximum(v["w2"], -127))
    v["w1"][2, 7, ::5] = -128
    out[path + "/ffn_int8_symmetric"] = cases.int8_ffn(v, output_dtype="float32").asnumpy()
    e_idx = np.array([rng.permutation(16)[:4] for _ in range(900)], np.int32)
    p, s, c = mo.moe_token_permute(bf(rng.normal(size=(900, 64))), Tensor(e_idx), 16)
    out[path + "/permute"] = p.astype(ms.float32).asnumpy()
    probs = f32(rng.uniform(size=(900, 4)))
    out[path + "/unpermute"] = mo.moe_token_unpermute(p, s, probs).astype(ms.float32).asnumpy()
    d_rows, d_probs = moe_token_unpermute_backward(p, s, probs, bf(rng.normal(size=(900, 64))))
    out[path + "/unpermute_bwd"] = d_rows.astype(ms.float32).asnumpy()
    out[path + "/unpermute_bwd_probs"] = d_probs.asnumpy()
    # weight-only int8 experts: groups cut along K (1 and 9 rows) and one not (20 rows)
    wq_counts = Tensor(np.array([1, 0, 9, 20], np.int64))
    wq = mo.ops.weight_quant_grouped_matmul(
        f32(rng.normal(size=(30, 1000))), Tensor(rng.integers(-128, 128, (4, 1000, 300)).astype(np.int8)),
        f32(rng.uniform(0.01, 0.1, (4, 300))), wq_counts)
    out[path + "/weight_quant_gmm"] = wq.asnumpy()
np.savez(sys.argv[1], **out)
'''


def _outputs(threads, path):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    tests = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, path, tests], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(path))


@needs_kernels("the thread counts of this package's OpenMP kernels and OpenBLAS")
@pytest.mark.slow  # three subprocesses
def test_same_bits_whatever_the_thread_count(tmp_path):
    runs = {n: _outputs(n, str(tmp_path / f"threads{n}.npz")) for n in (1, 2, 3)}
    for name, one in runs[1].items():
        assert np.abs(one).max() > 0, name
        for n in (2, 3):
            np.testing.assert_array_equal(runs[n][name], one, err_msg=f"{name}, {n} threads")
