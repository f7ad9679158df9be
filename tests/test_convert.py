"""ms_moe_ops.convert: transformers checkpoints (tiny random models of the five families, both
layouts, saved in the test) to MindSpore and back. The converted weights against the in-memory
state dict put through convert_moe_checkpoint; the round trip bit for bit; transformers loading
the export; every bad input an error naming the file and the tensor, with nothing left behind;
peak memory against the checkpoint's size; the command."""
import contextlib
import io
import json
import os
import sys

import numpy as np
import pytest

from ms_moe_ops import convert_moe_checkpoint
from ms_moe_ops.convert import (TensorFiles, convert_checkpoint, export_checkpoint, load_checkpoint,
                                load_pretrained)
from ms_moe_ops.convert import __main__ as command
from ms_moe_ops.convert._safetensors import SafetensorsWriter, cast
from ms_moe_ops.models import CausalLMConfig, MoECausalLM

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from hf_models import FAMILIES, hf_model, save  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def expected_parameters(model):
    """What the converted checkpoint must hold, from the in-memory model: each MoE block through
    convert_moe_checkpoint (transformers 5's fused names), every other tensor as it is."""
    config = CausalLMConfig.from_transformers(model.config)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    out = {}
    for layer in config.moe_layers:
        prefix = f"model.layers.{layer}.mlp."
        block = {k: state.pop(k) for k in list(state) if k.startswith(prefix)}
        out.update(convert_moe_checkpoint(block, prefix, prefix, config.family))
    out.update(state)
    return out


def files_identical(a, b):
    """Same names, files, dtypes, shapes and bytes."""
    a, b = TensorFiles(a), TensorFiles(b)
    assert a.where == b.where
    for name in a.names:
        assert (a.dtype(name), a.shape(name)) == (b.dtype(name), b.shape(name)), name
        assert a._open[a.where[name]].read_raw(name).tobytes() == \
            b._open[b.where[name]].read_raw(name).tobytes(), name
    return True


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip(family, layout, tmp_path, rng):
    """transformers -> MindSpore: exactly convert_moe_checkpoint's MoE parameters and the other
    tensors; -> transformers with the converted directory as reference: the source bit for bit
    (names, files, dtypes), which transformers loads into the same weights."""
    model = hf_model(family, rng)
    src = save(model, tmp_path / "hf", layout, shards=3)
    report = convert_checkpoint(src, tmp_path / "ms")
    assert report["files"] == sorted(TensorFiles(src).files)  # sharded like the source
    params = {k: v.asnumpy() for k, v in load_checkpoint(str(tmp_path / "ms")).items()}
    expected = expected_parameters(model)
    assert sorted(params) == sorted(expected)
    for name, value in expected.items():
        assert params[name].dtype == np.float32
        np.testing.assert_array_equal(params[name], value, err_msg=name)
    export_checkpoint(str(tmp_path / "ms"), tmp_path / "back", reference=tmp_path / "ms")
    assert files_identical(src, tmp_path / "back")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").state_dict()
    assert reloaded.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(reloaded[name], value), name


@pytest.mark.parametrize("family, layout, dtype", [("deepseek_v3", "per-expert", "bfloat16"),
                                                   ("qwen3_moe", "fused", "float16")])
