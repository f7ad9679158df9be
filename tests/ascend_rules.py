"""What an Ascend device requires of the graphs this package builds, as rules on the compiled IR
(tests/ascend_ir.py), each with the document that states it.

The dry run (tests/test_ascend_dry_run.py) compiles whole training steps with the resolver's
Ascend choices on CPU and applies every rule to what MindSpore's front end would hand the device.
A rule about a primitive the step should hold (`expected(soc, dtype)`) must find it there: a rule
that never finds its primitive proves nothing. tests/test_ascend_rules.py shows each rule failing
on a graph that breaks it.

Sources (CANN documents from the ops-transformer, ops-nn and ops-math operator repositories;
MindSpore 2.10's docstrings and C++ sources): see docs/ascend.md.
"""
import json
import os
import re

import numpy as np
from typing import Callable, NamedTuple

from ascend_ir import dtype_of, literal, shape_of

_PROTOTYPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                           "aclnn_prototypes.json")
A2, A3, S950 = "A2", "A3", "950"
FLOATS = ("Float16", "BFloat16", "Float32")


def _always(soc, dtype):
    return True


class Rule(NamedTuple):
    name: str
    prims: tuple           # the primitives it is about (IR names; Custom nodes by reg-op name)
    source: str            # the document that states it
    check: Callable        # (graph, soc) -> messages
    expected: Callable = _always  # (soc, dtype) -> whether a dry-run step must hold the primitive

    def applies(self, graph):
        return any(graph.of(p) for p in self.prims)

    def broken(self, graph, soc):
        return list(self.check(graph, soc))


# -- GroupedMatmul (GroupedMatmulV4 in the IR: gmm_v2_op and MindSpore's own GMM backward) ------
# arguments: x, weight, bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale,
# group_list, activation_input, activation_quant_scale, activation_quant_offset, split_item,
# group_type, group_list_type, act_type, tuning_config
_GMM_X, _GMM_W, _GMM_BIAS, _GMM_GROUPS, _GMM_GROUP_TYPE = 0, 1, 2, 8, 13
_GMM_MAX_GROUPS, _GMM_MAX_DIM = 1024, 65536


def _gmm_grouped_reduction(graph, soc):
    for node in graph.of("GroupedMatmulV4"):
        if literal(node.args[_GMM_GROUP_TYPE]) != 2:
            continue
        x = graph.through_tuples(node.args[_GMM_X])
        if x is None or x.prim != "TransposeExtView":
            yield (f"{node.where()}: group_type 2 needs x as a transposed view (TransposeExtView), "
                   f"got {x.where() if x else node.args[_GMM_X]}")
        if literal(node.args[_GMM_BIAS]) is not None:
            yield f"{node.where()}: group_type 2 takes no bias"


def _gmm_weight_not_copied(graph, soc):
    for node in graph.of("GroupedMatmulV4"):
        weight = graph.through_tuples(node.args[_GMM_W])
        if weight is not None and weight.prim == "Transpose":
            yield (f"{node.where()}: the weight is a transposed copy ({weight.where()}), made on "
                   f"every call: pass a TransposeExtView")


def _gmm_dtypes(graph, soc):
    for node in graph.of("GroupedMatmulV4"):
        x, w = dtype_of(node.inputs[_GMM_X]), dtype_of(node.inputs[_GMM_W])
        if x not in FLOATS or w != x:
            yield f"{node.where()}: x and weight must share a float dtype, got {x} and {w}"
        bias = dtype_of(node.inputs[_GMM_BIAS])
        want = "Float32" if x == "BFloat16" else x
        if bias is not None and bias != want:
            yield f"{node.where()}: a {x} product needs a {want} bias, got {bias}"
        if dtype_of(node.inputs[_GMM_GROUPS]) != "Int64":
            yield f"{node.where()}: group_list must be int64, got {node.inputs[_GMM_GROUPS]}"


