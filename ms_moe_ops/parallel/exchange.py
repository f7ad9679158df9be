"""Moving routed rows between the ranks of an expert-parallel group: the exchange pair and the
index arithmetic behind it.

Both implementations have the semantics of an all-to-all with uneven splits. With `send[s, d]`
the number of rows rank s sends to rank d (an int64 [n, n] tensor every rank holds) and
`plan = exchange.plan(send, M)` what the exchange derives from it once per step (M: the rows
this rank sends):
- `dispatch(x, plan)` on rank r takes x, its rows ordered by destination rank (rank 0's first),
  and returns the rows every rank sent to r, source by source (rank 0's first);
- `combine(y, plan)` is its transpose: y holds the rows r received, in that order, and it returns
  r's own rows, back in the order r sent them. Each is the other's gradient.

`AlltoAllVExchange` (Ascend, HCCL) is ops.AlltoAllV with exact sizes (dynamic shapes).
`AllReduceExchange` runs wherever AllReduce does (CPU's collectives have no all-to-all kernel)
with static shapes: each rank puts its M rows at its own offset of a zero [n*M, H] buffer, one
AllReduce (a sum in which every row has one contributor, so exact) gives every rank all rows, and
a gather takes its own; the result is padded with zero rows to n*M. Its way back scatters the
rows to their origins and all-reduces again. It moves n times the data of an all-to-all and
needs the same M on every rank.

With a fixed number of rows between every two ranks (pad_to_capacity: every rank sends B rows to
each rank), the exchange is an all-to-all of equal blocks, which is its own transpose: one call
`exchange(x [n*B, H])` sends block d of x to rank d and returns the blocks received, source by
source. `AlltoAllExchange` is ops.AlltoAll (Ascend, HCCL); `BlockAllReduceExchange` its emulation
with one AllReduce of n*n*B rows (any backend). No plan, no counts, static shapes.

`GroupGather` is an all-gather made of an AllReduce (MindSpore's CPU AllGather takes only the
world group; this works in any group): float32 values, exact for integers below 2**24.
"""
import mindspore as ms
from mindspore import ops

from ..nn._precision import SelfCastingCell
from ..ops._indexing import inverse_index as _inverse_index, take_rows

__all__ = ["AllReduceExchange", "AlltoAllVExchange", "AlltoAllExchange", "BlockAllReduceExchange",
           "GroupGather", "chunk_rows", "transpose_chunks_index", "inverse_index"]


def chunk_rows(sizes, starts, rows, pad):
    """Gather index that lays chunks end to end: for c = 0, 1, ..., sizes[c] rows copied from
    source rows starts[c], starts[c] + 1, ...; the output rows past the last chunk read row `pad`
    (a zero row appended to the source). sizes, starts: int64 [C]. -> int64 [rows]."""
    ends = ops.cumsum(sizes, 0)
    shift = starts - (ends - sizes)  # source row - output row, per chunk
    row = ops.arange(rows, dtype=ms.int64)
    chunk = ops.searchsorted(ends, row, right=True)  # C past the last chunk
    last = sizes.shape[0] - 1
    src = row + take_rows(shift, ops.minimum(chunk, last))
    return ops.where(chunk <= last, src, ops.full_like(src, pad))


def transpose_chunks_index(sizes, rows):
    """Gather index that reorders chunks from (i, j) to (j, i) order: the source holds chunk
    (i, j) of sizes[i, j] rows in row-major order (i = 0 first), the result holds them with j
    outermost; rows past the chunks read row `rows` (a zero row appended to the source).
    sizes: int64 [a, b]. -> int64 [rows]."""
    flat = sizes.reshape(-1)
    starts = (ops.cumsum(flat, 0) - flat).reshape(sizes.shape).T.reshape(-1)
    return chunk_rows(sizes.T.reshape(-1), starts, rows, rows)


def inverse_index(index):
    """The gather index that undoes one: index [rows] maps each output row to a distinct source
    row, or to `rows` (padding); the result maps each source row back to its output row, and the
    source rows no output row read to `rows`. int64 [rows]."""
    return _inverse_index(index, index.shape[0])


def at_rank(x, rank, size):
    """x [a, ...] at rows [rank*a, (rank+1)*a) of an otherwise zero [size*a, ...] tensor: this
    rank's share of an AllReduce in which every element has one contributor."""
    parts = []
    if rank > 0:
        parts.append(ops.zeros((rank * x.shape[0],) + x.shape[1:], dtype=x.dtype))
    parts.append(x)
    if rank < size - 1:
        parts.append(ops.zeros(((size - 1 - rank) * x.shape[0],) + x.shape[1:], dtype=x.dtype))
    return ops.concat(parts) if len(parts) > 1 else x


# The exchanges are SelfCastingCells: mixed precision (O2's to_float on every Cell) must not
# cast the rows they carry.
class _OverAllReduce(SelfCastingCell):
    """A Cell made of an AllReduce over `ep`'s group: this rank's place and the group's size."""

    def __init__(self, ep):
        super().__init__()
        self.rank = ep.rank
        self.size = ep.size
        self.all_reduce = ops.AllReduce(group=ep.group)


