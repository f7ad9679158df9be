"""Properties of the resolver over random sequences of calls: what EXECUTED is the implementation
forced by MS_MOE_OPS_IMPL (any letter case, spaces around) or else the preferred one, shown both by
record_choices and by behaviour only the kernels have (they check the data: counts that do not
fit the rows are their RuntimeError, a composition computes on); the caches (attributes, choices,
built operators) are keyed by everything that changes a result: an int and a float for an int
attribute (k=2 vs k=2.0), the dtype, every attribute, the forced implementation and the
instruction-set path MS_MOE_OPS_ISA names (read at every call: an unknown one fails every kernel
call, "" is the best path). Every call is compared with the golden model."""
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, strategies as st  # noqa: E402

from ms_moe_ops import reference as ref  # noqa: E402
from ms_moe_ops.ops import _op, _platform  # noqa: E402
from ms_moe_ops.ops.gating import GATING_TOP_K  # noqa: E402
from ms_moe_ops.ops.grouped_matmul import GROUPED_MATMUL  # noqa: E402
from conftest import DEVICE, assert_close, examples, isa_paths, kernels_missing, numpy, rounded, tensor  # noqa: E402

KERNELS = DEVICE == "CPU" and not kernels_missing()
PATHS = isa_paths() if KERNELS else []
pytestmark = pytest.mark.skipif(DEVICE != "CPU", reason="CPU only: the CPU implementations")


def spellings(name):
    """name in random letter case, with spaces around or not."""
    return st.tuples(st.lists(st.booleans(), min_size=len(name), max_size=len(name)),
                     st.sampled_from(["", " ", "\t"])).map(
        lambda c: c[1] + "".join(ch.upper() if up else ch for ch, up in zip(name, c[0])) + c[1])


FORCED = st.one_of(st.none(), st.just(""), spellings("kernel"), spellings("composition"),
                   spellings("aclnn"), spellings("builtin"), st.just("fastest"))
OPS = {"router": GATING_TOP_K, "grouped_matmul": GROUPED_MATMUL}
ISA = st.sampled_from([None, ""] + PATHS + ["sse9", "AVX2"] if PATHS else [None])


@st.composite
def sequences(draw):
    """Calls drawing their attributes from two sets per sequence, each value spelled in every way
    the attribute takes (or refuses: a float for an int), so that calls meet in the caches."""
    pool = [dict(k=draw(st.sampled_from([1, 2, 3])), routed_scaling_factor=draw(st.sampled_from([1, 2.5])),
                 eps=draw(st.sampled_from([1e-20, 0.5])), norm_type=draw(st.sampled_from([0, 1])))
            for _ in range(2)]
    sequence = []
    for _ in range(draw(st.integers(2, 8))):
        op = draw(st.sampled_from(["router", "grouped_matmul"]))
        step = dict(op=op, dtype=draw(st.sampled_from(["float32", "float16", "bfloat16"])),
                    forced=draw(FORCED), isa=draw(ISA), seed=draw(st.integers(0, 2 ** 16)))
        if op == "router":
            attrs = draw(st.sampled_from(pool))
            for k_type in draw(st.lists(st.sampled_from([int, float, np.int64]), min_size=1, max_size=3)):
                scale = attrs["routed_scaling_factor"]
                scale = draw(st.sampled_from([int, float]))(scale) if scale == 1 else scale
                sequence.append(dict(step, attrs=dict(attrs, k=k_type(attrs["k"]),
                                                      routed_scaling_factor=scale)))
        else:
            step["attrs"] = dict(transpose_weight=draw(st.booleans()), cumulative=draw(st.booleans()))
            step["fault"] = draw(st.booleans())  # counts past the rows: only a kernel checks them
            sequence.append(step)
    return sequence


def _set(monkeypatch, name, value):
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)


def _router(step, rng):
    x = rounded(rng.normal(0, 2, (4, 8)), step["dtype"])
    attrs = step["attrs"]
    y, idx, x_norm = GATING_TOP_K(tensor(x, step["dtype"]), None, **attrs)
    plain = {**attrs, "k": int(attrs["k"]), "routed_scaling_factor": float(attrs["routed_scaling_factor"])}
    assert_close(numpy(x_norm), ref.moe_gating_top_k(x, **plain)[2], rtol=1e-5)
    golden_y, golden_idx = ref.gating_from_scores(numpy(x_norm), **plain)
    np.testing.assert_array_equal(numpy(idx), golden_idx)
    assert_close(numpy(y), golden_y, step["dtype"], atol=1e-6)


def _grouped_matmul(step, rng):
    dtype, attrs = step["dtype"], step["attrs"]
    counts = np.array([2, 0, 3] if not step["fault"] else [2, 9, 3], np.int64)
    x = rounded(rng.normal(size=(6, 5)), dtype)
    w = rounded(rng.normal(size=(3, 5, 4)), dtype)
    stored = w.transpose(0, 2, 1).copy() if attrs["transpose_weight"] else w
    groups = np.cumsum(counts) if attrs["cumulative"] else counts
    y = numpy(GROUPED_MATMUL(tensor(x, dtype), tensor(stored, dtype), tensor(groups), None,
                             **attrs))
    if not step["fault"]:
        assert_close(y, ref.grouped_matmul(x, w, counts), dtype, atol=1e-5 * 5)


def _expected(step):
    """(error type or None, implementation that runs)."""
    attrs, forced = step["attrs"], (step["forced"] or "").strip().lower() or None
    if step["op"] == "router" and isinstance(attrs["k"], float):
        return TypeError, None
    if forced is not None and forced not in _op.IMPL_NAMES:
        return ValueError, None
    if forced is not None and OPS[step["op"]].impl(forced) is None:
        forced = None  # an operator without that implementation resolves as usual
    if forced not in (None, "kernel", "composition"):  # (an Ascend one, on CPU)
        return ValueError, None
    impl = forced or ("kernel" if KERNELS else "composition")
    if impl == "kernel" and (step["isa"] not in [None, ""] + PATHS or step.get("fault")):
        return RuntimeError, impl
    return None, impl


@given(sequence=sequences())
@examples(12)
def test_what_runs_is_what_was_asked_for(sequence, monkeypatch):
    for step in sequence:
        _set(monkeypatch, _platform.IMPL_ENV, step["forced"])
        _set(monkeypatch, "MS_MOE_OPS_ISA", step["isa"])
        if step["forced"] and step["forced"].strip().lower() == "kernel" and not KERNELS:
            continue
        error, impl = _expected(step)
        call = _router if step["op"] == "router" else _grouped_matmul
        rng = np.random.default_rng(step["seed"])
        with _op.record_choices() as ran:
            if error is None:
                call(step, rng)
            else:
                with pytest.raises(error):
                    call(step, rng)
        if step.get("fault"):
            _drain_fault()
        assert ran == ([] if impl is None else [(OPS[step["op"]].name, impl)]), (step, ran)


def _drain_fault():
    """The injected fault's error, raised at one read, was seen raised again at the next read
    (MindSpore's PyNative launch queue, under load): one read of a fresh tensor lets the next step
    start clean. Only that fault's message is swallowed."""
    try:
        numpy(tensor(np.zeros(1, np.float32)) + 1)
    except RuntimeError as error:
        if "group_list" not in str(error):
            raise
