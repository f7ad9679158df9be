"""Ascend aclnn bindings against the kernels' prototypes (tests/data/aclnn_prototypes.json, each
with its source): argument order; which arguments are device tensors, host arrays or scalars;
each scalar's C type; and what MindSpore 2.10's own aclnn code generator makes of the
registration. There is no Ascend device here: these are the checks a CPU can make."""
import dataclasses
import json
import os
import re

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, ops
from mindspore.ops.operations._custom_ops_utils import CustomCodeGenerator

from ms_moe_ops.ops import OPERATORS, _impls
from ms_moe_ops.ops._op import ABSENT, ACLNN_SCALARS, HOST, AclnnBinding, Attr, OpDef
from ms_moe_ops.ops.ffn import MOE_FFN
from ms_moe_ops.ops.swiglu import ACLNN_CLAMP_OFF, SWIGLU_GROUP_QUANT_GRAD

_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "aclnn_prototypes.json")
PROTOTYPES = json.load(open(_DATA, encoding="utf-8"))["prototypes"]
BOUND = {p["kernel"]: p for p in PROTOTYPES if p["bound"]}
# one entry per binding (a binding has an ops.Custom route in GRAPH mode and the C++ extension
# route, or the extension route alone when it takes host arguments)
ACLNN = list({impl.binding: (op, impl) for op in OPERATORS for impl in op.impls
              if impl.name == "aclnn"}.values())
CUSTOM = [(op, impl) for op, impl in ACLNN if impl.route == ""]


def parse_prototype(entry):
    """[(snake_name, C type, optional)] of the call arguments: outputs, workspaceSize and
    executor dropped."""
    args = re.search(r"\((.*)\)", entry["prototype"], re.S).group(1).split(",")
    params = []
    for arg in args[:len(args) - 2 - entry["outputs"]]:
        words = arg.replace("*", " * ").split()
        name, ctype = words[-1], " ".join(w for w in words[:-1] if w != "const").replace(" *", "*")
        optional = name.endswith("Optional") or name in entry.get("optional", ())
        snake = re.sub(r"(?<!^)(?=[A-Z])", "_", re.sub(r"Optional$", "", name)).lower()
        params.append((snake, ctype.replace(" ", ""), optional))
    return params


def problems(op, args, entry):
    """Why a binding (its (name, kind) arguments) cannot call the prototype `entry`."""
    params = parse_prototype(entry)
    found = []
    if [a for a, _ in args] != [p for p, _, _ in params]:
        found.append(f"argument order {[a for a, _ in args]} != {[p for p, _, _ in params]}")
    for (arg, kind), (_, ctype, optional) in zip(args, params):
        if kind == HOST:
            if ctype != "aclIntArray*":
                found.append(f"'{arg}': the kernel takes {ctype}, the binding passes a host array")
        elif kind in ("tensor", ABSENT):
            if ctype == "aclIntArray*":
                found.append(f"'{arg}': the kernel takes a host aclIntArray, the binding passes a "
                             f"device tensor")
            elif ctype != "aclTensor*":
                found.append(f"'{arg}': the kernel takes {ctype}, the binding passes a tensor")
            elif not optional and (kind == ABSENT or arg in op.optional):
                found.append(f"'{arg}': required by the kernel, the binding may pass None")
        elif ACLNN_SCALARS.get(kind) != ctype:
            found.append(f"'{arg}': registered as {kind} ({ACLNN_SCALARS.get(kind)}), the kernel "
                         f"takes {ctype}")
    return found


def prototype_types(entry):
    """The C types of every argument, as MindSpore's generator reads them from a header."""
    args = re.search(r"\((.*)\)", entry["prototype"], re.S).group(1).split(",")
    return [re.search(r"^\s*(\w+\s*\*+|\w+)", a.replace("const ", "")).group(1).replace(" ", "")
            for a in args]


def test_every_aclnn_binding_has_its_prototype():
    assert sorted(impl.binding.kernel for _, impl in ACLNN) == sorted(BOUND)


