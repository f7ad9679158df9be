"""The resolver: which implementation runs for a call on a patched device target, SoC family and
execution mode (each case names the implementation expected and why), the MS_MOE_OPS_IMPL
override, the log, the cache key, and the README's Ascend table against the same choices."""
import functools
import logging
import os

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
from conftest import kernels_missing, tensor

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
    (GATING_TOP_K, A2_PYNATIVE, ROUTER, dict(k=8), "composition",
     "PyNative's custom path takes tensors only: no aclnn"),
    (GATING_TOP_K, GRAPH_950, ROUTER, dict(k=8), "composition", "no aclnnMoeGatingTopK on 950"),
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
    (GATING_BACKWARD, A2_PYNATIVE, ROUTER_BWD, {}, "composition", "PyNative: no aclnn"),
    (GATING_BACKWARD, GRAPH_950, ROUTER_BWD, {}, "composition", "no kernel on 950"),
    (GATING_SOFTMAX_BACKWARD, A2_GRAPH, ROUTER_BWD, {}, "composition", "Ascend has no kernel"),
    (GATING_GRAD, A2_GRAPH, ROUTER_BWD + (None,), {}, "composition",
     "composed of the router backwards (aclnn where they have it)"),
    (GATING_GRAD, CPU_GRAPH, ROUTER_BWD + (None,), {}, "kernel", "the CPU kernel on CPU"),
    (SWIGLU_GROUP, A2_GRAPH, SWIGLU, {}, "composition", "no aclnn forward kernel exists"),
    (SWIGLU_GROUP, CPU_GRAPH, SWIGLU, {}, "kernel", "the CPU kernel on CPU"),
    (SWIGLU_GROUP_QUANT_GRAD, GRAPH_950, SWIGLU_BWD, dict(clamp_limit=7.0), "aclnn",
     "aclnnSwigluGroupQuantGrad exists on 950 only"),
    (SWIGLU_GROUP_QUANT_GRAD, PYNATIVE_950, SWIGLU_BWD, {}, "composition", "PyNative: no aclnn"),
    (SWIGLU_GROUP_QUANT_GRAD, A2_GRAPH, SWIGLU_BWD, {}, "composition", "not on A2/A3"),
    (MOE_FFN, A2_GRAPH, ffn_sig("float16"), {}, "builtin", "float16: MindSpore's FFN (aclnnFFN)"),
    (MOE_FFN, A2_PYNATIVE, ffn_sig("float16"), {}, "builtin", "built-ins run in PyNative too"),
    (MOE_FFN, A2_GRAPH, ffn_sig("bfloat16"), {}, "composition", "bfloat16 trains composed"),
    (MOE_FFN, A3_GRAPH, ffn_sig("float32"), dict(activation="gelu"), "composition",
     "float32 trains composed"),
    (MOE_FFN, A2_GRAPH, ffn_sig("float16", h=65536), {}, "composition",
     "aclnnFFN needs H < 65536"),
    (MOE_FFN, GRAPH_950, ffn_sig("float16"), {}, "composition", "no aclnnFFN on 950"),
    (MOE_FFN, A2_GRAPH, ffn_sig("int8"), {}, "builtin", "int8 with float16 output: aclnnFFN"),
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
    (PERMUTE, GRAPH_950, PERMUTE_K8, dict(num_experts=64), "composition", "not documented on 950"),
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
    with pytest.raises(ValueError, match="runs in graph mode only"):
        choice(GATING_TOP_K, forced(A2_PYNATIVE, "aclnn"), ROUTER, k=8)
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


# -- the log and the cache ------------------------------------------------------------------------

def test_a_fallback_is_logged_with_its_reasons(caplog):
    with caplog.at_level(logging.INFO, logger="ms_moe_ops"):
        choice(GATING_TOP_K, A2_PYNATIVE, ROUTER, k=8, eps=1e-12)
    assert ("moe_gating_top_k: composition on Ascend A2, pynative mode; passed over: aclnn "
            "(runs in graph mode only)") in caplog.text


def test_the_preferred_choice_is_logged_at_debug(caplog):
    with caplog.at_level(logging.DEBUG, logger="ms_moe_ops"):
        choice(GATING_TOP_K, A2_GRAPH, ROUTER, k=8, eps=1e-13)
    assert "moe_gating_top_k: aclnn on Ascend A2, graph mode" in caplog.text
    assert not [r for r in caplog.records if r.levelno > logging.DEBUG]


@pytest.mark.parametrize("field,other", [(0, "CPU"), (1, S950), (2, "pynative"),
                                         (3, "composition")])
def test_cache_key_holds_target_soc_mode_and_override(field, other):
    key = list(A2_GRAPH)
    assert choice(GATING_TOP_K, tuple(key), ROUTER, k=8) == "aclnn"
    key[field] = other
    assert choice(GATING_TOP_K, tuple(key), ROUTER, k=8) != "aclnn"


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

    def spy(op, signature, **kwargs):
        seen.append(tuple(None if s is None else s[1] for s in signature))
        return _op._resolve_now(op, signature, **kwargs)

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


# -- the README table --------------------------------------------------------------------------------

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
_WORDS = {"aclnn": "**aclnn**", "builtin": "**built-in**", "composition": "**composition**"}
_COLUMNS = {A2_GRAPH: 1, A2_PYNATIVE: 2, GRAPH_950: 3, PYNATIVE_950: 3}
_ROWS = {GATING_TOP_K: "moe_gating_top_k", GATING_BACKWARD: "moe_gating_top_k_backward",
         GATING_SOFTMAX_BACKWARD: "softmax router backward",
         GATING_GRAD: "router backward with x_norm's gradient", SWIGLU_GROUP: "swiglu_group",
         SWIGLU_GROUP_QUANT_GRAD: "swiglu_group_quant_grad", MOE_FFN: "moe_ffn",
         GROUPED_MATMUL: "grouped_matmul", PERMUTE: "moe_token_permute",
         UNPERMUTE: "moe_token_unpermute", UNPERMUTE_BACKWARD: "moe_token_unpermute backward",
         FFN_ACTIVATION_GRAD: "moe_ffn activation backward"}


def _readme_table():
    text = open(README, encoding="utf-8").read()
    table = text[text.index("| operator | Atlas A2/A3, GRAPH |"):]
    rows = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells
    return rows


def test_readme_table_names_the_resolvers_choices():
    rows = _readme_table()
    assert set(_ROWS) == set(OPERATORS) and set(rows) == set(_ROWS.values())
    for op, platform, signature, attrs, expected, why in SELECTION:
        if op not in _ROWS or platform not in _COLUMNS:
            continue
        cell = rows[_ROWS[op]][_COLUMNS[platform]]
        assert _WORDS[expected] in cell, (op.name, platform, expected, cell)
    for op, row in _ROWS.items():  # and every cell names something the operator has
        for cell in rows[row][1:4]:
            named = [name for name, word in _WORDS.items() if word in cell]
            assert named and all(op.impl(name) is not None for name in named), (row, cell)
