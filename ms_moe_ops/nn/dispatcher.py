"""Token dispatchers: how a MoE layer takes each token's rows to its experts and back.

Every dispatcher offers the same two calls, so MoELayer has one path whatever runs the experts:
- `dispatch(x [T, H], expert_idx [T, K] int32)` -> (rows [R, H], counts int64 [E_here], route):
  the (token, slot) rows of the experts held here, expert by expert (counts[e] rows for the
  e-th of them); route is what combine needs;
- `combine(y [R, H], weights [T, K] float32, route)` -> [T, H] in y's dtype: each token's K
  expert outputs times its routing weights, summed in float32 (moe_token_unpermute): the weight
  scales an expert's whole output, its bias included.
Dispatchers are SelfCastingCells (ms_moe_ops.nn._precision): they move rows in the dtype they are
given. Attributes: `local_experts` (E_here), `padded` (rows past sum(counts) are padding, which the
experts must allow: MoeFFN(padded=True)) and `count_group` (the communication group over which
the router counts tokens; None: this process).

With an expert capacity (ms_moe_ops.nn.capacity; the dispatchers take the layer's
ExpertCapacity, or None) the expert_idx given to dispatch marks the dropped pairs with the
sentinel expert E: they get no expert's row, and their weight is 0. With `pad_to_capacity` every
expert gets exactly `padded_rows(T, ...)` rows (the pairs it kept, then zero rows): the rows, the
counts and everything between have static shapes.

`LocalDispatcher` keeps every expert in this process. The expert-parallel dispatcher
(`ms_moe_ops.parallel.ExpertDispatcher`, made by `ExpertParallel.dispatcher`) wraps a
LocalDispatcher around an exchange between ranks, so both paths share these steps and numerics.
"""
import mindspore as ms
from mindspore import ops

from ..ops import moe_token_permute, moe_token_unpermute
from .. import _compat
from ..ops import _platform
from ..ops._indexing import take_rows
from ._precision import SelfCastingCell
from .capacity import padded_rows, padded_rows_index

__all__ = ["LocalDispatcher"]


class LocalDispatcher(SelfCastingCell):
    """All num_experts experts in this process: dispatch is moe_token_permute (route: the
    sorted_index), combine moe_token_unpermute with the routing weights. With `capacity` (an
    ExpertCapacity) the dropped pairs (expert E) are permuted past every expert's rows (padding,
    `padded`), or with pad_to_capacity each expert's pairs are gathered into its `rows` rows
    (route: each pair's row). A SelfCastingCell: mixed precision (which O2 applies to every Cell
    of a network) must not cast the float32 routing weights it combines with."""

    def __init__(self, num_experts, capacity=None):
        super().__init__()
        self.num_experts = num_experts
        self.local_experts = num_experts
        self.pad = capacity is not None and capacity.pad_to_capacity
        # what the padded layout needs of the capacity (its Cell belongs to the layer)
        self.capacity_of = None if capacity is None else (capacity.top_k, capacity.capacity_factor)
        # the dropped pairs' rows follow the experts' (all but with pad_to_capacity)
        self.padded = capacity is not None and not self.pad
        self.count_group = None
        self.widen_bfloat16 = _platform.device_target() != "Ascend"

    def dispatch(self, x, expert_idx):
        if self.pad:
            return self._dispatch_padded(x, expert_idx)
        if self.capacity_of is None:
            rows, sorted_index, counts = moe_token_permute(x, expert_idx, self.num_experts)
            return rows, counts, sorted_index
        rows, sorted_index, counts = moe_token_permute(x, expert_idx, self.num_experts + 1)
        return rows, counts[:self.num_experts], sorted_index

    def combine(self, y, weights, route):
        if self.pad:
            # each pair's row (a zero row for the dropped ones), then the weighted sum per token
            pairs = y if _none(route) else \
                take_rows(_with_zero_row(self._carried(y)), route).astype(y.dtype)
            return moe_token_unpermute(pairs, ops.arange(pairs.shape[0], dtype=ms.int32), weights)
        return moe_token_unpermute(y, route, weights)

    def _dispatch_padded(self, x, expert_idx):
        """[E*C, H] rows, expert e's at [e*C, (e+1)*C): its pairs in token order, then zero rows;
        counts C each; route: each pair's row (E*C for a dropped pair)."""
        tokens, k = expert_idx.shape
        top_k, factor = self.capacity_of
        rows = padded_rows(tokens, top_k, self.num_experts, factor)
        if _none(expert_idx):  # no rows (and no gathers: the CPU's bprop of one refuses none)
            return x.reshape(0, x.shape[1]), ops.zeros((self.num_experts,), dtype=ms.int64), \
                ops.zeros((0,), dtype=ms.int64)
        flat = expert_idx.reshape(-1)
        row_of_pair, kept = padded_rows_index(flat, self.num_experts, rows)
        # row e*C + s holds a pair when s < the pairs expert e kept, else zeros (row T of x): the
        # pair whose row it is, found in the pairs sorted by row
        row = ops.arange(self.num_experts * rows, dtype=ms.int64)
        filled = row % rows < take_rows(kept, row // rows)
        ordered, pair = ops.sort(row_of_pair.astype(ms.int32))
        at = ops.minimum(ops.searchsorted(ordered, row.astype(ms.int32)), tokens * k - 1)
        token = ops.where(filled, take_rows(pair, at).astype(ms.int64) // k,
                          ops.zeros_like(row) + tokens)
        out = take_rows(_with_zero_row(self._carried(x)), token).astype(x.dtype)
        return out, ops.zeros((self.num_experts,), dtype=ms.int64) + rows, row_of_pair

    def _carried(self, rows):
        """bfloat16 rows through float32 off Ascend (exact): the CPU has no bfloat16 Gather."""
        if self.widen_bfloat16 and rows.dtype == ms.bfloat16:
            return rows.astype(ms.float32)
        return rows


def _none(t):
    """Whether t is known to be empty while the graph is built (no tokens)."""
    return _compat.is_constant(t.shape[0]) and t.shape[0] == 0


def _with_zero_row(rows):
    return ops.concat((rows, ops.zeros((1, rows.shape[1]), dtype=rows.dtype)))