@pytest.mark.parametrize("kernel", sorted(BOUND))
def test_binding_matches_prototype(kernel):
    op, impl = next((op, impl) for op, impl in ACLNN if impl.binding.kernel == kernel)
    assert problems(op, impl.binding.args, BOUND[kernel]) == []


@pytest.mark.parametrize("kernel", sorted(impl.binding.kernel for _, impl in CUSTOM))
def test_registration_is_what_mindspore_generates_from_the_header(kernel):
    # MindSpore 2.10 builds the call from the installed header when it finds it, else from the
    # registration: both must give the prototype's types, and the generator must accept them
    op, impl = next((op, impl) for op, impl in CUSTOM if impl.binding.kernel == kernel)
    info = _impls.aclnn_reg_info(op, impl.binding)
    header = prototype_types(BOUND[kernel])
    generator = CustomCodeGenerator()
    assert generator.get_api_types_by_reg_info(info)[:-2] == header[:-2]
    code = generator.generate_callback_by_types(kernel, info, header)
    assert f"{kernel}GetWorkSpaceSize" in code


def test_checks_find_the_known_mismatches():
    # the document's own SwiGLU prototype (aclIntArray groupIndex) and aclnnMoeFFN (a host
    # aclIntArray of expert tokens) cannot be bound to device tensors
    swiglu_doc = next(p for p in PROTOTYPES if p["kernel"] == "aclnnSwigluGroupQuantGrad"
                      and not p["bound"])
    found = problems(SWIGLU_GROUP_QUANT_GRAD, SWIGLU_GROUP_QUANT_GRAD.impl("aclnn").binding.args,
                     swiglu_doc)
    assert found == ["'group_index': the kernel takes a host aclIntArray, the binding passes a "
                     "device tensor"]
    moe_ffn_doc = next(p for p in PROTOTYPES if p["kernel"] == "aclnnMoeFFN")
    naive = tuple((name, "tensor") for name in MOE_FFN.inputs) + (("activation", "str"),)
    found = problems(MOE_FFN, naive, moe_ffn_doc)
    assert "'expert_tokens': the kernel takes a host aclIntArray, the binding passes a device " \
        "tensor" in found
    assert not [f for f in found if "activation" in f]  # the char* activation crosses
    # a tensor the kernel requires, passed as possibly None
    v3 = MOE_FFN.impl("aclnn").binding.args
    optional_x = tuple((a, ABSENT if a == "weight1" else k) for a, k in v3)
    assert problems(MOE_FFN, optional_x, BOUND["aclnnFFNV3"]) == [
        "'weight1': required by the kernel, the binding may pass None"]
    # a double registered as float is found too
    op, impl = next((op, impl) for op, impl in ACLNN if impl.binding.kernel ==
                    "aclnnMoeGatingTopKBackward")
    as_float = tuple((a, "float" if k == "double" else k) for a, k in impl.binding.args)
    assert problems(op, as_float, BOUND["aclnnMoeGatingTopKBackward"]) == [
        "'routed_scaling_factor': registered as float (float), the kernel takes double",
        "'eps': registered as float (float), the kernel takes double"]


def test_moe_ffn_binds_ffn_v3_and_the_seeds_moe_ffn_with_host_counts():
    bound = [(impl.binding.kernel, impl.route, impl.modes) for impl in MOE_FFN.impls
             if impl.name == "aclnn"]
    assert bound == [("aclnnFFNV3", "", ("graph",)), ("aclnnFFNV3", "extension", ("pynative",)),
                     ("aclnnMoeFFN", "extension", ("graph", "pynative"))]
    moe_ffn = MOE_FFN.impls[3].binding
    assert dict(moe_ffn.args)["expert_tokens"] == HOST


def test_a_list_cannot_be_registered():
    # a host list is an input of the operator (`name:host`, the C++ extension route), never an
    # attribute (a constant of the graph)
    impl = _impls.aclnn("aclnnX", "x, sizes:listInt", socs=("A2",),
                        dtypes=[("float32", "float32")])[0]
    with pytest.raises(TypeError, match="'sizes' has type 'listInt'"):
        OpDef(name="x_op", inputs=("x",), outputs=("y",), infer=None, infer_dtype=None,
              impls=(impl,), attrs=(Attr("sizes", str, "a"),))


