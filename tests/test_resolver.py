"""The resolver: which implementation runs for a call on a patched device target, SoC family and
execution mode (each case names the implementation expected and why), the MS_MOE_OPS_IMPL
override, the log, the cache key, and the README's Ascend table against the same choices."""
import functools
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn

from ms_moe_ops.ops import OPERATORS, _op, _platform
from ms_moe_ops.ops._checks import to_mstype
from ms_moe_ops.ops._impls import kernel
from ms_moe_ops.ops.ffn import FFN_ACTIVATION_GRAD, MOE_FFN
from ms_moe_ops.ops.gating import GATING_BACKWARD, GATING_GRAD, GATING_SOFTMAX_BACKWARD, GATING_TOP_K
from ms_moe_ops.ops.grouped_matmul import GROUPED_MATMUL
from ms_moe_ops.ops.permute import PERMUTE, UNPERMUTE, UNPERMUTE_BACKWARD
from ms_moe_ops.ops.swiglu import SWIGLU_GROUP, SWIGLU_GROUP_QUANT_GRAD
from ascend_sim import with_cann
from conftest import kernels_missing, tensor


@pytest.fixture(autouse=True)
def _cann_has_every_kernel(monkeypatch):
    """The Ascend choices below are those of a CANN that has every kernel the package binds
    (test_a_kernel_the_installed_cann_lacks_is_passed_over says what happens otherwise)."""
    with_cann(monkeypatch)
    yield
    _op.choose.cache_clear()

A2, A3, S950 = _platform.A2, _platform.A3, _platform.ASCEND_950
A2_GRAPH, A2_PYNATIVE = ("Ascend", A2, "graph", None), ("Ascend", A2, "pynative", None)
A3_GRAPH, GRAPH_950 = ("Ascend", A3, "graph", None), ("Ascend", S950, "graph", None)
PYNATIVE_950, CPU_GRAPH = ("Ascend", S950, "pynative", None), ("CPU", "", "graph", None)


def sig(*inputs):
    """A call signature from (dtype name, shape) pairs, None for an absent input."""
    return tuple(None if i is None else (to_mstype(i[0]), tuple(i[1])) for i in inputs)


def choice(op, platform, signature, **attrs):
    return _op.choose(op, tuple(op.resolve(**attrs).items()), platform, signature).name


ROUTER = sig(("bfloat16", (16, 256)), ("bfloat16", (256,)))
ROUTER_BWD = sig(("float32", (16, 256)), ("bfloat16", (16, 8)), ("int32", (16, 8)))
SWIGLU = sig(("bfloat16", (16, 64)), ("float32", (16, 1)), ("int64", (4,)))
SWIGLU_BWD = sig(("bfloat16", (16, 32)), ("bfloat16", (16, 64)), ("float32", (16, 1)),
                 ("bfloat16", (16, 32)), ("int64", (4,)))


def ffn_sig(dtype, h=64, f=128, e=4, out_dtype=None):
    quant = dtype == "int8"
    bias = "int32" if quant else dtype
    extra = [("float32", (e,)), ("float32", (e,)), ("uint64", (e, f)), ("uint64", (e, h))] if \
        quant else [None] * 4
    return sig((dtype, (32, h)), ("int64", (e,)), (dtype, (e, h, f)), (bias, (e, f)),
               (dtype, (e, f, h)), (bias, (e, h)), *extra)


GMM = sig(("bfloat16", (32, 64)), ("bfloat16", (4, 64, 16)), ("int64", (4,)), ("bfloat16", (4, 16)))
PERMUTE_K8 = sig(("bfloat16", (16, 64)), ("int32", (16, 8)))
UNPERMUTE_K8 = sig(("bfloat16", (128, 64)), ("int32", (128,)), ("float32", (16, 8)))
UNPERMUTE_BWD = sig(("bfloat16", (128, 64)), ("int32", (128,)), ("float32", (16, 8)),
                    ("bfloat16", (16, 64)))

