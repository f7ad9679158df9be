"""ExpertDispatcher: the token dispatcher of an expert-parallel MoE layer (the interface:
ms_moe_ops.nn.dispatcher), which takes the rows of each token to the ranks that hold their
experts and brings the results back.

The local steps with an exchange between them: permute by expert (LocalDispatcher.dispatch) ->
exchange the counts -> exchange the rows -> (the local experts run on the rows received) ->
exchange back -> weighted unpermute (LocalDispatcher.combine). On a group of one process every
exchange is the identity, and the layer computes what the local layer computes, bit for bit.
"""
import mindspore as ms
from mindspore import ops

from ..nn._precision import SelfCastingCell
from ..nn.dispatcher import LocalDispatcher
from ..ops import _platform
from ..ops._indexing import take_rows
from .exchange import (AllReduceExchange, AlltoAllExchange, AlltoAllVExchange,
                       BlockAllReduceExchange, GroupGather, inverse_index, transpose_chunks_index)

__all__ = ["ExpertDispatcher", "OneRankExchange"]


class ExpertDispatcher(SelfCastingCell):
    """Token routing of a MoE layer whose num_experts experts are split over `ep` (an
    ExpertParallel): this rank holds experts [first, first + E/n), first = rank * E/n.

    `dispatch(x [T, H], expert_idx [T, K] int32)` -> (rows, counts, route):
      permutes the T*K (token, slot) rows by expert, gathers every rank's per-expert counts, sends
      each row to the rank holding its expert and orders the rows received by local expert
      (within an expert: by source rank, then token). counts int64 [E/n] are the rows of each
      local expert. With the AllReduce exchange rows is [n*T*K, H]: the rows past sum(counts)
      are zero padding, which the grouped kernels skip, so only experts that received rows do
      work (`padded` is then True: the experts must be told, e.g. MoeFFN(padded=True)).
      route: what combine needs.
    `combine(y, weights [T, K] float32, route)` -> [T, H]: y (the experts' output, rows as
      dispatched) goes back to the ranks the rows came from; each token's K rows are summed,
      weighted by its routing weights.

    With an expert capacity (`capacity`, an ExpertCapacity) each rank drops the pairs past the
    capacity of its own T tokens before anything is sent (as Megatron-Core does), so they are
    not sent. With pad_to_capacity every rank sends every rank exactly (E/n)*C rows (C =
    capacity.rows_per_expert(T)): no counts are exchanged and the exchange is an all-to-all of
    equal blocks (ops.AlltoAll on Ascend, one AllReduce elsewhere); each local expert gets n*C
    rows, every shape static.

    Every rank must call both with the same T (the AllReduce exchange has static shapes).
    bfloat16 rows travel as float32 off Ascend (the CPU has no bfloat16 collectives or gathers).
    """

    def __init__(self, ep, num_experts, hidden_size, capacity=None):
        super().__init__()
        self.num_experts = num_experts
        self.size = ep.size
        self.local_experts = ep.local_experts(num_experts)
        self.first_expert = ep.rank * self.local_experts
        self.local = LocalDispatcher(num_experts, capacity)
        self.pad = self.local.pad
        if ep.size == 1:
            self.gather = _Stacked()
            self.exchange = OneRankExchange()
        elif self.pad:
            self.exchange = (AlltoAllExchange(ep) if ep.exchange == "alltoallv"
                             else BlockAllReduceExchange(ep))
        else:
            self.gather = GroupGather(ep)
            self.exchange = (AlltoAllVExchange(ep, hidden_size) if ep.exchange == "alltoallv"
                             else AllReduceExchange(ep))
        # whether dispatch pads the rows past the local experts' (static shapes)
        self.padded = isinstance(self.exchange, AllReduceExchange) or self.local.padded
        # the router (and the capacity) count the tokens of every rank that trains the model
        self.count_group = ep.world_group if ep.world_size > 1 else None
        # through the platform module (as the resolver): the Ascend dry run patches it
        self.widen_bfloat16 = _platform.device_target() != "Ascend"

    def dispatch(self, x, expert_idx):
        dtype = x.dtype
        if self.pad:
            return self._dispatch_padded(x, expert_idx)
        permuted, counts, position = self.local.dispatch(x, expert_idx)
        # table[s, e]: rows rank s routes to expert e (every rank needs all of it to place rows)
        table = self.gather(counts).astype(ms.int64).reshape(self.size, self.num_experts)
        send = table.reshape(self.size, self.size, self.local_experts).sum(-1)  # rank to rank
        mine = table[:, self.first_expert:self.first_expert + self.local_experts]  # [n, E/n]
        plan = self.exchange.plan(send, permuted.shape[0])
        received = self.exchange.dispatch(self._carried(permuted), plan)  # by source rank
        # (source, expert) chunks -> (expert, source): each local expert's rows together
        order = transpose_chunks_index(mine, received.shape[0])
        rows = take_rows(self._with_zero_row(received), order)
        return rows.astype(dtype), mine.sum(0), (position, plan, order)

    def combine(self, y, weights, route):
        if self.pad:
            return self._combine_padded(y, weights, route)
        position, plan, order = route
        dtype = y.dtype
        by_source = take_rows(self._with_zero_row(self._carried(y)), inverse_index(order))
        back = self.exchange.combine(by_source, plan)
        return self.local.combine(back.astype(dtype), weights, position)

    def _dispatch_padded(self, x, expert_idx):
        """Every expert's C rows of this rank (LocalDispatcher) to its rank; received [n, E/n, C]
        blocks by source, regrouped by local expert: [E/n, n, C] rows."""
        rows, counts, position = self.local.dispatch(x, expert_idx)
        c = rows.shape[0] // self.num_experts
        received = self.exchange(self._carried(rows))
        rows = self._regrouped(received, (self.size, self.local_experts, c))
        counts = ops.full((self.local_experts,), self.size * c, dtype=ms.int64)
        return rows.astype(x.dtype), counts, position

    def _combine_padded(self, y, weights, route):
        c = y.shape[0] // (self.size * self.local_experts)
        back = self.exchange(self._regrouped(self._carried(y), (self.local_experts, self.size, c)))
        return self.local.combine(back.astype(y.dtype), weights, route)

    @staticmethod
    def _regrouped(rows, blocks):
        """rows [a*b*c, H] in (a, b, c) order -> (b, a, c) order."""
        a, b, c = blocks
        return rows.reshape(a, b, c, -1).transpose(1, 0, 2, 3).reshape(a * b * c, -1)

    def _carried(self, rows):
        if self.widen_bfloat16 and rows.dtype == ms.bfloat16:
            return rows.astype(ms.float32)
        return rows

    @staticmethod
    def _with_zero_row(rows):
        return ops.concat((rows, ops.zeros((1, rows.shape[1]), dtype=rows.dtype)))


class _Stacked(SelfCastingCell):
    """The gather of a group of one: x as [1, ...] float32."""

    def construct(self, x):
        return ops.stop_gradient(x).astype(ms.float32).expand_dims(0)


class OneRankExchange(SelfCastingCell):
    """The exchange pair of a group of one process (see exchange.py): every row stays here (also
    as the all-to-all of equal blocks)."""

    def construct(self, x):
        return x

    def plan(self, send, m):
        return send

    def dispatch(self, x, plan):
        return x

    def combine(self, y, plan):
        return y