def test_every_scalar_type_is_one_mindspore_can_pass():
    for _, impl in ACLNN:
        for _, kind in impl.binding.args:
            assert kind in ("tensor", ABSENT, HOST) or kind in ACLNN_SCALARS


class _Recorder:
    """Stands in for ops.Custom: records the registration, returns the call's arguments."""
    made = []

    def __init__(self, func, out_shape=None, out_dtype=None, func_type=None, bprop=None,
                 reg_info=None):
        self.reg_info = reg_info
        _Recorder.made.append(self)

    def __call__(self, *args):
        return args


@pytest.mark.parametrize("clamp,sent", [(0.0, ACLNN_CLAMP_OFF), (-3.0, ACLNN_CLAMP_OFF),
                                        (2.5, 2.5)])
def test_clamp_off_reaches_the_aclnn_kernel_as_the_largest_float(monkeypatch, clamp, sent):
    # aclnnSwigluGroupQuantGrad's versions read 0 or -1 as "off" (and reject or misread the
    # other): a limit no finite input reaches is the same to both; the CPU kernel keeps the value
    monkeypatch.setattr(_impls.ops, "Custom", _Recorder)
    monkeypatch.setattr(_Recorder, "made", [])
    op = SWIGLU_GROUP_QUANT_GRAD
    attrs = op.resolve(clamp_limit=clamp)
    assert attrs["clamp_limit"] == clamp
    call = op.impl("aclnn").build(op, attrs)
    assert call(("gy", "x", "w", "yo", None)) == ("gy", "x", "w", "yo", None, sent)
    info = _Recorder.made[-1].reg_info
    assert [(a["name"], a["type"]) for a in info["attr"]] == [("clamp_limit", "double")]
    assert all("value" not in a for a in info["attr"])  # values travel as call inputs


class _SwigluGradKernel(_Recorder):
    """aclnnSwigluGroupQuantGrad's stand-in: grad_x, and a grad_weight buffer it did not write."""

    def __call__(self, *args):
        x = args[1]
        return ops.zeros_like(x), ops.full((x.shape[0], 1), 7.0, dtype=ms.float32)


@pytest.mark.parametrize("weighted", [False, True])
def test_grad_weight_without_weight_is_zeros_not_the_unwritten_buffer(monkeypatch, weighted):
    monkeypatch.setattr(_impls.ops, "Custom", _SwigluGradKernel)
    monkeypatch.setattr(_Recorder, "made", [])
    op = SWIGLU_GROUP_QUANT_GRAD
    rng = np.random.default_rng(0)
    gy, x = (Tensor(rng.normal(size=s).astype(np.float32)) for s in ((3, 4), (3, 8)))
    w = Tensor(np.ones((3, 1), np.float32)) if weighted else None
    _, grad_w = op.impl("aclnn").build(op, op.resolve())((gy, x, w, gy if weighted else None, None))
    assert grad_w.shape == (3, 1) and grad_w.dtype == ms.float32
    assert grad_w.asnumpy().tolist() == ([[7.0]] * 3 if weighted else [[0.0]] * 3)


class _RouterKernel(_Recorder):
    """aclnnMoeGatingTopK's stand-in: records its arguments, returns (y, expert_idx, whatever
    the unwritten x_norm holds)."""

    def __call__(self, *args):
        self.args = args
        x = args[0]
        return x[:, :2], ops.zeros((x.shape[0], 2), dtype=ms.int32), ops.full_like(x, 7.0)


