"""The exchange pairs in one process. AlltoAllV (expert parallelism on Ascend) has no CPU kernel,
so a stand-in plays the collective of a world of ranks (what each rank receives, computed with
numpy from every rank's rows, with AlltoAllV's documented shape-() result when nothing arrives)
and the exchange's own plan, dispatch and combine run for real, in both modes. The AllReduce
pair (every other device) runs the same way, for worlds of more than the two ranks msrun gives
its distributed tests here."""
import numpy as np
import pytest
from mindspore import Tensor, nn

from ms_moe_ops.nn._precision import SelfCastingCell
from ms_moe_ops.parallel.exchange import (AllReduceExchange, AlltoAllVExchange,
                                        BlockAllReduceExchange, GroupGather)
from conftest import numpy, run

H = 3


class _World:
    """n ranks; send[s, d] rows go from rank s to rank d; rows[s] is rank s's [M_s, H] block,
    ordered by destination."""

    def __init__(self, send, rng):
        self.send = np.asarray(send, np.int64)
        self.rows = [rng.normal(size=(int(self.send[s].sum()), H)).astype(np.float32)
                     for s in range(len(self.send))]

    def chunk(self, s, d):
        start = int(self.send[s, :d].sum())
        return self.rows[s][start:start + int(self.send[s, d])]

    def received(self, r):
        """What AlltoAllV gives rank r: the chunks every rank sent it, source by source (flat),
        shape () when nothing arrives."""
        got = np.concatenate([self.chunk(s, r) for s in range(len(self.send))])
        return got.reshape(-1) if got.size else np.zeros((), np.float32)


class _Collective(nn.Cell):
    """AlltoAllV as rank r sees it in a world: returns `out` whatever it is sent, which must be
    `sent` elements (None: any) (a reshape to that size fails otherwise)."""

    def __init__(self, out, sent=None):
        super().__init__()
        self.out = Tensor(out)
        self.sent = sent

    def construct(self, flat, send, receive):
        if self.sent is not None:
            flat = flat.reshape((self.sent,))
        return self.out + 0 * flat.sum()


class _Exchange(AlltoAllVExchange):
    def __init__(self, rank, out, sent=None):  # no process group: the collective is the stand-in
        SelfCastingCell.__init__(self)
        self.rank, self.hidden_size = rank, H
        self.all_to_all = _Collective(out, sent)


# rank 2 receives nothing (and sends nothing), rank 0 sends only to itself
WORLDS = [[[2, 0, 0], [1, 3, 0], [0, 0, 0]], [[0, 0], [4, 0]], [[1, 2], [3, 1]]]


@pytest.mark.parametrize("send", WORLDS)
def test_dispatch_gives_each_rank_what_was_sent_to_it(send, mode, rng):
    world = _World(send, rng)
    for r in range(len(send)):
        exchange = _Exchange(r, world.received(r), int(world.send[r].sum()) * H)
        fn = lambda x, s: exchange.dispatch(x, exchange.plan(s, x.shape[0]))  # noqa: E731
        # a row past those sent (a pair dropped at a capacity) is not sent
        extra = np.concatenate([world.rows[r], np.full((1, H), 9.0, np.float32)])
        got = numpy(run(fn, Tensor(extra), Tensor(world.send), mode=mode))
        expected = np.concatenate([world.chunk(s, r) for s in range(len(send))]).reshape(-1, H)
        np.testing.assert_array_equal(got, expected)
        assert got.shape == (int(world.send[:, r].sum()), H)


@pytest.mark.parametrize("send", WORLDS)
def test_combine_gives_each_rank_its_own_rows_back(send, mode, rng):
    world = _World(send, rng)
    for r in range(len(send)):
        # on the way back each rank receives its own rows, from every destination in turn
        own = world.rows[r].reshape(-1) if world.rows[r].size else np.zeros((), np.float32)
        exchange = _Exchange(r, own)
        received = np.zeros((int(world.send[:, r].sum()), H), np.float32)
        m = len(world.rows[r]) + 2  # two rows past those sent (pairs dropped at a capacity)
        fn = lambda y, s: exchange.combine(y, exchange.plan(s, m))  # noqa: E731
        got = numpy(run(fn, Tensor(received), Tensor(world.send), mode=mode))
        assert got.shape == (m, H)
        np.testing.assert_array_equal(got[:m - 2], world.rows[r].reshape(-1, H))
        np.testing.assert_array_equal(got[m - 2:], 0)


def test_the_plan_is_this_ranks_row_and_column(rng):
    send = np.array([[1, 2, 0], [3, 0, 4], [0, 5, 6]], np.int64)
    sent, received, m = _Exchange(1, np.zeros(())).plan(Tensor(send), 7)
    assert sent.asnumpy().tolist() == [3, 0, 4] and received.asnumpy().tolist() == [2, 0, 5]
    assert m == 7


# -- the AllReduce pair: every rank sends M rows in all (send rows sum to M) ------------------------

