"""examples/train_moe.py runs end to end on tiny sizes and writes everything it promises."""
import os
import subprocess
import sys

import mindspore as ms

from conftest import cpu_only
from ms_moe_ops.parallel import msrun

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "train_moe.py")


def test_example_runs_a_few_steps(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, EXAMPLE, "--steps", "3", "--batch-size", "4", "--seq-len", "16",
           "--d-model", "32", "--heads", "2", "--ffn", "16", "--layers", "2", "--experts", "4",
           "--top-k", "2", "--eval-every", "2", "--eval-batches", "1", "--sample-chars", "10",
           "--router", "softmax", "--aux-loss", "0.01", "--seq-aux-loss", "0.01", "--z-loss", "1e-3",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("moe_lm.ckpt", "loss.png", "expert_load.png"):
        assert (out / name).stat().st_size > 0, name
    assert "== summary ==" in proc.stdout and "== sample" in proc.stdout
    assert "train loss" in proc.stdout and "load imbalance" in proc.stdout
    assert "router losses (unscaled, mean over layers): switch" in proc.stdout


@cpu_only("msrun workers on the CPU backend")
def test_example_with_experts_split_over_two_processes(tmp_path):
    """`--expert-parallel 2` under msrun trains, the first process reports, and the checkpoint
    it joins from the two parts loads into the one-process model."""
    out = tmp_path / "run"
    args = ["--steps", "3", "--batch-size", "4", "--seq-len", "16", "--d-model", "32", "--heads",
            "2", "--ffn", "16", "--layers", "1", "--experts", "4", "--top-k", "2", "--eval-every",
            "3", "--eval-batches", "1", "--sample-chars", "2", "--mode", "pynative",
            "--aux-loss", "0.01", "--expert-parallel", "2", "--out", str(out)]
    logs = msrun(EXAMPLE, args, workers=2, timeout=300, log_dir=str(tmp_path / "logs"))
    with open(os.path.join(logs, "worker_0.log")) as f:
        first = f.read()
    with open(os.path.join(logs, "worker_1.log")) as f:
        second = f.read()
    assert "== summary ==" in first and "experts split over 2 processes" in first
    assert "router losses (unscaled, mean over layers): switch" in first
    assert "== summary ==" not in second  # one report
    for name in ("moe_lm.ckpt", "moe_lm-rank0.ckpt", "moe_lm-rank1.ckpt", "loss.png"):
        assert (out / name).stat().st_size > 0, name

    sys.path.insert(0, os.path.dirname(EXAMPLE))
    try:
        from moe_lm import CharData, MoELanguageModel
    finally:
        sys.path.pop(0)
    net = MoELanguageModel(CharData().vocab_size, 16, 32, 2, 1, 16, 4, 2, 1, 5e-3)
    params = ms.load_checkpoint(str(out / "moe_lm.ckpt"))
    assert params["blocks.0.moe.experts.weight1"].shape == (4, 32, 32)
    not_loaded, unused = ms.load_param_into_net(net, params)
    assert not not_loaded and not unused
