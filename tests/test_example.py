"""examples/train_moe.py: end to end on tiny sizes (it writes everything it promises), on two
processes with msrun, and its small decisions: where a run writes, how often it validates, how
an expert-parallel run is launched."""
import json
import os
import subprocess
import sys

import mindspore as ms
import pytest

from conftest import cpu_only
from ms_moe_ops.parallel import msrun

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
EXAMPLE = os.path.join(EXAMPLES, "train_moe.py")
TINY = ["--steps", "3", "--batch-size", "4", "--seq-len", "16", "--d-model", "32", "--heads", "2",
        "--ffn", "16", "--experts", "4", "--top-k", "2", "--eval-batches", "1"]

sys.path.insert(0, EXAMPLES)
try:
    import train_moe
    from moe_lm import CharData
finally:
    sys.path.pop(0)


@pytest.mark.slow  # a whole run: about 40 s
def test_example_runs_a_few_steps(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, EXAMPLE, *TINY, "--layers", "2", "--sample-chars", "10",
           "--router", "softmax", "--aux-loss", "0.01", "--seq-aux-loss", "0.01", "--z-loss", "1e-3",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("moe_lm.ckpt", "loss.png", "expert_load.png"):
        assert (out / name).stat().st_size > 0, name
    chars = json.loads((out / "chars.json").read_text(encoding="utf-8"))
    assert chars == CharData().chars and all(len(c) == 1 for c in chars)
    assert "== summary ==" in proc.stdout and "== sample" in proc.stdout
    assert "train loss" in proc.stdout and "load imbalance" in proc.stdout
    assert "router losses (unscaled, mean over layers): switch" in proc.stdout
    # validated after every one of the 3 steps: a curve, not two points
    assert "val loss" in proc.stdout and "(step 3)" in proc.stdout


@pytest.mark.slow  # a whole run: about 40 s
def test_causal_lm_run_saves_a_model_load_pretrained_reads(tmp_path):
    """--model causal-lm trains a MoECausalLM and saves config.json + model.safetensors:
    load_pretrained gives the trained weights back (the same loss as moe_lm.ckpt's)."""
    import numpy as np
    from ms_moe_ops.convert import load_pretrained
    from moe_lm import CharCausalLM, causal_lm_config

    out = tmp_path / "run"
    flags = [*TINY, "--layers", "2", "--sample-chars", "5", "--model", "causal-lm", "--z-loss",
             "1e-3", "--out", str(out)]
    proc = subprocess.run([sys.executable, EXAMPLE, *flags], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    assert config["model_type"] == "deepseek_v3" and config["n_routed_experts"] == 4
    assert json.loads((out / "chars.json").read_text(encoding="utf-8")) == CharData().chars

    args = train_moe.parse_args(flags)
    trained = CharCausalLM(causal_lm_config(len(CharData().chars), 16, 2, 2,
                                            train_moe.moe_config(args)), 16)
    not_loaded, _ = ms.load_param_into_net(trained, ms.load_checkpoint(str(out / "moe_lm.ckpt")))
    assert not [n for n in not_loaded if "router." not in n], not_loaded
    loaded = load_pretrained(str(out))
    data = CharData()
    x, y = data.batch("val", 4, 16, np.random.default_rng(0))
    loss = ms.nn.CrossEntropyLoss()
    expected = float(loss(trained(ms.Tensor(x)), ms.Tensor(y.reshape(-1))))
    got = float(loss(loaded(ms.Tensor(x)).reshape(-1, len(data.chars)), ms.Tensor(y.reshape(-1))))
    assert got == pytest.approx(expected, rel=1e-6)
    # and the generate command talks with it, through chars.json
    proc = subprocess.run([sys.executable, "-m", "ms_moe_ops.generate", str(out), "--prompt",
                           "def ", "--greedy", "--max-new-tokens", "8", "--mode", "pynative"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("def ") and len(proc.stdout.rstrip("\n")) == 12, proc.stdout
    assert "tokens/s" in proc.stderr


@pytest.mark.distributed
@cpu_only("msrun workers on the CPU backend")
def test_example_with_experts_split_over_two_processes(tmp_path):
    """`--expert-parallel 2` under msrun trains, the first process reports, and the checkpoint
    it joins from the two parts loads into the one-process model."""
    out = tmp_path / "run"
    args = [*TINY, "--layers", "1", "--eval-every", "3", "--sample-chars", "2", "--mode",
            "pynative", "--aux-loss", "0.01", "--expert-parallel", "2", "--out", str(out)]
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

    from moe_lm import CharData, MoELanguageModel

    args = train_moe.parse_args(args)
    net = MoELanguageModel(CharData().vocab_size, 16, 2, 1, train_moe.moe_config(args))
    params = ms.load_checkpoint(str(out / "moe_lm.ckpt"))
    assert params["blocks.0.moe.experts.weight1"].shape == (4, 32, 32)
    not_loaded, unused = ms.load_param_into_net(net, params)
    assert not not_loaded and not unused


def test_expert_parallel_without_msrun_says_how_to_launch():
    proc = subprocess.run([sys.executable, EXAMPLE, "--expert-parallel", "2", "--steps", "5"],
                          capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if not k.startswith("MS_")})
    assert proc.returncode == 1
    assert "--expert-parallel 2 runs on 2 processes: launch it with msrun" in proc.stderr
    assert "msrun --worker_num=2 --local_worker_num=2" in proc.stderr
    assert "train_moe.py --expert-parallel 2 --steps 5" in proc.stderr


def test_an_earlier_run_is_not_overwritten(tmp_path):
    out = str(tmp_path / "run")
    assert train_moe.output_dir(out, False) == out  # nothing there yet
    os.makedirs(out)
    (tmp_path / "run" / "notes.txt").write_text("mine")
    assert train_moe.output_dir(out, False) == out  # a folder without a run
    (tmp_path / "run" / "loss.png").write_bytes(b"png")
    assert train_moe.output_dir(out, False) == out + "_2"
    os.makedirs(out + "_2")
    (tmp_path / "run_2" / "moe_lm.ckpt").write_bytes(b"ckpt")
    assert train_moe.output_dir(out, False) == out + "_3"
    assert train_moe.output_dir(out, True) == out


@pytest.mark.parametrize("steps,every", [(3, 1), (50, 5), (1000, 100), (5000, 100)])
def test_validation_interval_draws_a_curve(steps, every):
    assert train_moe.parse_args(["--steps", str(steps)]).eval_every == every
    assert train_moe.parse_args(["--steps", str(steps), "--eval-every", "7"]).eval_every == 7


@pytest.mark.parametrize("experts,layers", [(8, 2), (16, 4), (64, 1)])
def test_plots_keep_every_text_inside_the_figure(experts, layers, tmp_path, monkeypatch):
    """loss.png and expert_load.png: every title, axis label and legend entry lies inside the
    image (expert_load.png's one-line title ran past both edges)."""
    import numpy as np
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    outside = []
    savefig = Figure.savefig

    def checked(fig, *args, **kwargs):
        out = savefig(fig, *args, **kwargs)
        fig.canvas.draw()  # (laid out again at the figure's own dpi, where it is measured)
        renderer, box = fig.canvas.get_renderer(), fig.bbox
        texts = [fig._suptitle] if fig._suptitle else []  # pylint: disable=protected-access
        for ax in fig.axes:
            texts += [ax.title, ax.xaxis.label, ax.yaxis.label]
            texts += ax.get_legend().get_texts() if ax.get_legend() else []
        for text in texts:
            extent = text.get_window_extent(renderer)
            if text.get_visible() and text.get_text() and (
                    extent.x0 < box.x0 - 1 or extent.x1 > box.x1 + 1 or
                    extent.y0 < box.y0 - 1 or extent.y1 > box.y1 + 1):
                outside.append((os.path.basename(args[0]), text.get_text()))
        return out

    monkeypatch.setattr(Figure, "savefig", checked)
    rng = np.random.default_rng(0)
    train_moe.plot_losses(list(rng.uniform(1, 4, 300)), [(1, 4.5), (300, 1.2)],
                          str(tmp_path / "loss.png"))
    train_moe.plot_expert_load(rng.integers(0, 50, (300, layers, experts)).astype(float),
                               str(tmp_path / "expert_load.png"))
    assert (tmp_path / "expert_load.png").exists() and not outside, outside
