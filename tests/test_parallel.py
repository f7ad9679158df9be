"""ms_moe_ops.parallel in one process: the routing index arithmetic against numpy, checkpoint
sharding, the expert-parallel path on a group of one process (bit for bit the local layer), the
launcher's environment, and what needs no process group. The runs on several processes are in
test_parallel_distributed.py."""
import os
import sys

import numpy as np
import pytest
from mindspore import Parameter, Tensor

from ms_moe_ops import MoELayer, dropped_fraction, update_expert_bias
from ms_moe_ops.parallel import (ExpertDispatcher, ExpertParallel, OneRankExchange,
                                 expert_parameter_names, gather_experts, is_expert_parameter,
                                 launch, msrun, shard_experts)
from ms_moe_ops.parallel.exchange import chunk_rows, inverse_index, transpose_chunks_index
from cases import inputs, layer_grads, make_layer
from conftest import numpy, run, tensor


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


def test_sharded_parameters_are_named_after_their_key(rng):
    """A Parameter gets its checkpoint key as its name (what load_param_into_net matches), also
    when the Parameter it was made from had another name (a sub-network's own)."""
    full = {"net." + k: Parameter(Tensor(v), name=k) for k, v in _checkpoint(rng).items()}
    shards = [shard_experts(full, r, 2) for r in range(2)]
    for params in shards + [gather_experts(shards)]:
        for key, value in params.items():
            if is_expert_parameter(key):
                assert value.name == key


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


# -- the expert-parallel path on one process ----------------------------------------------------

ONE_RANK_CASES = {
    "swiglu, gated shared": dict(e=4, k=2, shared=1, shared_expert_gate=True),
    "fastgelu, softmax, biases": dict(e=6, k=3, activation="fastgelu", score_func="softmax",
                                      norm_topk_prob=False, has_bias=True),
    "groups, clamp, losses": dict(e=8, k=2, n_group=4, topk_group=2, clamp_limit=0.7,
                                  aux_loss_coeff=0.1, seq_aux_loss_coeff=0.1, z_loss_coeff=0.01),
    "capacity by probs": dict(e=4, k=2, capacity_factor=0.75),
    "capacity by position, padded": dict(e=4, k=2, shared=1, capacity_factor=0.75,
                                         drop_policy="position", pad_to_capacity=True),
}


def _twins(**options):
    """A local MoELayer and the same layer (same weights) on the expert-parallel path of one
    process."""
    local = make_layer(**options, seed=3)
    parallel = MoELayer(local.config, expert_parallel=ExpertParallel.single())
    for (name, p), (other, q) in zip(local.parameters_and_names(), parallel.parameters_and_names()):
        assert name == other
        q.set_data(Tensor(p.asnumpy()))
    return local, parallel


# every case in both modes and dtypes in the full run; in the default run each case once, one
# in GRAPH mode, one in bfloat16 (each case costs two compilations per mode)
_ONE_RANK_DEFAULT = {("swiglu, gated shared", "float32", "graph"),
                     ("fastgelu, softmax, biases", "float32", "pynative"),
                     ("groups, clamp, losses", "bfloat16", "pynative"),
                     ("capacity by position, padded", "float32", "pynative")}
# (the capacity cases in bfloat16 in PyNative mode only: their dispatch is dtype-blind index work)
ONE_RANK_RUNS = [pytest.param(case, dtype, mode, id=f"{mode}-{case}-{dtype}",
                              marks=() if (case, dtype, mode) in _ONE_RANK_DEFAULT
                              else pytest.mark.slow)
                 for case in ONE_RANK_CASES for dtype in ("float32", "bfloat16")
                 for mode in ("pynative", "graph")
                 if not (case.startswith("capacity") and (dtype, mode) == ("bfloat16", "graph"))]


