"""Ascend bindings against the aclnn prototypes: kernel name, positional order, argument kinds.

There is no Ascend device here; these tests check what can be checked on a CPU: the declaration
of every aclnn-backed operator and the CustomRegOp registration built from it.
"""
import os
import re

import pytest

from ms_moe_ops.ops import gating
from ms_moe_ops.ops._op import aclnn_reg_info

# First-stage prototypes (outputs and the workspace/executor arguments included, as documented).
PROTOTYPES = {
    "aclnnMoeGatingTopKBackward": (
        gating.GATING_BACKWARD,
        "aclnnMoeGatingTopKBackwardGetWorkspaceSize(const aclTensor *xNorm, const aclTensor *gradY, "
        "const aclTensor *expertIdx, int64_t renorm, int64_t normType, double routedScalingFactor, "
        "double eps, const aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor)",
        "aclnnMoeGatingTopKBackward.md"),
    "aclnnMoeGatingTopK": (
        gating.GATING_TOP_K,
        "aclnnMoeGatingTopKGetWorkspaceSize(const aclTensor *x, const aclTensor *biasOptional, "
        "int64_t k, int64_t kGroup, int64_t groupCount, int64_t groupSelectMode, int64_t renorm, "
        "int64_t normType, bool outFlag, double routedScalingFactor, double eps, "
        "const aclTensor *yOut, const aclTensor *expertIdxOut, const aclTensor *outOut, "
        "uint64_t *workspaceSize, aclOpExecutor **executor)",
        None),
}

_KINDS = {"int64_t": int, "double": float, "float": float, "bool": bool, "char": str}


def parse_prototype(text):
    """[(snake_name, kind)] of the inputs: kind 'tensor', 'optional' or a Python type."""
    args = re.search(r"\((.*)\)", text, re.S).group(1)
    parsed = []
    for arg in args.split(","):
        words = arg.replace("*", " ").split()
        ctype, name = words[-2], words[-1]
        if name in ("workspaceSize", "executor"):
            continue
        optional = name.endswith("Optional")
        name = re.sub(r"Optional$", "", name)
        snake = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
        if ctype in ("aclTensor", "aclIntArray"):
            parsed.append((snake, "optional" if optional else "tensor"))
        else:
            parsed.append((snake, _KINDS[ctype]))
    return parsed


def _seed_text(name):
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", "shared", "seeds", name)
    return open(path, encoding="utf-8").read() if os.path.exists(path) else None


@pytest.mark.parametrize("aclnn", sorted(PROTOTYPES))
def test_binding_matches_prototype(aclnn):
    op, prototype, seed = PROTOTYPES[aclnn]
    if seed and _seed_text(seed) is not None:
        flat = " ".join(_seed_text(seed).split())
        assert aclnn + "GetWorkspaceSize(" in flat
        for name, _ in parse_prototype(prototype):
            camel = re.sub(r"_(\w)", lambda m: m.group(1).upper(), name)
            assert camel in flat, camel
    assert op.aclnn == aclnn
    params = parse_prototype(prototype)
    params = params[:len(params) - len(op.outputs)]  # outputs are not call arguments
    assert tuple(name for name, _ in params) == op.aclnn_args
    attrs = {a.name: a.kind for a in op.attrs}
    for name, kind in params:
        if kind in ("tensor", "optional"):
            assert name in op.inputs
            assert (name in op.optional) == (kind == "optional"), name
        else:
            assert attrs[name] is kind, (name, attrs[name], kind)


@pytest.mark.parametrize("aclnn", sorted(PROTOTYPES))
def test_reg_info_lists_arguments_in_order(aclnn):
    op = PROTOTYPES[aclnn][0]
    attrs = op.resolve(**({"k": 2} if op is gating.GATING_TOP_K else {}))
    info = aclnn_reg_info(op, attrs)
    assert info["op_name"] == aclnn and info["target"] == "Ascend"
    assert [i["name"] for i in info["inputs"]] == list(op.inputs)
    assert [a["name"] for a in info["attr"]] == list(op.aclnn_args[len(op.inputs):])
    assert [o["name"] for o in info["outputs"]] == list(op.outputs)
    for a in info["attr"]:
        assert a["value"] == attrs[a["name"]]


def test_scalars_follow_tensors_on_ascend(monkeypatch):
    from ms_moe_ops.ops import _op
    monkeypatch.setattr(_op, "_device_target", lambda: "Ascend")
    monkeypatch.setattr(_op, "_build", lambda op, attrs, target: ("prim", target))
    _op._bind.cache_clear()
    try:
        prim, scalars = _op._bind(gating.GATING_BACKWARD, routed_scaling_factor=2.5, eps=1e-20)
        assert prim == ("prim", "Ascend")
        assert scalars == (0, 1, 2.5, 1e-20)
    finally:
        _op._bind.cache_clear()