def _gmm_shapes(graph, soc):
    for node in graph.of("GroupedMatmulV4"):
        x, w = shape_of(node.inputs[_GMM_X]), shape_of(node.inputs[_GMM_W])
        groups = shape_of(node.inputs[_GMM_GROUPS])
        if x is not None and len(x) != 2:
            yield f"{node.where()}: x must be 2-D, got {x}"
        if w is not None and len(w) not in (2, 3):
            yield f"{node.where()}: weight must be 2-D or 3-D, got {w}"
        if groups and groups[0] > _GMM_MAX_GROUPS:
            yield f"{node.where()}: at most {_GMM_MAX_GROUPS} groups, got {groups[0]}"
        for arg, shape in ((node.args[_GMM_X], x), (node.args[_GMM_W], w)):
            stored = _stored_shape(graph, arg, shape)
            if stored and stored[-1] >= _GMM_MAX_DIM:
                yield (f"{node.where()}: every stored last dimension must be < {_GMM_MAX_DIM}, "
                       f"got {stored}")
        if literal(node.args[12]) != 3 or literal(node.args[14]) not in (0, 1):
            yield f"{node.where()}: split_item 3 and group_list_type 0 or 1 expected"
        if literal(node.args[_GMM_GROUP_TYPE]) == 2 and len(shape_of(node.output) or ()) != 3:
            yield f"{node.where()}: group_type 2 gives a [G, K, N] result, got {node.output}"


def _stored_shape(graph, arg, shape):
    """The shape of a tensor argument as stored: the viewed tensor's for a TransposeExtView."""
    producer = graph.through_tuples(arg)
    if producer is not None and producer.prim == "TransposeExtView":
        return shape_of(producer.inputs[0])
    return shape


# -- scatters and sums at indices -------------------------------------------------------------------

def _no_scatter_reduction(graph, soc):
    for node in graph.of("TensorScatterElements"):
        if literal(node.args[-1]) not in (None, 0):
            yield f"{node.where()}: TensorScatterElements with a reduction ({node.args[-1]})"
        if dtype_of(node.inputs[0]) not in ("Float16", "Float32"):
            yield f"{node.where()}: TensorScatterElements takes float16/float32 on Ascend"


# what the package's own code must not call (MindSpore 2.10 documents the APIs as deprecated)
_DEPRECATED = ("TensorScatterAdd", "TensorScatterElements", "ScatterNd", "UnsortedSegmentSum")


def _no_deprecated_primitive(graph, soc):
    for prim in _DEPRECATED:
        for node in graph.of(prim):
            # called by ms_moe_ops' code (not MindSpore's own bprops of what it called)
            if node.source and not node.scope.startswith("Gradients"):
                yield f"{node.where()}: {prim} (a deprecated API) called by the package"


def _index_add_out_of_place(graph, soc):
    for node in graph.of("IndexAdd"):
        yield (f"{node.where()}: IndexAdd writes its first input in place (a zeros buffer of a "
               f"static shape may be a constant of the graph): use IndexAddExt on Ascend")


# -- the Custom aclnn kernels: arity and scalar kinds against the vendor prototypes ----------------

# The IR type a scalar argument may have for each C type of a prototype. A double may come as a
# float32 scalar (a Python float in a graph): MindSpore's custom aclnn kernel converts it
# (CustomV2AclnnKernelMod::ConvertTypes, kTypeDouble: a Float32 input is cast to double).
_C_KINDS = {"int64_t": ("Int64",), "bool": ("Bool",), "double": ("Float64", "Float32"),
            "float": ("Float32",), "char": ("String",), "aclIntArray": ("Tuple", "List")}


def prototypes():
    with open(_PROTOTYPES) as f:
        return {p["kernel"]: p for p in json.load(f)["prototypes"] if p["bound"]}