@pytest.mark.parametrize("norm_type,out_flag", [(1, True), (1, False), (0, True)])
def test_router_kernel_arguments_and_the_x_norm_it_leaves_out(monkeypatch, norm_type, out_flag):
    # renorm goes as 0 (sigmoid renormalises whatever it says; releases before 2026 take 0
    # only), out_flag as false whatever the call says (the kernel's fast tiling, and the only
    # value its first 950 releases accept): then the kernel leaves x_norm unwritten, and x_norm
    # is the scores of the logits, computed beside it
    monkeypatch.setattr(_impls.ops, "Custom", _RouterKernel)
    monkeypatch.setattr(_Recorder, "made", [])
    op = next(op for op, impl in ACLNN if impl.binding.kernel == "aclnnMoeGatingTopK")
    attrs = op.resolve(k=2, renorm=1 if norm_type else 0, norm_type=norm_type, eps=1e-6,
                       out_flag=out_flag)
    logits = np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32)
    _, _, x_norm = op.impl("aclnn").build(op, attrs)((Tensor(logits), None))
    kernel = _Recorder.made[-1]
    assert kernel.args[1:] == (None, 2, 1, 1, 0, 0, norm_type, False, 1.0, 1e-6)
    expected = 1 / (1 + np.exp(-logits)) if norm_type else \
        np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(x_norm.asnumpy(), expected, rtol=1e-5)


def test_ffn_v3_gets_the_tensors_in_its_order(monkeypatch):
    # the kernel's order (x, weight1, weight2, expert_tokens, ...), None for the antiquant
    # tensors, then the activation as a string, innerPrecise 0 and tokensIndexFlag
    monkeypatch.setattr(_impls.ops, "Custom", _Recorder)
    monkeypatch.setattr(_Recorder, "made", [])
    call = MOE_FFN.impl("aclnn").build(MOE_FFN, MOE_FFN.resolve(activation="gelu",
                                                                tokens_index_flag=True))
    names = ("x", "tokens", "w1", "b1", "w2", "b2", "scale", "offset", "dq1", "dq2")

    class Named(str):
        dtype = None

    got = call(tuple(Named(n) for n in names))
    assert list(got) == ["x", "w1", "w2", "tokens", "b1", "b2", "scale", "offset", "dq1", "dq2",
                         None, None, None, None, "gelu", 0, True]
    info = _Recorder.made[-1].reg_info
    assert [i["name"] for i in info["inputs"]][:4] == ["x", "weight1", "weight2", "expert_tokens"]


def test_dtype_rows_cover_absent_optional_inputs():
    op = SWIGLU_GROUP_QUANT_GRAD
    rows = _impls.dtype_rows(op, op.impl("aclnn").binding.dtypes)
    assert len(rows) == 3 * 2 ** 3 and len(set(rows)) == len(rows)
    assert ("float16", "float16", None, None, None, "float16", "float32") in rows


def test_binding_declaration_is_checked():
    bad = AclnnBinding("aclnnX", (("k", "int"), ("x", "tensor")), (("float32", "float32"),))
    impl = _impls.aclnn("aclnnX", "x", socs=("A2",), dtypes=[("float32", "float32")])[0]
    with pytest.raises(ValueError, match="tensors before its scalars"):
        OpDef(name="x_op", inputs=("x",), outputs=("y",), infer=None, infer_dtype=None,
              impls=(dataclasses.replace(impl, binding=bad),), attrs=(Attr("k", int, 1),))
    missing = AclnnBinding("aclnnX", (("y", "tensor"),), (("float32", "float32"),))
    with pytest.raises(ValueError, match="once each"):
        OpDef(name="x_op", inputs=("x",), outputs=("y",), infer=None, infer_dtype=None,
              impls=(dataclasses.replace(impl, binding=missing),))
    unknown = AclnnBinding("aclnnX", (("x", "tensor"), ("k", "int")), (("float32", "float32"),))
    with pytest.raises(ValueError, match="not an attribute"):
        OpDef(name="x_op", inputs=("x",), outputs=("y",), infer=None, infer_dtype=None,
              impls=(dataclasses.replace(impl, binding=unknown),))
    short = dataclasses.replace(impl, binding=impl.binding._replace(dtypes=(("float32",),)))
    with pytest.raises(ValueError, match="dtype"):
        OpDef(name="x_op", inputs=("x",), outputs=("y",), infer=None, infer_dtype=None,
              impls=(short,))
