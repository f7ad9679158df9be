"""The option matrix: every option of the public API, as found in the code (tests/option_matrix.py:
OpDef attributes, functional wrappers, config dataclasses, Cells' and functions' keyword options,
family presets, the parallel API), has each of its value classes (default, every other value or
enum member, boundaries) exercised by a case checked against evidence that shares no code with
it: the numpy golden models of ms_moe_ops/reference.py, finite differences, transformers' own MoE
blocks, plain MindSpore compositions, a single-process run.

- CLASSES: for each option, its value classes (name -> predicate on the value);
- the cases below declare the option values they run with; test_every_option_has_a_case fails
  for an option without classes (naming it and where it was found), a class no case reaches,
  and an entry naming an option that no longer exists;
- ALLOWED: the few options that need no value case, each with its reason.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import mindspore as ms
from mindspore import Parameter, Tensor, nn

from ms_moe_ops import (ExpertKind, MoEConfig, MoELayer, MoeFFN, SharedExperts, QuantMoeFFN,
                        convert_moe_checkpoint, moe_config_from_transformers, quantize_moe_ffn,
                        reference as ref, update_expert_bias)
from ms_moe_ops.nn import EXPERT_KINDS, families, register_expert_kind, set_loss_scale
from ms_moe_ops.nn.ffn import swiglu_experts
from ms_moe_ops.ops import GATING_TOP_K, OPERATORS
from ms_moe_ops.parallel import (ExpertParallel, ExpertParallelGradReducer,
                                 ExpertParallelTrainStep, LaunchError, gather_experts, launch,
                                 msrun, shard_experts)
from ms_moe_ops.parallel import train as ep_train
from cases import CASES, _gmm, _moe_ffn, _router_backward, compare, op_input
from conftest import assert_close, finite_diff, nan_pool, numpy, run, tensor
from option_matrix import family_reads_configuration, inventory
import megatron_capacity as megatron


# -- value classes --------------------------------------------------------------------------------

def _flag():
    return {"False": lambda v: not v, "True": lambda v: bool(v)}


def _members(*values):
    return {repr(m): (lambda v, m=m: v == m) for m in values}


def _one_or_more(one="1"):
    return {one: lambda v: v == 1, ">1": lambda v: v > 1}


_SCALE = {"1": lambda v: v == 1, "!=1": lambda v: v != 1}
_COEFF = {"0 (off)": lambda v: v == 0, ">0": lambda v: v > 0}
_EPS = {"default 1e-20": lambda v: v == 1e-20, "other": lambda v: v != 1e-20}
_GIVEN = {"given": lambda v: v is not None}
_OPTIONAL = {"None": lambda v: v is None, "given": lambda v: v is not None}
_TOP_K = {"1": lambda v: v == 1, ">1": lambda v: v > 1}


def _same(classes, *ids):
    return {i: classes for i in ids}


CLASSES = {
    # moe_gating_top_k
    "moe_gating_top_k.k": _TOP_K,
    "moe_gating_top_k.k_group": _one_or_more(),
    "moe_gating_top_k.group_count": _one_or_more(),
    "moe_gating_top_k.group_select_mode": _members(0, 1),
    "moe_gating_top_k.renorm": _members(0, 1),
    "moe_gating_top_k.norm_type": _members(0, 1),
    "moe_gating_top_k.out_flag": _flag(),
    "moe_gating_top_k.routed_scaling_factor": _SCALE,
    "moe_gating_top_k.eps": _EPS,
    # its backward operators (the sigmoid one takes norm_type=1 only: SPEC)
    "moe_gating_top_k_backward.renorm": _members(0, 1),
    "moe_gating_top_k_backward.norm_type": _members(1),
    "moe_gating_top_k_backward.routed_scaling_factor": _SCALE,
    "moe_gating_top_k_backward.eps": _EPS,
    "moe_gating_top_k_softmax_backward.renorm": _members(0, 1),
    "moe_gating_top_k_softmax_backward.routed_scaling_factor": _SCALE,
    "moe_gating_top_k_softmax_backward.eps": _EPS,
    "moe_gating_top_k_grad.norm_type": _members(0, 1),
    "moe_gating_top_k_grad.renorm": _members(0, 1),
    "moe_gating_top_k_grad.routed_scaling_factor": _SCALE,
    "moe_gating_top_k_grad.eps": _EPS,
    "swiglu_group.clamp_limit": _COEFF,
    "swiglu_group_quant_grad.clamp_limit": _COEFF,
    "moe_ffn.activation": _members("fastgelu", "gelu", "relu", "silu"),
    "moe_ffn.tokens_index_flag": _flag(),
    "moe_ffn.output_dtype": _members("", "float16", "bfloat16", "float32"),
    "moe_ffn.padded": _flag(),
    "moe_ffn_activation_grad.activation": _members("fastgelu", "gelu", "relu", "silu"),
    "grouped_matmul.transpose_x": _flag(),
    "grouped_matmul.transpose_weight": _flag(),
    "grouped_matmul.cumulative": _flag(),
    "grouped_matmul.padded": _flag(),
    "weight_quant_grouped_matmul.padded": _flag(),
    "cast.dtype": _members("float32", "float16", "bfloat16"),
    "rms_norm.eps": {"default 1e-6": lambda v: v == 1e-6, "other": lambda v: v != 1e-6},
    "add_rms_norm.eps": {"default 1e-6": lambda v: v == 1e-6, "other": lambda v: v != 1e-6},
    "decode_attention.scaling": {"default 1": lambda v: v == 1.0, "other": lambda v: v != 1.0},
    "moe_token_permute.num_experts": {"given": lambda v: v >= 1},
    "moe_token_unpermute.top_k": {"0 (from probs)": lambda v: v == 0, ">0": lambda v: v > 0},
    "moe_token_unpermute.with_probs": _flag(),
    "moe_token_unpermute_backward.top_k": {"0 (from probs)": lambda v: v == 0,
                                           ">0": lambda v: v > 0},
    "moe_token_unpermute_backward.with_probs": _flag(),
    # the Cells' configs
    **_same(_GIVEN, "MoEConfig.hidden_size", "MoEConfig.ffn_hidden_size", "MoEConfig.num_experts",
            "RouterConfig.hidden_size", "RouterConfig.num_experts", "ExpertsConfig.num_experts",
            "ExpertsConfig.hidden_size", "ExpertsConfig.ffn_hidden_size",
            "SharedExpertsConfig.hidden_size", "SharedExpertsConfig.ffn_hidden_size"),
    **_same({**_TOP_K, "K=N (every expert)": "K=N"}, "MoEConfig.top_k", "RouterConfig.top_k"),
    **_same(_one_or_more(), "MoEConfig.n_group", "RouterConfig.n_group", "MoEConfig.topk_group",
            "RouterConfig.topk_group"),
    **_same(_members(0, 1), "MoEConfig.group_select_mode", "RouterConfig.group_select_mode"),
    **_same(_members("sigmoid", "softmax"), "MoEConfig.score_func", "RouterConfig.score_func"),
    **_same(_flag(), "MoEConfig.norm_topk_prob", "RouterConfig.norm_topk_prob",
            "MoEConfig.has_bias", "ExpertsConfig.has_bias", "ExpertsConfig.padded",
            "MoEConfig.shared_expert_gate", "SharedExpertsConfig.gate"),
    **_same(_SCALE, "MoEConfig.routed_scaling_factor", "RouterConfig.routed_scaling_factor"),
    **_same({"0 (no step)": lambda v: v == 0, "default 1e-3": lambda v: v == 1e-3,
             "other": lambda v: v not in (0, 1e-3)},
            "MoEConfig.bias_update_rate", "RouterConfig.bias_update_rate"),
    **_same(_COEFF, "MoEConfig.aux_loss_coeff", "RouterConfig.aux_loss_coeff",
            "MoEConfig.seq_aux_loss_coeff", "RouterConfig.seq_aux_loss_coeff",
            "MoEConfig.z_loss_coeff", "RouterConfig.z_loss_coeff",
            "MoEConfig.clamp_limit", "ExpertsConfig.clamp_limit"),
    **_same(_members(*EXPERT_KINDS), "MoEConfig.activation", "ExpertsConfig.activation"),
    "MoEConfig.n_shared_experts": {"0": lambda v: v == 0, "1": lambda v: v == 1,
                                   ">1": lambda v: v > 1},
    "MoEConfig.shared_ffn_hidden_size": _OPTIONAL,
    # the expert capacity (a CapacityConfig exists only with a capacity_factor)
    "MoEConfig.capacity_factor": {"None (dropless)": lambda v: v is None,
                                  "< 1": lambda v: v is not None and v < 1,
                                  ">= 1": lambda v: v is not None and v >= 1},
    "CapacityConfig.capacity_factor": {"< 1": lambda v: v < 1, ">= 1": lambda v: v >= 1},
    **_same(_members("probs", "position"), "MoEConfig.drop_policy", "CapacityConfig.drop_policy"),
    **_same(_flag(), "MoEConfig.pad_to_capacity", "CapacityConfig.pad_to_capacity"),
    **_same(_GIVEN, "CapacityConfig.num_experts"),
    "CapacityConfig.top_k": _TOP_K,
    **_same(_OPTIONAL, "LocalDispatcher(capacity)", "ExpertDispatcher(capacity)"),
    "MoELayer(expert_parallel)": {"None": lambda v: v is None,
                                  "one process": lambda v: v == "single",
                                  "a group of 2": lambda v: v == "group"},
    "ExpertKind.width": _one_or_more(),
    "ExpertKind.clamps": _flag(),
    # functions
    **_same({"None": lambda v: v is None, "matching": lambda v: v == "matching",
             "mismatching (ValueError)": lambda v: v == "mismatching"},
            *(f"{name}(num_experts)" for name in (
                "convert_moe_checkpoint", "convert_deepseek_v3_moe", "convert_deepseek_v2_moe",
                "convert_qwen3_moe", "convert_qwen2_moe", "convert_mixtral_moe"))),
    "QuantMoeFFN(activation)": _members("fastgelu", "gelu", "relu", "silu"),
    "QuantMoeFFN(padded)": _flag(),
    "quantize(mode)": _members("int8", "w8a16"),
    "quantize(calibration)": _OPTIONAL,
    **_same(_members("float16", "bfloat16", "float32"), "QuantMoeFFN(output_dtype)",
            "quantize_moe_ffn(output_dtype)"),
    # parallel
    "ExpertParallel(group)": {"None (world)": lambda v: v is None, "named": lambda v: v is not None},
    "ExpertParallel(exchange)": _members("auto", "allreduce", "alltoallv"),
    "ExpertParallel(size)": {"None (one group)": lambda v: v is None,
                             "1 (data parallelism only)": lambda v: v == 1,
                             "2 of 4 (EP x DP)": lambda v: v == 2},
    "ExpertParallelTrainStep(sens)": _SCALE,
    **_same(_members("mean", "sum"), "ExpertParallelTrainStep(reduction)",
            "ExpertParallelGradReducer(reduction)"),
    "gather_experts(check)": _flag(),
    "msrun(args)": {"none": lambda v: not v, "some": lambda v: bool(v)},
    "msrun(workers)": {"2 (default)": lambda v: v == 2, "other": lambda v: v != 2},
    "msrun(timeout)": {"not reached": lambda v: v == "ok", "reached": lambda v: v == "reached"},
    "msrun(log_dir)": _OPTIONAL,
    "msrun(cluster_time_out)": {"default": lambda v: v == 60, "other": lambda v: v != 60},
    "msrun(env)": {"None (os.environ)": lambda v: v is None, "given": lambda v: v is not None},
    "msrun(local_workers)": {"None (every worker here)": lambda v: v is None,
                             "fewer (one node of several)": lambda v: v is not None},
    "msrun(master_addr)": {"default 127.0.0.1": lambda v: v == "127.0.0.1",
                           "other": lambda v: v != "127.0.0.1"},
    **_same(_OPTIONAL, "msrun(master_port)", "msrun(node_rank)"),
}

ALLOWED = {
    "ExpertKind.name": "a registry key: one string works as well as another (the kinds "
                       "registered under their names are ExpertsConfig.activation's classes)",
    "ExpertKind.forward": "the kind's computation: each registered one is an "
                          "ExpertsConfig.activation class, checked against numpy",
}


class Cover:
    """Option values the cases run with: {option id: [(case, value, values of the case)]}."""

    def __init__(self):
        self.seen = {}

    def add(self, case, values):
        for option, value in values.items():
            self.seen.setdefault(option, []).append((case, value, values))


def _reached(predicate, value, values):
    if predicate == "K=N":
        return values.get("top_k") == values.get("num_experts")
    return predicate(value)


# -- operators: every OpDef attribute against the golden models ------------------------------------

def _logits(rng, m, n):
    """Logits far from ties (as tests/cases.py's)."""
    return (np.array([rng.permutation(n) for _ in range(m)], np.float64) - n / 2) * (4.0 / n) + \
        rng.uniform(-0.01, 0.01, (m, n))


def _router(rng, dtype, **attrs):
    x = _logits(rng, 4, 8)
    bias = rng.uniform(-0.2, 0.2, 8) if attrs.pop("with_bias", False) else None
    return GATING_TOP_K, [x, bias], attrs, ref.moe_gating_top_k(x, bias=bias, **attrs)


# Every combination of the router's weighting options (score function, renormalisation, scale,
# groups in either selection mode): forward here, gradients in test_router_combination_gradient.
ROUTER_COMBOS = {
    f"router_{'softmax' if nt == 0 else 'sigmoid'}_renorm{rn}_scale{sc}_{g}": dict(
        k=3, norm_type=nt, renorm=rn, routed_scaling_factor=sc, with_bias=g != "flat",
        **({} if g == "flat" else dict(group_count=4, k_group=2, group_select_mode=int(g[-1]))))
    for nt in (0, 1) for rn in (0, 1) for sc in (1.0, 2.5) for g in ("flat", "groups0", "groups1")}

OP_CASES = {
    **CASES,
    **{name: (lambda r, d, a=attrs: _router(r, d, **a)) for name, attrs in ROUTER_COMBOS.items()},
    "router_k1": lambda r, d: _router(r, d, k=1),
    "router_k_is_n": lambda r, d: _router(r, d, k=8, norm_type=0, renorm=1),
    "router_backward_renorm": lambda r, d: _router_backward(r, d, renorm=1, eps=1e-6),
    "router_softmax_backward_scaled": lambda r, d: _router_backward(
        r, d, True, routed_scaling_factor=2.5),
    "moe_ffn_relu": lambda r, d: _moe_ffn(r, d, "relu"),
    "grouped_matmul_exact_rows": lambda r, d: _unpadded(_gmm(r, d)),
    # out_flag=False: x_norm is not asked for; y and expert_idx as always
    "router_no_x_norm": lambda r, d: _first_two(_router(r, d, k=2, out_flag=False)),
}


def _first_two(case):
    """A router case checked on y and expert_idx only."""
    op, inputs, attrs, golden = case
    return op, inputs, attrs, golden[:2]


def _unpadded(case):
    """A grouped_matmul case whose rows the groups cover exactly, with padded=False."""
    op, inputs, attrs, golden = case
    return op, inputs, dict(attrs, padded=False), golden


def _op_values(op, attrs):
    return {f"{op.name}.{k}": v for k, v in op.resolve(**attrs).items()}


def _apply(op, inputs, attrs, mode="pynative"):
    tensors = [op_input(a) for a in inputs]
    outs = run(lambda *t: op(*t, **attrs), *tensors, mode=mode)
    return outs if isinstance(outs, tuple) else (outs,)


@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_operator_option(case, rng):
    op, inputs, attrs, golden = OP_CASES[case](rng, "float32")
    outs = _apply(op, inputs, attrs)[:len(golden)]
    compare(outs, golden, "float32")


@pytest.mark.parametrize("case", [c for c in sorted(ROUTER_COMBOS) if "scale2.5" in c])
def test_router_combination_gradient(case, rng):
    """d/dx of sum(y * gy) + sum(x_norm * gn) through the operator's backward = central
    differences of the golden model (the choice held: logits far from ties)."""
    _, (x, bias), attrs, _ = OP_CASES[case](rng, "float32")
    gy, gn = rng.normal(size=(4, 3)), rng.normal(size=(4, 8))

    bt = None if bias is None else Tensor(bias.astype(np.float32))

    def objective(xt, gyt, gnt):
        y, _, x_norm = GATING_TOP_K(xt, bt, **attrs)
        return (y * gyt).sum() + (x_norm * gnt).sum()

    got = ms.grad(objective, grad_position=0)(*(Tensor(np.asarray(a, np.float32))
                                                for a in (x, gy, gn)))
    expected = finite_diff(lambda v: float((ref.moe_gating_top_k(v, bias=bias, **attrs)[0] * gy).sum()
                                           + (ref.moe_gating_top_k(v, bias=bias, **attrs)[2]
                                              * gn).sum()), x)
    # float32 arithmetic: an absolute floor of its rounding at the terms' size (about 1)
    assert_close(numpy(got), expected, rtol=1e-4, atol=1e-6)


def _moe_ffn_output_dtype(rng, output_dtype):
    """The int8 path's output_dtype (the float path takes none): the int8 golden model rounded."""
    from cases import INT8_FFN_INPUTS, int8_ffn, int8_ffn_case
    v = int8_ffn_case(rng, counts=(3, 0, 2), h=5, f=6)
    got = int8_ffn(v, output_dtype=output_dtype)
    want = ref.moe_ffn(*(v[n] for n in INT8_FFN_INPUTS), output_dtype=output_dtype or None)
    assert str(got.dtype).lower() == (output_dtype or "float16")
    np.testing.assert_array_equal(numpy(got), want)


@pytest.mark.parametrize("output_dtype", ["", "float16", "bfloat16", "float32"])
def test_moe_ffn_output_dtype(output_dtype, rng):
    _moe_ffn_output_dtype(rng, output_dtype)


OP_EXTRA = [("moe_ffn", {"output_dtype": d}) for d in ("", "float16", "bfloat16", "float32")]


# -- Cells: MoELayer and its parts against the numpy model, gradients by finite differences -------

H = 8
LAYER_CASES = {
    "defaults": dict(ffn_hidden_size=6, num_experts=4, top_k=2),
    "sigmoid groups mode 1, scale, clamp, biases, shared": dict(
        ffn_hidden_size=5, num_experts=8, top_k=2, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, clamp_limit=0.7, has_bias=True, n_shared_experts=1,
        bias_update_rate=0.05),
    "softmax unnormalised, groups mode 0, fastgelu, two gated shared": dict(
        ffn_hidden_size=5, num_experts=8, top_k=3, score_func="softmax", norm_topk_prob=False,
        n_group=4, topk_group=2, group_select_mode=0, activation="fastgelu", n_shared_experts=2,
        shared_ffn_hidden_size=3, shared_expert_gate=True, bias_update_rate=0.0),
    "sigmoid unnormalised, scale, gelu": dict(ffn_hidden_size=6, num_experts=4, top_k=2,
                                              norm_topk_prob=False, routed_scaling_factor=1.5,
                                              activation="gelu"),
    "softmax renormalised, k=1, relu": dict(ffn_hidden_size=6, num_experts=4, top_k=1,
                                            score_func="softmax", activation="relu"),
    "k=N, silu, losses": dict(ffn_hidden_size=4, num_experts=4, top_k=4, activation="silu",
                              aux_loss_coeff=0.7, seq_aux_loss_coeff=1.3, z_loss_coeff=0.2),
    "softmax losses, one process expert parallel": dict(
        ffn_hidden_size=6, num_experts=4, top_k=2, score_func="softmax", norm_topk_prob=False,
        aux_loss_coeff=0.5, z_loss_coeff=0.3, expert_parallel="single"),
    # the expert capacity against Megatron-Core's token dropping (tests/megatron_capacity.py)
    "capacity by probs, shared": dict(ffn_hidden_size=6, num_experts=4, top_k=2,
                                      capacity_factor=0.75, n_shared_experts=1),
    "capacity by position, padded, top-1, one process expert parallel": dict(
        ffn_hidden_size=6, num_experts=4, top_k=1, score_func="softmax", capacity_factor=1.0,
        drop_policy="position", pad_to_capacity=True, expert_parallel="single"),
}
# reference options whose other value changes the case's output (else a Cell forcing the option
# to that value would pass)
DISCRIMINATES = {
    "softmax unnormalised, groups mode 0, fastgelu, two gated shared": dict(group_select_mode=1),
    "sigmoid groups mode 1, scale, clamp, biases, shared": dict(group_select_mode=0),
}
# (the GRAPH-mode runs are slow, a compilation each: test_moe_ffn_cell_option and
# test_shared_experts_option run the parts' options in GRAPH mode in the default run)
LAYER_GRAPH_DEFAULT = set()


def _layer(options):
    options = dict(options)
    ep = options.pop("expert_parallel", None)
    return MoELayer(H, **options,
                    expert_parallel=ExpertParallel.single() if ep == "single" else None)


def _set_weights(cell, rng):
    """Random weights (routers large enough that no choice is near a tie, a small selection
    bias): {name: numpy float64}."""
    out = {}
    for name, p in cell.parameters_and_names():
        if name.endswith(("tokens_per_expert", "aux_losses", "loss_scale")):  # state, not weights
            continue
        scale = 0.8 if name.endswith("router.weight") else 0.05 if name.endswith(
            "expert_bias") else 0.4
        value = rng.normal(0, scale, p.shape).astype(np.float32)
        p.set_data(Tensor(value))
        out[name.split("layer.", 1)[-1]] = value.astype(np.float64)
    return out


def _reference_options(options, w, x_shape):
    """reference.moe_layer's arguments from the case's options (never from the layer's own
    attributes, which a bug could have changed alike)."""
    c = MoEConfig(H, **{k: v for k, v in options.items() if k != "expert_parallel"})
    kw = dict(router_weight=w["router.weight"], expert_bias=w["router.expert_bias"],
              weight1=w["experts.weight1"], weight2=w["experts.weight2"], top_k=c.top_k,
              n_group=c.n_group, topk_group=c.topk_group, group_select_mode=c.group_select_mode,
              routed_scaling_factor=c.routed_scaling_factor, score_func=c.score_func,
              norm_topk_prob=c.norm_topk_prob, activation=c.activation,
              clamp_limit=c.clamp_limit)
    if c.has_bias:
        kw.update(bias1=w["experts.bias1"], bias2=w["experts.bias2"])
    if c.n_shared_experts:
        width = (c.shared_ffn_hidden_size or c.ffn_hidden_size) * c.n_shared_experts
        assert w["shared_experts.weight2"].shape == (width, H)
        kw.update(shared_weight1=w["shared_experts.weight1"],
                  shared_weight2=w["shared_experts.weight2"])
        if c.shared_expert_gate:
            kw.update(shared_gate=w["shared_experts.gate"])
    sequences = x_shape[0] if len(x_shape) == 3 else 1
    return c, kw, sequences


def _reference_losses(c, kw, x, idx, sequences):
    logits = x.reshape(-1, H) @ kw["router_weight"].T
    return np.array([ref.switch_aux_loss(logits, idx, c.score_func),
                     ref.sequence_aux_loss(logits, idx, sequences, c.score_func),
                     ref.router_z_loss(logits)])


def _dropped(c, kw, x, idx):
    """What the pairs dropped at the experts' capacity add to a dropless layer's output (0
    without a capacity_factor), from Megatron-Core's model (tests/megatron_capacity.py)."""
    if c.capacity_factor is None:
        return 0.0
    rows = x.reshape(-1, H)
    scores = rows @ kw["router_weight"].T
    scores = 1 / (1 + np.exp(-scores)) if c.score_func == "sigmoid" else \
        np.exp(scores - scores.max(-1, keepdims=True)) / np.exp(
            scores - scores.max(-1, keepdims=True)).sum(-1, keepdims=True)
    probs = np.take_along_axis(scores, idx.astype(np.int64), 1)
    if c.norm_topk_prob:
        probs = probs / probs.sum(1, keepdims=True)
    probs = probs * c.routed_scaling_factor
    keep = megatron.keep_mask(probs, idx, c.num_experts, c.capacity_factor, c.drop_policy)

    def expert(e, r):
        h = r @ kw["weight1"][e] + (kw["bias1"][e] if "bias1" in kw else 0)
        a = ref.swiglu_group(h, clamp_limit=c.clamp_limit) if c.activation == "swiglu" else \
            ref.ffn_activation(c.activation, h)
        return a @ kw["weight2"][e] + (kw["bias2"][e] if "bias2" in kw else 0)

    return megatron.moe_output(rows, probs, idx, ~keep, expert).reshape(x.shape)


def _objective(c, kw, sequences, cot, idx):
    coeffs = np.array([c.aux_loss_coeff, c.seq_aux_loss_coeff, c.z_loss_coeff])

    def f(x):
        out, _ = ref.moe_layer(x, **kw, expert_idx=idx)
        out = out - _dropped(c, kw, x, idx)
        return float((out * cot).sum() + coeffs @ _reference_losses(c, kw, x, idx, sequences))

    return f


class _Loss(nn.Cell):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def construct(self, x, cot):
        return (self.layer(x) * cot).sum()


def _check_layer(options, mode, rng, discriminates=()):
    layer = _layer(options)
    w = _set_weights(layer, rng)
    shape = (2, 4, H)
    discriminates = dict(discriminates)
    x = rng.normal(0, 1, shape).astype(np.float32).astype(np.float64)
    cot = rng.normal(0, 1, shape)
    c, kw, sequences = _reference_options(options, w, shape)
    expected, idx = ref.moe_layer(x, **kw)
    dropped = _dropped(c, kw, x, idx)
    if c.capacity_factor is not None:  # the case drops pairs that matter
        assert np.abs(dropped).max() > 1e-3
    expected = expected - dropped
    for option, other in discriminates.items():  # the case tells this option's values apart
        changed = ref.moe_layer(x, **dict(kw, **{option: other}))[0]
        assert np.abs(changed - expected).max() > 1e-3, f"{option}={other} changes nothing here"
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        out = layer(Tensor(x.astype(np.float32)))
        losses = layer.router.aux_losses.asnumpy()
        dx = ms.grad(_Loss(layer))(Tensor(x.astype(np.float32)),
                                   Tensor(cot.astype(np.float32)))
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert_close(numpy(out), expected, rtol=1e-4)
    coeffs = np.array([c.aux_loss_coeff, c.seq_aux_loss_coeff, c.z_loss_coeff])
    assert_close(losses, np.where(coeffs > 0, _reference_losses(c, kw, x, idx, sequences), 0),
                 rtol=1e-5)
    assert_close(numpy(dx), finite_diff(_objective(c, kw, sequences, cot, idx), x), rtol=1e-4)
    # the auxiliary-loss-free step: bias_update_rate * sign(mean load - load), twice counted
    # (forward and forward-backward)
    load = 2 * np.bincount(idx.reshape(-1), minlength=c.num_experts).astype(np.float64)
    update_expert_bias(layer)
    step = c.bias_update_rate * np.sign(load.mean() - load)
    assert_close(layer.router.expert_bias.asnumpy(), w["router.expert_bias"] + step, rtol=1e-6)


@pytest.mark.parametrize("case,mode", [
    pytest.param(c, m, marks=() if m == "pynative" or c in LAYER_GRAPH_DEFAULT
                 else pytest.mark.slow, id=f"{m}-{c}")
    for c in LAYER_CASES for m in ("pynative", "graph")])
def test_moe_layer_option(case, mode, rng):
    _check_layer(LAYER_CASES[case], mode, rng, DISCRIMINATES.get(case, ()))


def _layer_values(options):
    c = MoEConfig(H, **{k: v for k, v in options.items() if k != "expert_parallel"})
    values = {f"MoEConfig.{k}": v for k, v in vars(c).items()}
    values["MoELayer(expert_parallel)"] = options.get("expert_parallel")
    dispatcher = ("ExpertDispatcher(capacity)" if options.get("expert_parallel") else
                  "LocalDispatcher(capacity)")
    values[dispatcher] = c.capacity()
    for part, name in ((c.router(), "RouterConfig"), (c.experts(), "ExpertsConfig"),
                       (c.capacity(), "CapacityConfig"), (c.shared_experts(), "SharedExpertsConfig")):
        if part is not None:
            values.update({f"{name}.{k}": v for k, v in vars(part).items()})
    return values


def _numpy_experts(x, counts, w1, w2, b1, b2, activation, clamp_limit):
    """Each expert on its rows, in numpy; rows past sum(counts) are zero."""
    out, start = np.zeros((x.shape[0], w2.shape[2])), 0
    for e, n in enumerate(counts):
        rows = slice(start, start + n)
        h = x[rows] @ w1[e] + (0 if b1 is None else b1[e])
        a = ref.swiglu_group(h, clamp_limit=clamp_limit) if activation == "swiglu" else \
            ref.ffn_activation(activation, h)
        out[rows] = a @ w2[e] + (0 if b2 is None else b2[e])
        start += n
    return out


FFN_CASES = {
    "padded swiglu with biases": dict(activation="swiglu", has_bias=True, clamp_limit=0.5,
                                      padded=True),
    "fastgelu exact rows": dict(),
    "padded relu": dict(activation="relu", padded=True),
}


# one GRAPH-mode case of each part in the default run (a compilation each)
def _graph_once(names, default):
    return [pytest.param(n, m, marks=() if m == "pynative" or n == default else pytest.mark.slow,
                         id=f"{m}-{n}") for n in names for m in ("pynative", "graph")]


@pytest.mark.parametrize("case,mode", _graph_once(FFN_CASES, "padded swiglu with biases"))
def test_moe_ffn_cell_option(case, mode, rng):
    options = FFN_CASES[case]
    cell = MoeFFN(3, H, 5, **options)
    w = _set_weights(cell, rng)
    counts = np.array([2, 0, 3], np.int64)
    x = rng.normal(0, 1, (5 + 2 * options.get("padded", False), H)).astype(np.float32)
    got = run(cell, Tensor(x), Tensor(counts), mode=mode)
    expected = _numpy_experts(x.astype(np.float64), counts, w["weight1"], w["weight2"],
                              w.get("bias1"), w.get("bias2"), cell.activation,
                              options.get("clamp_limit", 0.0))
    assert_close(numpy(got), expected, rtol=1e-4)


@pytest.mark.parametrize("gate,mode", _graph_once([False, True], True))
def test_shared_experts_option(gate, mode, rng):
    cell = SharedExperts(H, 5, gate=gate)
    w = _set_weights(cell, rng)
    x = rng.normal(0, 1, (4, H)).astype(np.float32)
    got = run(cell, Tensor(x), mode=mode)
    y = ref.swiglu_group(x.astype(np.float64) @ w["weight1"]) @ w["weight2"]
    if gate:
        y = y / (1 + np.exp(-(x.astype(np.float64) @ w["gate"])))[:, None]
    assert_close(numpy(got), y, rtol=1e-4)


def test_expert_kind_width_and_clamps(rng):
    """A registered kind's width sizes weight1, its clamps flag decides whether clamp_limit is
    taken: a width-2 kind that clamps runs SwiGLU with its clamp; one that does not refuses it."""
    clamping = register_expert_kind(ExpertKind("matrix_swiglu", swiglu_experts, 2, True))
    refusing = register_expert_kind(ExpertKind("matrix_plain", swiglu_experts, 2, False))
    try:
        cell = MoeFFN(2, H, 3, activation=clamping.name, clamp_limit=0.4)
        assert cell.weight1.shape == (2, H, 6)
        w = _set_weights(cell, rng)
        x = rng.normal(0, 1, (4, H)).astype(np.float32)
        counts = np.array([1, 3], np.int64)
        expected = _numpy_experts(x.astype(np.float64), counts, w["weight1"], w["weight2"], None,
                                  None, "swiglu", 0.4)
        assert_close(numpy(cell(Tensor(x), Tensor(counts))), expected, rtol=1e-4)
        with pytest.raises(ValueError, match="clamp_limit"):
            MoeFFN(2, H, 3, activation=refusing.name, clamp_limit=0.4)
        assert MoeFFN(2, H, 3, activation="relu").weight1.shape == (2, H, 3)  # width 1
    finally:
        EXPERT_KINDS.pop(clamping.name)
        EXPERT_KINDS.pop(refusing.name)


KIND_VALUES = [{"ExpertKind.width": 2, "ExpertKind.clamps": True},
               {"ExpertKind.width": 2, "ExpertKind.clamps": False},
               {"ExpertKind.width": 1, "ExpertKind.clamps": False}]


# -- losses with zero tokens, and the losses under expert parallelism -----------------------------

@pytest.mark.parametrize("shape", [(0, H), (2, 0, H)], ids=["no tokens", "empty sequences"])
@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
@pytest.mark.slow_in_graph
def test_losses_with_zero_tokens(shape, score_func, mode, rng):
    """Every loss is 0 for an empty batch (documented), its gradients finite and zero, whatever
    the memory pool held before."""
    layer = _layer(dict(ffn_hidden_size=6, num_experts=4, top_k=2, score_func=score_func,
                        aux_loss_coeff=0.5, seq_aux_loss_coeff=0.7, z_loss_coeff=0.3))
    _set_weights(layer, rng)
    x = Tensor(np.zeros(shape, np.float32))
    nan_pool(mode)
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    out = layer(x)
    assert out.shape == shape
    np.testing.assert_array_equal(layer.router.aux_losses.asnumpy(), [0, 0, 0])
    grads = ms.grad(_Loss(layer), grad_position=None, weights=layer.trainable_params())(
        x, Tensor(np.ones(shape, np.float32)))
    for p, g in zip(layer.trainable_params(), grads):
        assert np.isfinite(g.asnumpy()).all() and not g.asnumpy().any(), p.name


def test_losses_use_this_ranks_tokens_under_expert_parallelism(rng):
    """With expert parallelism the router counts every rank's tokens (its count reducer) while the
    losses keep this rank's: a reducer that sees two ranks of the same tokens doubles the counts
    and leaves the losses (and their gradients) at the single-process reference."""
    options = dict(ffn_hidden_size=6, num_experts=4, top_k=2, aux_loss_coeff=0.5,
                   seq_aux_loss_coeff=0.7, z_loss_coeff=0.3, expert_parallel="single")
    layer = _layer(options)
    w = _set_weights(layer, rng)
    layer.router.count_reducer = lambda counts: counts * 2  # two ranks, the same tokens
    x = rng.normal(0, 1, (2, 3, H)).astype(np.float32).astype(np.float64)
    c, kw, sequences = _reference_options(options, w, x.shape)
    _, idx = ref.moe_layer(x, **kw)
    layer(Tensor(x.astype(np.float32)))
    assert_close(layer.router.aux_losses.asnumpy(),
                 _reference_losses(c, kw, x, idx, sequences), rtol=1e-5)
    np.testing.assert_array_equal(layer.router.tokens_per_expert.asnumpy(),
                                  2 * np.bincount(idx.reshape(-1), minlength=4))


# -- families against transformers' blocks -------------------------------------------------------

FAMILY_CASES = {
    # DeepSeek-V3 with and without renormalisation; sizes and groups differ between the two
    "deepseek_v3": dict(moe_intermediate_size=6, n_routed_experts=8, num_experts_per_tok=3,
                        n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1),
    "deepseek_v3-nonorm": dict(hidden_size=12, moe_intermediate_size=4, n_routed_experts=4,
                               num_experts_per_tok=2, n_group=2, topk_group=1,
                               routed_scaling_factor=1.0, n_shared_experts=2,
                               norm_topk_prob=False),
    # DeepSeek-V2: its default greedy routing, and the group-limited one
    "deepseek_v2-greedy": dict(hidden_size=12, moe_intermediate_size=4, n_routed_experts=4,
                               num_experts_per_tok=2, routed_scaling_factor=1.0,
                               n_shared_experts=1, n_group=2, topk_group=1),
    "deepseek_v2-grouped": dict(moe_intermediate_size=6, n_routed_experts=8,
                                num_experts_per_tok=3, topk_method="group_limited_greedy",
                                n_group=4, topk_group=2, routed_scaling_factor=1.7,
                                n_shared_experts=2),
    "qwen3_moe": dict(moe_intermediate_size=6, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True),
    "qwen3_moe-nonorm": dict(hidden_size=12, moe_intermediate_size=4, num_experts=4,
                             num_experts_per_tok=3, norm_topk_prob=False),
    "qwen2_moe": dict(moe_intermediate_size=6, num_experts=8, num_experts_per_tok=2,
                      shared_expert_intermediate_size=10, norm_topk_prob=False),
    "qwen2_moe-norm": dict(hidden_size=12, moe_intermediate_size=4, num_experts=4,
                           num_experts_per_tok=3, shared_expert_intermediate_size=6,
                           norm_topk_prob=True),
    "mixtral": dict(intermediate_size=6, num_local_experts=8, num_experts_per_tok=2),
    "mixtral-small": dict(hidden_size=12, intermediate_size=4, num_local_experts=4,
                          num_experts_per_tok=3),
}
FAMILY_GRAPH_DEFAULT = set()  # a compilation each: slow


def _hf_config(case):
    import transformers

    family = case.split("-")[0]
    cls = {"deepseek_v3": transformers.DeepseekV3Config,
           "deepseek_v2": transformers.DeepseekV2Config,
           "qwen3_moe": transformers.Qwen3MoeConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
           "mixtral": transformers.MixtralConfig}[family]
    options = dict(hidden_size=H, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, vocab_size=16, intermediate_size=6)
    options.update(FAMILY_CASES[case])
    if family == "deepseek_v2":
        options.setdefault("topk_method", "greedy")
        assert transformers.DeepseekV2Config().topk_method == "greedy"  # its default
    return family, cls(**options)


def _hf_block(family, config, rng):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    import torch

    cls = {"deepseek_v3": DeepseekV3MoE, "deepseek_v2": DeepseekV2Moe,
           "qwen3_moe": Qwen3MoeSparseMoeBlock, "qwen2_moe": Qwen2MoeSparseMoeBlock,
           "mixtral": MixtralSparseMoeBlock}[family]
    block = cls(config).float()
    with torch.no_grad():
        for key, value in block.state_dict().items():
            scale = 1.0 if key.startswith("gate.") else 0.4  # routers: no near tie
            value.copy_(torch.from_numpy(rng.normal(0, scale, tuple(value.shape)).astype(np.float32)))
    return block


@pytest.mark.parametrize("case,mode", [
    pytest.param(c, m, marks=() if m == "pynative" or c in FAMILY_GRAPH_DEFAULT
                 else pytest.mark.slow, id=f"{m}-{c}")
    for c in FAMILY_CASES for m in ("pynative", "graph")])
def test_family_option(case, mode, rng):
    """The family's MoELayer (options read by moe_config_from_transformers, weights by the
    converter) against transformers' block: output and input gradient."""
    torch = pytest.importorskip("torch")
    family, config = _hf_config(case)
    block = _hf_block(family, config, rng)
    layer = MoELayer.from_config(moe_config_from_transformers(config))
    state = {k: v.detach().numpy() for k, v in block.state_dict().items()}
    params = convert_moe_checkpoint(state, "", "", family)
    ms.load_param_into_net(layer, {k: Parameter(Tensor(v), name=k) for k, v in params.items()},
                           strict_load=True)
    x = rng.normal(0, 1, (2, 5, config.hidden_size)).astype(np.float32)
    cot = rng.normal(0, 1, x.shape).astype(np.float32)
    xt = torch.from_numpy(x).requires_grad_(True)
    expected = block(xt)
    (expected * torch.from_numpy(cot)).sum().backward()
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        out = layer(Tensor(x))
        dx = ms.grad(_Loss(layer))(Tensor(x), Tensor(cot))
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert_close(numpy(out), expected.detach().numpy())
    assert_close(numpy(dx), xt.grad.numpy(), rtol=2e-5)


# -- functions ----------------------------------------------------------------------------------

def _tiny_state(experts=4):
    rng = np.random.default_rng(0)
    shapes = {"gate.weight": (experts, 3), "experts.gate_up_proj": (experts, 4, 3),
              "experts.down_proj": (experts, 3, 2)}
    return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


CONVERTERS = ["convert_moe_checkpoint", "convert_deepseek_v3_moe", "convert_deepseek_v2_moe",
              "convert_qwen3_moe", "convert_qwen2_moe", "convert_mixtral_moe"]


@pytest.mark.parametrize("name", CONVERTERS)
@pytest.mark.parametrize("num_experts", [None, "matching", "mismatching"])
def test_converter_num_experts(name, num_experts):
    import ms_moe_ops

    state = _tiny_state()
    convert = getattr(ms_moe_ops, name)
    if name == "convert_moe_checkpoint":
        convert = (lambda s, a, b, num_experts=None:  # noqa: E731
                   ms_moe_ops.convert_moe_checkpoint(s, a, b, "qwen3_moe", num_experts))
    given = {None: None, "matching": 4, "mismatching": 5}[num_experts]
    if num_experts == "mismatching":
        with pytest.raises(ValueError, match="num_experts=5"):
            convert(state, "", "", num_experts=given)
        return
    out = convert(state, "", "", num_experts=given)
    np.testing.assert_array_equal(out["experts.weight1"],
                                  state["experts.gate_up_proj"].transpose(0, 2, 1))
    np.testing.assert_array_equal(out["router.weight"], state["gate.weight"])


@pytest.mark.parametrize("activation", ["fastgelu", "gelu", "relu", "silu"])
@pytest.mark.parametrize("output_dtype", ["float16", "bfloat16", "float32"])
def test_quantised_cell_option(activation, output_dtype, rng):
    """quantize_moe_ffn's output_dtype and the QuantMoeFFN it makes (its activation, from the
    cell's): the output dtype asked for, within 3% of the float experts in numpy."""
    cell = MoeFFN(2, 32, 64, activation=activation)
    for p, fan_in in ((cell.weight1, 32), (cell.weight2, 64)):
        p.set_data(Tensor(rng.uniform(-1, 1, p.shape).astype(np.float32) / np.sqrt(fan_in)))
    counts = np.array([60, 68], np.int64)
    x = rng.standard_normal((128, 32)).astype(np.float32)
    q = quantize_moe_ffn(cell, x, counts, output_dtype=output_dtype)
    assert isinstance(q, QuantMoeFFN)
    y = q(Tensor(x), Tensor(counts))
    assert str(y.dtype).lower() == output_dtype
    expected = _numpy_experts(x.astype(np.float64), counts, cell.weight1.asnumpy().astype(float),
                              cell.weight2.asnumpy().astype(float), None, None, activation, 0.0)
    err = np.linalg.norm(numpy(y) - expected) / np.linalg.norm(expected)
    assert err < 0.03, f"relative error {err:.3%}"


@pytest.mark.parametrize("padded", [False, True])
def test_quantised_cell_padded(padded, rng):
    """QuantMoeFFN(padded), from the MoeFFN's own: rows past the counts' sum are zero (padded),
    the covered rows within 3% of the float experts in numpy."""
    cell = MoeFFN(2, 32, 64, activation="gelu", padded=padded)
    for p, fan_in in ((cell.weight1, 32), (cell.weight2, 64)):
        p.set_data(Tensor(rng.uniform(-1, 1, p.shape).astype(np.float32) / np.sqrt(fan_in)))
    counts = np.array([50, 60], np.int64)
    x = rng.standard_normal((110, 32)).astype(np.float32)
    q = quantize_moe_ffn(cell, x, counts, output_dtype="float32")
    assert q.padded is padded
    rows = np.concatenate([x, np.full((18, 32), 50, np.float32)]) if padded else x
    y = numpy(q(Tensor(rows), Tensor(counts)))
    expected = _numpy_experts(x.astype(np.float64), counts, cell.weight1.asnumpy().astype(float),
                              cell.weight2.asnumpy().astype(float), None, None, "gelu", 0.0)
    assert not y[len(x):].any()
    err = np.linalg.norm(y[:len(x)] - expected) / np.linalg.norm(expected)
    assert err < 0.03, f"relative error {err:.3%}"


@pytest.mark.parametrize("mode", ["int8", "w8a16"])
def test_quantize_option(mode, rng):
    """quantize(mode, calibration): a MoELayer's routed experts quantised in place (int8 with
    calibration batches, w8a16 without), the layer's output near the float layer's (int8 also
    rounds the activations to a per-tensor step: 5%; w8a16 the weights only: 1%)."""
    from ms_moe_ops import quantize
    layer = MoELayer(32, 64, 4, 2)
    layer.set_train(False)
    x = Tensor(rng.standard_normal((64, 32)).astype(np.float32))
    expected = numpy(layer(x)).astype(np.float64)
    calibration = [x] if mode == "int8" else None
    assert quantize(layer, mode, calibration=calibration) is layer
    assert not isinstance(layer.experts, MoeFFN)
    err = np.linalg.norm(numpy(layer(x)) - expected) / np.linalg.norm(expected)
    assert err < {"int8": 0.05, "w8a16": 0.01}[mode], f"relative error {err:.3%}"


QUANT_VALUES = [{"QuantMoeFFN(activation)": a, "QuantMoeFFN(output_dtype)": d,
                 "quantize_moe_ffn(output_dtype)": d, "QuantMoeFFN(padded)": False}
                for a in ("fastgelu", "gelu", "relu", "silu")
                for d in ("float16", "bfloat16", "float32")] + [
    {"QuantMoeFFN(padded)": True},  # test_quantised_cell_padded
    {"quantize(mode)": "int8", "quantize(calibration)": "batches"},  # test_quantize_option
    {"quantize(mode)": "w8a16", "quantize(calibration)": None}]


# -- parallel: the training step, sharding, the launcher -----------------------------------------

class _TwoRanksAlike:
    """An expert-parallel group of 2 ranks that see the same tokens: all-reducing a gradient
    doubles it. (PyNative: the reduction is a Python function.)"""
    group, size = "two ranks alike", 2
    world_group, world_size, data_group, data_size = group, size, None, 1


class _TwoGroupsAlike:
    """2 expert-parallel groups of 2 ranks (4 ranks, ExpertParallel(size=2)) that see the same
    tokens: all-reducing over every rank multiplies a gradient by 4, over the 2 replicas of an
    expert by 2."""
    group, size = "one group", 2
    world_group, world_size, data_group, data_size = "every rank", 4, "the replicas", 2
    REDUCED = {"every rank": 4, "the replicas": 2}


@pytest.mark.parametrize("reduction,sens", [
    ("mean", 1.0), ("sum", 4.0), pytest.param("sum", 1.0, marks=pytest.mark.slow),
    pytest.param("mean", 4.0, marks=pytest.mark.slow)])
def test_train_step_options_are_used(reduction, sens, monkeypatch, rng):
    """One SGD step of ExpertParallelTrainStep against nn.TrainOneStepCell's gradients g: the
    replicated parameters move by all_reduce(g) * scale, the experts' by g * scale (scale 1/n for
    "mean", 1 for "sum"), times sens."""
    monkeypatch.setattr(ep_train.ops, "AllReduce", lambda group: (lambda g: g * 2))
    options = dict(ffn_hidden_size=6, num_experts=4, top_k=2, expert_parallel="single")
    x = Tensor(rng.normal(0, 1, (5, H)).astype(np.float32))
    target = Tensor(rng.normal(0, 1, (5, H)).astype(np.float32))
    moved = {}
    for kind in ("plain", "ep"):
        layer = _layer(options)
        before = _set_weights(layer, np.random.default_rng(7))
        network = nn.WithLossCell(layer, nn.MSELoss())
        optimizer = nn.SGD(layer.trainable_params(), learning_rate=0.5)
        step = (nn.TrainOneStepCell(network, optimizer) if kind == "plain" else
                ExpertParallelTrainStep(network, optimizer, _TwoRanksAlike(), sens=sens,
                                        reduction=reduction))
        step(x, target)
        moved[kind] = {p.name: p.asnumpy() - before[p.name] for p in layer.trainable_params()}
    scale = sens * (0.5 if reduction == "mean" else 1.0)
    for name, delta in moved["plain"].items():
        factor = scale if name.startswith("experts.") else 2 * scale
        assert np.abs(delta).max() > 0, name
        # the steps differ by the rounding of the float32 weights (about 0.4) only
        assert_close(moved["ep"][name], factor * delta, rtol=1e-4, atol=3e-7)


def test_loss_scale_reaches_the_losses(rng):
    """A training step with sens=s moves every weight s times as far as with sens=1 (SGD, one
    step) once set_loss_scale gave the training losses the same scale: the loss scale
    multiplies the whole loss, training losses included."""
    options = dict(ffn_hidden_size=6, num_experts=4, top_k=2, aux_loss_coeff=0.5,
                   z_loss_coeff=0.3)
    x = Tensor(rng.normal(0, 1, (5, H)).astype(np.float32))
    target = Tensor(rng.normal(0, 1, (5, H)).astype(np.float32))
    moved = {}
    for sens in (1.0, 4.0):
        layer = _layer(options)
        before = _set_weights(layer, np.random.default_rng(7))
        optimizer = nn.SGD(layer.trainable_params(), learning_rate=0.5)
        assert set_loss_scale(layer, sens) == 1
        nn.TrainOneStepCell(nn.WithLossCell(layer, nn.MSELoss()), optimizer, sens)(x, target)
        moved[sens] = {p.name: p.asnumpy() - before[p.name] for p in layer.trainable_params()}
    for name, delta in moved[1.0].items():
        assert_close(moved[4.0][name], 4 * delta, rtol=1e-4, atol=3e-7)


@pytest.mark.parametrize("groups", [_TwoRanksAlike, _TwoGroupsAlike])
def test_grad_reducer_reduction_is_used(groups, monkeypatch, rng):
    """The replicated parameters' gradients are summed over every rank, the experts' over the
    replicas of their expert-parallel group (none without data parallelism); "mean" divides
    both by the number of ranks."""
    factor = getattr(groups, "REDUCED", {groups.world_group: 2})
    monkeypatch.setattr(ep_train.ops, "AllReduce", lambda group: (lambda g: g * factor[group]))
    layer = _layer(dict(ffn_hidden_size=6, num_experts=4, top_k=2, expert_parallel="single"))
    params = layer.trainable_params()
    grads = tuple(Tensor(np.ones(p.shape, np.float32)) for p in params)
    for reduction, scale in (("mean", 1 / groups.world_size), ("sum", 1.0)):
        reduced = ExpertParallelGradReducer(layer, params, groups(), reduction)(grads)
        for p, g in zip(params, reduced):
            summed = factor.get(groups.data_group, 1) if p.name.startswith("experts.") else \
                factor[groups.world_group]
            np.testing.assert_array_equal(g.asnumpy(), np.full(p.shape, scale * summed), p.name)


@pytest.mark.parametrize("requires_grad", [True, False])
def test_sharding_keeps_requires_grad(requires_grad, rng):
    """Sharded and gathered Parameters keep requires_grad (frozen experts stay frozen)."""
    full = {name: Parameter(Tensor(rng.normal(size=shape).astype(np.float32)), name=name,
                            requires_grad=requires_grad)
            for name, shape in (("moe.experts.weight1", (4, 3, 2)), ("moe.router.weight", (4, 3)))}
    shards = [shard_experts(full, r, 2) for r in range(2)]
    for shard in shards:
        for name, value in shard.items():
            assert isinstance(value, Parameter) and value.requires_grad is requires_grad, name
    for name, value in gather_experts(shards).items():
        assert value.requires_grad is requires_grad, name
        np.testing.assert_array_equal(value.asnumpy(), full[name].asnumpy())


@pytest.mark.parametrize("check", [True, False])
def test_gather_check(check):
    shards = [{"w": np.zeros(2)}, {"w": np.ones(2)}]
    if check:
        with pytest.raises(ValueError, match="differs between rank 0 and rank 1"):
            gather_experts(shards, check=check)
    else:
        np.testing.assert_array_equal(gather_experts(shards, check=check)["w"], np.zeros(2))


class _FakeLauncher:
    """subprocess.Popen for msrun: records the command and environment, exits with 0 (or never,
    when hang is set)."""
    started = {}
    hang = False
    pid = 0

    def __init__(self, cmd, env, cwd, **kwargs):
        _FakeLauncher.started = dict(cmd=cmd, env=env, cwd=cwd)

    def wait(self, timeout=None):
        _FakeLauncher.started["timeout"] = timeout
        if _FakeLauncher.hang:
            raise subprocess.TimeoutExpired("msrun", timeout)
        return 0


MSRUN_CASES = {
    "defaults": dict(),
    "everything given": dict(args=("a", 3), workers=3, timeout=7, log_dir="logs",
                             cluster_time_out=9, env={"MATRIX_ONLY_HERE": "1", "PATH": "/bin",
                                                       "PYTHONPATH": "/given/only"},
                             local_workers=1, master_addr="10.1.2.3", master_port=9999,
                             node_rank=2),
    "timeout reached": dict(timeout=5),
}


@pytest.mark.parametrize("case", list(MSRUN_CASES))
def test_msrun_options_reach_the_launch(case, monkeypatch, tmp_path):
    options = dict(MSRUN_CASES[case])
    if "log_dir" in options:
        options["log_dir"] = str(tmp_path / options["log_dir"])
    monkeypatch.setattr(launch.subprocess, "Popen", _FakeLauncher)
    monkeypatch.setattr(launch, "_end_job", lambda launcher: None)
    monkeypatch.setattr(_FakeLauncher, "hang", case == "timeout reached")
    monkeypatch.setenv("MATRIX_ONLY_OUTSIDE", "1")
    monkeypatch.setenv("PYTHONPATH", "/caller/only")
    if case == "timeout reached":
        with pytest.raises(LaunchError, match="no result within 5 s on 2 processes"):
            msrun("w.py", **options)
        assert _FakeLauncher.started["timeout"] == 5
        return
    log_dir = msrun("w.py", **options)
    started = _FakeLauncher.started
    cmd, env = started["cmd"], started["env"]
    assert cmd[-1 - len(options.get("args", ())):] == [os.path.abspath("w.py")] + [
        str(a) for a in options.get("args", ())]
    assert f"--worker_num={options.get('workers', 2)}" in cmd
    assert f"--local_worker_num={options.get('local_workers', options.get('workers', 2))}" in cmd
    assert f"--master_addr={options.get('master_addr', '127.0.0.1')}" in cmd
    port = [int(a.split("=")[1]) for a in cmd if a.startswith("--master_port=")]
    assert port == [options["master_port"]] if "master_port" in options else 1024 <= port[0]
    ranks = [a for a in cmd if a.startswith("--node_rank")]
    assert ranks == ([f"--node_rank={options['node_rank']}"] if "node_rank" in options else [])
    assert f"--cluster_time_out={options.get('cluster_time_out', 60)}" in cmd
    assert f"--log_dir={log_dir}" in cmd and started["cwd"] == log_dir
    assert started["timeout"] == options.get("timeout", 300)
    if "log_dir" in options:
        assert log_dir == options["log_dir"] and os.path.isdir(log_dir)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(launch.__file__)))
    paths = env["PYTHONPATH"].split(os.pathsep)
    assert os.path.dirname(package_root) == paths[0]  # the caller's ms_moe_ops first
    if "env" in options:  # the given environment, not the caller's (PYTHONPATH included)
        assert env["MATRIX_ONLY_HERE"] == "1" and "MATRIX_ONLY_OUTSIDE" not in env
        assert paths[1:] == [p for p in [options["env"].get("PYTHONPATH")] if p]
    else:
        assert env["MATRIX_ONLY_OUTSIDE"] == "1" and paths[1:] == ["/caller/only"]