def prototype_args(prototype):
    """(name, C type without const and *) of every argument before the outputs."""
    body = prototype["prototype"].split("(", 1)[1].rsplit(")", 1)[0]
    args = [a.strip() for a in body.split(",")]
    args = args[:len(args) - 2 - prototype["outputs"]]  # outputs, workspaceSize, executor
    return [(a.replace("*", " ").split()[-1], re.sub(r"\bconst\b|\*", " ", a).split()[0])
            for a in args]


def _aclnn_arguments(graph, soc):
    for name, proto in prototypes().items():
        expected = prototype_args(proto)
        for node in graph.of(name):
            if len(node.args) != len(expected):
                yield (f"{node.where()}: {len(node.args)} arguments, the prototype has "
                       f"{len(expected)} before its outputs")
                continue
            for (arg_name, kind), typ in zip(expected, node.inputs):
                if kind == "aclTensor":
                    if not typ.startswith(("<Tensor", "<Ref", "<None")):
                        yield f"{node.where()}: '{arg_name}' is a tensor, the graph passes {typ}"
                    continue
                written = typ.strip("<>").split(",")[0].split("[")[0]
                if written not in _C_KINDS.get(kind, (kind,)):
                    yield (f"{node.where()}: '{arg_name}' is {kind} in the prototype, the graph "
                           f"passes {typ}")


def _only_on(kernel, socs):
    def check(graph, soc):
        for node in graph.of(kernel):
            if soc not in socs:
                yield f"{node.where()}: {kernel} runs on {'/'.join(socs)} only, not {soc}"
    return check


# -- aclnnMoeGatingTopK and its backward (CANN ops-transformer moe_gating_top_k(_backward)) --------

