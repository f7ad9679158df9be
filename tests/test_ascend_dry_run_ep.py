"""The expert-parallel layer's training step as MindSpore compiles it for Atlas A2, on two CPU
processes (msrun): its experts split over the ranks, rows exchanged by AlltoAllV, gradients
all-reduced by ExpertParallelTrainStep. As in tests/test_ascend_dry_run.py, only the CPU backend
may refuse (an Ascend kernel: AlltoAllV has no CPU kernel either), and the compiled IR must obey
the Ascend rules, AlltoAllV's included."""
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
