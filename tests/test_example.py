"""examples/train_moe.py runs end to end on tiny sizes and writes everything it promises."""
import os
import subprocess
import sys

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