# (operator, platform, signature, attributes, expected implementation, why)
SELECTION = [
    (GATING_TOP_K, CPU_GRAPH, ROUTER, dict(k=8), "kernel", "the CPU kernel on CPU"),
    (GATING_TOP_K, A2_GRAPH, ROUTER, dict(k=8, k_group=4, group_count=8), "aclnn",
     "aclnnMoeGatingTopK exists on A2, GRAPH mode"),
    (GATING_TOP_K, A3_GRAPH, ROUTER, dict(k=8, renorm=1), "aclnn",
     "sigmoid: renorm is sent as 0, which the kernel supports"),
    (GATING_TOP_K, A2_PYNATIVE, ROUTER, dict(k=8), "aclnn",
     "PyNative: aclnnMoeGatingTopK through the C++ extension"),
    (GATING_TOP_K, GRAPH_950, ROUTER, dict(k=8), "aclnn",
     "CANN documents aclnnMoeGatingTopK on 950 too"),
    (GATING_TOP_K, GRAPH_950, ROUTER, dict(k=8, norm_type=0), "composition",
     "the kernel's first 950 releases take sigmoid scores only"),
    (GATING_TOP_K, A2_GRAPH, sig(("bfloat16", (-1, 256)), ("bfloat16", (256,))), dict(k=8),
     "composition", "rows known at run time only: not sent to the kernel"),
    (GROUPED_MATMUL, A2_GRAPH, sig(("bfloat16", (32, 64)), ("bfloat16", (2000, 64, 16)),
                                   ("int64", (2000,)), None), {}, "composition",
     "aclnnGroupedMatmulV4 takes at most 1024 groups"),
    (GROUPED_MATMUL, A2_GRAPH, sig(("bfloat16", (32, 65536)), ("bfloat16", (4, 65536, 16)),
                                   ("int64", (4,)), None), {}, "composition",
     "aclnnGroupedMatmulV4 needs every stored last dimension < 65536"),
    (GATING_TOP_K, A2_GRAPH, sig(("float32", (4, 2048)), None), dict(k=8, group_count=128,
                                                                     k_group=128),
     "aclnn", "every group kept: the kernel does not select groups, nothing to align"),
    (GATING_TOP_K, A2_GRAPH, sig(("float32", (4, 2048)), None), dict(k=8, group_count=128),
     "composition", "16 experts per group align to 32: 32 x 128 groups > 2048"),
    (GATING_TOP_K, A2_GRAPH, sig(("float32", (4, 1920)), None), dict(k=8, group_count=64),
     "aclnn", "30 experts per group align to 32: 32 x 64 groups = 2048 fits"),
    (GATING_TOP_K, A2_GRAPH, ROUTER, dict(k=8, norm_type=0, renorm=1), "composition",
     "the kernel supports renorm=0 only"),
    (GATING_TOP_K, ("Ascend", "ascend310p", "graph", None), ROUTER, dict(k=8), "composition",
     "an SoC without the kernel"),
    (GATING_TOP_K, ("Ascend", "", "graph", None), ROUTER, dict(k=8), "composition",
     "SoC not known yet: nothing SoC-specific"),
    (GATING_BACKWARD, A2_GRAPH, ROUTER_BWD, {}, "aclnn", "aclnnMoeGatingTopKBackward on A2"),
    (GATING_BACKWARD, A2_PYNATIVE, ROUTER_BWD, {}, "aclnn", "PyNative: the C++ extension"),
    (GATING_BACKWARD, GRAPH_950, ROUTER_BWD, {}, "aclnn",
     "CANN documents aclnnMoeGatingTopKBackward on 950 too"),
    (GATING_SOFTMAX_BACKWARD, A2_GRAPH, ROUTER_BWD, {}, "composition", "Ascend has no kernel"),
    (GATING_GRAD, A2_GRAPH, ROUTER_BWD + (None,), {}, "composition",
     "composed of the router backwards (aclnn where they have it)"),
    (GATING_GRAD, CPU_GRAPH, ROUTER_BWD + (None,), {}, "kernel", "the CPU kernel on CPU"),
    (SWIGLU_GROUP, A2_GRAPH, SWIGLU, {}, "composition", "no aclnn forward kernel exists"),
    (SWIGLU_GROUP, CPU_GRAPH, SWIGLU, {}, "kernel", "the CPU kernel on CPU"),
    (SWIGLU_GROUP_QUANT_GRAD, GRAPH_950, SWIGLU_BWD, dict(clamp_limit=7.0), "aclnn",
     "aclnnSwigluGroupQuantGrad exists on 950 only"),
    (SWIGLU_GROUP_QUANT_GRAD, PYNATIVE_950, SWIGLU_BWD, {}, "aclnn",
     "PyNative: the C++ extension"),
    (SWIGLU_GROUP_QUANT_GRAD, A2_GRAPH, SWIGLU_BWD, {}, "composition", "not on A2/A3"),
    (MOE_FFN, A2_GRAPH, ffn_sig("float16"), {}, "aclnn", "float16: aclnnFFNV3"),
    (MOE_FFN, A2_GRAPH, ffn_sig("float16"), dict(tokens_index_flag=True, padded=True), "aclnn",
     "cumulative and padded: aclnnFFNV3"),
    (MOE_FFN, A2_GRAPH, ffn_sig("bfloat16"), {}, "composition",
     "aclnnFFNV3 documents bfloat16 for Atlas A2 inference products only"),
    (MOE_FFN, A2_PYNATIVE, ffn_sig("float16"), {}, "aclnn",
     "PyNative: aclnnFFNV3 through the C++ extension"),
    (MOE_FFN, A2_PYNATIVE, ffn_sig("bfloat16"), {}, "composition",
     "bfloat16 in PyNative trains composed"),
    (MOE_FFN, A3_GRAPH, ffn_sig("float16"), {}, "composition",
     "the FFN kernels are documented for Atlas A2 only"),
    (MOE_FFN, A2_GRAPH, ffn_sig("float32"), dict(activation="gelu"), "composition",
     "float32 trains composed"),
    (MOE_FFN, A2_GRAPH, ffn_sig("float16", h=65536), {}, "composition",
     "aclnnFFN(V3) needs H < 65536"),
    (MOE_FFN, GRAPH_950, ffn_sig("float16"), {}, "composition", "no FFN kernel on 950"),
    (MOE_FFN, A2_GRAPH, ffn_sig("int8"), {}, "aclnn", "int8 with float16 output: aclnnFFNV3"),
    (MOE_FFN, A2_PYNATIVE, ffn_sig("int8"), {}, "aclnn", "int8 in PyNative: aclnnFFNV3"),
    (MOE_FFN, CPU_GRAPH, ffn_sig("int8"), dict(output_dtype="bfloat16"), "kernel",
     "the CPU kernel has every output dtype"),
    (GROUPED_MATMUL, A2_GRAPH, GMM, {}, "builtin", "MindSpore's grouped matmul"),
    (GROUPED_MATMUL, PYNATIVE_950, GMM, dict(cumulative=True), "builtin", "on 950 too"),
    (GROUPED_MATMUL, ("Ascend", "ascend310p", "pynative", None), GMM, {}, "composition",
     "an SoC without it"),
    (GROUPED_MATMUL, CPU_GRAPH, GMM, {}, "kernel", "the CPU kernel on CPU"),
    (PERMUTE, A2_PYNATIVE, PERMUTE_K8, dict(num_experts=64), "builtin", "top-k 8 <= 512"),
    (PERMUTE, A2_GRAPH, sig(("bfloat16", (4, 64)), ("int32", (4, 600))), dict(num_experts=1024),
     "composition", "top-k 600 > 512"),
    (PERMUTE, GRAPH_950, PERMUTE_K8, dict(num_experts=64), "builtin",
     "CANN documents aclnnMoeTokenPermute on 950"),
    (UNPERMUTE, A3_GRAPH, UNPERMUTE_K8, dict(with_probs=True), "builtin", "top-k 8 <= 512"),
    (UNPERMUTE, A2_GRAPH, sig(("bfloat16", (1200, 64)), ("int32", (1200,)), None),
     dict(top_k=600), "composition", "top-k 600 > 512"),
    (UNPERMUTE_BACKWARD, A2_GRAPH, UNPERMUTE_BWD, dict(with_probs=True), "composition",
     "composed on Ascend"),
]