def _gating_top_k(graph, soc):
    for node in graph.of("aclnnMoeGatingTopK"):
        x, bias = node.inputs[0], node.inputs[1]
        shape = shape_of(x)
        if dtype_of(x) not in FLOATS or shape is None or len(shape) != 2:
            yield f"{node.where()}: x must be a 2-D float16/bfloat16/float32 tensor, got {x}"
            continue
        n = shape[1]
        if not 1 <= n <= 2048:
            yield f"{node.where()}: the expert count must be in [1, 2048], got {n}"
        if dtype_of(bias) is not None and dtype_of(bias) != dtype_of(x):
            yield f"{node.where()}: bias must have x's dtype, got {bias}"
        k, k_group, groups, mode, renorm, norm_type, out_flag = (
            literal(a) for a in node.args[2:9])
        if out_flag is not False:
            yield (f"{node.where()}: out_flag must be false (the first 950 releases reject true, "
                   f"and the fast tiling needs false), got {node.args[8]}")
        if renorm != 0 or norm_type not in (0, 1) or (soc == S950 and norm_type != 1):
            yield (f"{node.where()}: renorm 0 and norm_type 0/1 (1 on Ascend 950), got renorm="
                   f"{renorm}, norm_type={norm_type}")
        if n > 0 and n % groups == 0:
            per_group = n // groups
            if not 1 <= k_group <= groups or not 1 <= k <= k_group * per_group:
                yield f"{node.where()}: k={k}, k_group={k_group} out of range for {groups} groups"
            if mode == 1 and groups > 1 and per_group < 2:
                yield f"{node.where()}: group_select_mode 1 needs 2 experts per group"
            if groups not in (1, n) and k_group != groups and \
                    -(-per_group // 32) * 32 * groups > 2048:
                yield f"{node.where()}: the aligned group size x groups exceeds 2048"
        else:
            yield f"{node.where()}: {n} experts are not divisible into {groups} groups"
        outputs = re.findall(r"Tensor\[(\w+)\]", node.output)
        if outputs[2:] != ["Float32"]:
            yield f"{node.where()}: x_norm must be float32, got {node.output}"


def _gating_top_k_backward(graph, soc):
    for node in graph.of("aclnnMoeGatingTopKBackward"):
        x_norm, grad_y, idx = node.inputs[:3]
        if dtype_of(x_norm) != "Float32" or dtype_of(idx) != "Int32":
            yield f"{node.where()}: x_norm float32 and expert_idx int32 expected, got {x_norm}, {idx}"
        if dtype_of(node.output) != dtype_of(grad_y):
            yield f"{node.where()}: the output must have grad_y's dtype, got {node.output}"
        shape = shape_of(x_norm)
        if shape and not 2 <= shape[-1] <= 2048:
            yield f"{node.where()}: the expert count must be in [2, 2048], got {shape}"
        k = (shape_of(grad_y) or (0, 0))[-1]
        if literal(node.args[4]) != 1 or (shape and k > shape[-1]):
            yield f"{node.where()}: norm_type 1 and K <= N expected, got {node.args[4]}, K={k}"


# -- aclnnSwigluGroupQuantGrad (CANN ops-nn activation/swiglu_group_quant_grad) -------------------

def _swiglu_quant_grad(graph, soc):
    for node in graph.of("aclnnSwigluGroupQuantGrad"):
        clamp = literal(node.args[5])
        if not isinstance(clamp, float) or clamp <= 0:
            yield (f"{node.where()}: the clamp limit must be > 0 (the kernel's versions read 0 and "
                   f"-1 differently), got {node.args[5]}")
        grad_y, x, weight, y_origin, groups = node.inputs[:5]
        if dtype_of(x) not in FLOATS or dtype_of(grad_y) != dtype_of(x):
            yield f"{node.where()}: grad_y and x must share a float dtype, got {grad_y}, {x}"
        if dtype_of(weight) not in (None, "Float32"):
            yield f"{node.where()}: weight must be float32, got {weight}"
        if dtype_of(groups) not in (None, "Int64"):
            yield f"{node.where()}: group_index must be int64, got {groups}"
        if dtype_of(weight) is not None and dtype_of(y_origin) is None:
            yield f"{node.where()}: weight needs y_origin"


# -- the FFN kernels (CANN ops-transformer ffn: aclnnFFN, aclnnFFNV3) -----------------------------

_FFN_ACTIVATIONS = ('"fastgelu"', '"gelu"', '"relu"', '"silu"')


def _ffn_v3(graph, soc):
    for node in graph.of("aclnnFFNV3"):
        x, w1, w2, tokens, b1, b2 = node.inputs[:6]
        dtype = dtype_of(x)
        if dtype not in ("Float16", "BFloat16", "Int8"):
            yield f"{node.where()}: x must be float16, bfloat16 or int8, got {x}"
        tokens_shape = shape_of(tokens)
        if dtype_of(tokens) != "Int64" or not tokens_shape or tokens_shape[0] > 256:
            yield f"{node.where()}: expert_tokens must be int64 [E], E <= 256, got {tokens}"
        bias = {"Float16": "Float16", "BFloat16": "Float32", "Int8": "Int32"}.get(dtype)
        for b in (b1, b2):
            if dtype_of(b) not in (None, bias):
                yield f"{node.where()}: a {dtype} FFN takes {bias} biases, got {b}"
        for w in (w1, w2):
            shape = shape_of(w)
            if shape is None or len(shape) != 3 or max(shape[1:]) >= 65536:
                yield f"{node.where()}: weights must be [E, K, N] with K, N < 65536, got {w}"
        if dtype_of(node.output) not in ("Float16", "BFloat16"):
            yield f"{node.where()}: y must be float16 or bfloat16, got {node.output}"
        if literal(node.args[15]) != 0:
            yield f"{node.where()}: innerPrecise 0 (high precision) expected, got {node.args[15]}"
        if node.args[14].strip() not in _FFN_ACTIVATIONS:
            yield f"{node.where()}: activation {node.args[14]} is not one the kernel has"


# -- token permutation (MindSpore 2.10 moe_token_permute / moe_token_unpermute) --------------------

def _permute(graph, soc):
    for node in graph.of("MoeTokenPermute"):
        tokens, indices = node.inputs[:2]
        shape = shape_of(indices)
        if dtype_of(tokens) not in FLOATS or len(shape_of(tokens) or ()) != 2:
            yield f"{node.where()}: tokens must be 2-D float16/bfloat16/float32, got {tokens}"
        if dtype_of(indices) not in ("Int32", "Int64") or shape is None or len(shape) > 2:
            yield f"{node.where()}: indices must be int32/int64 of rank <= 2, got {indices}"
        elif len(shape) == 2 and shape[1] > 512:
            yield f"{node.where()}: top-k must be <= 512, got {shape[1]}"
        if shape and all(d >= 0 for d in shape) and np.prod(shape) >= 16777215:
            yield f"{node.where()}: fewer than 16777215 indices expected, got {shape}"


def _unpermute(graph, soc):
    for node in graph.of("InnerMoeTokenUnpermute"):
        if dtype_of(node.inputs[1]) != "Int32":
            yield f"{node.where()}: sorted_indices must be int32, got {node.inputs[1]}"


# -- collectives -------------------------------------------------------------------------------

def _alltoallv(graph, soc):
    for node in graph.of("AlltoAllV"):
        shape, dtype = shape_of(node.inputs[0]), dtype_of(node.inputs[0])
        if shape is not None and len(shape) != 1:
            yield f"{node.where()}: the input must be flattened (1-D), got {shape}"
        if dtype == "Bool":
            yield f"{node.where()}: bool is not supported"


def _alltoall(graph, soc):
    for node in graph.of("AlltoAll"):
        count = re.search(r"split_count: I64\((\d+)\)", node.attrs)
        dim = re.search(r"split_dim: I64\((-?\d+)\)", node.attrs)
        shape = shape_of(node.inputs[0])
        if not (count and dim and shape):
            yield f"{node.where()}: split_count, split_dim and the input's shape not found"
            continue
        size = shape[int(dim.group(1))]
        if size < 0:
            yield f"{node.where()}: the split dimension must be known at compile time, got {shape}"
        elif size % int(count.group(1)):
            yield (f"{node.where()}: the split dimension ({size}) must be a multiple of "
                   f"split_count ({count.group(1)})")


RULES = (
    Rule("gmm-grouped-reduction", ("GroupedMatmulV4",),
         "CANN aclnnGroupedMatmulV4: with groupType 2 x must be transposed and non-contiguous and "
         "bias null; MindSpore 2.10's own GMM backward feeds TransposeExtView",
         _gmm_grouped_reduction),
    Rule("gmm-weight-view", ("GroupedMatmulV4",),
         "CANN aclnnGroupedMatmulV4: a transposed weight is taken as a non-contiguous view (a "
         "copy of every expert's weights per call costs their size in memory traffic)",
         _gmm_weight_not_copied),
    Rule("gmm-dtypes", ("GroupedMatmulV4",),
         "CANN aclnnGroupedMatmulV4: x and weight FLOAT16/BFLOAT16/FLOAT32 alike, a bfloat16 "
         "product's bias FLOAT32, groupListOptional INT64",
         _gmm_dtypes),
    Rule("gmm-shapes", ("GroupedMatmulV4",),
         "CANN aclnnGroupedMatmulV4: x 2-D, weight 3-D (2-D with groupType 2), at most 1024 "
         "groups, every last dimension < 65536",
         _gmm_shapes),
    Rule("no-scatter-reduction", ("TensorScatterElements",),
         "MindSpore 2.10 ops.tensor_scatter_elements: on Ascend the reduction only supports "
         "'none'",
         _no_scatter_reduction, expected=lambda soc, dtype: False),
    Rule("no-deprecated-primitive", _DEPRECATED,
         "MindSpore 2.10: tensor_scatter_add, tensor_scatter_elements, scatter_nd and "
         "unsorted_segment_sum are deprecated ('will be removed after version 2.9.0')",
         _no_deprecated_primitive, expected=lambda soc, dtype: False),
    Rule("index-add-out-of-place", ("IndexAdd",),
         "MindSpore 2.10 IndexAdd: its first input is written in place (RW_WRITE), and MindSpore "
         "folds a static-shape zeros buffer into a constant",
         _index_add_out_of_place, expected=lambda soc, dtype: False),
    Rule("aclnn-prototype", tuple(prototypes()),
         "the kernels' prototypes (tests/data/aclnn_prototypes.json, from the CANN headers and "
         "documents): MindSpore passes a Custom aclnn node's arguments positionally",
         _aclnn_arguments),
    Rule("gating-top-k", ("aclnnMoeGatingTopK",),
         "CANN aclnnMoeGatingTopK (document and tiling): x 2-D FLOAT16/BFLOAT16/FLOAT32 with "
         "E <= 2048, bias of x's dtype, outOut FLOAT32, renorm 0 (before 2026), k and kGroup in "
         "range, 2 experts per group for groupSelectMode 1, align32(E/groups) x groups <= 2048 "
         "when groups are selected; Ascend 950 (first releases): normType 1, outFlag false",
         _gating_top_k),
    Rule("gating-top-k-backward", ("aclnnMoeGatingTopKBackward",),
         "CANN aclnnMoeGatingTopKBackward: xNorm FLOAT32 [M, N], 2 <= N <= 2048, expertIdx INT32, "
         "out of gradY's dtype",
         _gating_top_k_backward),
    Rule("swiglu-quant-grad", ("aclnnSwigluGroupQuantGrad",),
         "CANN aclnnSwigluGroupQuantGrad: gradY/x/yOrigin one float dtype, weight FLOAT32, "
         "groupIndex INT64, weight needs yOrigin; clampLimit 0 (document) vs -1 (tiling)",
         _swiglu_quant_grad, expected=lambda soc, dtype: soc == S950),
    Rule("swiglu-quant-grad-soc", ("aclnnSwigluGroupQuantGrad",),
         "CANN aclnnSwigluGroupQuantGrad: Ascend 950 only",
         _only_on("aclnnSwigluGroupQuantGrad", (S950,)),
         expected=lambda soc, dtype: soc == S950),
    Rule("ffn-v3", ("aclnnFFNV3",),
         "CANN aclnnFFNV3: x FLOAT16/BFLOAT16/INT8, expertTokens INT64 <= 256, biases FLOAT16 "
         "(float16), FLOAT32 (bfloat16), INT32 (int8), K and N < 65536, y FLOAT16/BFLOAT16, "
         "activation fastgelu/gelu/relu/silu",
         _ffn_v3, expected=lambda soc, dtype: soc == A2 and dtype == "float16"),
    Rule("ffn-soc", ("aclnnFFNV3", "FFNExt"),
         "CANN aclnnFFN / aclnnFFNV3: Atlas A2 only",
         lambda graph, soc: [m for k in ("aclnnFFNV3", "FFNExt") for m in
                             _only_on(k, (A2,))(graph, soc)],
         expected=lambda soc, dtype: soc == A2 and dtype == "float16"),
    Rule("permute", ("MoeTokenPermute",),
         "MindSpore 2.10 ops.moe_token_permute: tokens 2-D, indices int32/int64 rank <= 2, "
         "top-k <= 512",
         _permute),
    Rule("unpermute", ("InnerMoeTokenUnpermute",),
         "MindSpore 2.10 ops.moe_token_unpermute: sorted_indices int32",
         _unpermute),
    Rule("alltoallv", ("AlltoAllV",),
         "MindSpore 2.10 ops.AlltoAllV: a flattened input; no bool on Ascend",
         _alltoallv, expected=lambda soc, dtype: False),
    Rule("alltoall", ("AlltoAll",),
         "MindSpore 2.10 ops.AlltoAll: the input split into split_count equal blocks along "
         "split_dim (y_split_dim = x_split_dim / split_count)",
         _alltoall, expected=lambda soc, dtype: False),
)
