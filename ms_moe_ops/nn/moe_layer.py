"""MoELayer: router -> token permute -> experts -> unpermute (+ shared experts), the MoE block of
DeepSeek-V2/V3, Qwen2/Qwen3-MoE and Mixtral; helpers for its load balance."""
import math

import numpy as np
import mindspore as ms
from mindspore import Parameter, ops
from mindspore.common.initializer import Uniform, initializer

from ..ops import cast
from ._backend import Fork, project, reshape, rows_of
from ._checks import TOKENS, checked, config_of, int_arg
from ._precision import SelfCastingCell, register_opaque_to_rewrite
from .capacity import ExpertCapacity, check_options
from .config import MoEConfig, SharedExpertsConfig
from .dispatcher import LocalDispatcher
from .ffn import MoeFFN, swiglu_experts
from .gating import GatingTopK

__all__ = ["MoELayer", "SharedExperts", "moe_layers", "expert_load", "load_imbalance",
           "dropped_fraction", "update_expert_bias", "reset_expert_load"]


class SharedExperts(SelfCastingCell):
    """The always-on experts: one dense SwiGLU MLP over every token, optionally gated.

    Built from a SharedExpertsConfig, or from its options: `SharedExperts(hidden_size,
    ffn_hidden_size, gate=False)`.

    Parameters: `weight1` [H, 2F] (gate | up columns), `weight2` [F, H], float32, cast to the
    compute dtype (x's dtype or `compute_dtype`, as in MoeFFN); with `gate=True` also `gate` [H]:
    each token's output is scaled by `sigmoid(x . gate)` (Qwen2-MoE's shared-expert gate, in
    float32). Runs the routed experts' SwiGLU (one group of all rows), so float16/bfloat16 work
    on every backend.

    construct(x [T, H] float32/float16/bfloat16) -> [T, H] in the compute dtype.
    """

    def __init__(self, config=None, *args, **options):
        super().__init__()
        config = self.config = config_of("SharedExperts", SharedExpertsConfig, config, args,
                                         options)
        hidden_size = int_arg("SharedExperts", "hidden_size", config.hidden_size)
        ffn_hidden_size = int_arg("SharedExperts", "ffn_hidden_size", config.ffn_hidden_size)
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.weight1 = Parameter(initializer(Uniform(1 / math.sqrt(hidden_size)),
                                             (hidden_size, 2 * ffn_hidden_size), ms.float32),
                                 name="weight1")
        self.weight2 = Parameter(initializer(Uniform(1 / math.sqrt(ffn_hidden_size)),
                                             (ffn_hidden_size, hidden_size), ms.float32),
                                 name="weight2")
        self.gate = Parameter(initializer(Uniform(1 / math.sqrt(hidden_size)), (hidden_size,),
                                          ms.float32), name="gate") if config.gate else None

    def construct(self, x):
        checked("SharedExperts", "x", x, ("[T, {}]",), self.hidden_size)
        dtype = x.dtype if self.compute_dtype is None else self.compute_dtype
        # one group: [1, H, 2F] and [1, F, H], reshaped in float32 (the CPU backend has no
        # bfloat16 Reshape in GRAPH mode); the casts are the package's (fast on the CPU)
        w1 = cast(cast(self.weight1, ms.float32).reshape((1,) + self.weight1.shape), dtype)
        w2 = cast(cast(self.weight2, ms.float32).reshape((1,) + self.weight2.shape), dtype)
        if self.gate is None:
            return swiglu_experts(cast(x, dtype), rows_of(x), w1, None, w2, None, "swiglu", 0.0,
                                  True)
        # x once, in float32: with the gate its two gradients add up in float32 (no bfloat16 AddN)
        x = cast(x, ms.float32)
        y = swiglu_experts(cast(x, dtype), rows_of(x), w1, None, w2, None, "swiglu", 0.0, True)
        g = ops.sigmoid(project(x, cast(self.gate, ms.float32).reshape(1, -1)))
        return cast(cast(y, ms.float32) * g, dtype)