@pytest.mark.parametrize("op,platform,signature,attrs,expected,why", SELECTION,
                         ids=[f"{s[0].name}-{'-'.join(s[1][:3])}-{s[4]}" for s in SELECTION])
def test_selection(op, platform, signature, attrs, expected, why):
    if expected == "kernel" and kernels_missing():
        pytest.skip(f"the CPU kernel: {kernels_missing()}")
    assert choice(op, platform, signature, **attrs) == expected, why


def test_a_kernel_the_installed_cann_lacks_is_passed_over(monkeypatch, caplog):
    with_cann(monkeypatch, missing=("aclnnMoeGatingTopKBackward",))
    with caplog.at_level(logging.INFO, logger="ms_moe_ops"):
        assert choice(GATING_BACKWARD, A2_GRAPH, ROUTER_BWD) == "composition"
    assert ("moe_gating_top_k_backward: composition on Ascend A2, graph mode; passed over: aclnn "
            "(the installed CANN does not have aclnnMoeGatingTopKBackward)") in caplog.text
    with pytest.raises(ValueError, match="MS_MOE_OPS_IMPL=aclnn .*does not have "
                                         "aclnnMoeGatingTopKBackward"):
        choice(GATING_BACKWARD, forced(A2_GRAPH, "aclnn"), ROUTER_BWD)


