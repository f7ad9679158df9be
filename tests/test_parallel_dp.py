"""Expert parallelism inside data parallelism, and msrun's multi-node launch (CPU, msrun).

4 ranks = 2 expert-parallel groups of 2 x 2 data-parallel replicas (ExpertParallel(size=2)),
tests/ep_dp_worker.py on each: training steps of a dropless layer and of a padded capacity layer
(static shapes, the all-to-all of equal blocks), in GRAPH and PyNative mode, against one process
that takes the global batch. Then the same workers started by two launches on this host standing
for two nodes of 2 workers each (msrun's --worker_num, --local_worker_num, --master_addr,
--node_rank): the same results as the one launch, bit for bit. A launch costs 15-25 s and more
with 4 processes on 2 cores: one launch of each kind, every check reads their results."""
import os
import socket
import threading
import time

import numpy as np
import pytest
from mindspore import nn

import cases as case
from conftest import assert_close, cpu_only
from ms_moe_ops.parallel import LaunchError, is_expert_parameter, msrun
from ms_moe_ops.parallel.launch import free_port

pytestmark = [pytest.mark.distributed, cpu_only("the workers run on the CPU backend")]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ep_dp_worker.py")
TOL = 1e-5


def _launch_in_thread(failures, *args, **kwargs):
    def launch():
        try:
            msrun(WORKER, *args, **kwargs)
        except LaunchError as error:
            failures.append(error)

    thread = threading.Thread(target=launch)
    thread.start()
    return thread


def _ranks(out):
    return [dict(np.load(os.path.join(out, f"rank{r}.npz"))) for r in range(case.DP_RANKS)]


@pytest.fixture(scope="module")
def one_launch(tmp_path_factory):
    """(per-rank results of one launch of 4 workers, single-process results)."""
    out = str(tmp_path_factory.mktemp("ep_dp"))
    failures = []
    thread = _launch_in_thread(failures, [out], workers=case.DP_RANKS, timeout=600, log_dir=out)
    try:
        single = _single_process()
    finally:
        thread.join()
        case.set_mode("pynative")
    if failures:
        pytest.fail(str(failures[0]), pytrace=False)
    return _ranks(out), single


def _single_process():
    """Every run in one process holding every expert, on the global batch: the MSE over all of
    it (dropless), or the mean of the MSEs of each rank's part (a capacity counts the tokens of
    one call, as each rank's layer does)."""
    result = {}
    for config, mode in case.DP_RUNS:
        case.set_mode(mode)
        layer = case.dp_layer(config)
        case.load_weights(layer, case.dp_weights(config))
        network = ((lambda net: nn.WithLossCell(net, nn.MSELoss())) if config == "dropless" else
                   (lambda net: case.ChunkedLoss(net, case.DP_RANKS)))
        trained = case.dp_train(layer, case.dp_batches(), network, nn.TrainOneStepCell)
        result.update({f"{config}/{mode}/{k}": v for k, v in trained.items()})
    return result


def _expert_slice(full, rank):
    """The experts of world rank `rank`: its expert-parallel rank's share."""
    local = full.shape[0] // case.DP_EP_SIZE
    ep_rank = rank % case.DP_EP_SIZE
    return full[ep_rank * local:(ep_rank + 1) * local]


@pytest.mark.parametrize("config,mode", case.DP_RUNS, ids=[f"{c}-{m}" for c, m in case.DP_RUNS])
def test_ep_x_dp_trains_as_one_process(one_launch, config, mode):
    ranks, single = one_launch
    key = f"{config}/{mode}/"
    assert_close(sum(r[key + "loss"] for r in ranks) / case.DP_RANKS, single[key + "loss"],
                 rtol=TOL)
    np.testing.assert_allclose([r[key + "dropped"] for r in ranks],
                               [single[key + "dropped"]] * case.DP_RANKS, rtol=1e-6)
    if config == "capacity":
        assert (single[key + "dropped"] > 0).all()
    names = [k[len(key + "weights/"):] for k in single if k.startswith(key + "weights/")]
    assert "experts.weight1" in names and "router.weight" in names
    for name in names:
        want = single[key + "weights/" + name]
        for r, got in enumerate(ranks):
            got = got[key + "weights/" + name]
            assert_close(got, _expert_slice(want, r) if is_expert_parameter(name) else want,
                         rtol=TOL, atol=1e-6)
    assert np.abs(single[key + "weights/router.expert_bias"]).max() > 0


def test_replicas_hold_the_same_experts(one_launch):
    """Ranks 0 and 2 (one data-parallel group) hold the same experts, bit for bit; ranks 0 and 1
    (one expert-parallel group) other experts."""
    ranks, _ = one_launch
    name = "dropless/graph/weights/experts.weight1"
    np.testing.assert_array_equal(ranks[0][name], ranks[2][name])
    np.testing.assert_array_equal(ranks[1][name], ranks[3][name])
    assert not np.allclose(ranks[0][name], ranks[1][name])


def test_padded_capacity_step_has_static_shapes(one_launch):
    """The compiled training step of the padded capacity layer on every rank (the exchange an
    all-to-all of equal blocks, here one AllReduce): no dimension known only at run time."""
    ranks, _ = one_launch
    for r, result in enumerate(ranks):
        dynamic = list(result["capacity/graph/dynamic"])
        assert not dynamic, f"rank {r}:\n" + "\n".join(dynamic[:10])


def test_two_nodes_train_as_one_launch(one_launch, tmp_path):
    """Two launches of 2 workers (node_rank 0 and 1, one master address and port) give the 4
    ranks the same results as one launch of 4, bit for bit (the GRAPH-mode runs)."""
    ranks, _ = one_launch
    out, port, failures = str(tmp_path), free_port(), []
    nodes = [_launch_in_thread(failures, [out, "graph"], workers=case.DP_RANKS, local_workers=2,
                               master_addr="127.0.0.1", master_port=port, node_rank=0,
                               timeout=600, log_dir=os.path.join(out, "node0"))]
    _wait_for_port(port, failures)  # node 0's scheduler first: node 1's launch finds it there
    nodes.append(_launch_in_thread(failures, [out, "graph"], workers=case.DP_RANKS,
                                   local_workers=2, master_addr="127.0.0.1", master_port=port,
                                   node_rank=1, timeout=600, log_dir=os.path.join(out, "node1")))
    for node in nodes:
        node.join()
    if failures:
        pytest.fail("\n".join(map(str, failures)), pytrace=False)
    assert {"worker_2.log", "worker_3.log"} <= set(os.listdir(os.path.join(out, "node1")))
    two = _ranks(out)
    for r in range(case.DP_RANKS):
        keys = list(two[r])
        assert len(keys) == len([k for k in ranks[r] if "/graph/" in k]) > 0
        for key in keys:
            np.testing.assert_array_equal(two[r][key], ranks[r][key], err_msg=f"rank {r} {key}")


def _wait_for_port(port, failures, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and not failures:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"no scheduler listened on port {port} within {timeout} s\n"
                         + "\n".join(map(str, failures)))
