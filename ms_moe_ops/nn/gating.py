"""GatingTopK: the router Cell (sigmoid or softmax scores, group-limited top-k), with
DeepSeek-V3's auxiliary-loss-free load balancing and the auxiliary training losses."""
import math
import numbers

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, ops
from mindspore.common.initializer import Normal, initializer

from .. import _compat
from ..ops.gating import GATING_TOP_K, moe_gating_top_k
from ..ops._indexing import count
from ._backend import project
from ._checks import TOKENS, checked, config_of, int_arg
from ._precision import SelfCastingCell
from .config import RouterConfig
from .losses import AuxLossScaler, balance_probs, router_z_loss, sequence_aux_loss, switch_aux_loss

__all__ = ["GatingTopK"]

_SCORE_FUNCS = {"sigmoid": 1, "softmax": 0}
# the primitives: ops.assign and ops.assign_add are deprecated (MindSpore 2.10)
_ASSIGN, _ASSIGN_ADD = ops.Assign(), ops.AssignAdd()
# adds to a Parameter's entries at indices in place (duplicates add up)
_SCATTER_ADD = ops.ScatterNdAdd()


def _unroutable(num_experts, top_k, n_group, topk_group):
    """The condition of the group-limited choice that these sizes break, in words ("" if none)."""
    if num_experts % n_group:
        return (f"num_experts={num_experts} is not divisible by n_group={n_group} (the experts "
                f"form n_group groups of the same size)")
    if topk_group > n_group:
        return f"topk_group={topk_group} > n_group={n_group} (the groups kept are among n_group)"
    if n_group == 1 and top_k > num_experts:
        return f"top_k={top_k} > num_experts={num_experts}"
    kept = topk_group * (num_experts // n_group)
    if top_k > kept:
        return (f"top_k={top_k} > the experts of the kept groups: topk_group * num_experts / "
                f"n_group = {topk_group} * {num_experts} / {n_group} = {kept}")
    return ""


class GatingTopK(SelfCastingCell):
    """Routes each token to top_k of num_experts experts.

    Logits are computed in float32 (whatever the input and parameter dtypes, and whatever mixed
    precision, `Cell.to_float` or `auto_mixed_precision`, asks for), scored with sigmoid or softmax,
    and experts chosen by score + `expert_bias` (optionally group-limited: the topk_group best of
    n_group groups). The weights come from the un-biased scores, renormalised when
    norm_topk_prob, times routed_scaling_factor.

    Training losses (see `ms_moe_ops.nn.losses`; each is computed only when its coefficient is
    not 0, and enters through the backward, never through the output): `aux_loss_coeff` times
    the Switch load-balancing loss, `seq_aux_loss_coeff` times DeepSeek-V3's sequence-wise
    balance loss (a sequence is one row of a [B, S, H] input; any other input is one sequence),
    `z_loss_coeff` times the router z-loss.

    Built from a RouterConfig (the options above and their defaults), or from its options:
    `GatingTopK(hidden_size, num_experts, top_k, n_group=1, ...)`.

    Parameters: `weight` [num_experts, hidden_size] (trainable), `expert_bias` [num_experts]
    (selection only, not trainable), `tokens_per_expert` [num_experts] float32 (routed tokens
    since the last `update_expert_bias()`, not trainable), `aux_losses` [3] float32 (switch,
    sequence and z-loss of the last forward pass, unscaled, 0 when off; not trainable).

    construct(hidden_states [T, hidden_size] or [B, S, hidden_size], float32/float16/bfloat16)
    -> (weights [T, top_k] float32, expert_idx [T, top_k] int32), T = number of tokens. Another
    rank, width or dtype is a ValueError/TypeError naming the Cell.
    """

    def __init__(self, config=None, *args, **options):
        super().__init__()
        config = self.config = config_of("GatingTopK", RouterConfig, config, args, options)
        if config.score_func not in _SCORE_FUNCS:
            raise ValueError(f"GatingTopK: score_func must be 'sigmoid' or 'softmax', got "
                             f"{config.score_func!r}")
        hidden_size, num_experts, top_k, n_group, topk_group = (
            int_arg("GatingTopK", name, getattr(config, name))
            for name in ("hidden_size", "num_experts", "top_k", "n_group", "topk_group"))
        group_select_mode = int_arg("GatingTopK", "group_select_mode", config.group_select_mode, 0)
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.n_group = n_group
        self.topk_group = topk_group
        self.group_select_mode = group_select_mode if n_group > 1 else 0
        self.score_func = config.score_func
        self.norm_type = _SCORE_FUNCS[config.score_func]
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.bias_update_rate = float(config.bias_update_rate)
        self.weight = Parameter(initializer(Normal(0.02), (num_experts, hidden_size), ms.float32),
                                name="weight")
        self.expert_bias = Parameter(Tensor(np.zeros(num_experts, np.float32)), name="expert_bias",
                                     requires_grad=False)
        self.tokens_per_expert = Parameter(Tensor(np.zeros(num_experts, np.float32)),
                                           name="tokens_per_expert", requires_grad=False)
        self.aux_losses = Parameter(Tensor(np.zeros(3, np.float32)), name="aux_losses",
                                    requires_grad=False)
        self.loss_coeffs = _loss_coeffs(config.aux_loss_coeff, config.seq_aux_loss_coeff,
                                        config.z_loss_coeff)
        self.loss_scaler = AuxLossScaler(self.loss_coeffs) if any(self.loss_coeffs) else None
        self.count_reducer = None  # see count_over
        self.last_load = None  # see update_expert_bias
        # Sigmoid scores without renormalisation: the op always renormalises sigmoid weights, so
        # these are gathered from its x_norm output (which is differentiable too).
        self.gather_unnormalised = self.norm_type == 1 and not self.norm_topk_prob
        # Validate the configuration now rather than at the first call.
        unroutable = _unroutable(num_experts, top_k, n_group, topk_group)
        if unroutable:
            raise ValueError(f"GatingTopK: {unroutable}")
        attrs = GATING_TOP_K.resolve(k=top_k, k_group=topk_group, group_count=n_group,
                                     group_select_mode=self.group_select_mode,
                                     norm_type=self.norm_type)
        try:  # the operator's own contract for this expert count (N = num_experts)
            GATING_TOP_K.infer(attrs, [-1, num_experts], [num_experts])
        except ValueError as error:
            raise ValueError(f"GatingTopK(num_experts={num_experts}, n_group={n_group}, "
                             f"topk_group={topk_group}, top_k={top_k}, group_select_mode="
                             f"{self.group_select_mode}) cannot route: {error}") from None

    def construct(self, hidden_states):
        if (self.expert_bias.dtype != ms.float32 or self.tokens_per_expert.dtype != ms.float32
                or self.aux_losses.dtype != ms.float32):
            raise TypeError(f"GatingTopK: its state ('expert_bias', 'tokens_per_expert', "
                            f"'aux_losses') must stay float32 (a bias moved in small steps, "
                            f"counters), got {self.expert_bias.dtype}, "
                            f"{self.tokens_per_expert.dtype} and {self.aux_losses.dtype}; convert "
                            f"only the trainable parameters to half precision")
        width = checked("GatingTopK", "hidden_states", hidden_states, TOKENS, self.hidden_size)
        # float32 whatever the input and parameter dtypes and mixed-precision flags
        h = hidden_states.astype(ms.float32).reshape(-1, width)
        sequences = hidden_states.shape[0] if hidden_states.ndim == 3 else 1
        logits = project(h, self.weight.astype(ms.float32))
        weights, expert_idx, scores = moe_gating_top_k(
            logits, self.top_k, self.expert_bias.astype(ms.float32), k_group=self.topk_group,
            group_count=self.n_group, group_select_mode=self.group_select_mode,
            renorm=int(self.norm_topk_prob), norm_type=self.norm_type,
            routed_scaling_factor=self.routed_scaling_factor)
        if self.gather_unnormalised:
            weights = ops.gather_elements(scores, 1, expert_idx) * self.routed_scaling_factor
        if (not self.training and self.count_reducer is None and self.loss_scaler is None
                and _compat.is_constant(expert_idx.size)):
            # inference (a decoding step): each routed pair adds one to its expert's count, one
            # kernel instead of the count's four and the sum
            ones = Tensor(np.ones(expert_idx.size, np.float32))
            added = _SCATTER_ADD(self.tokens_per_expert, expert_idx.reshape(-1, 1), ones)
            # (stop_gradient: a gradient taken in inference mode must not look for its bprop)
            return ops.depend(weights, ops.stop_gradient(added)), expert_idx
        counts = ops.stop_gradient(count(expert_idx, self.num_experts).astype(ms.float32))
        load = counts
        if self.count_reducer is not None:
            load = self.count_reducer(load)  # every rank's tokens; the losses keep this rank's
        # depend: keeps the count update in the graph even when expert_idx is unused
        weights = ops.depend(weights, _ASSIGN_ADD(self.tokens_per_expert, load))
        if self.loss_scaler is not None:
            losses = self._losses(logits, scores, expert_idx, counts, sequences)
            weights = self.loss_scaler(weights, losses)
            weights = ops.depend(weights, _ASSIGN(self.aux_losses, ops.stop_gradient(losses)))
        return weights, expert_idx

    def _losses(self, logits, scores, expert_idx, counts, sequences):
        """[switch, sequence, z] losses of this pass (0 for those whose coefficient is 0)."""
        probs = balance_probs(scores, self.score_func)
        zero = ops.zeros((), dtype=ms.float32)
        aux, seq, z = self.loss_coeffs
        return ops.stack([switch_aux_loss(probs, counts) if aux else zero,
                          sequence_aux_loss(probs, expert_idx, sequences) if seq else zero,
                          router_z_loss(logits) if z else zero])

    def losses(self):
        """{"switch", "sequence", "z"}: the unscaled losses of the last forward pass (floats)."""
        return dict(zip(("switch", "sequence", "z"), self.aux_losses.asnumpy().tolist()))

    def count_over(self, group):
        """Counts the routed tokens of every rank of a communication group in
        `tokens_per_expert` (an all-reduce per call): with expert parallelism every rank's load
        and expert_bias then stay the same. The training losses keep using this rank's tokens."""
        self.count_reducer = ops.AllReduce(group=group)

    def load(self):
        """Tokens routed to each expert since the last bias update (numpy float32 [E])."""
        return self.tokens_per_expert.asnumpy().copy()

    def recent_load(self):
        """load(), or when no token was routed since the last bias update, the load that drove
        it: what `load_imbalance` reports, before or after the update of a step."""
        load = self.load()
        if load.sum() == 0 and self.last_load is not None:
            return self.last_load.copy()
        return load

    def update_expert_bias(self):
        """Auxiliary-loss-free balancing (DeepSeek-V3): nudge the selection bias of overloaded
        experts down and of underloaded ones up, then reset the counts (`recent_load` keeps
        them). Call between steps."""
        load = self.load()
        if load.sum() > 0:
            step = self.bias_update_rate * np.sign(load.mean() - load)
            self.expert_bias.set_data(Tensor((self.expert_bias.asnumpy() + step).astype(np.float32)))
            self.last_load = load
        self.reset_load(keep_last=True)

    def reset_load(self, keep_last=False):
        """Forgets the routed-token counts (and, unless keep_last, the load of the last update)."""
        self.tokens_per_expert.set_data(Tensor(np.zeros(self.num_experts, np.float32)))
        if not keep_last:
            self.last_load = None


def _loss_coeffs(*coeffs):
    """The three loss coefficients as floats: TypeError for what is no number (bools included),
    ValueError for negative or non-finite ones."""
    names = ("aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff")
    for name, value in zip(names, coeffs):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"GatingTopK: {name} must be a number, got {type(value).__name__} "
                            f"({value!r})")
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"GatingTopK: {name} must be a finite number >= 0, got {value!r}")
    return tuple(float(c) for c in coeffs)