def test_an_implementation_mindspore_cannot_build_here_is_passed_over(monkeypatch, caplog):
    # building a Custom aclnn primitive on a device compiles a callback against the installed
    # CANN (ASCEND_OPP_PATH, g++, a writable cache directory, the kernel's header): when that
    # fails, the next implementation runs, and the reason is logged
    from ascend_sim import as_on
    from conftest import run
    from ms_moe_ops.ops import _impls

    def no_compiler(name, *args, **kwargs):
        raise RuntimeError("g++ not found")

    as_on(monkeypatch, A2)
    monkeypatch.setattr(_impls.ops, "Custom", no_compiler)
    monkeypatch.setattr(_op, "_BROKEN", {})
    x = Tensor(np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32))

    def route(v):
        return GATING_TOP_K(v, None, k=2, eps=1e-11)[1]

    with caplog.at_level(logging.WARNING, logger="ms_moe_ops"):
        idx = run(route, x, mode="graph")
    assert np.array_equal(np.sort(idx.asnumpy(), 1), np.sort(np.argsort(-x.asnumpy())[:, :2], 1))
    assert "moe_gating_top_k: aclnn passed over: building it failed (RuntimeError: g++ not " \
        "found)" in caplog.text
    monkeypatch.setenv(_platform.IMPL_ENV, "aclnn")
    with pytest.raises(ValueError, match="building it failed"):
        run(route, x, mode="graph")


def test_int8_without_a_fitting_builtin_is_not_implemented():
    with pytest.raises(NotImplementedError, match=r"moe_ffn: .*Ascend A2, graph mode.*"
                                                  r"output_dtype='float16'.*composition \(the "
                                                  r"int8 path has no composition\)"):
        choice(MOE_FFN, A2_GRAPH, ffn_sig("int8"), output_dtype="bfloat16")


def test_every_operator_resolves_on_every_platform():
    # every operator has a composition that runs anywhere: no platform is left without one
    for op in OPERATORS:
        assert op.impl("composition") is not None and op.impl("composition").target is None
        assert op.impls[0].name == "kernel"


# -- MS_MOE_OPS_IMPL ------------------------------------------------------------------------------

def forced(platform, name):
    return platform[:3] + (name,)


def test_override_forces_the_composition_everywhere():
    assert choice(GATING_TOP_K, forced(CPU_GRAPH, "composition"), ROUTER, k=8) == "composition"
    assert choice(GATING_TOP_K, forced(A2_GRAPH, "composition"), ROUTER, k=8) == "composition"
    assert choice(MOE_FFN, forced(A2_GRAPH, "composition"), ffn_sig("float16")) == "composition"


def test_operator_without_the_forced_implementation_keeps_its_own():
    if kernels_missing():
        pytest.skip(f"the CPU kernel: {kernels_missing()}")
    op = _op.OpDef(name="kernel_only", inputs=("x",), outputs=("y",),
                   infer=lambda a, x: (x,), infer_dtype=lambda a, x: (x,),
                   impls=(kernel("Nothing"),))
    assert choice(op, forced(CPU_GRAPH, "composition"), sig(("float32", (2,)))) == "kernel"