def test_msrun_one_node_of_several_needs_the_port_and_rank():
    for given in (dict(master_port=9999), dict(node_rank=1)):
        with pytest.raises(ValueError, match="one node of several.* needs the master_port and "
                                             "node_rank"):
            msrun("w.py", workers=4, local_workers=2, **given)
    with pytest.raises(ValueError, match="need 1 <= local_workers <= workers"):
        msrun("w.py", workers=2, local_workers=3)


def test_msrun_judges_a_launch_by_its_workers_when_its_scheduler_was_refused(monkeypatch,
                                                                              tmp_path):
    """Launches on one host standing for nodes: msrun fails a launch whose scheduler found the
    port taken (another launch's); msrun() takes it when no worker failed, and fails it else."""
    logs = {"scheduler.log": "[ERROR] ... Failed to create the TCP server.\n",
            "msrun.log": "[ERROR] ... Scheduler process 12 exit with exception.\n"}

    class Failing(_FakeLauncher):
        def wait(self, timeout=None):
            for name, text in logs.items():
                (tmp_path / name).write_text(text)
            return 1

    monkeypatch.setattr(launch.subprocess, "Popen", Failing)
    monkeypatch.setattr(launch, "_end_job", lambda launcher: None)
    node = dict(workers=4, local_workers=2, master_port=9999, node_rank=1, log_dir=str(tmp_path))
    assert msrun("w.py", **node) == str(tmp_path)
    with pytest.raises(LaunchError, match="failed on 2 processes"):  # one node only
        msrun("w.py", workers=2, log_dir=str(tmp_path))
    logs["msrun.log"] += "[ERROR] ... Worker process 13 exit with exception.\n"
    with pytest.raises(LaunchError, match="failed on 2 processes"):
        msrun("w.py", **node)


