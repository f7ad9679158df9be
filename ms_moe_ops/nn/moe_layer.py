"""MoELayer: router -> token permute -> experts -> unpermute (+ shared experts), the DeepSeek-V3
MoE block; helpers for its load balance and for loading Hugging Face DeepSeek-V3 weights."""
import math

import numpy as np
import mindspore as ms
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import Uniform, initializer

from .. import ops as moe_ops
from .ffn import ACTIVATIONS, MoeFFN
from .gating import GatingTopK

__all__ = ["MoELayer", "SharedExperts", "moe_layers", "expert_load", "load_imbalance",
           "update_expert_bias", "reset_expert_load", "convert_deepseek_v3_moe"]


class SharedExperts(nn.Cell):
    """The always-on experts: one dense SwiGLU MLP over every token.

    Parameters: `weight1` [H, 2F] (gate | up columns), `weight2` [F, H], float32, cast to the
    input's dtype. Runs on the same grouped-matmul and SwiGLU kernels as the routed experts (one
    group), so float16/bfloat16 work on every backend.
    """

    def __init__(self, hidden_size, ffn_hidden_size):
        super().__init__()
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.weight1 = Parameter(initializer(Uniform(1 / math.sqrt(hidden_size)),
                                             (hidden_size, 2 * ffn_hidden_size), ms.float32),
                                 name="weight1")
        self.weight2 = Parameter(initializer(Uniform(1 / math.sqrt(ffn_hidden_size)),
                                             (ffn_hidden_size, hidden_size), ms.float32),
                                 name="weight2")

    def construct(self, x):
        rows = ops.fill(ms.int64, (1,), x.shape[0])
        h = moe_ops.grouped_matmul(x, self.weight1.expand_dims(0).astype(x.dtype), rows)
        a = moe_ops.swiglu_group(h)
        return moe_ops.grouped_matmul(a, self.weight2.expand_dims(0).astype(x.dtype), rows)


class MoELayer(nn.Cell):
    """A Mixture-of-Experts FFN block (DeepSeek-V3 style):

    `out[t] = sum_k w[t,k] * expert_{idx[t,k]}(x[t]) + shared(x[t])`

    where (w, idx) come from the router `GatingTopK` (sigmoid or softmax scores, optional
    group-limited choice, auxiliary-loss-free `expert_bias` for the choice only), tokens are
    permuted so each expert's rows are consecutive, the experts `MoeFFN` run on them and
    the results are summed back per token.

    Sub-cells (checkpoints load into these names): `router` (`router.weight` [E, H],
    `router.expert_bias` [E]), `experts` (`experts.weight1` [E, H, 2F] for swiglu, else
    [E, H, F]; `experts.weight2` [E, F, H]) and, when n_shared_experts > 0, `shared_experts`
    (`shared_experts.weight1` [H, 2 Fs], `shared_experts.weight2` [Fs, H],
    Fs = shared_ffn_hidden_size * n_shared_experts, shared_ffn_hidden_size defaulting to
    ffn_hidden_size).

    construct(hidden [B, S, H] or [T, H], float32/float16/bfloat16) -> same shape and dtype.
    With swiglu the routing weights are the SwiGLU kernel's per-token weight; with the other
    activations they weight the unpermute sum. Gradients reach the input, the router weight and
    all expert weights. Load balance: `router.tokens_per_expert` counts routed tokens (GRAPH mode
    too); call `update_expert_bias(model)` between training steps and `load_imbalance(model)`
    to watch it.
    """

    def __init__(self, hidden_size, ffn_hidden_size, num_experts, top_k, n_group=1, topk_group=1,
                 group_select_mode=1, routed_scaling_factor=1.0, score_func="sigmoid",
                 n_shared_experts=0, shared_ffn_hidden_size=None, activation="swiglu",
                 clamp_limit=0.0, bias_update_rate=1e-3):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"MoELayer: activation must be one of {ACTIVATIONS}, got {activation!r}")
        if not isinstance(n_shared_experts, int) or n_shared_experts < 0:
            raise ValueError(f"MoELayer: n_shared_experts must be an int >= 0, got {n_shared_experts!r}")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.swiglu = activation == "swiglu"
        self.router = GatingTopK(hidden_size, num_experts, top_k, n_group=n_group,
                                 topk_group=topk_group, group_select_mode=group_select_mode,
                                 score_func=score_func, routed_scaling_factor=routed_scaling_factor,
                                 bias_update_rate=bias_update_rate)
        self.experts = MoeFFN(num_experts, hidden_size, ffn_hidden_size, activation=activation,
                              clamp_limit=clamp_limit)
        if n_shared_experts > 0:
            shared = (shared_ffn_hidden_size or ffn_hidden_size) * n_shared_experts
            self.shared_experts = SharedExperts(hidden_size, shared)
        else:
            self.shared_experts = None

    def construct(self, hidden):
        shape = hidden.shape
        dtype = hidden.dtype
        # x is used once, in float32: the gradients of its three consumers then add up in float32
        # (MindSpore's CPU backend has no bfloat16 AddN)
        x = hidden.reshape(-1, self.hidden_size).astype(ms.float32)
        weights, expert_idx = self.router(x)
        permuted, position, counts = moe_ops.moe_token_permute(x.astype(dtype), expert_idx,
                                                               self.num_experts)
        if self.swiglu:
            # the routing weight of each permuted row: row position[j] holds (token, slot) j
            n = position.shape[0]
            order = ops.scatter_nd(position.reshape(-1, 1), ops.arange(n, dtype=ms.int32), (n,))
            row_weight = ops.gather(weights.reshape(-1), order, 0)
            y = self.experts(permuted, counts, row_weight)
            out = moe_ops.moe_token_unpermute(y, position, top_k=self.top_k)
        else:
            y = self.experts(permuted, counts)
            out = moe_ops.moe_token_unpermute(y, position, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x.astype(dtype))
        return out.reshape(shape)


