"""The Ascend implementations, checked as far as a CPU allows (no Ascend device here):

- each one builds on CPU (the Custom primitive with its registration, MindSpore's built-in
  primitive objects) for the attribute sets the tests use (conftest repeats this after the
  session for every attribute set any test built);
- compiled in GRAPH mode on CPU, as the resolver would pick it on Atlas A2 or Ascend 950,
  MindSpore's own front end (argument handlers, type and shape inference of the built-in
  primitives, our inference for the Custom ones) accepts it and only the CPU backend refuses:
  no kernel for it on CPU.
"""
import numpy as np
import pytest
import mindspore as ms

from ms_moe_ops import reference as ref
from ms_moe_ops.ops import OPERATORS, _extension, _op, _platform
from ms_moe_ops.ops.ffn import MOE_FFN
from ms_moe_ops.ops.grouped_matmul import cover_every_row
from ascend_sim import ASCEND_ONLY, as_on, backend_refusal
from conftest import cpu_only, grad, numpy, run, tensor
from cases import CASES, compare, op_input as _t

pytestmark = cpu_only("builds the Ascend implementations on CPU, where they cannot run")

# (the C++ extension route is compiled by tests/test_ascend_extension.py, against the stub CANN tree)
ASCEND = [(op, impl) for op in OPERATORS for impl in op.impls
          if impl.target == "Ascend" and impl.route != "extension"]


@pytest.mark.parametrize("op,impl", ASCEND, ids=[f"{o.name}-{i.name}" for o, i in ASCEND])
def test_builds_on_cpu_for_every_tested_attribute_set(op, impl):
    rng = np.random.default_rng(0)
    attribute_sets = [op.resolve()]
    for case in CASES.values():
        case_op, _, attrs, _ = case(rng, "float32")
        if case_op is op:
            attribute_sets.append(op.resolve(**attrs))
    assert attribute_sets
    for attrs in attribute_sets:
        assert callable(impl.build(op, attrs))


def _int8_ffn_inputs(rng, output_dtype=None):
    i8 = lambda *s: rng.integers(-128, 128, s).astype(np.int8)  # noqa: E731
    deq = lambda *s: ref.float_to_deq_scale(rng.uniform(1e-4, 2e-4, s))  # noqa: E731
    inputs = [i8(6, 4), np.array([2, 4], np.int64), i8(2, 4, 8), np.zeros((2, 8), np.int32),
              i8(2, 8, 4), np.zeros((2, 4), np.int32), np.full(2, 100.0, np.float32),
              np.zeros(2, np.float32), deq(2, 8), deq(2, 4)]
    return MOE_FFN, inputs, dict(output_dtype=output_dtype or "")


# (impl name, SoC, case, dtype): each Ascend implementation in a call it accepts
FRONT_END = [
    ("aclnn", _platform.A2, "router_groups_max", "bfloat16"),
    ("aclnn", _platform.A3, "router_backward", "float16"),
    ("aclnn", _platform.ASCEND_950, "swiglu_backward", "bfloat16"),
    ("aclnn", _platform.ASCEND_950, "router_groups_max", "float32"),
    ("aclnn", _platform.A2, "moe_ffn", "float16"),
    ("aclnn", _platform.A2, "moe_ffn_int8", "int8"),
    ("aclnn", _platform.A2, "moe_ffn_padded", "float16"),
    ("builtin", _platform.A2, "moe_ffn", "float16"),
    ("builtin", _platform.A2, "moe_ffn_int8", "int8"),
    ("builtin", _platform.A2, "grouped_matmul", "bfloat16"),
    ("builtin", _platform.ASCEND_950, "grouped_matmul_transpose_weight", "float16"),
    ("builtin", _platform.A3, "grouped_matmul_transpose_x", "float32"),
    ("builtin", _platform.A2, "grouped_matmul_padded", "float16"),
    ("builtin", _platform.A3, "grouped_matmul_transpose_x_padded", "bfloat16"),
    ("builtin", _platform.A2, "moe_ffn_padded", "float16"),
    ("builtin", _platform.A2, "permute", "bfloat16"),
    ("builtin", _platform.A2, "unpermute", "float16"),
    ("builtin", _platform.A2, "unpermute_unweighted", "float32"),
]


# what the CPU backend calls the primitive of each built-in implementation
BUILTIN_PRIMITIVES = {"grouped_matmul": ("GroupedMatmulV4",), "moe_ffn": ("FFNExt",),
                      "moe_token_permute": ("MoeTokenPermute", "IndexAddExt"),
                      "moe_token_unpermute": ("InnerMoeTokenUnpermute",)}


def _on_ascend(monkeypatch, impl_name, soc):
    as_on(monkeypatch, soc)
    monkeypatch.setenv(_platform.IMPL_ENV, impl_name)


def _backend_refuses(fn, expected=ASCEND_ONLY):
    """fn fails, and it is the CPU backend refusing one of the `expected` Ascend kernels (the
    front end accepted everything before it)."""
    with pytest.raises(Exception) as info:  # noqa: PT011 (the message decides)
        fn()
    refused = backend_refusal(info.value)
    assert refused in expected, (refused, str(info.value).splitlines()[:8])


