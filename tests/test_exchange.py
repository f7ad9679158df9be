"""The AlltoAllV exchange pair (expert parallelism on Ascend) in one process: AlltoAllV has no CPU
kernel, so a stand-in plays the collective of a world of ranks (what each rank receives, computed
with numpy from every rank's rows, with AlltoAllV's documented shape-() result when nothing
arrives) and the exchange's own plan, dispatch and combine run for real, in both modes."""
import numpy as np
import pytest
from mindspore import Tensor, nn

from ms_moe_ops.nn._precision import SelfCastingCell
from ms_moe_ops.parallel.exchange import AlltoAllVExchange
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
    """AlltoAllV as rank r sees it in a world: returns `out` whatever it is sent."""

    def __init__(self, out):
        super().__init__()
        self.out = Tensor(out)

    def construct(self, flat, send, receive):
        return self.out


class _Exchange(AlltoAllVExchange):
    def __init__(self, rank, out):  # no process group: the collective is the stand-in
        SelfCastingCell.__init__(self)
        self.rank, self.hidden_size = rank, H
        self.all_to_all = _Collective(out)


# rank 2 receives nothing (and sends nothing), rank 0 sends only to itself
WORLDS = [[[2, 0, 0], [1, 3, 0], [0, 0, 0]], [[0, 0], [4, 0]], [[1, 2], [3, 1]]]


@pytest.mark.parametrize("send", WORLDS)
def test_dispatch_gives_each_rank_what_was_sent_to_it(send, mode, rng):
    world = _World(send, rng)
    for r in range(len(send)):
        exchange = _Exchange(r, world.received(r))
        fn = lambda x, s: exchange.dispatch(x, exchange.plan(s, x.shape[0]))  # noqa: E731
        got = numpy(run(fn, Tensor(world.rows[r]), Tensor(world.send), mode=mode))
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
        fn = lambda y, s: exchange.combine(y, exchange.plan(s, 0))  # noqa: E731
        got = numpy(run(fn, Tensor(received), Tensor(world.send), mode=mode))
        np.testing.assert_array_equal(got, world.rows[r].reshape(-1, H))


def test_the_plan_is_this_ranks_row_and_column(rng):
    send = np.array([[1, 2, 0], [3, 0, 4], [0, 5, 6]], np.int64)
    sent, received = _Exchange(1, np.zeros(())).plan(Tensor(send), 7)
    assert sent.asnumpy().tolist() == [3, 0, 4] and received.asnumpy().tolist() == [2, 0, 5]
