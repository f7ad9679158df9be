"""The API reference (docs/api, Sphinx autodoc; .ci/run builds it with warnings as errors) covers
every public name, and its recipes run as written (the expert-parallel one on 2 processes)."""
import importlib
import inspect
import os
import re
import shlex

import numpy as np
import pytest

import ms_moe_ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API = os.path.join(ROOT, "docs", "api")
MODULES = ["ops", "nn", "parallel", "models", "convert"]


def _read(*parts):
    with open(os.path.join(API, *parts), encoding="utf-8") as f:
        return f.read()


def public_names(module):
    """The classes and functions a module offers: defined in it or in one of its public
    submodules (not its private helpers, such as ms_moe_ops.convert._layout)."""
    name = module.__name__
    return {n for n, obj in vars(module).items()
            if not n.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))
            and (obj.__module__ == name or (obj.__module__.startswith(name + ".")
                                            and "._" not in obj.__module__[len(name):]))}


@pytest.mark.parametrize("name", MODULES)
def test_every_public_name_has_its_reference(name):
    """Each module's page documents its __all__ (automodule with the members), or the name has
    a directive of its own; every documented name has a docstring."""
    module = importlib.import_module(f"ms_moe_ops.{name}")
    page = _read(f"{name}.rst")
    assert re.search(rf"^\.\. automodule:: ms_moe_ops\.{name}\s*$", page, re.M), page
    explicit = set(re.findall(rf"^\.\. auto\w+:: ms_moe_ops\.{name}\.(\w+)", page, re.M))
    data = set(re.findall(rf"^\.\. py:data:: ms_moe_ops\.{name}\.(\w+)\n\n   \S", page, re.M))
    missing = public_names(module) - set(module.__all__) - explicit
    assert not missing, f"ms_moe_ops.{name}: public but not in __all__ nor documented: {missing}"
    for n in set(module.__all__) | explicit:
        obj = getattr(module, n)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__doc__, f"ms_moe_ops.{name}.{n} has no docstring"
        else:  # (autodoc shows no data without a description: the page gives it)
            assert n in data, f"ms_moe_ops.{name}.{n}: a py:data directive with a description"
    assert f"\n   {name}\n" in _read("index.rst")


def test_the_package_names_are_those_of_nn_and_ops():
    """ms_moe_ops's own names are .nn's and .ops's (documented there, as its page says) and its
    modules."""
    names = {n for n in dir(ms_moe_ops) if not n.startswith("_")
             and not inspect.ismodule(getattr(ms_moe_ops, n))}
    assert names == set(ms_moe_ops.nn.__all__) | set(ms_moe_ops.ops.__all__)
    assert ".. automodule:: ms_moe_ops\n" in _read("ms_moe_ops.rst")


def recipe(name, language="python"):
    """The code blocks of a recipe page, in order."""
    blocks = re.findall(rf"\.\. code-block:: {language}\n\n((?:   .*\n|\n)+)", _read("recipes", f"{name}.rst"))
    assert blocks, name
    return ["\n".join(line[3:] for line in block.splitlines()) + "\n" for block in blocks]


def test_recipe_deepseek_v3_layer(capsys):
    scope = {}
    for code in recipe("deepseek_v3_layer"):
        exec(compile(code, "deepseek_v3_layer.rst", "exec"), scope)  # pylint: disable=exec-used
    assert scope["config"].n_group == 8 and scope["layer"].config.n_shared_experts == 1
    assert capsys.readouterr().out.startswith("8 4 2.5\n")


class _Tokenizer:
    eos_token_id = 1

    def __call__(self, text):
        return {"input_ids": [ord(c) % 64 for c in text]}

    def decode(self, ids):
        return " ".join(map(str, ids))


def test_recipe_convert_and_generate(tmp_path, rng, monkeypatch, capsys):
    """Its command and its Python, on a tiny random DeepSeek-V3 (its own tokenizer stands in)."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from hf_models import hf_model, save
    from ms_moe_ops.convert.__main__ import main

    from tokenizers import Tokenizer, models, pre_tokenizers
    from ms_moe_ops.generate import main as generate_main

    command, generate_command = recipe("convert_and_generate", "bash")
    src, dst = command.split()[-2:]
    save(hf_model("deepseek_v3", rng), tmp_path / src)
    monkeypatch.chdir(tmp_path)
    assert main([src, dst, "--quiet"]) == 0
    capsys.readouterr()
    words = ["<unk>", "The", "capital", "of", "France", "is"] + [f"w{i}" for i in range(58)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / src / "tokenizer.json"))
    argv = shlex.split(generate_command)
    assert argv[:3] == ["python", "-m", "ms_moe_ops.generate"]
    assert generate_main([a if a != "20" else "3" for a in argv[3:]]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("The capital of France is") and "tokens/s" in err
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: _Tokenizer())
    code, = recipe("convert_and_generate")
    assert "max_new_tokens=20" in code
    code = code.replace("max_new_tokens=20", "max_new_tokens=3")  # (a shorter run of the same)
    scope = {}
    exec(compile(code, "convert_and_generate.rst", "exec"), scope)  # pylint: disable=exec-used
    tokens = scope["tokens"]
    assert tokens.shape[0] == 1 and tokens.shape[1] > len(scope["ids"][0])
    np.testing.assert_array_equal(tokens[:, :scope["ids"].shape[1]], scope["ids"])
    assert capsys.readouterr().out.splitlines()[-1] == " ".join(map(str, tokens[0]))


@pytest.mark.distributed
def test_recipe_expert_parallel_training(tmp_path):
    """The script on 2 processes with msrun (3 steps), then its checkpoints joined and loaded
    into the one-process model."""
    import mindspore as ms
    from ms_moe_ops.parallel import msrun

    script, join = recipe("expert_parallel_training")
    (tmp_path / "train_ep.py").write_text(script)
    log_dir = msrun(str(tmp_path / "train_ep.py"), args=(3,), workers=2, log_dir=str(tmp_path))
    with open(os.path.join(log_dir, "worker_0.log"), encoding="utf-8") as f:
        assert "3 steps on 2 processes" in f.read()
    one = ms_moe_ops.MoELayer(ms_moe_ops.MoEConfig(hidden_size=64, ffn_hidden_size=32,
                                                   num_experts=8, top_k=2))
    scope = {"ms": ms, "one_process_net": ms.nn.SequentialCell([one])}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code = join.replace("one_process_net, whole", "one_process_net, {'0.' + k[len('moe.'):]: v "
                            "for k, v in whole.items() if k.startswith('moe.')}")
        exec(compile(code, "expert_parallel_training.rst", "exec"), scope)  # pylint: disable=exec-used
    finally:
        os.chdir(cwd)
    assert scope["whole"]["moe.experts.weight1"].shape == (8, 64, 64)  # [E, H, 2F]: all experts