def test_forced_choice_surfaces_its_errors_automatic_choice_falls_back():
    big = sig(("float32", (4, 2048)), None)
    assert choice(GATING_TOP_K, A2_GRAPH, big, k=8, group_count=128) == "composition"
    with pytest.raises(ValueError, match=r"MS_MOE_OPS_IMPL=aclnn .* 32 \(32\) x group_count \(128\)"):
        choice(GATING_TOP_K, forced(A2_GRAPH, "aclnn"), big, k=8, group_count=128)
    with pytest.raises(ValueError, match="runs on Ascend only"):
        choice(GATING_TOP_K, forced(CPU_GRAPH, "aclnn"), ROUTER, k=8)
    # in PyNative mode the forced aclnn kernel is the one of the C++ extension route
    pynative = _op.choose(GATING_TOP_K, tuple(GATING_TOP_K.resolve(k=8).items()),
                          forced(A2_PYNATIVE, "aclnn"), ROUTER)
    assert (pynative.name, pynative.route) == ("aclnn", "extension")
    with pytest.raises(ValueError, match="the int8 path has no composition"):
        choice(MOE_FFN, forced(CPU_GRAPH, "composition"), ffn_sig("int8"))


def test_unknown_override_is_an_error():
    with pytest.raises(ValueError, match="MS_MOE_OPS_IMPL must be one of"):
        choice(GATING_TOP_K, forced(CPU_GRAPH, "fast"), ROUTER, k=8)


def test_override_is_read_on_every_call(monkeypatch, caplog):
    # the cache key holds the override: setting it takes effect at once
    x = Tensor(np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32))
    attrs = dict(k=2, routed_scaling_factor=1.25)
    with caplog.at_level(logging.INFO, logger="ms_moe_ops"):
        kernel_out = GATING_TOP_K(x, None, **attrs)
        monkeypatch.setenv(_platform.IMPL_ENV, "composition")
        composed_out = GATING_TOP_K(x, None, **attrs)
    assert "moe_gating_top_k: composition (forced by MS_MOE_OPS_IMPL)" in caplog.text
    np.testing.assert_array_equal(kernel_out[1].asnumpy(), composed_out[1].asnumpy())


# -- what runs -------------------------------------------------------------------------------------

def _router_call():
    x = Tensor(np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32))
    return lambda **attrs: GATING_TOP_K(x, None, k=2, **attrs)


@pytest.mark.parametrize("forced", ["kernel", "composition"])
@pytest.mark.parametrize("mode", ["pynative", "graph"])
def test_the_forced_implementation_is_the_one_that_runs(monkeypatch, forced, mode):
    from conftest import run
    from ms_moe_ops.ops import record_choices

    x = Tensor(np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32))

    def route(v):
        return GATING_TOP_K(v, None, k=2, eps=1e-9)[0]

    monkeypatch.setenv(_platform.IMPL_ENV, forced)
    with record_choices() as ran:
        run(route, x, mode=mode)
    assert ran == [("moe_gating_top_k", forced)]


def test_the_built_callable_is_the_chosen_implementations():
    # the same attributes built for two implementations: each call runs its own
    from ms_moe_ops.ops import record_choices

    call = _router_call()
    with record_choices() as ran:
        for forced in ("composition", "kernel", "composition"):
            os.environ[_platform.IMPL_ENV] = forced
            try:
                call(eps=1e-7)
            finally:
                del os.environ[_platform.IMPL_ENV]
    assert ran == [("moe_gating_top_k", n) for n in ("composition", "kernel", "composition")]


@pytest.mark.parametrize("spelling", ["Composition", " COMPOSITION ", "composition"])
def test_the_override_is_read_in_any_letter_case(monkeypatch, spelling):
    from ms_moe_ops.ops import record_choices

    monkeypatch.setenv(_platform.IMPL_ENV, spelling)
    with record_choices() as ran:
        _router_call()(eps=1e-8)
    assert ran == [("moe_gating_top_k", "composition")]


def test_attribute_cache_keeps_an_int_and_a_float_apart():
    call = _router_call()
    call(group_count=1)
    with pytest.raises(TypeError, match="attribute 'group_count' must be int"):
        call(group_count=1.0)
    with pytest.raises(TypeError, match="attribute 'out_flag' must be bool"):
        call(out_flag=1)


# -- the log and the cache ------------------------------------------------------------------------