def test_round_trip_half_precision(family, layout, dtype, tmp_path, rng):
    """bfloat16/float16 sources: widened exactly to float32, narrowed back to the same bits
    (DeepSeek-V3's e_score_correction_bias stored as float32, as transformers keeps it)."""
    model = hf_model(family, rng)
    src = save(model, tmp_path / "hf", layout, shards=2, dtype=dtype)
    convert_checkpoint(src, tmp_path / "ms")
    params = load_checkpoint(str(tmp_path / "ms"))
    theirs = {}
    for file in TensorFiles(src).files:
        theirs.update(load_file(os.path.join(src, file)))
    if family == "deepseek_v3":
        assert theirs["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
        assert theirs["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    name = "model.layers.0.self_attn.kv_b_proj.weight" if family == "deepseek_v3" else \
        "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(params[name].asnumpy(), theirs[name].float().numpy())
    export_checkpoint(str(tmp_path / "ms"), tmp_path / "back", reference=tmp_path / "ms")
    assert files_identical(src, tmp_path / "back")


def test_export_to_the_other_layout(tmp_path, rng):
    """With a reference and layout="fused": the experts under transformers 5's names, in the
    files and dtype of the source's block; transformers loads the same weights as from the
    source."""
    model = hf_model("qwen2_moe", rng)
    src = save(model, tmp_path / "hf", "per-expert", shards=3, dtype="bfloat16")
    convert_checkpoint(src, tmp_path / "ms")
    export_checkpoint(str(tmp_path / "ms"), tmp_path / "fused", reference=tmp_path / "ms",
                      layout="fused")
    source, fused = TensorFiles(src), TensorFiles(tmp_path / "fused")
    name = "model.layers.2.mlp.experts.gate_up_proj"
    assert fused.where[name] == source.where["model.layers.2.mlp.gate.weight"]
    assert fused.dtype(name) == "BF16" and fused.files == source.files
    assert not any(".experts.0." in n for n in fused.names)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(src).state_dict()
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fused").state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


def test_trained_model_exports_to_transformers(tmp_path, rng):
    """A model whose weights changed after conversion (the selection bias moved, one expert
    scaled) exports, without a reference, from the Cell or its parameters under a training
    wrapper's names, in both layouts and as float32 or bfloat16, to
    checkpoints transformers loads and computes our logits with (for bfloat16, from weights
    already rounded to bfloat16, so that both sides hold the same values)."""
    model = hf_model("deepseek_v3", rng)
    convert_checkpoint(save(model, tmp_path / "hf"), tmp_path / "ms")
    net = load_pretrained(str(tmp_path / "ms"))
    bias = net.model.layers[2].mlp.router.expert_bias
    bias.set_data(bias + ms_tensor(rng.normal(0, 0.1, bias.shape)))
    w1 = net.model.layers[1].mlp.experts.weight1
    w1.set_data(w1 * 1.5)
    ids = rng.integers(0, 64, (2, 9))
    for layout, dtype in (("fused", "float32"), ("per-expert", "bfloat16")):
        if dtype == "bfloat16":
            for _, p in net.parameters_and_names():
                p.set_data(ms_tensor(torch.from_numpy(p.asnumpy()).bfloat16().float().numpy()))
        ours = net(ms_tensor(ids, np.int32)).asnumpy()
        out = tmp_path / f"hf-{layout}"
        # names as a training wrapper leaves them (TrainOneStepCell(CausalLMLoss(net)))
        params = {"net." + k: v for k, v in net.parameters_and_names()} if layout == "fused" else net
        export_checkpoint(params, out, config=tmp_path / "ms" / "config.json", layout=layout,
                          dtype=dtype)
        files = TensorFiles(out)
        assert ("model.layers.1.mlp.experts.gate_up_proj" in files.names) == (layout == "fused")
        assert {files.dtype(n) for n in files.names} == {"F32" if dtype == "float32" else "BF16"}
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        with torch.no_grad():
            theirs = reloaded(torch.from_numpy(ids)).logits.numpy()
        error = np.abs(ours - theirs).max() / np.abs(theirs).max()
        print(layout, dtype, f"max relative logit error {error:.1e}")
        assert error < 1e-5


def ms_tensor(array, dtype=np.float32):
    from mindspore import Tensor
    return Tensor(np.asarray(array, dtype))


def test_skipped_and_tied_tensors(tmp_path, rng):
    """Tensors of layers past num_hidden_layers (DeepSeek-V3's multi-token-prediction layer on
    the Hub) and a tied lm_head are left out and reported; a Mixtral checkpoint holds its
    per-expert blocks under block_sparse_moe."""
    model = hf_model("deepseek_v3", rng)
    src = save(model, tmp_path / "hf")
    state = load_file(src / "model.safetensors")
    state["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64)
    save_file(state, src / "model.safetensors", {"format": "pt"})
    report = convert_checkpoint(src, tmp_path / "ms")
    assert report["skipped"] == ["model.layers.3.eh_proj.weight"]
    mixtral = save(hf_model("mixtral", rng), tmp_path / "mixtral")
    assert any(".block_sparse_moe.experts.0.w1." in n for n in TensorFiles(mixtral).names)
    convert_checkpoint(mixtral, tmp_path / "mixtral-ms")
    assert "model.layers.0.mlp.experts.weight1" in TensorFiles(tmp_path / "mixtral-ms").names


# -- bad input ------------------------------------------------------------------------------------

def rewrite(path, change):
    """Applies change(state dict) to the safetensors file at path."""
    state = load_file(path)
    change(state)
    save_file(state, path, {"format": "pt"})


def break_index(src):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = "model.norm.weight"
    other = next(f for f in set(index["weight_map"].values()) if f != index["weight_map"][name])
    index["weight_map"][name] = other
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


def drop(src, name):
    """The checkpoint without tensor `name` (its shard and the index)."""
    rewrite(shard_of(src, name), lambda state: state.pop(name))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


def pickle_only(src):
    for name in os.listdir(src):
        if name.startswith("model"):
            os.remove(src / name)
    (src / "pytorch_model.bin").write_bytes(b"never read")


def shard_of(src, name):
    return src / TensorFiles(src).where[name]


BROKEN = {
    # what is broken: (change to the checkpoint directory, exception, words of the message)
    "missing shard": (lambda src: os.remove(shard_of(src, "model.norm.weight")),
                      FileNotFoundError, ["missing shard", "-of-0000", "places '"]),
    "index names the wrong shard": (break_index, ValueError,
                                    ["model.norm.weight", "is not in this file"]),
    "wrong shape": (lambda src: rewrite(shard_of(src, "model.layers.0.self_attn.q_proj.weight"),
                                        lambda s: s.update({"model.layers.0.self_attn.q_proj.weight":
                                                            torch.zeros(32, 30)})),
                    ValueError, ["model.layers.0.self_attn.q_proj.weight", "[32, 30]", "[32, 32]",
                                 "the configuration makes it"]),
    "wrong expert shape": (lambda src: rewrite(
        shard_of(src, "model.layers.1.mlp.experts.3.down_proj.weight"),
        lambda s: s.update({"model.layers.1.mlp.experts.3.down_proj.weight": torch.zeros(32, 8)})),
        ValueError, ["model.layers.1.mlp.experts.3.down_proj.weight", "[32, 8]", "[32, 16]"]),
    "integer tensor": (lambda src: rewrite(shard_of(src, "model.norm.weight"), lambda s: s.update(
        {"model.norm.weight": torch.zeros(32, dtype=torch.int32)})),
        ValueError, ["model.norm.weight", "I32"]),
    "unknown tensor": (lambda src: rewrite(shard_of(src, "model.norm.weight"), lambda s: s.update(
        {"model.layers.0.self_attn.rotary.weight": torch.zeros(4)})),
        ValueError, ["model.layers.0.self_attn.rotary.weight", "no rule converts it"]),
    "unknown tensor in a MoE block": (lambda src: rewrite(shard_of(src, "model.norm.weight"),
                                                          lambda s: s.update(
        {"model.layers.2.mlp.experts.0.extra.weight": torch.zeros(4)})),
        ValueError, ["model.layers.2.mlp.experts.0.extra.weight", "MoE block",
                     "no rule converts it"]),
    "missing tensor": (lambda src: drop(src, "model.norm.weight"),
                       ValueError, ["model.norm.weight", "missing"]),
    "missing expert": (lambda src: drop(src, "model.layers.1.mlp.experts.2.up_proj.weight"),
                       ValueError, ["model.layers.1.mlp.experts.2.up_proj.weight", "missing"]),
    "unknown family": (lambda src: (src / "config.json").write_text(json.dumps(
        {**json.loads((src / "config.json").read_text()), "model_type": "llama"})),
        ValueError, ["config.json", "model_type", "llama"]),
    "not safetensors": (lambda src: shard_of(src, "model.norm.weight").write_bytes(b"\x10" * 64),
                        ValueError, ["not a valid safetensors file"]),
    "a pickle only": (lambda src: pickle_only(src), FileNotFoundError, ["pickle", "never loaded"]),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_bad_input_is_a_clear_error_and_writes_nothing(case, tmp_path, rng):
    src = save(hf_model("qwen3_moe", rng), tmp_path / "hf", shards=3)
    change, error, words = BROKEN[case]
    change(src)
    with pytest.raises(error) as info:
        convert_checkpoint(src, tmp_path / "ms")
    message = str(info.value)
    print(f"{case}: {type(info.value).__name__}: {message}")
    for word in words + [str(src)]:  # the source's file or directory
        assert word in message, (word, message)
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_failure_while_writing_leaves_nothing(tmp_path, rng, monkeypatch):
    """An error in the middle of writing (a full disk, say) removes the partial output; an
    existing dst stays as it was unless overwrite, which replaces it only once complete."""
    src = save(hf_model("deepseek_v3", rng), tmp_path / "hf", shards=3)
    (tmp_path / "ms").mkdir()
    (tmp_path / "ms" / "old").write_text("kept")
    with pytest.raises(FileExistsError, match="overwrite"):
        convert_checkpoint(src, tmp_path / "ms")
    writes = []
    original = SafetensorsWriter.write

    def failing(self, name, array):
        if len(writes) == 10:
            raise OSError("No space left on device")
        writes.append(name)
        return original(self, name, array)
    monkeypatch.setattr(SafetensorsWriter, "write", failing)
    with pytest.raises(OSError, match="No space"):
        convert_checkpoint(src, tmp_path / "ms", overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["hf", "ms"]
    assert os.listdir(tmp_path / "ms") == ["old"]
    monkeypatch.setattr(SafetensorsWriter, "write", original)
    convert_checkpoint(src, tmp_path / "ms", overwrite=True)
    assert "old" not in os.listdir(tmp_path / "ms") and sorted(os.listdir(tmp_path)) == ["hf", "ms"]
    with pytest.raises(ValueError, match="cannot be the source"):
        convert_checkpoint(src, src, overwrite=True)


def test_export_and_load_errors(tmp_path, rng):
    model = hf_model("qwen3_moe", rng)
    convert_checkpoint(save(model, tmp_path / "hf"), tmp_path / "ms")
    net = load_pretrained(str(tmp_path / "ms"))
    bias = net.model.layers[1].mlp.router.expert_bias
    bias.set_data(bias + 0.1)
    with pytest.raises(ValueError, match="model.layers.1.mlp.router.expert_bias is not zero"):
        export_checkpoint(net, tmp_path / "out", reference=tmp_path / "ms")
    params = {k: v for k, v in net.parameters_and_names() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="no 'model.norm.weight'"):
        export_checkpoint(params, tmp_path / "out", reference=tmp_path / "ms")
    with pytest.raises(ValueError, match="give reference"):
        export_checkpoint(net, tmp_path / "out")
    with pytest.raises(ValueError, match="layout must be one of"):
        export_checkpoint(net, tmp_path / "out", reference=tmp_path / "ms", layout="stacked")
    assert not (tmp_path / "out").exists()
    other = MoECausalLM(CausalLMConfig.from_transformers(
        {**model.config.to_dict(), "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match=r"'model\.layers\.2\..*' is not a parameter"):
        load_checkpoint(str(tmp_path / "ms"), other)
    with pytest.raises(ValueError, match="ms_moe_ops.convert converts it"):
        load_pretrained(str(tmp_path / "hf"))


def test_bfloat16_rounding_is_to_nearest_even():
    """cast(float32 -> BF16) against torch's conversion, ties and NaN included."""
    bits = np.array([0x3F808000, 0x3F818000, 0x3F807FFF, 0x7F7FFFFF, 0xFF800000, 0x7FC00001,
                     0x00008000, 0x80018000], np.uint32)
    values = np.concatenate([bits.view(np.float32),
                             np.random.default_rng(0).standard_normal(1000).astype(np.float32)])
    ours = cast(values, "BF16").view(np.uint16)
    theirs = torch.from_numpy(values).bfloat16().view(torch.int16).numpy().view(np.uint16)
    finite = np.isfinite(values)
    np.testing.assert_array_equal(ours[finite], theirs[finite])
    assert np.isnan(cast(values, "BF16").view("<u2").astype(np.uint32).__lshift__(16).view(
        np.float32)[~np.isfinite(values) & np.isnan(values)]).all()


# -- streaming ------------------------------------------------------------------------------------

@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="needs Linux's /proc/self/clear_refs to reset the peak RSS")
def test_peak_memory_grows_with_the_largest_block_not_the_model(tmp_path):
    """benchmarks/bench_convert.py on a checkpoint of 12 layers: the resident memory the
    conversion adds stays under 3 float32 copies of its largest block plus 24 MiB, well under
    half the checkpoint."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_convert
    finally:
        sys.path.pop(0)
    args = bench_convert.parse_args(["--layers", "12", "--hidden", "256", "--ffn", "256",
                                     "--experts", "16", "--vocab", "4096", "--dtype", "float32"])
    result = bench_convert.measure(args, str(tmp_path), repeat=1)
    total, block, peak = result["total"], result["block32"], result["peak_convert"]
    assert total > 8 * block
    assert peak < 3 * block + 24 * 2**20, (peak, block)
    assert peak < total / 2, (peak, total)


# -- the command ----------------------------------------------------------------------------------

def run_command(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = command.main(argv)
    return code, out.getvalue(), err.getvalue()


def test_loading_warns_of_nothing_that_is_in_order(tmp_path, rng):
    """load_pretrained of a sharded checkpoint: no MindSpore warning that parameters "are not
    loaded" (each file lacks the others' tensors, and the routing statistics are run-time state,
    not weights: every load once warned of router.tokens_per_expert and aux_losses). A parameter
    really missing is still an error."""
    import logging

    from ms_moe_ops._compat import mindspore_logger

    src = save(hf_model("deepseek_v3", rng), tmp_path / "hf", shards=2)
    convert_checkpoint(src, tmp_path / "ms")
    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    mindspore_logger().addHandler(handler)
    try:
        net = load_pretrained(str(tmp_path / "ms"))
        assert not [m for m in said if "not loaded" in m], said
        ms_logger_still_warns = mindspore_logger().isEnabledFor(logging.WARNING)
    finally:
        mindspore_logger().removeHandler(handler)
    assert ms_logger_still_warns and not mindspore_logger().filters  # nothing left behind
    assert (net.model.layers[1].mlp.router.tokens_per_expert.asnumpy() == 0).all()
    index = json.loads((tmp_path / "ms" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # (each file lacked the others' tensors)
    config = CausalLMConfig.from_transformers(str(tmp_path / "ms"))
    deeper = MoECausalLM(config.replace(num_layers=config.num_layers + 1))
    with pytest.raises(ValueError, match="parameters of the model not in the checkpoint"):
        load_checkpoint(str(tmp_path / "ms"), deeper)


def test_command_names_a_source_that_is_not_there(tmp_path):
    """A source directory that does not exist, or a file where a directory is read: the one line
    says so (it once said only what a checkpoint directory holds)."""
    missing = tmp_path / "nonexistent"
    code, out, err = run_command([str(missing), str(tmp_path / "dst")])
    assert code == 1 and out == "" and err.startswith(f"error: {missing} does not exist: "), err
    (tmp_path / "file").write_text("")
    code, out, err = run_command([str(tmp_path / "file"), str(tmp_path / "dst")])
    assert code == 1 and err.startswith(f"error: {tmp_path / 'file'} is a file, not a directory"), err
    assert not (tmp_path / "dst").exists()


def test_command(tmp_path, rng):
    """`python -m ms_moe_ops.convert` (its main, in this process): a progress bar, a summary,
    the way back with --to-transformers, and errors as one line and exit status 1."""
    model = hf_model("qwen2_moe", rng)
    src = save(model, tmp_path / "hf", "fused", shards=2)
    code, out, err = run_command([str(src), str(tmp_path / "ms")])
    assert code == 0, err
    assert "100%" in err and "wrote" in out and "2 file(s)" in out
    code, out, err = run_command(["--to-transformers", "--reference", str(tmp_path / "ms"),
                                  str(tmp_path / "ms"), str(tmp_path / "back"), "--quiet"])
    assert code == 0 and err == "", err
    assert files_identical(src, tmp_path / "back")
    code, out, err = run_command([str(src), str(tmp_path / "ms")])
    assert code == 1 and err.startswith("error: ") and "exists" in err
    os.remove(shard_of(src, "model.norm.weight"))
    code, out, err = run_command([str(src), str(tmp_path / "ms2"), "--quiet"])
    assert code == 1 and "missing shard" in err and "places '" in err, err
    code, out, err = run_command([str(src), str(tmp_path / "ms2"), "--layout", "fused"])
    assert code == 1 and "--layout is an option of --to-transformers" in err


@pytest.mark.slow  # a fresh interpreter importing MindSpore: about 5 s
def test_command_in_a_subprocess(tmp_path, rng):
    import subprocess

    src = save(hf_model("mixtral", rng), tmp_path / "hf")
    run = [sys.executable, "-m", "ms_moe_ops.convert"]
    done = subprocess.run(run + [str(src), str(tmp_path / "ms")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "wrote" in done.stdout and "100%" in done.stderr, done.stderr
    done = subprocess.run(run + [str(src), str(tmp_path / "ms")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1 and done.stderr.startswith("error: ") and "exists" in done.stderr