def _msrun_values(options):
    return {"msrun(args)": options.get("args", ()), "msrun(workers)": options.get("workers", 2),
            "msrun(local_workers)": options.get("local_workers"),
            "msrun(master_addr)": options.get("master_addr", "127.0.0.1"),
            "msrun(master_port)": options.get("master_port"),
            "msrun(node_rank)": options.get("node_rank"),
            "msrun(timeout)": "reached" if "timeout" in options and len(options) == 1 else "ok",
            "msrun(log_dir)": options.get("log_dir"),
            "msrun(cluster_time_out)": options.get("cluster_time_out", 60),
            "msrun(env)": options.get("env")}


# -- on 2 processes -------------------------------------------------------------------------------

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "option_matrix_worker.py")


@pytest.mark.distributed
def test_on_two_processes(tmp_path, rng):
    """One launch (tests/option_matrix_worker.py): msrun's env reaches the workers; ExpertParallel's
    group and exchange options; an expert-parallel MoELayer with the training losses on, each
    rank against the local layer on its own tokens; ExpertParallelTrainStep's reduction and sens,
    and ExpertParallel(size=1) (data parallelism alone), against the gradients of one process."""
    from cases import RANKS
    import option_matrix_worker as worker

    out = str(tmp_path)
    env = dict(os.environ, MATRIX_WORKER_VALUE="from msrun(env)")
    msrun(WORKER, [out], workers=RANKS, timeout=400, log_dir=out, env=env)
    ranks = [dict(np.load(os.path.join(out, f"rank{r}.npz"))) for r in range(RANKS)]
    expected = worker.single_process()
    for r, got in enumerate(ranks):
        assert str(got["env"]) == "from msrun(env)"
        assert str(got["exchange/auto"]) == "allreduce" and str(got["group/world"]) == "ok"
        assert len([k for k in expected[r] if k.startswith("step/")]) == 2 * 3
        assert len([k for k in expected[r] if k.startswith("data_parallel/")]) == 3
        for key, value in expected[r].items():
            try:
                assert_close(got[key], value, rtol=1e-5, atol=1e-6)
            except AssertionError as error:
                raise AssertionError(f"rank {r}, {key}: {error}") from None