@pytest.mark.parametrize("impl_name,soc,case,dtype", FRONT_END)
def test_front_end_accepts(monkeypatch, impl_name, soc, case, dtype):
    rng = np.random.default_rng(1)
    if case == "moe_ffn_int8":
        op, inputs, attrs = _int8_ffn_inputs(rng)
    else:
        op, inputs, attrs, _ = CASES[case](rng, dtype)
    _on_ascend(monkeypatch, impl_name, soc)
    args = [_t(a, dtype) for a in inputs]

    def fn(*xs):
        return op(*xs, **attrs)

    impl = op.impl(impl_name)
    expected = (impl.binding.kernel,) if impl.binding else BUILTIN_PRIMITIVES[op.name]
    _backend_refuses(lambda: run(fn, *args, mode="graph"), expected)
    signature = tuple(None if a is None else (a.dtype, tuple(a.shape)) for a in args)
    platform = ("Ascend", soc, "graph", impl_name)
    assert _op.choose(op, tuple(op.resolve(**attrs).items()), platform, signature).name == \
        impl_name


@pytest.mark.parametrize("case,wrt", [("grouped_matmul", (0, 1, 3)), ("moe_ffn", (0, 2, 4))])
def test_front_end_accepts_the_builtin_backward(monkeypatch, case, wrt):
    # grouped_matmul's backward is MindSpore's own gmm_backward; moe_ffn's (float16 through the
    # built-in FFN) recomputes with grouped matmuls
    op, inputs, attrs, _ = CASES[case](np.random.default_rng(2), "float16")
    _on_ascend(monkeypatch, "builtin", _platform.A2)
    args = [_t(a, "float16") for a in inputs]

    def loss(*xs):
        out = op(*xs, **attrs)
        return out.astype(ms.float32).sum()

    _backend_refuses(lambda: grad(loss, *args, mode="graph", argnums=wrt))


def test_int8_ffn_without_a_fitting_builtin_names_platform_and_alternative(monkeypatch):
    op, inputs, attrs = _int8_ffn_inputs(np.random.default_rng(3), "bfloat16")
    as_on(monkeypatch, _platform.A2)
    with pytest.raises(NotImplementedError, match=r"Ascend A2.*output_dtype='float16'.*CPU kernel"):
        op(*[tensor(a) for a in inputs], **attrs)


@pytest.mark.parametrize("group_list,cumulative,extended,rows", [
    ([3, 0, 4], False, [3, 0, 7], 7), ([3, 3, 7], True, [3, 3, 10], 7),
    ([3, 0, 7], False, [3, 0, 7], 10)])
def test_padded_rows_join_the_last_group_and_are_masked(group_list, cumulative, extended, rows,
                                                        mode):
    # the built-in kernels need every row in a group: what their wrappers send them
    fn = lambda g: cover_every_row(g, 10, cumulative)  # noqa: E731
    every_row, covered = run(fn, tensor(np.array(group_list, np.int64)), mode=mode)
    assert numpy(every_row).tolist() == extended
    assert numpy(covered).ravel().tolist() == [True] * rows + [False] * (10 - rows)


# -- PyNative mode: every Ascend choice called, as far as the CPU allows ------------------------------

# MindSpore's PyNative refusals of a built-in primitive that has no CPU kernel (after its own
# argument handling accepted the call)
PYNATIVE_REFUSALS = ("Not found op", "unregistered", "Not implement exception")


@pytest.mark.parametrize("soc", [_platform.A2, _platform.A3, _platform.ASCEND_950])
@pytest.mark.parametrize("case", sorted(CASES))
def test_pynative_choices_run_or_only_miss_their_cpu_kernel(monkeypatch, soc, case):
    # what runs on the device in PyNative mode: a composition gives the golden results here; a
    # built-in gets through MindSpore's argument handling and stops only at the missing kernel
    op, inputs, attrs, golden = CASES[case](np.random.default_rng(4), "float32")
    as_on(monkeypatch, soc)
    args = [_t(a, "float32") for a in inputs]
    signature = tuple(None if a is None else (a.dtype, tuple(a.shape)) for a in args)
    chosen = _op.choose(op, tuple(op.resolve(**attrs).items()), ("Ascend", soc, "pynative", None),
                        signature)
    assert chosen.name in ("builtin", "composition", "aclnn"), chosen.name
    calls = []
    if chosen.route == "extension":
        # the C++ extension is compiled for Ascend only (tests/test_ascend_extension.py compiles
        # it against the stub CANN tree, and runs the same route built for CPU): here the call
        # reaches its function with the output spec the declaration infers, and stops there
        def function(op_, binding, backend="Ascend", symbol=""):
            def call(spec, *rest):
                calls.append(spec)
                raise RuntimeError(f"{binding.kernel}: unregistered on CPU")
            return call

        monkeypatch.setattr(_extension, "function", function)
        monkeypatch.setattr(_op, "_BUILT", {})  # built with this test's function, then forgotten
    try:
        out = op(*args, **attrs)
        out = out if isinstance(out, tuple) else (out,)
        numpy(out[0])  # PyNative may raise at the first read
    except RuntimeError as error:  # a built-in (or one a composition calls) without CPU kernel
        assert any(words in str(error) for words in PYNATIVE_REFUSALS), str(error)[:500]
        if chosen.route == "extension":
            assert calls and calls[0][0] == len(op.outputs), calls
        return
    assert chosen.name == "composition", "a built-in ran on CPU"
    compare(out, golden, "float32")
