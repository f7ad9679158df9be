"""ms_moe_ops.parallel in one process: the routing index arithmetic against numpy, checkpoint
sharding, and what needs no process group. The runs on several processes are in
test_parallel_distributed.py."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Parameter, Tensor

from ms_moe_ops.parallel import ExpertParallel, gather_experts, is_expert_parameter, shard_experts
from ms_moe_ops.parallel.exchange import chunk_rows, inverse_index, transpose_chunks_index
from conftest import run


def _transposed_chunks(sizes, rows):
    """numpy: source rows of chunks (i, j) laid out i-major, listed j-major, padded with rows."""
    a, b = sizes.shape
    start = np.concatenate([[0], np.cumsum(sizes.reshape(-1))])[:-1].reshape(a, b)
    out = [start[i, j] + k for j in range(b) for i in range(a) for k in range(sizes[i, j])]
    return np.array(out + [rows] * (rows - len(out)), np.int64)


@pytest.mark.parametrize("shape", [(2, 3), (3, 1), (1, 4), (4, 4)])
def test_transpose_chunks_index_and_its_inverse(shape, mode, rng):
    sizes = rng.integers(0, 4, shape).astype(np.int64)
    sizes.flat[rng.integers(0, sizes.size)] = 0  # an empty chunk, always
    rows = int(sizes.sum()) + int(rng.integers(0, 4))  # some padding, or none
    if rows == 0:
        rows = 1

    def fn(s):
        order = transpose_chunks_index(s, rows)
        return order, inverse_index(order)

    order, inverse = (o.asnumpy() for o in run(fn, Tensor(sizes), mode=mode))
    expected = _transposed_chunks(sizes, rows)
    np.testing.assert_array_equal(order, expected)
    # the inverse undoes it: every source row read goes back to where it was read from
    total = int(sizes.sum())
    np.testing.assert_array_equal(order[inverse[:total]], np.arange(total))
    assert (inverse[total:] == rows).all()


def test_chunk_rows_lays_chunks_end_to_end(mode):
    sizes = Tensor(np.array([2, 0, 3], np.int64))
    starts = Tensor(np.array([10, 4, 0], np.int64))

    def fn(s, t):
        return chunk_rows(s, t, 7, 99)

    got = run(fn, sizes, starts, mode=mode).asnumpy()
    np.testing.assert_array_equal(got, [10, 11, 0, 1, 2, 99, 99])


# -- checkpoints --------------------------------------------------------------------------------

def _checkpoint(rng, experts=4):
    moe = "layers.0.moe."
    shapes = {moe + "router.weight": (experts, 3), moe + "router.expert_bias": (experts,),
              moe + "experts.weight1": (experts, 3, 4), moe + "experts.weight2": (experts, 2, 3),
              moe + "shared_experts.weight1": (3, 4), "moment1." + moe + "experts.weight1": (experts, 3, 4),
              "embed.weight": (5, 3)}
    return {k: rng.normal(0, 1, s).astype(np.float32) for k, s in shapes.items()}


def test_expert_parameters_by_name():
    assert is_expert_parameter("experts.weight1")
    assert is_expert_parameter("blocks.1.moe.experts.bias2")
    assert is_expert_parameter("moment2.blocks.1.moe.experts.weight2")
    for name in ("shared_experts.weight1", "router.weight", "experts", "weight1",
                 "blocks.0.experts.gate"):
        assert not is_expert_parameter(name), name


@pytest.mark.parametrize("size", [1, 2, 4])
def test_shard_then_gather_gives_the_checkpoint_back(size, rng):
    full = _checkpoint(rng)
    shards = [shard_experts(full, r, size) for r in range(size)]
    for r, shard in enumerate(shards):
        assert shard.keys() == full.keys()
        for name, value in shard.items():
            if is_expert_parameter(name):
                local = 4 // size
                np.testing.assert_array_equal(value, full[name][r * local:(r + 1) * local])
            else:
                assert value is full[name]
    back = gather_experts(shards)
    assert back.keys() == full.keys()
    for name in full:
        np.testing.assert_array_equal(back[name], full[name])


def test_parameters_stay_parameters(rng):
    full = {k: Parameter(Tensor(v), name=k, requires_grad="bias" not in k)
            for k, v in _checkpoint(rng).items()}
    shard = shard_experts(full, 1, 2)
    w1 = shard["layers.0.moe.experts.weight1"]
    assert isinstance(w1, Parameter) and w1.name == "layers.0.moe.experts.weight1"
    np.testing.assert_array_equal(w1.asnumpy(), full["layers.0.moe.experts.weight1"].asnumpy()[2:])
    assert shard["layers.0.moe.router.expert_bias"].requires_grad is False
    back = gather_experts([shard_experts(full, r, 2) for r in range(2)])
    assert isinstance(back["layers.0.moe.experts.weight2"], Parameter)
    np.testing.assert_array_equal(back["layers.0.moe.experts.weight2"].asnumpy(),
                                  full["layers.0.moe.experts.weight2"].asnumpy())


def test_checkpoint_errors(rng):
    full = _checkpoint(rng, experts=3)
    with pytest.raises(ValueError, match="3 experts, not a multiple of size=2"):
        shard_experts(full, 0, 2)
    with pytest.raises(ValueError, match="0 <= rank < size"):
        shard_experts(full, 2, 2)
    full = _checkpoint(rng)
    shards = [shard_experts(full, r, 2) for r in range(2)]
    shards[1] = dict(shards[1], **{"embed.weight": full["embed.weight"] + 1})
    with pytest.raises(ValueError, match="'embed.weight' differs between rank 0 and rank 1"):
        gather_experts(shards)
    assert gather_experts(shards, check=False)["embed.weight"] is full["embed.weight"]
    losses = [dict(s, **{"layers.0.moe.router.aux_losses": np.float32([r, 0, 0])})
              for r, s in enumerate(shards)]  # a per-rank record: rank 0's, unchecked
    assert gather_experts(losses, check=False)["layers.0.moe.router.aux_losses"][0] == 0
    shards = [dict(s, **{"embed.weight": full["embed.weight"]}) for s in losses]
    assert gather_experts(shards)["layers.0.moe.router.aux_losses"][0] == 0
    del shards[1]["embed.weight"]
    with pytest.raises(ValueError, match=r"'embed.weight' is missing on ranks \[1\]"):
        gather_experts(shards)
    with pytest.raises(ValueError, match="at least one rank"):
        gather_experts([])


def test_expert_parallel_needs_a_process_group():
    with pytest.raises(RuntimeError, match=r"init\(\) first"):
        ExpertParallel()
