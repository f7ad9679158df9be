"""MoELayer: router -> token permute -> experts -> unpermute (+ shared experts), the MoE block of
DeepSeek-V2/V3, Qwen2/Qwen3-MoE and Mixtral; helpers for its load balance."""
import dataclasses
import math

import numpy as np
import mindspore as ms
from mindspore import Parameter, ops
from mindspore.common.initializer import Uniform, initializer

from .. import ops as moe_ops
from ..ops._checks import int_arg
from ..parallel.dispatcher import ExpertDispatcher
from .config import MoEConfig
from .ffn import ACTIVATIONS, MoeFFN
from ._backend import project, reshape
from ._precision import SelfCastingCell, register_opaque_to_rewrite
from .gating import GatingTopK

__all__ = ["MoELayer", "SharedExperts", "moe_layers", "expert_load", "load_imbalance",
           "update_expert_bias", "reset_expert_load"]


class SharedExperts(SelfCastingCell):
    """The always-on experts: one dense SwiGLU MLP over every token, optionally gated.

    Parameters: `weight1` [H, 2F] (gate | up columns), `weight2` [F, H], float32, cast to the
    compute dtype (x's dtype or `compute_dtype`, as in MoeFFN); with `gate=True` also `gate` [H]:
    each token's output is scaled by `sigmoid(x . gate)` (Qwen2-MoE's shared-expert gate, in
    float32). Runs on the same grouped-matmul and SwiGLU kernels as the routed experts (one
    group), so float16/bfloat16 work on every backend.
    """

    def __init__(self, hidden_size, ffn_hidden_size, gate=False):
        super().__init__()
        hidden_size = int_arg("SharedExperts", "hidden_size", hidden_size)
        ffn_hidden_size = int_arg("SharedExperts", "ffn_hidden_size", ffn_hidden_size)
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.weight1 = Parameter(initializer(Uniform(1 / math.sqrt(hidden_size)),
                                             (hidden_size, 2 * ffn_hidden_size), ms.float32),
                                 name="weight1")
        self.weight2 = Parameter(initializer(Uniform(1 / math.sqrt(ffn_hidden_size)),
                                             (ffn_hidden_size, hidden_size), ms.float32),
                                 name="weight2")
        self.gate = Parameter(initializer(Uniform(1 / math.sqrt(hidden_size)), (hidden_size,),
                                          ms.float32), name="gate") if gate else None

    def construct(self, x):
        dtype = x.dtype if self.compute_dtype is None else self.compute_dtype
        rows = ops.fill(ms.int64, (1,), x.shape[0])
        # [1, H, 2F] in float32 first: the CPU backend has no bfloat16 ExpandDims
        w1 = self.weight1.astype(ms.float32).expand_dims(0).astype(dtype)
        w2 = self.weight2.astype(ms.float32).expand_dims(0).astype(dtype)
        # x once, in float32: with the gate its two gradients add up in float32 (no bfloat16 AddN)
        x = x.astype(ms.float32)
        h = moe_ops.grouped_matmul(x.astype(dtype), w1, rows)
        y = moe_ops.grouped_matmul(moe_ops.swiglu_group(h), w2, rows)
        if self.gate is not None:
            g = ops.sigmoid(project(x, self.gate.astype(ms.float32).reshape(1, -1)))
            y = (y.astype(ms.float32) * g).astype(dtype)
        return y