def test_a_fallback_is_logged_with_its_reasons(caplog):
    with caplog.at_level(logging.INFO, logger="ms_moe_ops"):
        choice(GATING_TOP_K, A2_PYNATIVE, sig(("float32", (4, 2048)), None), k=8,
               group_count=128, eps=1e-12)
    assert ("moe_gating_top_k: composition on Ascend A2, pynative mode; passed over: aclnn "
            "(runs in graph mode only); aclnn (experts per group aligned up to 32 (32) x "
            "group_count (128) = 4096 > 2048)") in caplog.text


def test_the_preferred_choice_is_logged_at_debug(caplog):
    with caplog.at_level(logging.DEBUG, logger="ms_moe_ops"):
        choice(GATING_TOP_K, A2_GRAPH, ROUTER, k=8, eps=1e-13)
    assert "moe_gating_top_k: aclnn on Ascend A2, graph mode" in caplog.text
    assert not [r for r in caplog.records if r.levelno > logging.DEBUG]


@pytest.mark.parametrize("field,other", [(0, "CPU"), (1, "ascend310p"), (2, "pynative"),
                                         (3, "composition")])
def test_cache_key_holds_target_soc_mode_and_override(field, other):
    key, attrs = list(A2_GRAPH), tuple(GATING_TOP_K.resolve(k=8).items())
    first = _op.choose(GATING_TOP_K, attrs, tuple(key), ROUTER)
    assert first.name == "aclnn"
    key[field] = other
    assert _op.choose(GATING_TOP_K, attrs, tuple(key), ROUTER) is not first


def test_platform_is_read_from_mindspore():
    assert _platform.device_target() == ms.get_context("device_target")
    if _platform.device_target() != "Ascend":
        assert _platform.soc_family() == ""
    assert _platform.execution_mode() == "pynative"
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        assert _platform.execution_mode() == "graph"
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


def test_a_jit_function_in_pynative_mode_resolves_as_graph(monkeypatch):
    """A @ms.jit function is compiled into a graph although the context says PyNative: the
    PyNative-only routes (the C++ extension's runner) must not be chosen there."""
    monkeypatch.setenv(_platform.IMPL_ENV, "composition")
    modes = []
    real = _op.choose

    def spy(op, attr_items, platform, signature, *rest):
        modes.append(platform[2])
        return real(op, attr_items, platform, signature, *rest)

    spy.cache_clear = real.cache_clear
    monkeypatch.setattr(_op, "choose", spy)

    def permute(a, b):
        return PERMUTE(a, b, num_experts=4)[0]

    x = Tensor(np.ones((4, 3), np.float32))
    idx = Tensor(np.array([[0, 1], [2, 3], [1, 0], [3, 2]], np.int32))
    permute(x, idx)
    ms.jit(permute)(x, idx)
    assert modes == ["pynative", "graph"]


@pytest.mark.parametrize("name,family", [
    ("ascend910b", A2), ("Ascend910B3", A2), ("ascend910_93", A3), ("Ascend910_9391", A3),
    ("ascend950", S950), ("Ascend950DT_9571", S950), ("Ascend910_9599", S950),
    ("ascend310p", "ascend310p"), ("", "")])
def test_soc_families(name, family):
    assert _platform.family_of(name) == family


# -- whatever runs, the declaration validates -------------------------------------------------------

def test_validation_holds_for_every_implementation(monkeypatch):
    monkeypatch.setenv(_platform.IMPL_ENV, "composition")
    x = tensor(np.zeros((4, 3), np.int32))
    with pytest.raises(TypeError, match="moe_token_permute: 'x' must have dtype"):
        PERMUTE(x, tensor(np.zeros((4, 2), np.int32)), num_experts=4)
    with pytest.raises(ValueError, match="swiglu_group: input 'x' is required"):
        SWIGLU_GROUP(None, None, None)
    with pytest.raises(ValueError, match="swiglu_group: the last dimension of 'x' must be even"):
        SWIGLU_GROUP(tensor(np.zeros((4, 5), np.float32)), None, None)


def test_an_unhashable_attribute_is_the_attributes_type_error():
    x, idx = tensor(np.zeros((2, 3), np.float32)), tensor(np.zeros((2, 1), np.int32))
    with pytest.raises(TypeError, match="moe_token_permute: attribute 'num_experts' must be int"):
        PERMUTE(x, idx, num_experts=[4])


class _Permuter(nn.Cell):
    def construct(self, x, idx):
        return PERMUTE(x, idx, num_experts=4)[0]