class MoELayer(SelfCastingCell):
    """A Mixture-of-Experts FFN block:

    `out[t] = sum_k w[t,k] * expert_{idx[t,k]}(x[t]) + gate(x[t]) * shared(x[t])`

    where (w, idx) come from the router `GatingTopK` (sigmoid or softmax scores, optional
    group-limited choice, auxiliary-loss-free `expert_bias` for the choice only, weights
    renormalised when norm_topk_prob, times routed_scaling_factor), a token dispatcher takes each
    token's rows to its experts `MoeFFN` and back, and each token's expert outputs are summed
    weighted by its routing weights. gate is 1, or with shared_expert_gate
    `sigmoid(x . shared_experts.gate)`.

    Built from a MoEConfig: `MoELayer(config)`; or from its options, which build the config
    once: `MoELayer(hidden_size, ffn_hidden_size, num_experts, top_k, n_group=..., ...)` (the
    options and their defaults: MoEConfig, RouterConfig, ExpertsConfig). `layer.config` gives the
    config back; `MoELayer.from_config(config)` is `MoELayer(config)`.

    The families of transformers, as options (`moe_config_from_transformers` reads them from a
    model configuration, `FAMILIES` in `ms_moe_ops.nn.families` lists them; the converters there
    load their checkpoints):

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
    [E, H, F]; `experts.weight2` [E, F, H]; with has_bias `experts.bias1`, `experts.bias2`) and,
    when n_shared_experts > 0, `shared_experts` (`shared_experts.weight1` [H, 2 Fs],
    `shared_experts.weight2` [Fs, H], with the gate `shared_experts.gate` [H]; Fs =
    shared_ffn_hidden_size * n_shared_experts, shared_ffn_hidden_size defaulting to
    ffn_hidden_size). `dispatcher`: the token dispatcher (ms_moe_ops.nn.dispatcher).

    construct(hidden [T, H] or [B, S, H], float32/float16/bfloat16) -> same shape, in hidden's
    dtype or in the dtype mixed precision asks for: `to_float` and `auto_mixed_precision` O2/O3
    set the dtype the experts compute in; the router stays float32 and so do the routing
    weights. Another rank, width H or dtype is a ValueError/TypeError naming the layer.
    Gradients reach the input, the router weight and all expert weights. Load balance:
    `router.tokens_per_expert` counts routed tokens (GRAPH mode too); the module functions
    `ms_moe_ops.update_expert_bias(model)` (between training steps) and
    `ms_moe_ops.load_imbalance(model)` (to watch it) act on every MoELayer of a model.

    Expert parallelism: with `expert_parallel=ep` (a `ms_moe_ops.parallel.ExpertParallel` of n
    ranks) this rank holds experts [rank*E/n, (rank+1)*E/n) (`experts.weight1`/`weight2` are
    [E/n, ...]; ValueError when n does not divide E) and the router and shared experts are
    replicated; `ep.dispatcher(...)` is the layer's token dispatcher. Each rank feeds its own
    tokens (the same number on every rank) and gets the output of its own tokens; the rows
    routed to other ranks' experts travel through `ep.exchange`. The expert gradients are
    complete on their rank, the router's and shared experts' are this rank's part
    (`ms_moe_ops.parallel.ExpertParallelTrainStep` all-reduces them).
    `router.tokens_per_expert` counts the tokens of all ranks, so `update_expert_bias` keeps
    every rank's expert_bias the same; the training losses use this rank's tokens (as
    Megatron-LM's do).
    """

    def __init__(self, config=None, *args, expert_parallel=None, **options):
        super().__init__()
        config = self.config = config_of("MoELayer", MoEConfig, config, args, options)
        hidden_size, _, num_experts, top_k = (
            int_arg("MoELayer", name, getattr(config, name))
            for name in ("hidden_size", "ffn_hidden_size", "num_experts", "top_k"))
        n_shared = int_arg("MoELayer", "n_shared_experts", config.n_shared_experts, 0)
        if config.shared_ffn_hidden_size is not None:
            int_arg("MoELayer", "shared_ffn_hidden_size", config.shared_ffn_hidden_size)
        if config.shared_expert_gate and not n_shared:
            raise ValueError("MoELayer: shared_expert_gate=True needs shared experts, got "
                             "n_shared_experts=0")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.router = GatingTopK(config.router())
        check_options(config)
        capacity = config.capacity()
        self.capacity = None if capacity is None else ExpertCapacity(capacity)
        self.expert_parallel = expert_parallel
        self.dispatcher = (LocalDispatcher(num_experts, self.capacity) if expert_parallel is None
                           else expert_parallel.dispatcher(num_experts, hidden_size, self.capacity))
        if self.dispatcher.count_group is not None:
            self.router.count_over(self.dispatcher.count_group)
            if self.capacity is not None:
                self.capacity.count_over(self.dispatcher.count_group)
        self.experts = MoeFFN(config.experts(self.dispatcher.local_experts, self.dispatcher.padded))
        shared = config.shared_experts()
        self.shared_experts = None if shared is None else SharedExperts(shared)
        # the tokens go to the router, the dispatcher and the shared experts
        self.fork = Fork(2 if shared is None else 3)

    @classmethod
    def from_config(cls, config, expert_parallel=None):
        """The MoELayer of a MoEConfig (its experts split over expert_parallel, if given)."""
        return cls(config, expert_parallel=expert_parallel)

    def sharded_parameters(self):
        """The parameters split over the ranks of its expert-parallel group (the routed
        experts'); none in one process."""
        return list(self.experts.get_parameters()) if self.expert_parallel is not None else []

    def construct(self, hidden):
        width = checked("MoELayer", "hidden", hidden, TOKENS, self.hidden_size)
        shape = hidden.shape
        dtype = hidden.dtype if self.compute_dtype is None else self.compute_dtype
        # the tokens in float32, once: the gradients of their consumers add up in float32 (the
        # CPU backend has no bfloat16 AddN), in one order on every path (Fork)
        # (the check above runs before the cast's own dtype check: GRAPH mode runs it when its
        # value is used)
        tokens = self.fork(cast(ops.depend(hidden, width), ms.float32).reshape(-1, width))
        # the router sees the sequences ([B, S, H]) for its sequence-wise loss
        weights, expert_idx = self.router(tokens[0].reshape(shape))
        if self.capacity is not None:  # the pairs past an expert's capacity: weight 0, expert E
            weights, expert_idx = self.capacity(weights, expert_idx)
        rows, counts, route = self.dispatcher.dispatch(cast(tokens[1], dtype), expert_idx)
        out = self.dispatcher.combine(self.experts(rows, counts), weights, route)
        if self.shared_experts is not None:
            # added in float32, rounded once (MindSpore's CPU Add of bfloat16 is slow too)
            shared = self.shared_experts(cast(tokens[2], dtype))
            out = cast(cast(out, ms.float32) + cast(shared, ms.float32), dtype)
        return out if len(shape) == 2 else reshape(out, shape)


