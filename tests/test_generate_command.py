"""python -m ms_moe_ops.generate: a run on a tiny converted model and on a transformers
directory (converted on the fly) with a tokenizer.json built here, a character-level model
with chars.json, and each error (one line naming the file, exit code 2)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import mindspore as ms

import ms_moe_ops
from ms_moe_ops.convert import convert_checkpoint, load_pretrained
from ms_moe_ops.generate import main
from ms_moe_ops.models import generate

pytest.importorskip("torch")
pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
from hf_models import hf_model, save  # noqa: E402

WORDS = [f"w{i}" for i in range(64)]


def write_tokenizer(path):
    """A word-level tokenizer.json of the tiny models' 64 ids ("w0" ... "w63")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A transformers Qwen3-MoE directory and its conversion, both with tokenizer.json."""
    root = tmp_path_factory.mktemp("command")
    save(hf_model("qwen3_moe", np.random.default_rng(0), layers=2), root / "hf")
    write_tokenizer(root / "hf")
    convert_checkpoint(root / "hf", root / "ms")
    write_tokenizer(root / "ms")
    return root


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("which", ["ms", "hf"])
def test_greedy_run_streams_the_tokens_of_generate(which, dirs, capsys):
    prompt = "w3 w17 w42 w5"
    code, out, err = run(capsys, dirs / which, "--prompt", prompt, "--greedy",
                         "--max-new-tokens", 6, "--mode", "pynative")
    assert code == 0, err
    assert "tokens/s" in err
    ms.set_context(mode=ms.PYNATIVE_MODE)
    net = load_pretrained(str(dirs / "ms"))
    ids = np.array([[WORDS.index(w) for w in prompt.split()]])
    tokens = generate(net, ids, 6)[0, 4:]
    assert out == prompt + "".join(" " + WORDS[t] for t in tokens) + "\n"


def test_character_level_model(tmp_path, capsys):
    chars = list("abcdefgh ")
    model = hf_model("qwen3_moe", np.random.default_rng(1), layers=2, vocab_size=len(chars))
    save(model, tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "ms")
    (tmp_path / "ms" / "chars.json").write_text(json.dumps(chars))
    code, out, err = run(capsys, tmp_path / "ms", "--prompt", "abc", "--seed", "1",
                         "--max-new-tokens", 5, "--mode", "pynative", "--top-k", 3)
    assert code == 0, err
    assert out.startswith("abc") and len(out) == 3 + 5 + 1 and set(out[3:-1]) <= set(chars)
    code, _, err = run(capsys, tmp_path / "ms", "--prompt", "xyz")
    assert code == 2 and "chars.json" in err and "'xyz'" in err


def test_errors(dirs, tmp_path, capsys):
    code, _, err = run(capsys, tmp_path / "nowhere", "--prompt", "w1")
    assert code == 2 and "nowhere: no such directory" in err and err.count("\n") == 1
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    code, _, err = run(capsys, tmp_path / "bare", "--prompt", "w1")
    assert code == 2 and "no tokenizer" in err and "bare" in err and err.count("\n") == 1
    write_tokenizer(tmp_path / "bare")
    (tmp_path / "bare" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, _, err = run(capsys, tmp_path / "bare", "--prompt", "w1")
    assert code == 2 and "config.json" in err and "model_type" in err and "llama" in err
    assert err.count("\n") == 1
    long = " ".join(["w1"] * 130)  # the tiny models' context is 128
    code, _, err = run(capsys, dirs / "ms", "--prompt", long, "--mode", "pynative")
    assert code == 2 and "130 tokens" in err and "128" in err and "config.json" in err


@pytest.mark.parametrize("mode", ["int8", "w8a16"])
def test_quantized_experts(mode, dirs, capsys):
    """--quantize: the experts of the loaded model quantised as ms_moe_ops.quantize does (int8
    calibrated on the prompt), the greedy tokens those of generate on that model."""
    prompt = "w3 w17 w42 w5"
    code, out, err = run(capsys, dirs / "ms", "--prompt", prompt, "--greedy",
                         "--max-new-tokens", 4, "--mode", "pynative", "--quantize", mode)
    assert code == 0, err
    assert f"routed experts quantised: {mode}" in err
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ids = np.array([[WORDS.index(w) for w in prompt.split()]])
    net = load_pretrained(str(dirs / "ms"))
    ms_moe_ops.quantize(net, mode, calibration=[ms.Tensor(ids.astype(np.int32))]
                        if mode == "int8" else None)
    tokens = generate(net, ids, 4)[0, 4:]
    assert out == prompt + "".join(" " + WORDS[t] for t in tokens) + "\n"


def test_command_line_exit_code(tmp_path):
    """As a command: exit code 2 and one line, no traceback."""
    result = subprocess.run([sys.executable, "-m", "ms_moe_ops.generate", str(tmp_path / "x"),
                             "--prompt", "hi"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")


def test_openmp_threads_sleep(monkeypatch):
    """The command runs again with OMP_WAIT_POLICY=PASSIVE (libgomp reads it only when it loads,
    and `import mindspore` has loaded it), unless the policy is set already."""
    from ms_moe_ops import generate as command
    calls = []
    monkeypatch.setattr(command.os, "execv", lambda path, argv: calls.append((path, argv)))
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    command._sleeping_openmp()
    assert calls == [(sys.executable, sys.orig_argv)]
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    command._sleeping_openmp()
    assert len(calls) == 1 and os.environ["OMP_WAIT_POLICY"] == "active"
