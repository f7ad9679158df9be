"""Expert capacity (Megatron-Core's token dropping): each expert takes at most
`capacity = ceil(T * K / E * capacity_factor)` of the (token, slot) pairs routed to it in one call;
the pairs past it are dropped, they contribute nothing to the output, and the routing weights of
the kept pairs are not renormalised. `ExpertCapacity` decides which pairs are dropped; the token
dispatchers (ms_moe_ops.nn.dispatcher, ms_moe_ops.parallel) give a dropped pair no row, and with
`pad_to_capacity` lay every expert's rows out in exactly `min(capacity, T)` rows (static shapes).
"""
import math
import numbers

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, ops

from .. import _compat
from ..ops._indexing import count, inverse_permutation, take_rows
from ._checks import config_of, int_arg
from ._precision import SelfCastingCell
from .config import CapacityConfig

__all__ = ["ExpertCapacity", "DROP_POLICIES", "expert_capacity", "padded_rows", "check_options"]

DROP_POLICIES = ("probs", "position")
_ASSIGN_ADD = ops.AssignAdd()


def expert_capacity(tokens, top_k, num_experts, capacity_factor):
    """Megatron-Core's capacity of one expert for `tokens` tokens: ceil(T * K / E * factor),
    computed as Megatron's get_capacity does (T*K / E in float64, times the factor). An int; in
    a GRAPH-mode graph where T is known only at run time, an int64 tensor (the same float64
    arithmetic, in the graph)."""
    if _compat.is_constant(tokens):
        return math.ceil((tokens * top_k / num_experts) * capacity_factor)
    pairs = ops.scalar_to_tensor(tokens * top_k, ms.float64)
    return ops.ceil(pairs / num_experts * capacity_factor).astype(ms.int64)


def padded_rows(tokens, top_k, num_experts, capacity_factor):
    """The rows of each expert with pad_to_capacity: min(capacity, T) (a token takes an expert
    at most once, so no expert is routed more than T pairs)."""
    capacity = expert_capacity(tokens, top_k, num_experts, capacity_factor)
    if _compat.is_constant(tokens):
        return min(capacity, tokens)
    return ops.minimum(capacity, ops.scalar_to_tensor(tokens, ms.int64))


def check_options(config):
    """Checks the capacity options of a MoEConfig or CapacityConfig (TypeError/ValueError naming
    the option); returns capacity_factor as a float, or None (dropless)."""
    factor, policy, pad = config.capacity_factor, config.drop_policy, config.pad_to_capacity
    if factor is not None:
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
            raise TypeError(f"MoELayer: capacity_factor must be None (dropless) or a number, got "
                            f"{type(factor).__name__} ({factor!r})")
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"MoELayer: capacity_factor must be a finite number > 0 (or None: "
                             f"dropless), got {factor!r}")
        factor = float(factor)
    if not isinstance(policy, str) or policy not in DROP_POLICIES:
        raise ValueError(f"MoELayer: drop_policy must be one of {DROP_POLICIES}, got {policy!r}")
    if not isinstance(pad, (bool, np.bool_)):
        raise TypeError(f"MoELayer: pad_to_capacity must be True or False, got {pad!r}")
    if pad and factor is None:
        raise ValueError("MoELayer: pad_to_capacity=True pads each expert's rows to its capacity, "
                         "which needs a capacity_factor (got None: dropless)")
    return factor


