"""Ascend bindings against the aclnn prototypes: kernel name, positional order, argument kinds.

There is no Ascend device here; these tests check what can be checked on a CPU: the declaration
of every aclnn-backed operator and the CustomRegOp registration built from it.
"""
import os
import re

import pytest

from ms_moe_ops.ops import ffn, gating, swiglu
from ms_moe_ops.ops._op import aclnn_reg_info

# First-stage prototypes (outputs and the workspace/executor arguments included, as documented).
PROTOTYPES = {
    "aclnnMoeGatingTopKBackward": (
        gating.GATING_BACKWARD,
        "aclnnMoeGatingTopKBackwardGetWorkspaceSize(const aclTensor *xNorm, const aclTensor *gradY, "
        "const aclTensor *expertIdx, int64_t renorm, int64_t normType, double routedScalingFactor, "
        "double eps, const aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor)",
        "aclnnMoeGatingTopKBackward.md", ()),
    "aclnnMoeGatingTopK": (
        gating.GATING_TOP_K,
        "aclnnMoeGatingTopKGetWorkspaceSize(const aclTensor *x, const aclTensor *biasOptional, "
        "int64_t k, int64_t kGroup, int64_t groupCount, int64_t groupSelectMode, int64_t renorm, "
        "int64_t normType, bool outFlag, double routedScalingFactor, double eps, "
        "const aclTensor *yOut, const aclTensor *expertIdxOut, const aclTensor *outOut, "
        "uint64_t *workspaceSize, aclOpExecutor **executor)",
        None, ()),
    "aclnnSwigluGroupQuantGrad": (
        swiglu.SWIGLU_GROUP_QUANT_GRAD,
        "aclnnSwigluGroupQuantGradGetWorkspaceSize(const aclTensor *gradY, const aclTensor *x, "
        "const aclTensor *weightOptional, const aclTensor *yOriginOptional, "
        "const aclIntArray *groupIndexOptional, double clampLimit, const aclTensor *gradXOut, "
        "const aclTensor *gradWeightOutOptional, uint64_t *workspaceSize, aclOpExecutor **executor)",
        "aclnnSwigluGroupQuantGrad.md", ()),
    # expertTokens is a host aclIntArray; the biases and quantisation tensors are documented as
    # optional ("可选") without the Optional suffix.
    "aclnnMoeFFN": (
        ffn.MOE_FFN,
        "aclnnMoeFFNGetWorkspaceSize(const aclTensor *x, const aclIntArray *expertTokens, "
        "const aclTensor *weight1, const aclTensor *bias1, const aclTensor *weight2, "
        "const aclTensor *bias2, const aclTensor *scale, const aclTensor *offset, "
        "const aclTensor *deqScale1, const aclTensor *deqScale2, char *activation, "
        "const aclTensor *y, uint64_t *workspaceSize, aclOpExecutor **executor)",
        "aclnnMoeFFN.md", ("bias1", "bias2", "scale", "offset", "deq_scale1", "deq_scale2")),
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


def _normalised(text):
    return re.sub(r"\s+", " ", text).replace("( ", "(").replace(" )", ")")


def _seed_text(name):
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", "shared", "seeds", name)
    return open(path, encoding="utf-8").read() if os.path.exists(path) else None


@pytest.mark.parametrize("aclnn", sorted(PROTOTYPES))
def test_binding_matches_prototype(aclnn):
    op, prototype, seed, documented_optional = PROTOTYPES[aclnn]
    if seed and _seed_text(seed) is not None:
        assert _normalised(prototype) in _normalised(_seed_text(seed)), "prototype differs from the seed"
    assert op.aclnn == aclnn
    params = parse_prototype(prototype)
    params = params[:len(params) - len(op.outputs)]  # outputs are not call arguments
    assert tuple(name for name, _ in params) == op.aclnn_args
    attrs = {a.name: a.kind for a in op.attrs}
    for name, kind in params:
        if kind in ("tensor", "optional"):
            assert name in op.inputs
            optional = kind == "optional" or name in documented_optional
            assert (name in op.optional) == optional, name
        else:
            assert attrs[name] is kind, (name, attrs[name], kind)


@pytest.mark.parametrize("aclnn", sorted(PROTOTYPES))
def test_reg_info_lists_arguments_in_order(aclnn):
    op = PROTOTYPES[aclnn][0]
    attrs = op.resolve(**({"k": 2} if op is gating.GATING_TOP_K else {}))
    if op is swiglu.SWIGLU_GROUP_QUANT_GRAD:
        assert attrs["clamp_limit"] == -1.0  # the Ascend kernel rejects 0: -1 means "off"
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
