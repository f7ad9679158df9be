"""opcheck: for every operator declaration and every implementation that runs on this device,
the shapes and dtypes its inference declares are the ones the implementation produces."""
import numpy as np
import pytest

from ms_moe_ops.ops import OPERATORS, _op, _platform
from ms_moe_ops.ops._checks import dtype_name
from conftest import kernels_missing, run
from cases import CASES, op_input as _t

# the first case of each operator, in float32 and bfloat16 (half precision for every float input)
_FIRST = {}
for _name in sorted(CASES):
    _FIRST.setdefault(CASES[_name](np.random.default_rng(0), "float32")[0], _name)
RUNNABLE = [(op, impl.name, dtype) for op in OPERATORS for impl in op.impls
            if impl.target in (None, _platform.device_target())
            for dtype in ("float32", "bfloat16")]


def test_every_operator_has_a_case():
    assert set(_FIRST) == set(OPERATORS)


@pytest.mark.parametrize("op,impl,dtype", RUNNABLE,
                         ids=[f"{o.name}-{i}-{d}" for o, i, d in RUNNABLE])
def test_inferred_shapes_and_dtypes_are_the_outputs(monkeypatch, op, impl, dtype):
    if impl == "kernel" and kernels_missing():
        pytest.skip(f"the CPU kernel: {kernels_missing()}")
    monkeypatch.setenv(_platform.IMPL_ENV, impl)
    _, inputs, attrs, _ = CASES[_FIRST[op]](np.random.default_rng(1), dtype)
    args = [_t(a, dtype) for a in inputs]

    def fn(*xs):
        return op(*xs, **attrs)

    outs = run(fn, *args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    resolved = op.resolve(**attrs)
    signature = tuple(None if a is None else (a.dtype, tuple(a.shape)) for a in args)
    platform = (_platform.device_target(), _platform.soc_family(), "pynative", impl)
    assert _op.choose(op, tuple(resolved.items()), platform, signature).name == impl
    shapes = op.infer(resolved, *[None if a is None else list(a.shape) for a in args])
    dtypes = op.infer_dtype(resolved, *[None if a is None else dtype_name(a.dtype) for a in args])
    assert len(outs) == len(op.outputs) == len(shapes) == len(dtypes)
    for out, shape, want in zip(outs, shapes, dtypes):
        assert (tuple(out.shape), dtype_name(out.dtype)) == (tuple(shape), want)
