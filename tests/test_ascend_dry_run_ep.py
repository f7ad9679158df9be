"""The expert-parallel layer's training step as MindSpore compiles it for Atlas A2, on two CPU
processes (msrun): its experts split over the ranks, rows exchanged by AlltoAllV, gradients
all-reduced by ExpertParallelTrainStep; and with the experts padded to their capacity, rows
exchanged by the fixed-size AlltoAll. As in tests/test_ascend_dry_run.py, only the CPU backend
may refuse (an Ascend kernel: AlltoAllV and AlltoAll have no CPU kernel either), and the compiled
IR must obey the Ascend rules, the collectives' included. The dropless step has dimensions known
only at run time (the rows AlltoAllV brings); the padded one none."""
import json
import os

import pytest

from ascend_sim import ASCEND_ONLY
from conftest import cpu_only
from ms_moe_ops.parallel import msrun

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ascend_dry_run_ep_worker.py")

pytestmark = [pytest.mark.distributed, cpu_only("msrun workers on the CPU backend")]


def test_expert_parallel_step_compiles_as_on_ascend(tmp_path):
    msrun(WORKER, [str(tmp_path)], workers=2, timeout=420, log_dir=str(tmp_path / "logs"))
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.json") as f:
            result = json.load(f)
        assert result["refused"] in ASCEND_ONLY + ("AlltoAllV",), result["error"]
        assert not result["broken"], "\n".join(result["broken"])
        assert {"alltoallv", "gmm-grouped-reduction", "gating-top-k"} <= set(result["applied"])
        assert result["dynamic"]  # AlltoAllV's rows
        padded = result["padded"]
        assert padded["refused"] in ASCEND_ONLY + ("AlltoAll",), padded["error"]
        assert not padded["broken"], "\n".join(padded["broken"])
        assert {"alltoall", "gmm-grouped-reduction", "gating-top-k"} <= set(padded["applied"])
        assert "alltoallv" not in padded["applied"]
        assert not padded["dynamic"], "\n".join(padded["dynamic"][:10])