class MoELayer(SelfCastingCell):
    """A Mixture-of-Experts FFN block:

    `out[t] = sum_k w[t,k] * expert_{idx[t,k]}(x[t]) + gate(x[t]) * shared(x[t])`

    where (w, idx) come from the router `GatingTopK` (sigmoid or softmax scores, optional
    group-limited choice, auxiliary-loss-free `expert_bias` for the choice only, weights
    renormalised when norm_topk_prob, times routed_scaling_factor), tokens are permuted so each
    expert's rows are consecutive, the experts `MoeFFN` run on them, each row weighted by its
    routing weight, and the results are summed back per token. gate is 1, or with
    shared_expert_gate `sigmoid(x . shared_experts.gate)`.

    The families of transformers, as options (`moe_config_from_transformers` reads them from a
    model configuration; the converters in `ms_moe_ops.nn.families` load their checkpoints):
    - DeepSeek-V3: the defaults, with n_group/topk_group (group_select_mode=1), routed_scaling_factor
      and n_shared_experts.
    - DeepSeek-V2: score_func="softmax", norm_topk_prob=False, group_select_mode=0 (group max),
      routed_scaling_factor, n_shared_experts.
    - Qwen3-MoE: score_func="softmax", norm_topk_prob as configured.
    - Mixtral: score_func="softmax".
    - Qwen2-MoE: score_func="softmax", norm_topk_prob as configured, n_shared_experts=1 with
      shared_ffn_hidden_size and shared_expert_gate=True.

    Training losses: aux_loss_coeff (Switch load balancing), seq_aux_loss_coeff (DeepSeek-V3's
    sequence-wise balance, one sequence per row of a [B, S, H] input) and z_loss_coeff (router
    z-loss) are applied by the router in the backward pass, never through the output; their
    unscaled values of the last forward pass are in `router.aux_losses` (see GatingTopK and
    `ms_moe_ops.nn.losses`).

    Sub-cells (checkpoints load into these names): `router` (`router.weight` [E, H],
    `router.expert_bias` [E]), `experts` (`experts.weight1` [E, H, 2F] for swiglu, else
    [E, H, F]; `experts.weight2` [E, F, H]) and, when n_shared_experts > 0, `shared_experts`
    (`shared_experts.weight1` [H, 2 Fs], `shared_experts.weight2` [Fs, H], with the gate
    `shared_experts.gate` [H]; Fs = shared_ffn_hidden_size * n_shared_experts,
    shared_ffn_hidden_size defaulting to ffn_hidden_size). All options together: `config`
    (a MoEConfig); `MoELayer.from_config(config)` builds a layer from one.

    construct(hidden [B, S, H] or [T, H], float32/float16/bfloat16) -> same shape, in hidden's
    dtype or in the dtype mixed precision asks for: `to_float` and `auto_mixed_precision` O2/O3
    set the dtype the experts compute in; the router stays float32 and so do the routing
    weights. Gradients reach the input, the router weight and all expert weights. Load balance:
    `router.tokens_per_expert` counts routed tokens (GRAPH mode too); call
    `update_expert_bias(model)` between training steps and `load_imbalance(model)` to watch it.

    Expert parallelism: with `expert_parallel=ep` (a `ms_moe_ops.parallel.ExpertParallel` of n
    ranks) this rank holds experts [rank*E/n, (rank+1)*E/n) (`experts.weight1`/`weight2` are
    [E/n, ...]; ValueError when n does not divide E) and the router and shared experts are
    replicated. Each rank feeds its own tokens (the same number on every rank) and gets the
    output of its own tokens; the rows routed to other ranks' experts travel through
    `ep.exchange`. The expert gradients are complete on their rank, the router's and shared
    experts' are this rank's part (`ms_moe_ops.parallel.ExpertParallelTrainStep` all-reduces
    them).
    `router.tokens_per_expert` counts the tokens of all ranks, so `update_expert_bias` keeps
    every rank's expert_bias the same; the training losses use this rank's tokens (as
    Megatron-LM's do).
    """

    def __init__(self, hidden_size, ffn_hidden_size, num_experts, top_k, n_group=1, topk_group=1,
                 group_select_mode=1, routed_scaling_factor=1.0, score_func="sigmoid",
                 n_shared_experts=0, shared_ffn_hidden_size=None, activation="swiglu",
                 clamp_limit=0.0, bias_update_rate=1e-3, norm_topk_prob=True,
                 shared_expert_gate=False, aux_loss_coeff=0.0, seq_aux_loss_coeff=0.0,
                 z_loss_coeff=0.0, expert_parallel=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"MoELayer: activation must be one of {ACTIVATIONS}, got {activation!r}")
        hidden_size, ffn_hidden_size, num_experts, top_k = (
            int_arg("MoELayer", name, value) for name, value in (
                ("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size),
                ("num_experts", num_experts), ("top_k", top_k)))
        n_shared_experts = int_arg("MoELayer", "n_shared_experts", n_shared_experts, 0)
        if shared_ffn_hidden_size is not None:
            shared_ffn_hidden_size = int_arg("MoELayer", "shared_ffn_hidden_size",
                                             shared_ffn_hidden_size)
        if shared_expert_gate and not n_shared_experts:
            raise ValueError("MoELayer: shared_expert_gate=True needs shared experts, got "
                             "n_shared_experts=0")
        cfg = self.config = MoEConfig(
            hidden_size, ffn_hidden_size, num_experts, top_k, n_group=n_group,
            topk_group=topk_group, group_select_mode=group_select_mode,
            routed_scaling_factor=routed_scaling_factor, score_func=score_func,
            n_shared_experts=n_shared_experts, shared_ffn_hidden_size=shared_ffn_hidden_size,
            activation=activation, clamp_limit=clamp_limit, bias_update_rate=bias_update_rate,
            norm_topk_prob=norm_topk_prob, shared_expert_gate=shared_expert_gate,
            aux_loss_coeff=aux_loss_coeff, seq_aux_loss_coeff=seq_aux_loss_coeff,
            z_loss_coeff=z_loss_coeff)
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.router = GatingTopK(hidden_size, num_experts, top_k, n_group=n_group,
                                 topk_group=topk_group, group_select_mode=group_select_mode,
                                 score_func=score_func, routed_scaling_factor=routed_scaling_factor,
                                 norm_topk_prob=norm_topk_prob, bias_update_rate=bias_update_rate,
                                 aux_loss_coeff=aux_loss_coeff,
                                 seq_aux_loss_coeff=seq_aux_loss_coeff, z_loss_coeff=z_loss_coeff)
        self.expert_parallel = expert_parallel
        self.dispatcher = None
        local_experts = num_experts
        if expert_parallel is not None:
            self.dispatcher = ExpertDispatcher(expert_parallel, num_experts, hidden_size)
            local_experts = self.dispatcher.local_experts
            self.router.count_over(expert_parallel.group)
        # the exchange may hand the experts a padded batch: they must allow it
        self.experts = MoeFFN(local_experts, hidden_size, ffn_hidden_size, activation=activation,
                              clamp_limit=clamp_limit,
                              padded=self.dispatcher is not None and self.dispatcher.padded)
        if n_shared_experts > 0:
            shared = (cfg.shared_ffn_hidden_size or ffn_hidden_size) * n_shared_experts
            self.shared_experts = SharedExperts(hidden_size, shared, gate=shared_expert_gate)
        else:
            self.shared_experts = None

    @classmethod
    def from_config(cls, config, expert_parallel=None):
        """The MoELayer of a MoEConfig (its experts split over expert_parallel, if given)."""
        return cls(**dataclasses.asdict(config), expert_parallel=expert_parallel)

    def construct(self, hidden):
        shape = hidden.shape
        dtype = hidden.dtype if self.compute_dtype is None else self.compute_dtype
        # x is used once, in float32: the gradients of its three consumers then add up in float32
        # (MindSpore's CPU backend has no bfloat16 AddN)
        x = hidden.astype(ms.float32).reshape(-1, self.hidden_size)
        # the router sees the sequences ([B, S, H]) for its sequence-wise loss
        weights, expert_idx = self.router(x.reshape(shape))
        if self.dispatcher is None:
            permuted, position, counts = moe_ops.moe_token_permute(x.astype(dtype), expert_idx,
                                                                   self.num_experts)
            # the routing weight of each permuted row: row position[j] holds (token, slot) j
            flat = weights.reshape(-1)
            row_weight = ops.tensor_scatter_elements(ops.zeros_like(flat), position, flat, axis=0)
            y = self.experts(permuted, counts, row_weight)
            out = moe_ops.moe_token_unpermute(y, position, top_k=self.top_k)
        else:  # the same steps, the rows of other ranks' experts through the exchange
            rows, counts, route = self.dispatcher.dispatch(x.astype(dtype), expert_idx)
            out = self.dispatcher.combine(self.experts(rows, counts), weights, route)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x.astype(dtype))
        return reshape(out, shape)


register_opaque_to_rewrite(GatingTopK, MoeFFN, SharedExperts, MoELayer)


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