def test_dynamic_shapes_resolve_once_while_compiling(monkeypatch):
    # a run-time dimension reaches the resolver as -1, at compile time, not at every step
    monkeypatch.setenv(_platform.IMPL_ENV, "composition")
    seen = []

    def spy(op, signature, *args, **kwargs):
        seen.append(tuple(None if s is None else s[1] for s in signature))
        return _op._resolve_now(op, signature, *args, **kwargs)

    monkeypatch.setattr(_op, "_resolve", functools.partial(spy))
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        net = _Permuter()
        net.set_inputs(Tensor(shape=[None, 3], dtype=ms.float32),
                       Tensor(shape=[None, 2], dtype=ms.int32))
        for t in (4, 6):
            idx = np.arange(2 * t, dtype=np.int32).reshape(t, 2) % 4
            out = net(Tensor(np.ones((t, 3), np.float32)), Tensor(idx))
            assert out.shape == (2 * t, 3)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert seen == [((-1, 3), (-1, 2))]


# -- the implementation table of docs/ascend.md ----------------------------------------------------

def test_docs_table_is_generated_from_the_declarations():
    import importlib.util

    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools",
                        "implementation_table.py")
    spec = importlib.util.spec_from_file_location("implementation_table", tool)
    implementation_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(implementation_table)
    with open(implementation_table.DOC, encoding="utf-8") as f:
        text = f.read()
    assert implementation_table.with_table(text) == text, (
        "docs/ascend.md's implementation table is stale: run python tools/implementation_table.py "
        "--write")


def test_docs_table_is_the_same_on_a_bare_host():
    # the table is a function of the declarations alone: generated in a fresh process whose
    # environment names no CANN (no kernel installed, no SoC), it is still the committed one
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASCEND", "MS_MOE_OPS"))}
    # (the package imported here, a checkout's or an installed one: not whatever root holds)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(
        _op.__file__))))
    out = subprocess.run([sys.executable, os.path.join(root, "tools", "implementation_table.py"),
                          "--check"], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("op,platform,signature,attrs,expected,why", SELECTION,
                         ids=[f"{s[0].name}-{'-'.join(s[1][:3])}-{s[4]}" for s in SELECTION])
def test_every_choice_is_a_candidate_of_the_table(op, platform, signature, attrs, expected, why):
    # what the resolver chooses is one of the implementations the table lists for the platform
    from ms_moe_ops.ops._table import candidates

    names = [impl.name for impl in candidates(op, *platform[:3])]
    assert expected in names, (op.name, platform, names)


def test_host_counts_kernel_is_not_chosen_for_a_graph_sunk_whole(monkeypatch):
    """aclnnMoeFFN reads the expert counts on the host each step (value-depend, kernel by kernel):
    under jit_level O2 the whole graph is sunk to the device and no host step runs between
    kernels, so the resolver passes it over there, saying why."""
    with_cann(monkeypatch, missing=("aclnnFFNV3",))
    attrs = tuple(MOE_FFN.resolve().items())
    chosen = _op.choose(MOE_FFN, attrs, A2_GRAPH, ffn_sig("float16"), "O1")
    assert (chosen.about, chosen.route) == ("aclnnMoeFFN", "extension")
    assert _op.choose(MOE_FFN, attrs, A2_GRAPH, ffn_sig("float16"), "").about == "aclnnMoeFFN"
    assert _op.choose(MOE_FFN, attrs, A2_GRAPH, ffn_sig("float16"), "O2").name == "builtin"
    ext = next(i for i in MOE_FFN.impls if i.about == "aclnnMoeFFN")
    assert "jit_level O2" in ext.unavailable("Ascend", A2, "graph", "O2")
    # PyNative mode has no sunk graph: the runner copies the counts to the host
    assert _op.choose(MOE_FFN, attrs, A2_PYNATIVE, ffn_sig("float16"), "").about == "aclnnMoeFFN"


def test_jit_level_is_read_from_the_context():
    assert _platform.jit_level() in ("", "O0", "O1", "O2")
    before = ms.get_context("jit_config")
    ms.set_context(jit_config={"jit_level": "O2"})
    try:
        assert _platform.jit_level() == "O2"
    finally:
        ms.set_context(jit_config={"jit_level": before.get("jit_level") or "O0"})
