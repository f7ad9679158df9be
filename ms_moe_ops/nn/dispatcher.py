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

`LocalDispatcher` keeps every expert in this process. The expert-parallel dispatcher
(`ms_moe_ops.parallel.ExpertDispatcher`, made by `ExpertParallel.dispatcher`) wraps a
LocalDispatcher around an exchange between ranks, so both paths share these steps and numerics.
"""
from ..ops import moe_token_permute, moe_token_unpermute
from ._precision import SelfCastingCell

__all__ = ["LocalDispatcher"]


class LocalDispatcher(SelfCastingCell):
    """All num_experts experts in this process: dispatch is moe_token_permute (route: the
    sorted_index), combine moe_token_unpermute with the routing weights. A SelfCastingCell: mixed
    precision (which O2 applies to every Cell of a network) must not cast the float32 routing
    weights it combines with."""

    def __init__(self, num_experts):
        super().__init__()
        self.num_experts = num_experts
        self.local_experts = num_experts
        self.padded = False
        self.count_group = None

    def dispatch(self, x, expert_idx):
        rows, sorted_index, counts = moe_token_permute(x, expert_idx, self.num_experts)
        return rows, counts, sorted_index

    def combine(self, y, weights, route):
        return moe_token_unpermute(y, route, weights)
