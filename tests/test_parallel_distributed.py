"""Expert parallelism on 2 processes launched with msrun (CPU, the AllReduce exchange), against
one process that holds every expert and takes the tokens of both ranks (the expert-parallel
case of tests/cases.py).

One launch (tests/ep_worker.py) does every check, because starting a cluster costs 15-25 s; the
single-process side is computed here while the workers run. A launch that fails or hangs fails
these tests with the last lines of each worker's log."""
import glob
import os
import threading

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn

import cases as case
from conftest import DEVICE, RTOL, assert_close, cpu_only
from ms_moe_ops.parallel import LaunchError, gather_experts, is_expert_parameter, msrun

pytestmark = [pytest.mark.distributed, cpu_only("the workers run on the CPU backend")]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ep_worker.py")
TOL = 1e-5


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """(per-rank results, single-process results, output directory)."""
    out = str(tmp_path_factory.mktemp("ep"))
    failure = []

    def launch():
        try:
            msrun(WORKER, [out], workers=case.RANKS, timeout=400, log_dir=out, cluster_time_out=60)
        except LaunchError as e:
            failure.append(e)

    thread = threading.Thread(target=launch)
    thread.start()
    try:
        single = _single_process()
    finally:
        thread.join()
        case.set_mode("pynative")
    if failure:
        pytest.fail(str(failure[0]), pytrace=False)
    ranks = [dict(np.load(os.path.join(out, f"rank{r}.npz"))) for r in range(case.RANKS)]
    return ranks, single, out


def _single_process():
    """The case in one process holding every expert, on all ranks' tokens."""
    x, cot, target = case.ep_tokens()
    result = {}
    for config, mode, train in case.EP_RUNS:
        case.set_mode(mode)
        key = f"{config}/{mode}/"
        layer = case.ep_layer(config)
        case.load_weights(layer, case.ep_weights(config))
        result.update({key + k: v for k, v in case.forward_backward(layer, x, cot).items()})
        if train:
            case.load_weights(layer, case.ep_weights(config))
            trained = case.train(layer, x, target, nn.TrainOneStepCell)
            result.update({key + k: v for k, v in trained.items()})
    case.set_mode("pynative")
    layer = case.ep_layer("swiglu")
    case.load_weights(layer, case.ep_weights("swiglu"))
    result["swiglu/bfloat16/out"] = layer(Tensor(x, ms.bfloat16)).astype(ms.float32).asnumpy()
    return result


def _concat(ranks, key):
    return np.concatenate([r[key] for r in ranks])


RUN_IDS = [f"{c}-{m}" for c, m, _ in case.EP_RUNS]
TRAINED = [(c, m) for c, m, t in case.EP_RUNS if t]


# -- the exchange pair ----------------------------------------------------------------------------

def _received(rows, send):
    """numpy AlltoAllV of per-rank rows, padded with zero rows to RANKS * M as the AllReduce
    exchange returns them."""
    m = rows.shape[1]
    return [np.concatenate([part, np.zeros((case.RANKS * m - len(part), rows.shape[2]))])
            for part in case.alltoallv(rows, send)]


def _returned(rows, send):
    """numpy transpose of the exchange: rows [RANKS, RANKS * M, H] received by each rank -> each
    rank's own M rows back."""
    out = []
    for r in range(case.RANKS):
        parts = []
        for d in range(case.RANKS):
            start = send[:r, d].sum()
            parts.append(rows[d][start:start + send[r, d]])
        out.append(np.concatenate(parts))
    return out


def test_exchange_pair_is_an_alltoallv_and_its_transpose(launched):
    ranks, _, _ = launched
    send, x, y, cot = case.exchange_case()
    m = case.EXCHANGE_ROWS
    expected = dict(dispatch=_received(x, send), combine=_returned(y, send),
                    # the gradient of each one is the other (over all ranks' losses)
                    dispatch_grad=_returned(cot, send), combine_grad=_received(cot[:, :m], send))
    assert send[0, 1] == 0  # one rank sends nothing to the other: an empty chunk
    for name, per_rank in expected.items():
        for r in range(case.RANKS):
            np.testing.assert_array_equal(ranks[r][f"exchange/{name}"], per_rank[r], err_msg=name)


# -- the layer ------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, mode", [r[:2] for r in case.EP_RUNS], ids=RUN_IDS)
def test_output_and_input_gradient(launched, config, mode):
    ranks, single, _ = launched
    key = f"{config}/{mode}/"
    assert_close(_concat(ranks, key + "out"), single[key + "out"], rtol=TOL)
    assert_close(_concat(ranks, key + "dx"), single[key + "dx"], rtol=TOL)