register_opaque_to_rewrite(GatingTopK, MoeFFN, SharedExperts, MoELayer)


# -- load balance: module functions over every MoELayer of a model --------------------------------

def moe_layers(model):
    """Every MoELayer inside a Cell (the Cell itself included), in definition order."""
    return [cell for _, cell in model.cells_and_names() if isinstance(cell, MoELayer)]


def _stacked(loads):
    return np.stack(loads) if loads else np.zeros((0, 0), np.float32)


def expert_load(model):
    """Tokens routed to each expert per MoELayer: numpy float32 [layers, E]. Those since the last
    bias update or, right after an update (no token routed since), those that drove it."""
    return _stacked([layer.router.recent_load() for layer in moe_layers(model)])


def load_imbalance(model_or_load):
    """max / mean of the tokens per expert, per layer (1.0 = perfectly balanced): a list of
    floats, from a Cell (its expert_load(): before or after update_expert_bias, the same) or
    from an expert_load() array."""
    load = model_or_load if isinstance(model_or_load, np.ndarray) else expert_load(model_or_load)
    return [float(row.max() / row.mean()) if row.mean() > 0 else 1.0 for row in np.atleast_2d(load)]


def dropped_fraction(model):
    """The share of the routed (token, slot) pairs each MoELayer dropped at its experts' capacity
    (capacity_factor), per layer: a list of floats, 0.0 for a dropless layer. The same window as
    load_imbalance: the pairs since the last update_expert_bias, or right after one, those of the
    step that drove it (with expert parallelism: every rank's pairs)."""
    out = []
    for layer in moe_layers(model):
        counts = layer.capacity.recent() if layer.capacity is not None else np.zeros((2, 1))
        out.append(float(counts[1].sum() / counts[0].sum()) if counts[0].sum() > 0 else 0.0)
    return out


def update_expert_bias(model):
    """Auxiliary-loss-free balancing step for every MoELayer (call between training steps);
    returns the loads that drove it, [layers, E] (the counts start again from zero;
    expert_load and load_imbalance keep reporting these until tokens are routed again)."""
    loads = []
    for layer in moe_layers(model):
        loads.append(layer.router.load())
        layer.router.update_expert_bias()
        if layer.capacity is not None:
            layer.capacity.update()
    return _stacked(loads)


def reset_expert_load(model):
    """Forgets the routed-token counts of every MoELayer, and the loads of the last update (e.g.
    after an evaluation pass, whose tokens should not steer the balancing)."""
    for layer in moe_layers(model):
        layer.router.reset_load()
        if layer.capacity is not None:
            layer.capacity.reset()