PARALLEL_VALUES = [
    *({"ExpertParallelTrainStep(reduction)": r, "ExpertParallelTrainStep(sens)": s,
       "ExpertParallelGradReducer(reduction)": r} for r in ("mean", "sum") for s in (1.0, 4.0)),
    *({"gather_experts(check)": c} for c in (True, False)),
    # test_on_two_processes
    *({"ExpertParallel(group)": g, "ExpertParallel(exchange)": e}
      for g, e in ((None, "auto"), ("named", "allreduce"), (None, "alltoallv"))),
    {"MoELayer(expert_parallel)": "group"},
    {"ExpertParallel(size)": None},
    {"ExpertParallel(size)": 1},  # test_on_two_processes: data parallelism alone
    {"ExpertParallel(size)": 2},  # tests/test_parallel_dp.py: 4 ranks, 2 x 2
]


# -- the matrix --------------------------------------------------------------------------------

def _coverage():
    cover = Cover()
    for name, build in OP_CASES.items():
        op, _, attrs, _ = build(np.random.default_rng(0), "float32")
        cover.add(f"test_operator_option[{name}]", _op_values(op, attrs))
    for name, attrs in OP_EXTRA:
        op = next(o for o in OPERATORS if o.name == name)
        cover.add(f"test_moe_ffn_output_dtype[{attrs}]", _op_values(op, attrs))
    for name, options in LAYER_CASES.items():
        cover.add(f"test_moe_layer_option[{name}]", _layer_values(options))
    for name, options in FFN_CASES.items():
        c = MoeFFN(3, H, 5, **options).config
        cover.add(f"test_moe_ffn_cell_option[{name}]",
                  {f"ExpertsConfig.{k}": v for k, v in vars(c).items()})
    for gate in (False, True):
        cover.add("test_shared_experts_option",
                  {f"SharedExpertsConfig.{k}": v for k, v in
                   vars(SharedExperts(H, 5, gate=gate).config).items()})
    for name in CONVERTERS:
        for value in (None, "matching", "mismatching"):
            cover.add(f"test_converter_num_experts[{name}]", {f"{name}(num_experts)": value})
    for values in KIND_VALUES + QUANT_VALUES + PARALLEL_VALUES:
        cover.add("explicit", values)
    for options in MSRUN_CASES.values():
        cover.add("test_msrun_options_reach_the_launch", _msrun_values(options))
    return cover