@pytest.mark.parametrize("config, mode", [r[:2] for r in case.EP_RUNS], ids=RUN_IDS)
def test_parameter_gradients(launched, config, mode):
    """Router and shared experts: per-rank parts that sum to the single-process gradient.
    Experts: each rank's gradient is complete, the single-process one of its experts."""
    ranks, single, _ = launched
    key = f"{config}/{mode}/grad/"
    names = [k[len(key):] for k in single if k.startswith(key)]
    assert any("router" in n for n in names) and any(is_expert_parameter(n) for n in names)
    for name in names:
        if is_expert_parameter(name):
            got = _concat(ranks, key + name)
        else:
            got = sum(r[key + name] for r in ranks)
            assert not np.allclose(ranks[0][key + name], single[key + name], atol=TOL), name
        assert_close(got, single[key + name], rtol=TOL)


@pytest.mark.parametrize("config, mode", [r[:2] for r in case.EP_RUNS], ids=RUN_IDS)
def test_expert_bias_after_an_update(launched, config, mode):
    ranks, single, _ = launched
    key = f"{config}/{mode}/expert_bias"
    assert np.abs(single[key]).max() > 0  # the update moved it
    for r in ranks:
        np.testing.assert_array_equal(r[key], single[key])


@pytest.mark.parametrize("config, mode", TRAINED, ids=[f"{c}-{m}" for c, m in TRAINED])
def test_training_steps_match_one_process(launched, config, mode):
    ranks, single, _ = launched
    key = f"{config}/{mode}/"
    mean_loss = sum(r[key + "loss"] for r in ranks) / case.RANKS
    assert_close(mean_loss, single[key + "loss"], rtol=TOL)
    assert single[key + "loss"][-1] < single[key + "loss"][0]
    prefix = key + "weights/"
    names = [k[len(prefix):] for k in single if k.startswith(prefix)]
    assert "experts.weight1" in names and "router.weight" in names
    for name in names:
        if is_expert_parameter(name):
            got = _concat(ranks, prefix + name)
        else:
            for r in ranks[1:]:  # replicated: the same on every rank
                np.testing.assert_array_equal(r[prefix + name], ranks[0][prefix + name], err_msg=name)
            got = ranks[0][prefix + name]
        assert_close(got, single[prefix + name], rtol=TOL)
    assert np.abs(single[key + "weights/router.expert_bias"]).max() > 0


@pytest.mark.parametrize("config, mode", TRAINED, ids=[f"{c}-{m}" for c, m in TRAINED])
def test_checkpoint_of_two_ranks_loads_in_one_process(launched, config, mode):
    """The ranks' checkpoints after training, gathered, make a single-process layer that
    computes what the two ranks computed (the other way, shard_experts fed every rank)."""
    ranks, _, out = launched
    files = sorted(glob.glob(os.path.join(out, f"{config}-{mode}-rank*.ckpt")))
    assert len(files) == case.RANKS
    full = gather_experts([ms.load_checkpoint(f) for f in files])
    layer = case.ep_layer(config)
    assert not ms.load_param_into_net(layer, full)[0]  # nothing left unloaded
    x, _, _ = case.ep_tokens()
    assert_close(layer(Tensor(x)).asnumpy(), _concat(ranks, f"{config}/{mode}/trained_out"), rtol=TOL)


def test_bfloat16_rows(launched):
    ranks, single, _ = launched
    # two bfloat16 runs of the layer that round its intermediate results in different
    # groupings (rows split over the ranks): a few ulps apart, not half of one, and near zero
    # (sums that cancel) an ulp of intermediates as large as the largest outputs
    single_out = single["swiglu/bfloat16/out"]
    assert_close(_concat(ranks, "swiglu/bfloat16/out"), single_out, "bfloat16",
                 rtol=4 * RTOL["bfloat16"], atol=2 * RTOL["bfloat16"] * np.abs(single_out).max())


def test_experts_must_divide_over_the_ranks(launched):
    ranks, _, _ = launched
    assert "num_experts must be a multiple of the expert-parallel group size 2" in str(
        ranks[0]["error/indivisible"])


def test_alltoallv_primitive_builds(launched):
    """The Ascend exchange's primitive, as MindSpore 2.10 documents it: the group and a
    block_size of H elements so that its split lists count rows (running it needs HCCL)."""
    ranks, _, _ = launched
    assert str(ranks[0]["alltoallv/attrs"]) == repr(("AlltoAllV", "mccl_world_group", case.EP_HIDDEN, 2))


def test_a_hung_launch_fails_with_the_worker_logs(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import os, time\nprint('worker', os.environ['MS_NODE_ID'], 'pid', os.getpid(), "
                      "flush=True)\ntime.sleep(600)\n")
    with pytest.raises(LaunchError) as info:
        msrun(str(script), workers=2, timeout=12, log_dir=str(tmp_path / "logs"), cluster_time_out=60)
    message = str(info.value)
    assert "no result within 12 s" in message
    pids = []
    for r in range(2):
        assert f"--- worker_{r}.log" in message
        pids.append(int(message.split(f"worker {r} pid ")[1].split()[0]))
    for pid in pids:  # ended with their process groups
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), pid


def _zombie(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[1].split()[0] == "Z"