class _Sum(nn.Cell):
    """The AllReduce as rank r sees it: returns `out` (the world's sum) whatever it is given;
    with out=None it records its input and returns it (to collect every rank's share first)."""

    def __init__(self, out=None):
        super().__init__()
        self.out, self.seen = (None if out is None else Tensor(out)), []

    def construct(self, x):
        if self.out is None:
            self.seen.append(x.asnumpy())
            return x
        return self.out


class _AllReduce(AllReduceExchange):
    def __init__(self, rank, size, all_reduce):
        SelfCastingCell.__init__(self)
        self.rank, self.size, self.all_reduce = rank, size, all_reduce


SUM_WORLDS = [[[2, 1, 0], [0, 1, 2], [1, 0, 2]], [[0, 3, 1, 0], [2, 0, 0, 2], [1, 1, 1, 1], [0, 0, 4, 0]],
              [[1, 2], [3, 0]]]


@pytest.mark.slow_in_graph  # a compilation per rank
@pytest.mark.parametrize("send", SUM_WORLDS)
def test_all_reduce_dispatch_gives_each_rank_what_was_sent_to_it(send, mode, rng):
    world = _World(send, rng)
    n, m = len(send), int(world.send[0].sum())
    everyone = np.concatenate(world.rows)  # the all-reduced [n*M, H]: rank s's rows at s*M
    for r in range(n):
        exchange = _AllReduce(r, n, _Sum(everyone))
        fn = lambda x, s: exchange.dispatch(x, exchange.plan(s, x.shape[0]))  # noqa: E731
        got = numpy(run(fn, Tensor(world.rows[r]), Tensor(world.send), mode=mode))
        mine = np.concatenate([world.chunk(s, r) for s in range(n)]).reshape(-1, H)
        assert got.shape == (n * m, H)
        np.testing.assert_array_equal(got[:len(mine)], mine)
        np.testing.assert_array_equal(got[len(mine):], 0)


@pytest.mark.parametrize("send", SUM_WORLDS)
def test_all_reduce_combine_gives_each_rank_its_own_rows_back(send, rng):
    world = _World(send, rng)
    n, m = len(send), int(world.send[0].sum())
    # the experts' results: each received row times 2 (plus rows past them that must be ignored)
    results = []
    for r in range(n):
        mine = np.concatenate([world.chunk(s, r) for s in range(n)]).reshape(-1, H)
        results.append(np.concatenate([2 * mine, np.full((n * m - len(mine), H), 7.0, np.float32)]))
    plans = [_AllReduce(r, n, None).plan(Tensor(world.send), m) for r in range(n)]
    shares = []
    for r in range(n):  # every rank's share of the AllReduce, then their sum for each
        recorder = _Sum()
        _AllReduce(r, n, recorder).combine(Tensor(results[r]), plans[r])
        shares.append(recorder.seen[0])
    total = np.sum(shares, axis=0)
    for r in range(n):
        got = _AllReduce(r, n, _Sum(total)).combine(Tensor(results[r]), plans[r]).asnumpy()
        np.testing.assert_array_equal(got, 2 * world.rows[r])


# -- the all-to-all of equal blocks (pad_to_capacity) and the gather of counts ---------------------

class _Block(BlockAllReduceExchange):
    def __init__(self, rank, size, all_reduce):
        SelfCastingCell.__init__(self)
        self.rank, self.size, self.all_reduce = rank, size, all_reduce


class _Gather(GroupGather):
    def __init__(self, rank, size, all_reduce):
        SelfCastingCell.__init__(self)
        self.rank, self.size, self.all_reduce = rank, size, all_reduce


def _world_sum(cls, inputs):
    """Every rank's share of the AllReduce inside cls, summed: what the collective returns."""
    shares = []
    for r, x in enumerate(inputs):
        recorder = _Sum()
        cls(r, len(inputs), recorder)(Tensor(x))
        shares.append(recorder.seen[0])
    return np.sum(shares, axis=0)


@pytest.mark.parametrize("n", [2, 3])
def test_equal_blocks_all_to_all(n, rng):
    """Rank r's block d goes to rank d; rank d gets the blocks of every rank, source by source;
    applied twice (the way back) every rank has its own rows again."""
    b = 2
    rows = [rng.normal(size=(n * b, H)).astype(np.float32) for _ in range(n)]
    total = _world_sum(_Block, rows)
    got = [_Block(r, n, _Sum(total))(Tensor(rows[r])).asnumpy() for r in range(n)]
    for d in range(n):
        np.testing.assert_array_equal(got[d], np.concatenate([rows[s][d * b:(d + 1) * b]
                                                              for s in range(n)]))
    back_total = _world_sum(_Block, got)
    for r in range(n):
        np.testing.assert_array_equal(_Block(r, n, _Sum(back_total))(Tensor(got[r])).asnumpy(),
                                      rows[r])


def test_group_gather(rng):
    counts = [rng.integers(0, 9, 4).astype(np.int64) for _ in range(3)]
    total = _world_sum(_Gather, counts)
    for r in range(3):
        got = _Gather(r, 3, _Sum(total))(Tensor(counts[r])).asnumpy()
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, np.stack(counts))