# -- load balance -------------------------------------------------------------------------------

def moe_layers(model):
    """Every MoELayer inside a Cell (the Cell itself included), in definition order."""
    return [cell for _, cell in model.cells_and_names() if isinstance(cell, MoELayer)]


def expert_load(model):
    """Tokens routed to each expert since the last bias update: numpy float32 [layers, E]."""
    layers = moe_layers(model)
    return np.stack([layer.router.load() for layer in layers]) if layers else np.zeros((0, 0))


def load_imbalance(model_or_load):
    """max / mean of the tokens per expert, per layer (1.0 = perfectly balanced): a list of
    floats, from a Cell (its current counts) or from an expert_load() array."""
    load = model_or_load if isinstance(model_or_load, np.ndarray) else expert_load(model_or_load)
    return [float(row.max() / row.mean()) if row.mean() > 0 else 1.0 for row in np.atleast_2d(load)]


def update_expert_bias(model):
    """Auxiliary-loss-free balancing step for every MoELayer (call between training steps);
    returns the expert_load() that drove it (the counts are reset)."""
    load = expert_load(model)
    for layer in moe_layers(model):
        layer.router.update_expert_bias()
    return load


def reset_expert_load(model):
    """Forgets the routed-token counts of every MoELayer (e.g. after an evaluation pass, whose
    tokens should not steer the balancing)."""
    for layer in moe_layers(model):
        counts = layer.router.tokens_per_expert
        counts.set_data(ops.zeros(counts.shape, counts.dtype))


# -- checkpoints --------------------------------------------------------------------------------

def convert_deepseek_v3_moe(state_dict, src_prefix, dst_prefix, num_experts):
    """One DeepSeek-V3 MoE block of a Hugging Face state dict (numpy arrays, torch layout
    [out, in]) -> {our parameter name: numpy float32} for a MoELayer at dst_prefix.

    src_prefix is e.g. "model.layers.3.mlp." and dst_prefix e.g. "layers.3.moe." (with the dot).
    Reads `gate.weight`, `gate.e_score_correction_bias`, `experts.{e}.{gate,up,down}_proj.weight`
    and, when present, `shared_experts.{gate,up,down}_proj.weight`. Load the result with
    `ms.load_param_into_net(net, {k: Parameter(Tensor(v)) ...})`.
    """
    def get(name):
        return np.asarray(state_dict[src_prefix + name], np.float32)

    out = {dst_prefix + "router.weight": get("gate.weight")}
    if src_prefix + "gate.e_score_correction_bias" in state_dict:
        out[dst_prefix + "router.expert_bias"] = get("gate.e_score_correction_bias")

    def swiglu_pair(stem):
        w1 = np.concatenate([get(stem + "gate_proj.weight").T, get(stem + "up_proj.weight").T], axis=1)
        return w1, get(stem + "down_proj.weight").T

    pairs = [swiglu_pair(f"experts.{e}.") for e in range(num_experts)]
    out[dst_prefix + "experts.weight1"] = np.ascontiguousarray(np.stack([p[0] for p in pairs]))
    out[dst_prefix + "experts.weight2"] = np.ascontiguousarray(np.stack([p[1] for p in pairs]))
    if src_prefix + "shared_experts.gate_proj.weight" in state_dict:
        w1, w2 = swiglu_pair("shared_experts.")
        out[dst_prefix + "shared_experts.weight1"] = np.ascontiguousarray(w1)
        out[dst_prefix + "shared_experts.weight2"] = np.ascontiguousarray(w2)
    return out