@pytest.mark.parametrize("case,dtype,mode", ONE_RANK_RUNS)
def test_one_rank_expert_parallel_is_the_local_layer_bit_for_bit(case, dtype, mode):
    local, parallel = _twins(**ONE_RANK_CASES[case])
    assert isinstance(parallel.dispatcher, ExpertDispatcher)
    assert parallel.experts.num_experts == local.experts.num_experts
    x = inputs((2, 5, 8), seed=5, dtype=dtype)
    cot = np.random.default_rng(6).normal(0, 1, (2, 5, 8))
    for layer in (local, parallel):
        layer.result = layer_grads(layer, x, cot, mode, dtype)
        layer.out = numpy(run(layer, tensor(x, dtype), mode=mode))
        layer.load = update_expert_bias(layer)
    np.testing.assert_array_equal(parallel.out, local.out, err_msg="out")
    np.testing.assert_array_equal(parallel.result[0], local.result[0], err_msg="dx")
    assert parallel.result[1].keys() == local.result[1].keys()
    for name, grad in local.result[1].items():
        np.testing.assert_array_equal(parallel.result[1][name], grad, err_msg=name)
    np.testing.assert_array_equal(parallel.load, local.load)
    assert local.load.sum() > 0
    np.testing.assert_array_equal(parallel.router.expert_bias.asnumpy(),
                                  local.router.expert_bias.asnumpy())
    np.testing.assert_array_equal(parallel.router.aux_losses.asnumpy(),
                                  local.router.aux_losses.asnumpy())
    assert dropped_fraction(parallel) == dropped_fraction(local)
    if local.capacity is not None:
        assert 0 < dropped_fraction(local)[0] < 1


def test_one_rank_group():
    ep = ExpertParallel.single()
    assert (ep.group, ep.rank, ep.size) == (None, 0, 1)
    layer = MoELayer(8, 6, 4, 2, expert_parallel=ep)
    assert isinstance(layer.dispatcher.exchange, OneRankExchange)
    assert not layer.dispatcher.padded and layer.router.count_reducer is None
    assert expert_parameter_names(layer) == {"experts.weight1", "experts.weight2"}
    assert expert_parameter_names(MoELayer(8, 6, 4, 2)) == set()


# -- msrun --------------------------------------------------------------------------------------

def test_workers_start_with_the_callers_interpreter(monkeypatch, tmp_path):
    """msrun starts each worker as `python` looked up on PATH: the caller's interpreter's
    directory goes first, so a virtual environment that is not activated works too."""
    started = {}

    class Launcher:
        pid = 0

        def __init__(self, cmd, env, **kwargs):
            started.update(cmd=cmd, env=env)

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(launch.subprocess, "Popen", Launcher)
    monkeypatch.setattr(launch, "_end_job", lambda launcher: None)
    bin_dir = os.path.dirname(os.path.abspath(sys.executable))
    msrun("script.py", workers=2, log_dir=str(tmp_path), env={"PATH": "/usr/bin:/bin"})
    assert started["cmd"][0] == sys.executable
    assert started["env"]["PATH"].split(os.pathsep) == [bin_dir, "/usr/bin", "/bin"]
    moved = launch.worker_path(f"/usr/bin{os.pathsep}{bin_dir}")
    assert moved.split(os.pathsep) == [bin_dir, "/usr/bin"]
    assert launch.worker_path(None) == bin_dir


@pytest.mark.parametrize("exchange", ["alltoallv", "allreduce"])
def test_the_experts_take_what_each_exchange_gives(exchange, rng):
    """Rank 0's layer of a 2-rank group (built in this process, never run across processes): its
    experts are padded exactly when its exchange pads the rows it receives (AllReduce: n*T*K rows,
    zeros past the counts), and on such rows they compute what the same experts compute on the
    received rows alone, zeros past them. (The padded experts of an AllReduce layer were checked
    only by the 2-process msrun runs.)"""
    from ms_moe_ops import MoeFFN

    ep = ExpertParallel.single()  # (every attribute set), then rank 0 of 2 in the world group
    ep.group, ep.rank, ep.size, ep.exchange = "hccl_world_group", 0, 2, exchange
    ep.world_group, ep.world_size = ep.group, ep.size
    layer = MoELayer(8, 6, 4, 2, expert_parallel=ep)
    assert layer.experts.num_experts == 2
    assert layer.experts.padded == layer.dispatcher.padded == (exchange == "allreduce")
    if not layer.dispatcher.padded:
        return
    tokens, k = 5, 2
    counts = np.array([4, 3], np.int64)  # of the n*T*K = 20 rows, 7 for this rank's experts
    rows = np.zeros((2 * tokens * k, 8), np.float32)
    rows[:7] = rng.normal(size=(7, 8))
    alone = MoeFFN(layer.experts.config.replace(padded=False))
    for p, q in zip(layer.experts.get_parameters(), alone.get_parameters()):
        q.set_data(Tensor(p.asnumpy()))
    got = numpy(layer.experts(Tensor(rows), Tensor(counts)))
    np.testing.assert_array_equal(got[:7], numpy(alone(Tensor(rows[:7]), Tensor(counts))))
    np.testing.assert_array_equal(got[7:], 0)