class AllReduceExchange(_OverAllReduce):
    """The exchange pair with static shapes from AllReduce (see the module docstring)."""

    def plan(self, send, m):
        """Row of the all-reduced [n*M] buffer holding each row this rank receives (n*M past
        them): from source s, the send[s, r] rows after those s sends to lower ranks."""
        n, r = self.size, self.rank
        before = ops.cumsum(send, 1) - send
        starts = ops.arange(n, dtype=ms.int64) * m + before[:, r]
        return chunk_rows(send[:, r], starts, n * m, n * m)

    def dispatch(self, x, plan):
        """x [M, H] -> [n*M, H]: the rows sent to this rank, then zero rows."""
        h = x.shape[1]
        everyone = self.all_reduce(at_rank(x, self.rank, self.size))
        padded = ops.concat((everyone, ops.zeros((1, h), dtype=x.dtype)))
        return take_rows(padded, plan)

    def combine(self, y, plan):
        """y [n*M, H] (rows past those received are ignored) -> [M, H]."""
        rows, h = y.shape
        m = rows // self.size
        # each received row back at its place in the [n*M] buffer (zeros where none goes)
        padded = ops.concat((y, ops.zeros((1, h), dtype=y.dtype)))
        home = take_rows(padded, inverse_index(plan))
        mine = self.all_reduce(home)
        return mine[self.rank * m:(self.rank + 1) * m]


class AlltoAllVExchange(SelfCastingCell):
    """The exchange pair as ops.AlltoAllV (HCCL on Ascend; no CPU kernel). Exact sizes: dispatch
    returns [R, H] with R = sum(send[:, r]) (a dynamic shape), combine [M, H]. MindSpore's
    backward of AlltoAllV is AlltoAllV with the two lists swapped, which is the other function
    of the pair. A rank that receives nothing at all gets a tensor of shape () from AlltoAllV
    (MindSpore documents it): the rows taken are the first R*H elements, so that is [0, H]."""

    def __init__(self, ep, hidden_size):
        super().__init__()
        self.rank = ep.rank
        self.hidden_size = hidden_size
        # block_size H: the split lists count rows of H elements
        self.all_to_all = ops.AlltoAllV(group=ep.group, block_size=hidden_size)

    def plan(self, send, m):
        """(rows sent to each rank, rows received from each rank, M)."""
        return send[self.rank], send[:, self.rank], m

    def dispatch(self, x, plan):
        """x [M, H] -> the rows received; x's rows past sum(sent) (pairs dropped at an expert's
        capacity) are not sent."""
        sent, received, _ = plan
        flat = x.reshape(-1)[:sent.sum() * self.hidden_size]
        return self._rows(self.all_to_all(flat, sent, received), received)

    def combine(self, y, plan):
        """-> [M, H]: this rank's rows back, then zero rows up to M."""
        sent, received, m = plan
        back = self._rows(self.all_to_all(y.reshape(-1), received, sent), sent)
        with_zero = ops.concat((back, ops.zeros((1, self.hidden_size), dtype=back.dtype)))
        return take_rows(with_zero, ops.minimum(ops.arange(m, dtype=ms.int64), sent.sum()))

    def _rows(self, out, counts):
        """AlltoAllV's output as [rows, H] (its shape-() result when nothing arrives: [0, H])."""
        return out.reshape(-1)[:counts.sum() * self.hidden_size].reshape(-1, self.hidden_size)


class AlltoAllExchange(SelfCastingCell):
    """The all-to-all of equal blocks as ops.AlltoAll (HCCL on Ascend; no CPU kernel): x [n*B, H]
    -> [n*B, H], block d sent to rank d, block s of the result from rank s. Its backward is an
    AlltoAll too (MindSpore's bprop swaps split and concat dimensions, both 0 here)."""

    def __init__(self, ep):
        super().__init__()
        self.all_to_all = ops.AlltoAll(split_count=ep.size, split_dim=0, concat_dim=0,
                                       group=ep.group)

    def construct(self, x):
        return self.all_to_all(x)


class BlockAllReduceExchange(_OverAllReduce):
    """The all-to-all of equal blocks from one AllReduce (any backend): each rank puts its n
    blocks at its own row of a zero [n, n, B, H] buffer and takes column `rank` of the sum
    (every element has one contributor: exact). Static shapes; n*n*B rows all-reduced."""

    def construct(self, x):
        h = x.shape[1]
        blocks = x.reshape(1, self.size, -1, h)
        everyone = self.all_reduce(at_rank(blocks, self.rank, self.size))  # [source, dest, B, H]
        return everyone[:, self.rank].reshape(-1, h)


class GroupGather(_OverAllReduce):
    """x [...] of every rank of the group, stacked by rank: [n, ...] float32 (an AllReduce of x
    placed at row `rank` of zeros; exact for integers below 2**24). Forward only."""

    def construct(self, x):
        x = ops.stop_gradient(x).astype(ms.float32).expand_dims(0)
        return self.all_reduce(at_rank(x, self.rank, self.size))