def test_every_option_has_a_case():
    found = inventory()
    cover = _coverage()
    problems = []
    for option, (where, _) in found.items():
        if option.startswith("FAMILIES["):
            continue  # test_every_family_option_has_a_case
        if option in ALLOWED:
            continue
        if option not in CLASSES:
            problems.append(f"{option} (found in {where}): no value classes in CLASSES and no "
                            f"reason in ALLOWED")
            continue
        seen = cover.seen.get(option, [])
        for name, predicate in CLASSES[option].items():
            if not any(_reached(predicate, v, values) for _, v, values in seen):
                problems.append(f"{option} (found in {where}): no case runs it with "
                                f"{name!r}")
    for option in list(CLASSES) + list(ALLOWED) + list(cover.seen):
        if option not in found:
            problems.append(f"{option}: listed here, but no such option in the code any more")
    assert not problems, "\n".join(problems)


def test_every_family_option_has_a_case():
    """Every family has a case; every option it reads from the transformers configuration takes
    two different values over its cases (an option forced to one value fails one of them)."""
    found = inventory()
    problems = []
    for family, preset in families.FAMILIES.items():
        cases = [c for c in FAMILY_CASES if c.split("-")[0] == family]
        if not cases:
            problems.append(f"FAMILIES[{family}]: no case in FAMILY_CASES")
            continue
        configs = [moe_config_from_transformers(_hf_config(c)[1]) for c in cases]
        for option in {**families._OPTIONS, **preset.options}:
            if family_reads_configuration(family, option):
                values = {getattr(c, option) for c in configs}
                if len(values) < 2:
                    problems.append(f"FAMILIES[{family}].options.{option}: one value over the "
                                    f"cases ({values}): a case with another one is needed")
    for case in FAMILY_CASES:
        if case.split("-")[0] not in families.FAMILIES:
            problems.append(f"FAMILY_CASES[{case!r}]: no such family any more")
    assert {k for k in found if k.startswith("FAMILIES[")}, "no family options found"
    assert not problems, "\n".join(problems)


def test_the_matrix_fails_for_an_uncovered_option(monkeypatch):
    """The matrix's own check: a new option without classes and a class without a case fail."""
    real = inventory()
    monkeypatch.setitem(sys.modules[__name__].__dict__, "inventory",
                        lambda: {**real, "MoEConfig.new_option": ("MoEConfig fields", 0)})
    with pytest.raises(AssertionError, match="MoEConfig.new_option .*no value classes"):
        test_every_option_has_a_case()
    monkeypatch.setitem(sys.modules[__name__].__dict__, "inventory", lambda: real)
    monkeypatch.setitem(CLASSES, "MoEConfig.z_loss_coeff", {**_COEFF, "huge": lambda v: v > 1e9})
    with pytest.raises(AssertionError, match="MoEConfig.z_loss_coeff .*'huge'"):
        test_every_option_has_a_case()
    monkeypatch.setitem(CLASSES, "MoEConfig.gone", _flag())
    with pytest.raises(AssertionError, match="MoEConfig.gone: listed here"):
        test_every_option_has_a_case()