class ExpertCapacity(SelfCastingCell):
    """Drops the routed (token, slot) pairs past each expert's capacity.

    Built from a CapacityConfig (or its options): num_experts E, top_k K, capacity_factor (a
    number > 0), drop_policy ("probs": each expert keeps its pairs of the highest routing weight;
    "position": the earliest tokens), pad_to_capacity (the dispatchers then give every expert
    exactly `rows_per_expert(T)` rows). Ties between equal weights go to the earlier token.

    construct(weights [T, K] float32, expert_idx [T, K] int32) -> (weights, expert_idx): a dropped
    pair gets weight 0 (no gradient flows through it) and expert E, a sentinel past the last
    expert that the dispatchers give no expert's row; the kept weights are unchanged.

    State: `counts` [2, E] float32 (not trainable): the routed pairs (row 0) and the dropped ones
    (row 1) per expert since the last `update()` (with `count_over(group)`, summed over a
    communication group's ranks).
    """

    def __init__(self, config=None, *args, **options):
        super().__init__()
        config = self.config = config_of("MoELayer", CapacityConfig, config, args, options)
        self.num_experts = int_arg("MoELayer", "num_experts", config.num_experts)
        self.top_k = int_arg("MoELayer", "top_k", config.top_k)
        self.capacity_factor = check_options(config)
        if self.capacity_factor is None:
            raise ValueError("MoELayer: an expert capacity needs a capacity_factor (None is "
                             "dropless)")
        self.by_probs = config.drop_policy == "probs"
        self.pad_to_capacity = bool(config.pad_to_capacity)
        self.counts = Parameter(Tensor(np.zeros((2, self.num_experts), np.float32)),
                                name="counts", requires_grad=False)
        self.reducer = None  # see count_over
        self.last_counts = None

    def capacity(self, tokens):
        """The capacity of each expert for a call with `tokens` tokens."""
        return expert_capacity(tokens, self.top_k, self.num_experts, self.capacity_factor)

    def rows_per_expert(self, tokens):
        """The rows of each expert with pad_to_capacity (padded_rows)."""
        return padded_rows(tokens, self.top_k, self.num_experts, self.capacity_factor)

    def construct(self, weights, expert_idx):
        tokens, k = expert_idx.shape
        flat = expert_idx.reshape(-1)
        capacity = self.capacity(tokens)
        slot, routed = slots(flat, self.num_experts, weights.reshape(-1) if self.by_probs else None)
        keep = (slot < capacity).reshape(tokens, k)
        routed = routed[:self.num_experts]
        kept = ops.minimum(routed, capacity)
        counts = ops.stop_gradient(ops.stack((routed, routed - kept)).astype(ms.float32))
        if self.reducer is not None:
            counts = self.reducer(counts)
        weights = weights * ops.stop_gradient(keep.astype(weights.dtype))
        weights = ops.depend(weights, _ASSIGN_ADD(self.counts, counts))
        return weights, ops.where(keep, expert_idx, ops.full_like(expert_idx, self.num_experts))

    def count_over(self, group):
        """Sums the counts over the ranks of a communication group (an all-reduce per call)."""
        self.reducer = ops.AllReduce(group=group)

    def load(self):
        """[2, E] numpy: routed and dropped pairs per expert since the last update()."""
        return self.counts.asnumpy().copy()

    def recent(self):
        """load(), or when nothing was routed since the last update(), the counts it ended."""
        counts = self.load()
        if counts[0].sum() == 0 and self.last_counts is not None:
            return self.last_counts.copy()
        return counts

    def update(self):
        """Ends a window of counts (update_expert_bias calls it between steps)."""
        counts = self.load()
        if counts[0].sum() > 0:
            self.last_counts = counts
        self.reset(keep_last=True)

    def reset(self, keep_last=False):
        self.counts.set_data(Tensor(np.zeros((2, self.num_experts), np.float32)))
        if not keep_last:
            self.last_counts = None

    def extend_repr(self):
        return (f"capacity_factor={self.capacity_factor}, drop_policy="
                f"{self.config.drop_policy!r}, pad_to_capacity={self.pad_to_capacity}")


def slots(flat_idx, num_experts, weights=None):
    """(int64 [N]: the place of each pair among the pairs of its expert (0 first) in the order
    the drop policy keeps them: by weight, highest first (weights [N] given), then by position;
    int64 [E + 1]: the pairs of each expert). flat_idx [N] int32 in [0, num_experts]."""
    n = flat_idx.shape[0]
    key = flat_idx.astype(ms.int64)
    if weights is not None:
        w = ops.stop_gradient(weights).astype(ms.float32)
        ordered, _ = ops.sort(w)
        greater = n - ops.searchsorted(ordered, w, right=True)  # pairs with a higher weight
        key = key * n + greater
    # a stable sort: equal keys in position order (an arange, not a cumsum: no tokens works)
    _, order = ops.sort(key * n + ops.arange(n, dtype=ms.int64))
    place = inverse_permutation(order).astype(ms.int64)
    counts = count(flat_idx, num_experts + 1)
    first = ops.cumsum(counts, 0) - counts
    return place - take_rows(first, flat_idx), counts


def padded_rows_index(flat_idx, num_experts, rows):
    """(int64 [N]: each pair's row in the padded layout (expert e's rows at [e*rows, (e+1)*rows),
    its pairs in token order), E*rows for the pairs of the sentinel expert E (dropped); int64
    [E]: the pairs each expert kept)."""
    slot, counts = slots(flat_idx, num_experts)
    row = flat_idx.astype(ms.int64) * rows + slot
    return (ops.where(flat_idx < num_experts, row, ops.zeros_like(row) + num_experts * rows),
            counts[:num_experts])
